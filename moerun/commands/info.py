"""`moerun info`: what a GGUF file holds: architecture, sizes, quant mix, tokenizer facts.

Reads only the header (metadata and tensor table), so it is instant for any file size and works for
architectures moerun cannot run.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

from moerun.commands.generate import one_line_errors

NAME = "info"
HELP = "describe a GGUF file: architecture, parameters, context, layers/heads/experts, quant mix, tokenizer"

_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("file", nargs="?", metavar="FILE", help="the GGUF file (default: the built-in model)")
    p.add_argument("-m", "--model", metavar="FILE", help="the GGUF file (same as FILE)")


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def describe(path: str | Path) -> list[tuple[str, str]]:
    """(label, value) rows describing the file at `path`."""
    from moerun.chat_template import FALLBACK_TEMPLATES
    from moerun.gguf.reader import GGUFFile
    from moerun.models.registry import ARCHS

    f = GGUFFile(path)
    arch = f.get("general.architecture", "?")
    g = lambda key, default=None: f.get(f"{arch}.{key}", default)  # noqa: E731
    rows: list[tuple[str, str]] = []
    size = Path(path).stat().st_size
    rows.append(("file", f"{path} ({_size(size)}, GGUF v{f.version})"))
    if f.get("general.name"):
        rows.append(("name", str(f.get("general.name"))))
    rows.append(("architecture", f"{arch}" + ("" if arch in ARCHS else "  (not supported by moerun)")))
    n_params = sum(_numel(t.shape) for t in f.tensors.values())
    ftype = f.get("general.file_type")
    rows.append(("parameters", f"{_count(n_params)} ({n_params:,})"))
    if ftype is not None:
        rows.append(("file type", _FILE_TYPES.get(ftype, f"#{ftype}")))
    rows.append(("context length", str(g("context_length", "?"))))
    rows.append(("layers", str(g("block_count", "?"))))
    rows.append(("embedding", str(g("embedding_length", "?"))))
    n_head, n_kv = g("attention.head_count"), g("attention.head_count_kv")
    head_dim = g("attention.key_length")
    if head_dim is None and isinstance(n_head, int) and n_head and isinstance(g("embedding_length"), int):
        head_dim = g("embedding_length") // n_head
    rows.append(("attention heads", f"{n_head} query, {n_kv if n_kv is not None else n_head} key/value, "
                                    f"head dim {head_dim}"))
    if g("attention.sliding_window"):
        rows.append(("sliding window", str(g("attention.sliding_window"))))
    n_expert = g("expert_count", 0)
    if n_expert:
        rows.append(("experts", f"{n_expert}, {g('expert_used_count', '?')} used per token, expert FFN "
                                f"{g('expert_feed_forward_length', g('feed_forward_length', '?'))}"))
    else:
        rows.append(("feed-forward", f"{g('feed_forward_length', '?')} (dense)"))
    rope = g("rope.freq_base")
    if rope is not None:
        rows.append(("rope base", f"{rope:g}"))
    mix: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in f.tensors.values():
        mix[t.type_name] += 1
        nbytes[t.type_name] += t.n_bytes
    total = sum(nbytes.values())
    rows.append(("quant mix", f"{len(f.tensors)} tensors, {_size(total)}"))
    for name, n in sorted(mix.items(), key=lambda kv: -nbytes[kv[0]]):
        share = 100 * nbytes[name] / max(total, 1)
        rows.append((f"  {name}", f"{n:>4} tensors  {_size(nbytes[name]):>11}  {share:5.1f}%"))
    rows.extend(_tokenizer_rows(f, arch, FALLBACK_TEMPLATES))
    f.close()
    return rows


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tokenizer_rows(f: Any, arch: str, fallbacks: dict[str, str]) -> list[tuple[str, str]]:
    tokens = f.get("tokenizer.ggml.tokens")
    model = f.get("tokenizer.ggml.model")
    if not model:
        return [("tokenizer", "none in the file")]
    n = len(tokens) if isinstance(tokens, list) else 0

    def tok(role: str) -> str:
        i = f.get(f"tokenizer.ggml.{role}_token_id")
        if not isinstance(i, int) or not 0 <= i < n:
            return "-"
        return f"{i} {tokens[i]!r}"

    rows = [("tokenizer", f"{model} (pre-tokenizer {f.get('tokenizer.ggml.pre') or 'default'}), {n} tokens"),
            ("  bos / eos", f"{tok('bos')} / {tok('eos')}")]
    add_bos = f.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None:
        rows.append(("  add bos", str(bool(add_bos)).lower()))
    template = f.get("tokenizer.chat_template")
    if isinstance(template, str) and template.strip():
        rows.append(("  chat template", f"in the file ({len(template)} characters)"))
    else:
        which = "Gemma turns" if arch in fallbacks else "ChatML"
        rows.append(("  chat template", f"none in the file (moerun uses its {which} fallback)"))
    return rows


def run(args: argparse.Namespace) -> int:
    from moerun.errors import MoerunError

    if args.file and args.model and args.file != args.model:
        raise MoerunError("give the file once (FILE or -m FILE)")
    path = args.file or args.model
    if path is None:
        from moerun.default_model import default_model_path

        path = default_model_path()
    rows = describe(path)
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label:<{width}}{value}")
    return 0
