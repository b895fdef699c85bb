"""Prompt-processing variants on one model file, timed in one run (for benchmarks/NOTES.md).

    python benchmarks/bench_prefill.py MODEL.gguf [--tokens 512,4096] [--reps 5] [--profile]

For each variant (GEMM tiles, fused vs per-layer-dequantized expert weights, bf16 vs float32
matrix inputs, CUDA graphs or eager) times Engine.forward of N random tokens from position 0
(last-token logits, what `moerun bench`'s ppN runs), median of --reps after a warm-up, and prints a
table; --profile adds the GPU time by kernel of one eager 512-token prefill.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moerun.engine import fast_prefill as fp
from moerun.engine.engine import Engine
from moerun.kernels.triton.qgemm import GemmTile

VARIANTS: dict[str, dict] = {  # name -> (tiles for dense/gate_up/down, FastPrefill options)
    "default": {},
    "eager": {"graph_max": 0},
    "no prefetch": {"tiles": {k: t._replace(prefetch=frozenset()) for k, t in fp.TILES.items()}},
    "moe 128x64 w4 s3": {"tiles": {k: fp.TILES[k]._replace(block_n=64, num_warps=4) for k in ("gate_up", "down")}},
    "swap moe 128x64": {"tiles": {k: fp.TILES[k]._replace(block_n=64, num_warps=4, swap=True)
                                  for k in ("gate_up", "down")}},
    "swap moe 64x64": {"tiles": {k: fp.TILES[k]._replace(block_m=64, block_n=64, num_warps=4, swap=True)
                                 for k in ("gate_up", "down")}},
    "swap gate_up 128x64": {"tiles": {"gate_up": fp.TILES["gate_up"]._replace(block_n=64, num_warps=4, swap=True)}},
    "swap gate_up 64x64": {"tiles": {"gate_up": GemmTile(64, 64, 4, 3, fp.TILES["gate_up"].prefetch, swap=True),
                                     "down": GemmTile(64, 128, 4, 3, fp.TILES["down"].prefetch)}},
    "swap all 128x64": {"tiles": {k: t._replace(block_m=128, block_n=64, num_warps=4, swap=True)
                                  for k, t in fp.TILES.items()}},
    "prefetch all": {"tiles": {k: t._replace(prefetch=frozenset({8, 12, 14})) for k, t in fp.TILES.items()}},
    "all 64x64 w4 s3": {"tiles": {k: GemmTile(64, 64, 4, 3) for k in ("dense", "gate_up", "down")}},
    "moe 64x64 w4 s2": {"tiles": {"gate_up": GemmTile(64, 64, 4, 2), "down": GemmTile(64, 64, 4, 2)}},
    "moe 64x128 w4 s3": {"tiles": {"gate_up": GemmTile(64, 128, 4, 3), "down": GemmTile(64, 128, 4, 3)}},
    "dense 64x32 w4 s3": {"tiles": {"dense": GemmTile(64, 32, 4, 3)}},
    "dense 128x64 w4 s3": {"tiles": {"dense": GemmTile(128, 64, 4, 3)}},
    "experts dequant": {"experts": "dequant"},
    "dense dequant": {"dense": "dequant"},
    "dense fused": {"dense": "fused"},
    "dense cached": {"dense": "cached"},
    "router torch": {"router": "torch"},
    "large moe tiles": {"tiles": {"gate_up": fp.TILES["gate_up"], "down": fp.TILES["down"]}},  # no MOE_TILES_BY_ROWS
    "moe q8 words": {"tiles": {k: fp.TILES[k]._replace(q8_words=True) for k in ("gate_up", "down")}},
    "swap moe 128x64 q8 words": {"tiles": {k: fp.TILES[k]._replace(block_n=64, num_warps=4, swap=True, q8_words=True)
                                           for k in ("gate_up", "down")}},
    "float32 exact": {"exact": True},
}
DEFAULT_VARIANTS = "default,eager"


def parse_variant(name: str) -> dict:
    """A named VARIANTS entry, or tiles spelled out: KIND:BMxBNxWARPSxSTAGES[FLAGS] joined by '+', e.g.
    `gate_up:128x64x4x3sw+down:128x128x8x3` (kinds dense, gate_up, down; flags: sw = swapped operands,
    q8w = Q8_0 words, np = no raw-load prefetch; kinds not named keep fp.TILES)."""
    if name in VARIANTS:
        return VARIANTS[name]
    tiles = {}
    for part in name.split("+"):
        m = re.fullmatch(r"(dense|gate_up|down):(\d+)x(\d+)x(\d+)x(\d+)((?:sw|q8w|np)*)", part)
        if not m:
            raise SystemExit(f"variant {name!r}: expected one of {', '.join(VARIANTS)} or KIND:BMxBNxWxS[sw|q8w|np]"
                             f"+..., got {part!r}")
        kind, flags = m.group(1), m.group(6)
        base = fp.TILES[kind]
        tiles[kind] = GemmTile(*(int(m.group(i)) for i in range(2, 6)), frozenset() if "np" in flags else base.prefetch,
                               swap="sw" in flags, q8_words="q8w" in flags)
    return {"tiles": tiles}


def time_prefill(eng: Engine, n: int, reps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    toks = torch.randint(0, eng.cfg.n_vocab, (n,), generator=gen).tolist()
    times = []
    for i in range(reps + 1):
        eng.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward(toks, last_only=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", default="512,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated, each one of {', '.join(VARIANTS)} or tiles spelled out (see parse_variant)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    counts = [int(c) for c in args.tokens.split(",")]
    eng = Engine(args.model, fast=False, prefill="fast", n_ctx=max(counts) + 16)
    base_tiles = dict(fp.TILES)
    base_dense = eng.prefiller.dense
    rows = []
    for name in args.variants.split(","):
        v = parse_variant(name)
        fp.TILES.clear()
        fp.TILES.update(base_tiles | v.get("tiles", {}))
        p = eng.prefiller
        p.tile_overrides = set(v.get("tiles", {}))
        p.exact = v.get("exact", False)
        p.act_dtype = torch.float32 if p.exact else torch.bfloat16
        p.experts = v.get("experts", "fused")
        p.dense = v.get("dense", base_dense)
        p.router = v.get("router", "bmm")
        p.graph_max = v.get("graph_max", fp.DEFAULT_GRAPH_MAX)
        p._graphs.clear()  # graphs captured under another variant's tiles
        p._seen.clear()
        try:
            res = [n / time_prefill(eng, n, args.reps) for n in counts]
        except Exception as e:  # a tile that does not compile here: show it, keep going
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:200]}")
            res = [float("nan")] * len(counts)
        rows.append((name, res))
        print(name, " ".join(f"pp{n}={r:,.0f}" for n, r in zip(counts, res, strict=True)), flush=True)
    fp.TILES.clear()
    fp.TILES.update(base_tiles)
    p = eng.prefiller
    p.exact, p.act_dtype, p.experts, p.dense, p.router = False, torch.bfloat16, "fused", base_dense, "bmm"
    p.graph_max = 0  # the profile shows the kernels of an eager forward
    if args.profile:
        toks = list(range(1, 513))
        eng.reset()
        eng.forward(toks, last_only=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.reset()
            eng.forward(toks, last_only=True)
            torch.cuda.synchronize()
        agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                a = agg[ev.name[:60]]
                a[0] += ev.device_time_total
                a[1] += 1
        total = sum(a[0] for a in agg.values())
        print(f"\nGPU time of one 512-token prefill: {total / 1e3:.2f} ms")
        print("| kernel | ms | calls | share |\n|---|---:|---:|---:|")
        for k, (us, c) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:15]:
            print(f"| `{k}` | {us / 1e3:.3f} | {c} | {100 * us / total:.1f}% |")
    print("\n| variant | " + " | ".join(f"pp{n} t/s" for n in counts) + " |")
    print("|---|" + "---:|" * len(counts))
    for name, res in rows:
        print(f"| {name} | " + " | ".join(f"{r:,.0f}" for r in res) + " |")


if __name__ == "__main__":
    main()
