"""Break one decode step's GPU time down by kernel (torch.profiler), for benchmarks/NOTES.md.

    python benchmarks/profile_decode.py MODEL.gguf --decode reference|eager [--steps 8] [--depth D] [--ops A,B]

Prefills `--depth` tokens (default 16, in a context of D + 64, so the attention runs at that depth), warms up,
then profiles `--steps` decode steps and prints a table of kernels grouped by name: total GPU time per step, calls
per step, share; plus launches per step and the step's wall time. Several `--ops` (fused steps only) profile each
in turn on the one loaded model (`Engine.set_ops`), each from the same prefilled state.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moerun.engine.engine import Engine

MODES = {"reference": {"fast": False}, "eager": {"fast": True, "graph": False}, "fast": {"fast": True}}


def profile_steps(eng: Engine, prompt: list[int], steps: int, top: int, label: str) -> None:
    """Prefill `prompt`, warm up, then print `steps` decode steps' wall time and kernel table."""
    eng.reset()
    tok = eng.prefill(prompt)
    for _ in range(4):
        tok = eng.decode(tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = eng.decode(tok)
    wall = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            tok = eng.decode(tok)
        torch.cuda.synchronize()

    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name][1] += 1
    total = sum(v[0] for v in per.values())
    print(f"\n{label}: {wall * 1e3:.3f} ms/step wall, {total / steps / 1e3:.3f} ms/step GPU busy, "
          f"{sum(v[1] for v in per.values()) / steps:.0f} kernels/step")
    print("| kernel | us/step | calls/step | share |\n|---|---:|---:|---:|")
    for name, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        short = name if len(name) < 70 else name[:67] + "..."
        print(f"| `{short}` | {us / steps:.1f} | {calls / steps:.0f} | {100 * us / total:.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", choices=list(MODES), default="reference")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--depth", type=int, default=16, help="tokens prefilled before the profiled steps")
    ap.add_argument("--ops", default=None, metavar="A[,B...]",
                    help="decode ops, as `moerun bench --ops` (default triton); several: each in turn")
    args = ap.parse_args()
    ops = args.ops.split(",") if args.ops else [None]
    if args.depth < 1:
        sys.exit(f"profile_decode.py: --depth must be at least 1, got {args.depth}")
    if len(ops) > 1 and args.decode == "reference":
        sys.exit("profile_decode.py: several --ops need a fused step (--decode eager or fast)")

    eng = Engine(args.model, n_ctx=max(512, args.depth + 64 + args.steps * 2), ops=ops[0], **MODES[args.decode])
    prompt = [1 + i % 1000 for i in range(args.depth)]
    for name in ops:
        if name != eng.ops_name and name is not None:
            eng.set_ops(name)
        profile_steps(eng, prompt, args.steps, args.top,
                      f"{args.decode} ({name or 'default'} ops, depth {args.depth})")


if __name__ == "__main__":
    main()
