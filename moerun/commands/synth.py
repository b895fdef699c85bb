"""`moerun synth`: write a full-size GGUF with random weights for a named model shape (see moerun/synth/)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from moerun.errors import MoerunError

NAME = "synth"
HELP = "write a synthetic GGUF (random weights, real shapes and llama.cpp's type mix) for a model preset"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from moerun.synth import FILE_TYPES, PRESETS

    p.add_argument("--preset", metavar="NAME", help=f"model shape: {', '.join(PRESETS)}")
    p.add_argument("--type", dest="ftype", metavar="TYPE", default="q4_k_m",
                   help=f"file type (llama.cpp's mix for it): {', '.join(FILE_TYPES)} (default q4_k_m)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write the .gguf")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives identical bytes (default 0)")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.add_argument("--list", action="store_true", help="list the presets with their shapes and file sizes, and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _list() -> None:
    from moerun.synth import PRESETS, expected_size
    from moerun.synth.presets import n_params

    print(f"{'preset':<20} {'arch':<9} {'params':>8} {'layers':>6} {'embd':>5} {'heads':>7} {'experts':>8} "
          f"{'vocab':>7} {'q4_k_m':>9} {'q8_0':>9} {'f16':>9}  source")
    for name, p in PRESETS.items():
        sizes = [expected_size(p, t) for t in ("q4_k_m", "q8_0", "f16")]
        experts = f"{p.n_expert_used}/{p.n_expert}" if p.is_moe else "-"
        print(f"{name:<20} {p.arch:<9} {n_params(p) / 1e9:>7.2f}B {p.n_layer:>6} {p.n_embd:>5} "
              f"{p.n_head:>3}/{p.n_head_kv:<3} {experts:>8} {p.n_vocab:>7} "
              + " ".join(_size(s) for s in sizes) + f"  {p.source}")


def _size(n: int) -> str:
    """Bytes as 'x.xx GiB', or 'x.x MiB' under 1 GiB (9 characters)."""
    return f"{n / 2**30:>5.2f} GiB" if n >= 2**30 else f"{n / 2**20:>5.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from moerun.synth import FILE_TYPES, get_preset
    from moerun.synth.writer import check_free_space, plan_file, synth_report, synthesize

    if args.list:
        _list()
        return 0
    if not args.preset or not args.output:
        raise MoerunError("--preset NAME and -o FILE are required (see --list for the presets)")
    preset = get_preset(args.preset)
    if args.ftype.lower() not in FILE_TYPES:
        raise MoerunError(f"unknown type '{args.ftype}'; choose one of: {', '.join(FILE_TYPES)}")
    out = Path(args.output)
    if out.exists() and not args.force:
        raise MoerunError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise MoerunError(f"{out.parent} is not a directory")
    plan = plan_file(preset, args.ftype)
    check_free_space(out, plan.size)
    start = time.perf_counter()
    synthesize(preset, args.ftype, out, seed=args.seed, progress=not args.no_progress and sys.stderr.isatty())
    print(synth_report(out, plan, time.perf_counter() - start))
    return 0
