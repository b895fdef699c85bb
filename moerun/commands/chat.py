"""`moerun chat`: an interactive conversation through the model's chat template (like llama-cli -cnv).

Each line on stdin is a user turn; `/exit` or end of input ends the chat. Every turn renders the whole
history, and the KV cache is reused up to the longest common token prefix with what is already cached,
so only the new part is computed (`--verbose` shows how many tokens were reused).
"""

from __future__ import annotations

import argparse
import sys

from moerun.commands.generate import (
    _int,
    add_model_arguments,
    add_sampling_arguments,
    load_model,
    one_line_errors,
    sampling_params,
)

NAME = "chat"
HELP = "chat with the model through its chat template, one line per turn (/exit or end of input ends)"
EXIT_COMMANDS = ("/exit", "/quit", "/bye")


def add_arguments(p: argparse.ArgumentParser) -> None:
    one_line_errors(p)
    p.add_argument("-sys", "--system-prompt", metavar="TEXT", default=None, help="system message of the chat")
    p.add_argument("-n", "--n-predict", type=_int(-1, " (-1 = no limit)"), default=-1, metavar="N",
                   help="tokens per reply at most; -1 = until the model ends its turn (default -1)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a reply when the text TEXT is generated (not printed); repeatable")
    add_model_arguments(p)
    add_sampling_arguments(p)


def run(args: argparse.Namespace) -> int:
    from moerun.api import ChatSession

    verbose = getattr(args, "verbose", False)
    params = sampling_params(args)
    model = load_model(args)
    session = ChatSession(model, system=args.system_prompt, max_tokens=args.n_predict, stop=args.stop,
                          sampling=params)
    interactive = sys.stdin.isatty()
    if interactive:
        print("moerun chat: type a message and press Enter; /exit or Ctrl-D ends.", file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.strip() in EXIT_COMMANDS:
            break
        if not text.strip():
            continue
        turn += 1
        for piece in session.send(text, stream=True):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if verbose:
            st = model.last_stats
            print(f"moerun chat: turn {turn}: reused {st.n_reused} of {st.n_prompt} prompt tokens from the cache, "
                  f"computed {st.n_prompt - st.n_reused}; {st.summary()}", file=sys.stderr, flush=True)
    model.close()
    return 0
