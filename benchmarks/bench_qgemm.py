# ruff: noqa: B023  (each lambda is timed at once, inside its loop iteration)
"""Micro-benchmark of the prefill GEMM kernels (kernels/triton/qgemm.py) at OLMoE-1B-7B sizes.

    python benchmarks/bench_qgemm.py [--types Q4_K,Q8_0,F16] [--tiles 64x64x4x2,128x64x4x3sw,...] [--prefetch on,off]

Per weight type: the bf16 copy of a dense matrix (qgemm.dequantize_bf16, at --copy-tiles), and the dense
projection as that copy then cuBLAS;
per weight type and tile: the dense projection (512 x 2048 x 2048), the grouped gate+up (512 tokens,
64 experts, top-8, F = 1024) and the grouped down; median of 20 replays of a CUDA graph of 10 calls (GPU
time only), as TFLOP/s and as G weights decoded per second.
cuBLAS bf16 matmuls of the same shapes are the ceiling to compare with.
--prefetch on,off times each tile with and without the kernel's one-step-ahead raw loads (Q8_0, Q4_K, Q6_K).
"""

from __future__ import annotations

import argparse
import re
import statistics

import numpy as np
import torch
from _timing import capture_graph, event_ms
from gguf import GGMLQuantizationType as Q

from moerun.kernels.triton import qgemm as qg
from moerun.kernels.triton.qmatvec import GEOMETRY
from moerun.quant import random_blocks

T, N, F, E, TOPK = 512, 2048, 1024, 64, 8


def timed(fn, reps: int = 20, calls: int = 10) -> float:
    """Median milliseconds of one fn() call, GPU time only: `calls` calls captured in one CUDA graph, the graph
    replayed `reps` times (an event pair around one eager call also counts Triton's ~20-40 us Python launch,
    which inflated every short kernel's figure before 2026-12-03)."""
    g = capture_graph([fn] * calls, warmup=[fn] * 3)
    return statistics.median(event_ms(g.replay) / calls for _ in range(reps))


def weights(qtype: int, lead: tuple[int, ...], k: int, gen: np.random.Generator) -> torch.Tensor:
    bs, ts, _ = GEOMETRY[qtype]
    n = int(np.prod(lead))
    return torch.from_numpy(random_blocks(qtype, n * k // bs, gen, scale=0.5)).reshape(*lead, k // bs * ts).cuda()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,F16")
    ap.add_argument("--tiles", default="64x64x4x2,64x128x4x3,128x128x8x3,64x64x4x4,128x64x4x3")
    ap.add_argument("--copy-tiles", default="16x4x1,64x4x1,32x4x4,16x4x8,64x8x4,8x2x4",
                    help="dequantize_bf16 tiles to time: ROWSxWARPSxSTEPS (16x4x1 is the default)")
    ap.add_argument("--prefetch", default="on", help="on, off or on,off (raw-load prefetch of Q8_0/Q4_K/Q6_K)")
    args = ap.parse_args()
    gen = np.random.default_rng(0)
    dev = torch.device("cuda")
    x = torch.randn(T, N, device=dev).bfloat16()
    ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(T)]).to(dev).int()
    rw = torch.rand(T * TOPK, device=dev)
    rows = []
    # cuBLAS ceilings
    wd = torch.randn(N, N, device=dev).bfloat16()
    ms = timed(lambda: x @ wd.T)
    rows.append(("cuBLAS bf16", "dense", "-", ms, 2 * T * N * N / ms / 1e9, N * N / ms / 1e6))
    we = torch.randn(E, 2 * F, N, device=dev).bfloat16()
    xs = torch.randn(T * TOPK // E, N, device=dev).bfloat16()
    ms = timed(lambda: [xs @ we[e].T for e in range(E)])
    rows.append(("cuBLAS bf16 (64 matmuls)", "gate_up", "-", ms, 2 * T * TOPK * 2 * F * N / ms / 1e9,
                 E * 2 * F * N / ms / 1e6))
    for tname in args.types.split(","):
        qt = int(Q[tname])
        w_dense = weights(qt, (N,), N, gen)
        w_g = weights(qt, (E, F), N, gen)
        w_u = weights(qt, (E, F), N, gen)
        w_d = weights(qt, (E, N), F, gen)
        wb = torch.empty(N, N, device=dev, dtype=torch.bfloat16)
        for ct in args.copy_tiles.split(","):
            ctile = tuple(int(v) for v in ct.split("x"))
            ms = timed(lambda: qg.dequantize_bf16(w_dense, qt, wb, tile=ctile))
            gbs = (w_dense.numel() + 2 * N * N) / ms / 1e6  # bytes read + written
            rows.append((tname, "dense: bf16 copy only", f"{ct} (rows x warps x steps), {gbs:.0f} GB/s", ms, 0.0,
                         N * N / ms / 1e6))
            print(*rows[-1], flush=True)
        ms = timed(lambda: torch.mm(x, qg.dequantize_bf16(w_dense, qt, wb).T, out_dtype=torch.float32))
        rows.append((tname, "dense: bf16 copy + cuBLAS", "-", ms, 2 * T * N * N / ms / 1e9, N * N / ms / 1e6))
        print(*rows[-1], flush=True)
        for spec, pf in [(t, p) for t in args.tiles.split(",") for p in args.prefetch.split(",")]:
            dims, flags = re.fullmatch(r"([\dx]+)([a-z\d]*)", spec).groups()
            bm, bn, nw, ns = (int(v) for v in dims.split("x")[:4])
            tile = qg.GemmTile(bm, bn, nw, ns, frozenset({8, 12, 14}) if pf == "on" else frozenset(),
                               swap="sw" in flags, q8_words="q8w" in flags)
            spec = f"{spec} pf {pf}"
            try:
                out = torch.empty(T, N, device=dev)
                ms = timed(lambda: qg.qgemm(x, w_dense, qt, out, tile=tile))
                rows.append((tname, "dense", spec, ms, 2 * T * N * N / ms / 1e9, N * N / ms / 1e6))
                r = qg.moe_align(ids, E, bm)
                h = torch.empty(r.rows.shape[0], F, device=dev, dtype=torch.bfloat16)
                ms = timed(lambda: qg.moe_gate_up(x, w_g, w_u, qt, qt, r, h, tile=tile))
                rows.append((tname, "gate_up", spec, ms, 2 * T * TOPK * 2 * F * N / ms / 1e9, E * 2 * F * N / ms / 1e6))
                y = torch.empty(T * TOPK, N, device=dev)
                ms = timed(lambda: qg.moe_down(h, w_d, qt, r, rw, y, tile=tile))
                rows.append((tname, "down", spec, ms, 2 * T * TOPK * F * N / ms / 1e9, E * F * N / ms / 1e6))
                ms = timed(lambda: qg.moe_align(ids, E, bm))
                rows.append((tname, "align", spec, ms, 0.0, 0.0))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit: report and go on
                print(f"{tname} {spec}: {type(e).__name__}: {str(e)[:150]}")
            print(*rows[-1], flush=True)
    print("\n| type | product | tile BMxBNxWxS | ms | TFLOP/s | G weights/s |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.1f} | {r[5]:.0f} |")


if __name__ == "__main__":
    main()
