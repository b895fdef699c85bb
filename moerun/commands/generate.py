"""`moerun generate`: continue a prompt, streaming the text to stdout (like llama-cli -p / -n).

The model, sampling and context flags defined here (llama.cpp's names) are shared with `moerun chat`.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moerun.errors import MoerunError

NAME = "generate"
HELP = "continue a prompt with the model, streaming the text as it is generated (like llama-cli -p)"

DEFAULT_N_PREDICT = 128


# -- flag value types: a bad value is one argparse error line ---------------------------------------

def _int(lo: int | None = None, what: str = "") -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer value: {s!r}") from None
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}{what}, got {v}")
        return v
    return parse


def _float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {v:g}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {v:g}")
        return v
    return parse


def one_line_errors(p: argparse.ArgumentParser) -> None:
    """Make the subcommand parser `p` report a bad command line as one line ('moerun generate: error: ...',
    exit code 2), unknown flags included (argparse would leave those to the top-level parser)."""
    def error(message: str) -> None:
        p.exit(2, f"{p.prog}: error: {message} (see {p.prog} --help)\n")

    parse_known = p.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, extras = parse_known(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    p.error = error  # type: ignore[method-assign]
    p.parse_known_args = parse_known_args  # type: ignore[method-assign]


# -- shared flags -------------------------------------------------------------------------------------

def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """-m, -c, --device, --dtype, -t."""
    p.add_argument("-m", "--model", metavar="FILE",
                   help="GGUF model file (default: the built-in Gemma 3 270M Q4_K_M, prepared on first use in "
                        "$MOERUN_CACHE or ~/.cache/moerun)")
    p.add_argument("-c", "--ctx-size", type=_int(0), default=0, metavar="N",
                   help="context size in tokens (default 0 = the model's training context, at most 4096)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:1 or cpu (default: $MOERUN_DEVICE, else CUDA when present, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "f32", "bfloat16", "bf16"],
                   help="compute dtype (default float32 activations; on CUDA prompts multiply in bf16)")
    p.add_argument("-t", "--threads", type=_int(1), default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags, with its defaults."""
    g = p.add_argument_group("sampling (llama.cpp's chain: penalties -> top-k -> top-p -> min-p -> temperature)")
    g.add_argument("--temp", type=_float(), default=0.8, metavar="T",
                   help="temperature; 0 (or less) = greedy, always the most likely token (default 0.8)")
    g.add_argument("--top-k", type=_int(), default=40, metavar="N",
                   help="keep the N most likely tokens; 0 = all; 1 = greedy (default 40)")
    g.add_argument("--top-p", type=_float(0.0, 1.0), default=0.95, metavar="P",
                   help="keep the most likely tokens whose probabilities add up to P; 1.0 = off (default 0.95)")
    g.add_argument("--min-p", type=_float(0.0, 1.0), default=0.05, metavar="P",
                   help="drop tokens less likely than P times the most likely one; 0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=_float(0.0, lo_open=True), default=1.0, metavar="X",
                   help="penalise tokens seen in the last --repeat-last-n tokens; 1.0 = off (default 1.0)")
    g.add_argument("--repeat-last-n", type=_int(-1), default=64, metavar="N",
                   help="how many recent tokens the penalties look at; 0 = off, -1 = the context (default 64)")
    g.add_argument("--presence-penalty", type=_float(), default=0.0, metavar="X",
                   help="subtract X from the logit of every recent token; 0 = off (default 0)")
    g.add_argument("--frequency-penalty", type=_float(), default=0.0, metavar="X",
                   help="subtract X times its recent count from each token's logit; 0 = off (default 0)")
    g.add_argument("-s", "--seed", type=_int(-1), default=-1, metavar="N",
                   help="random seed; the same seed, prompt and flags give the same text; -1 = random (default)")


def sampling_params(args: argparse.Namespace) -> Any:
    from moerun.engine.sampler import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=None if args.seed < 0 else args.seed)


def load_model(args: argparse.Namespace) -> Any:
    """The Model named by -m (or the default model), on --device with --dtype and -c."""
    from moerun.api import load

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return load(args.model, device=args.device, dtype=args.dtype, n_ctx=args.ctx_size or None,
                progress=sys.stderr.isatty())


def print_stats(model: Any) -> None:
    print(f"\nmoerun: {model.last_stats.summary()}", file=sys.stderr, flush=True)


_ESCAPES = re.compile(r"\\(x[0-9a-fA-F]{2}|.)", re.DOTALL)
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "?": "?", "a": "\a", "b": "\b",
           "f": "\f", "v": "\v"}


def process_escapes(text: str) -> str:
    """llama.cpp's -e: \\n \\r \\t \\' \\" \\\\ \\xNN become the characters; other backslashes stay."""
    def sub(m: re.Match) -> str:
        e = m.group(1)
        if e.startswith("x") and len(e) == 3:
            return chr(int(e[1:], 16))
        return _SIMPLE.get(e, m.group(0))
    return _ESCAPES.sub(sub, text)


# -- the command --------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("-p", "--prompt", metavar="TEXT", help="the prompt to continue")
    p.add_argument("-f", "--file", metavar="FILE", help="read the prompt from FILE ('-' = stdin)")
    p.add_argument("-n", "--n-predict", type=_int(-1, " (-1 = no limit)"), default=DEFAULT_N_PREDICT, metavar="N",
                   help=f"tokens to generate at most; -1 = until an end-of-generation token or the context is full "
                        f"(default {DEFAULT_N_PREDICT})")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text TEXT is generated (not printed); repeatable")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token the model asks for")
    p.add_argument("--no-escape", action="store_true",
                   help=r"take the prompt literally (by default \n, \t, \\ ... in it are processed, as llama.cpp)")
    p.add_argument("--no-display-prompt", action="store_true", help="print only the generated text, not the prompt")
    add_model_arguments(p)
    add_sampling_arguments(p)


def _prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file:
        raise MoerunError("give either -p TEXT or -f FILE, not both")
    if args.file:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    elif args.prompt is not None:
        text = args.prompt if args.no_escape else process_escapes(args.prompt)
    else:
        raise MoerunError("no prompt: give -p TEXT or -f FILE")
    if not text:
        raise MoerunError("the prompt is empty")
    return text


def run(args: argparse.Namespace) -> int:
    prompt = _prompt(args)
    params = sampling_params(args)
    model = load_model(args)
    ids = model.encode(prompt, add_bos=not args.no_bos)
    if getattr(args, "verbose", False):
        print(f"moerun: {model!r}, prompt {len(ids)} tokens, sampling {params}", file=sys.stderr)
    out = sys.stdout
    if not args.no_display_prompt:
        out.write(prompt)
        out.flush()
    for piece in model.stream_tokens(ids, params=params, max_tokens=args.n_predict, stop=args.stop,
                                     ignore_eos=args.ignore_eos):
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    print_stats(model)
    sampler = model.engine.sampler
    if getattr(args, "verbose", False) and sampler is not None:
        print(f"moerun: sampler seed {sampler.seed_value} (pass --seed {sampler.seed_value} to repeat this text)",
              file=sys.stderr)
    model.close()
    return 0
