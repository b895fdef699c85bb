"""Break one decode step's GPU time down by kernel (torch.profiler), for benchmarks/NOTES.md.

    python benchmarks/profile_decode.py MODEL.gguf --decode reference|eager [--steps 8]

Runs a short prompt, warms up, then profiles `--steps` decode steps and prints a table of kernels
grouped by name: total GPU time per step, calls per step, share; plus launches per step and the
step's wall time.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moerun.engine.engine import Engine

MODES = {"reference": {"fast": False}, "eager": {"fast": True, "graph": False}, "fast": {"fast": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--decode", choices=list(MODES), default="reference")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--ops", default=None, help="decode ops, as `moerun bench --ops` (default triton)")
    args = ap.parse_args()

    eng = Engine(args.model, n_ctx=512, ops=args.ops, **MODES[args.decode])
    tok = eng.prefill(list(range(1, 17)))
    for _ in range(4):
        tok = eng.decode(tok)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        tok = eng.decode(tok)
    wall = (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            tok = eng.decode(tok)
        torch.cuda.synchronize()

    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name][1] += 1
    total = sum(v[0] for v in per.values())
    n = args.steps
    print(f"\n{args.decode} ({args.ops or 'default'} ops): {wall * 1e3:.3f} ms/step wall, "
          f"{total / n / 1e3:.3f} ms/step GPU busy, "
          f"{sum(v[1] for v in per.values()) / n:.0f} kernels/step")
    print("| kernel | us/step | calls/step | share |\n|---|---:|---:|---:|")
    for name, (us, calls) in sorted(per.items(), key=lambda kv: -kv[1][0])[: args.top]:
        short = name if len(name) < 70 else name[:67] + "..."
        print(f"| `{short}` | {us / n:.1f} | {calls / n:.0f} | {100 * us / total:.1f}% |")


if __name__ == "__main__":
    main()
