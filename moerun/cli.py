"""`moerun` command line: one subcommand per module in moerun/commands/.

Each command module defines `NAME`, `HELP`, `add_arguments(parser)` and `run(args) -> int`.
Errors a user can act on (MoerunError, missing files) print as one line and exit non-zero;
`--verbose` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moerun.errors import MoerunError

COMMANDS = ["generate", "chat", "info", "bench", "synth"]  # moerun/commands/<name>.py


def _available() -> list:
    mods = []
    for name in COMMANDS:
        try:
            mods.append(importlib.import_module(f"moerun.commands.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"moerun.commands.{name}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerun", description="Fast GGUF inference for Mixture-of-Experts models.")
    parser.add_argument("--verbose", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in _available():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (MoerunError, OSError) as e:
        if args.verbose:
            raise
        print(f"moerun {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
