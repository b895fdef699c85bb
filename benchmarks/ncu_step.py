"""One eager decode step under Nsight Compute: the program `ncu --profile-from-start off` runs.

    ncu --profile-from-start off --csv --page raw --metrics ... python benchmarks/ncu_step.py MODEL.gguf
    python benchmarks/ncu_step.py --summarise ncu.csv      # per-kernel table of the metrics, for NOTES.md

Prefills 16 tokens (`--depth D`: D, in a context of D + 64, so the steps run the attention at that depth, in its
phase's variant), decodes 4 warm-up steps eagerly (fast ops, no CUDA graph: ncu replays each kernel), then decodes
`--steps` steps between cudaProfilerStart and cudaProfilerStop.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict

# What each column of the summary means; ncu's raw metric names (Hopper, ncu 2025.3).
METRICS = {
    "us": "gpu__time_duration.sum",
    "DRAM MB": "dram__bytes_read.sum",
    "DRAM %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "occ %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "warps": "launch__warps_per_block",  # not a raw metric everywhere: falls back to block size / 32
    "block": "launch__block_size",
    "occ lim": "launch__occupancy_limit_registers",
    "inst M": "smsp__inst_executed.sum",
    "cyc": "sm__cycles_elapsed.max",
}
STALLS = ["long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle", "lg_throttle",
          "mio_throttle", "no_instruction", "not_selected", "selected", "branch_resolving", "membar", "drain",
          "dispatch_stall", "imc_miss"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def metric_list() -> str:
    names = [m for k, m in METRICS.items() if k != "warps"] + [STALL_METRIC.format(s) for s in STALLS]
    return ",".join(names)


def summarise(path: str) -> None:
    """Average each metric over the calls of each kernel name; stalls as cycles per issued instruction."""
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    head, units, body = rows[start], rows[start + 1], rows[start + 2:]
    col = {name: i for i, name in enumerate(head)}
    per: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in body:
        if len(r) != len(head):
            continue
        vals = {}
        for m in [*METRICS.values(), *(STALL_METRIC.format(s) for s in STALLS)]:
            if m in col:
                try:
                    vals[m] = float(r[col[m]].replace(",", ""))
                except ValueError:
                    pass
        per[r[col["Kernel Name"]]].append(vals)
    unit = {m: units[col[m]] for m in METRICS.values() if m in col}
    print(f"us: mean kernel time (ncu's unit {unit.get(METRICS['us'])}), DRAM MB read, inst M: warp instructions")
    keys = [k for k in METRICS if METRICS[k] in col]
    print("| kernel | calls | " + " | ".join(keys) + " | top stalls (cycles per issue) |")
    print("|---|---:|" + "---:|" * len(keys) + "---|")
    total = {n: sum(v.get(METRICS["us"], 0) for v in vs) for n, vs in per.items()}  # sort key: any unit
    for name in sorted(per, key=lambda n: -total[n]):
        vs = per[name]
        avg = {m: sum(v.get(m, 0.0) for v in vs) / len(vs) for m in vs[0]}
        cells = []
        for k in keys:
            x = avg.get(METRICS[k], float("nan"))
            if k == "inst M":
                x /= 1e6
            if k == "us":
                x *= {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit.get(METRICS[k], "us"), 1.0)
            if k == "DRAM MB":
                x /= 1e6 if unit.get(METRICS[k], "byte") == "byte" else 1
            cells.append(f"{x:.3g}" if k not in ("grid", "regs", "block") else f"{x:.0f}")
        stalls = sorted(((avg.get(STALL_METRIC.format(s), 0.0), s) for s in STALLS), reverse=True)[:4]
        st = ", ".join(f"{s} {v:.2g}" for v, s in stalls if v > 0)
        print(f"| `{name[:40]}` | {len(vs)} | " + " | ".join(cells) + f" | {st} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--depth", type=int, default=16, help="tokens prefilled before the profiled steps")
    ap.add_argument("--ops", default=None, help="decode ops, as `moerun bench --ops` (default triton)")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu and exit")
    ap.add_argument("--summarise", metavar="CSV", help="summarise ncu's --csv --page raw output and exit")
    args = ap.parse_args()
    if args.metrics:
        print(metric_list())
        return
    if args.summarise:
        summarise(args.summarise)
        return
    if not args.model:
        sys.exit("ncu_step.py: give the GGUF file to decode (or --metrics / --summarise CSV)")
    import torch

    from moerun.engine.engine import Engine

    if args.depth < 1:
        sys.exit(f"ncu_step.py: --depth must be at least 1, got {args.depth}")
    eng = Engine(args.model, n_ctx=max(512, args.depth + 64), fast=True, graph=False, ops=args.ops)
    tok = eng.prefill([1 + i % 1000 for i in range(args.depth)])
    for _ in range(4):
        tok = eng.decode(tok)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(args.steps):
        tok = eng.decode(tok)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
