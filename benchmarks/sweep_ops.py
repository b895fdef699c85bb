"""A `bench_qmatvec.py --sweep` JSON's fastest tiles as `moerun bench --ops` variants, so a micro-benchmark's
winners are timed in the whole decode step (gpu_run.sh `sweepab:TYPE:KIND`); with --attn, a `bench_decode_ops.py`
JSON's fastest long-phase attention features (gpu_run.sh `attnab:TYPE`).

    python benchmarks/sweep_ops.py sweep.json --kind out --top 3
    -> triton,triton+out@8x256x4,triton+out@4x512x4,triton+out@16x128x4
    python benchmarks/sweep_ops.py decode_ops.json --attn --top 2
    -> triton,triton+pipe32s4,triton+dot64

Prints `triton` (the default tiles) first, then `triton+KIND@BMxNBxWARPS` for the `top` fastest tiles of the
sweep's KIND case that differ from the default. KIND is a TILE_KINDS name (mv, out, gate_up, down): "out" is the
output-matrix case (the sweep names its kind "mv"), "mv" the 2048x2048 attention case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# TILE_KINDS name -> the sweep row's case label prefix (bench_qmatvec.py's `shapes`)
CASES = {"mv": "attn ", "out": "output ", "gate_up": "experts gate+up", "down": "experts down"}


def ops_from_sweep(rows: list[dict], kind: str, top: int) -> list[str]:
    """['triton', 'triton+KIND@BMxNBxWARPS', ...] from the sweep row of case `kind`: its `top` fastest tiles
    other than the default (the row's `tile`)."""
    if kind not in CASES:
        raise ValueError(f"kind {kind!r}: one of {', '.join(CASES)}")
    picked = [r for r in rows if r["case"].startswith(CASES[kind]) and r.get("sweep")]
    if not picked:
        cases = sorted({r["case"] for r in rows})
        raise ValueError(f"no swept {kind!r} case in the JSON (cases: {', '.join(cases) or 'none'})")
    row = picked[0]
    default = list(row["tile"][:3])
    tiles = [t[:3] for t, _us in sorted(row["sweep"], key=lambda e: e[1]) if list(t[:3]) != default]
    return ["triton"] + [f"triton+{kind}@{bm}x{nb}x{w}" for bm, nb, w in tiles[:top]]


def ops_from_attn(rows: list[dict], features: set[str], top: int, kv_len: int = 4096) -> list[str]:
    """['triton', 'triton+FEATURE', ...]: the `top` features (of `features`) whose attention rows ("attention
    FEATURE", f16 cache) are fastest at kv_len: by the step's launch (`step_us`, bench_decode_ops.py) where the row
    has it, else by `us`."""
    timed = [(r.get("step_us", r["us"]), r["kernel"].removeprefix("attention ")) for r in rows
             if r["kernel"].startswith("attention ") and r.get("kv_len") == kv_len and r.get("dtype") == "float16"]
    names = [name for _us, name in sorted(timed) if name in features]
    if not names:
        raise ValueError(f"no attention row of a feature ({', '.join(sorted(features)) or 'none'}) at kv_len {kv_len}")
    return ["triton"] + [f"triton+{name}" for name in names[:top]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="bench_qmatvec.py --sweep --json output (bench_decode_ops.py's: --attn)")
    ap.add_argument("--kind", choices=sorted(CASES))
    ap.add_argument("--attn", action="store_true", help="the fastest attention features of a bench_decode_ops JSON")
    ap.add_argument("--top", type=int, default=3, help="how many of the fastest non-default tiles")
    args = ap.parse_args(argv)
    try:
        rows = json.loads(args.json.read_text())["rows"]
        if args.attn:
            from moerun.kernels.ops import attention_features

            print(",".join(ops_from_attn(rows, set(attention_features()), args.top)))
        elif args.kind is None:
            raise ValueError("--kind is required without --attn")
        else:
            print(",".join(ops_from_sweep(rows, args.kind, args.top)))
    except (OSError, KeyError, ValueError) as e:
        print(f"sweep_ops: {args.json}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
