"""Experiment: Q4_K matvec variants at expert gate/up size (8 x 1024 rows x 2048), on the GPU.

    python benchmarks/exp_q4k.py

A: the shipped kernel (qblocks.row_dot) at several tiles.
B: 2-D weight-index decode: a [BM, 256] tile per block, every scale byte loaded at the element's own
   address (redundant L1 hits, no small-tensor broadcasts or layout conversions).
C: as B over a repacked layout: per 32-weight sub-block float32 (d*sc, dmin*m) pairs stored beside the
   nibbles (exact values, 6 bits/weight instead of 4.5).
Each prints us, GB/s (of the bytes it reads) and max error vs the dequantized reference.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from moerun.kernels.triton.qblocks import row_dot
from moerun.quant.random_blocks import random_blocks
from moerun.quant.registry import dequantize

Q4K = 12
M, K = 8192, 2048
NBLK = K // 256


@triton.jit
def _a_kernel(w_ptr, x_ptr, out_ptr, M, stride, N_BLOCKS: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    acc = row_dot(w_ptr + rows.to(tl.int64) * stride, rmask, x_ptr, N_BLOCKS, 12, BM, NB)
    tl.store(out_ptr + rows, acc, mask=rmask)


@triton.jit
def _b_kernel(w_ptr, x_ptr, out_ptr, M, stride, N_BLOCKS: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    wrow = w_ptr + rows.to(tl.int64) * stride  # [BM]
    w = tl.arange(0, 256)
    byte = 16 + 32 * (w // 64) + (w % 32)       # qs byte of weight w
    shift = 4 * ((w // 32) % 2)
    s = w // 32                                  # sub-block 0..7
    lo = s % 4
    first = s < 4
    acc = tl.zeros([BM, 256], dtype=tl.float32)
    for kb in range(0, N_BLOCKS):
        bp = wrow[:, None] + kb * 144            # [BM, 1]
        q = (tl.load(bp + byte[None, :]).to(tl.int32) >> shift[None, :]) & 15
        a = tl.load(bp + 4 + lo[None, :]).to(tl.int32)
        b = tl.load(bp + 8 + lo[None, :]).to(tl.int32)
        c = tl.load(bp + 12 + lo[None, :]).to(tl.int32)
        sc = tl.where(first[None, :], a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
        mn = tl.where(first[None, :], b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
        d = (tl.load(bp).to(tl.uint16) | (tl.load(bp + 1).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
        dm = (tl.load(bp + 2).to(tl.uint16) | (tl.load(bp + 3).to(tl.uint16) << 8)).to(tl.float16, bitcast=True)
        x = tl.load(x_ptr + kb * 256 + w)
        acc += ((d.to(tl.float32) * sc) * q.to(tl.float32) - dm.to(tl.float32) * mn) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _c_kernel(qs_ptr, sm_ptr, x_ptr, out_ptr, M, N_BLOCKS: tl.constexpr, BM: tl.constexpr):
    """qs: [M, K/2] nibbles (llama order within each 256-block), sm: [M, K/32, 2] f32 (d*sc, dmin*m)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    w = tl.arange(0, 256)
    byte = 32 * (w // 64) + (w % 32)
    shift = 4 * ((w // 32) % 2)
    s = w // 32
    acc = tl.zeros([BM, 256], dtype=tl.float32)
    for kb in range(0, N_BLOCKS):
        q = (tl.load(qs_ptr + r64[:, None] * (N_BLOCKS * 128) + kb * 128 + byte[None, :]).to(tl.int32)
             >> shift[None, :]) & 15
        sp = sm_ptr + r64[:, None] * (N_BLOCKS * 16) + (kb * 8 + s[None, :]) * 2
        sc = tl.load(sp)
        mn = tl.load(sp + 1)
        x = tl.load(x_ptr + kb * 256 + w)
        acc += (sc * q.to(tl.float32) - mn) * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1), mask=rmask)


@triton.jit
def _i2f(q):
    """Exact float32 of small non-negative ints without I2F: bits (q | 0x4B000000) = 2^23 + q."""
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _d_kernel(w_ptr, x_ptr, out_ptr, M, stride, N_BLOCKS: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """As A (same tile decode), with the magic-number int->float conversion of the nibbles."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    wrow = w_ptr + rows.to(tl.int64) * stride
    c = tl.arange(0, 4)
    j = tl.arange(0, 32)
    acc = tl.zeros([BM, NB, 4, 32], dtype=tl.float32)
    for kb in range(0, N_BLOCKS, NB):
        blk = kb + tl.arange(0, NB)
        bp = wrow[:, None] + blk[None, :] * 144
        m2 = rmask[:, None] & (blk < N_BLOCKS)[None, :]
        m3 = m2[:, :, None]
        d = (tl.load(bp, mask=m2, other=0).to(tl.uint16) | (tl.load(bp + 1, mask=m2, other=0).to(tl.uint16) << 8)
             ).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (tl.load(bp + 2, mask=m2, other=0).to(tl.uint16)
                | (tl.load(bp + 3, mask=m2, other=0).to(tl.uint16) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        sc_lo, mn_lo = _k4(bp[:, :, None] + 4, 2 * c, m3)
        sc_hi, mn_hi = _k4(bp[:, :, None] + 4, 2 * c + 1, m3)
        off = c[:, None] * 32 + j[None, :]
        q = tl.load(bp[:, :, None, None] + 16 + off[None, None, :, :], mask=m3[:, :, :, None], other=0)
        xi = blk[:, None, None] * 256 + c[None, :, None] * 64 + j[None, None, :]
        x_lo = tl.load(x_ptr + xi)
        x_hi = tl.load(x_ptr + xi + 32)
        d3, m3f = d[:, :, None], dmin[:, :, None]
        w_lo = (d3 * sc_lo)[:, :, :, None] * _i2f(q & 15) - (m3f * mn_lo)[:, :, :, None]
        w_hi = (d3 * sc_hi)[:, :, :, None] * _i2f(q >> 4) - (m3f * mn_hi)[:, :, :, None]
        acc += w_lo * x_lo[None] + w_hi * x_hi[None]
    tl.store(out_ptr + rows, tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), mask=rmask)


@triton.jit
def _k4(sp, s, m3):
    s3 = s[None, None, :]
    lo = s3 & 3
    a = tl.load(sp + lo, mask=m3, other=0).to(tl.int32)
    b = tl.load(sp + lo + 4, mask=m3, other=0).to(tl.int32)
    c = tl.load(sp + lo + 8, mask=m3, other=0).to(tl.int32)
    first = s3 < 4
    sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return _i2f(sc), _i2f(mn)


def timeit(fn, n_sets: int) -> float:
    """Median us per call inside a CUDA graph that cycles over n_sets weight copies (cold L2)."""
    g = torch.cuda.CUDAGraph()
    fn(0)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for i in range(n_sets):
            fn(i)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / n_sets)
    return float(np.median(times))


def main() -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    n_sets = 8  # 8 x 9.4 MB > 60 MB L2
    ws = [torch.from_numpy(random_blocks(Q4K, M * NBLK, rng, scale=0.05)).view(M, NBLK * 144).to(dev)
          for _ in range(n_sets)]
    x = torch.randn(K, device=dev)
    out = torch.empty(M, device=dev)
    ref = dequantize(ws[0], Q4K, (M, K)) @ x
    nbytes = ws[0].numel()
    rows = []
    for bm, nb, warps in [(8, 1, 4), (2, 8, 4), (4, 4, 4), (2, 4, 2), (1, 8, 2), (4, 8, 8)]:
        def fa(i, bm=bm, nb=nb, warps=warps):
            _a_kernel[(triton.cdiv(M, bm),)](ws[i], x, out, M, ws[i].stride(0), N_BLOCKS=NBLK, BM=bm, NB=nb,
                                             num_warps=warps)
        us = timeit(fa, n_sets)
        fa(0)
        rows.append((f"A bm={bm} nb={nb} w={warps}", us, nbytes, float((out - ref).abs().max())))
    for bm, nb, warps in [(2, 8, 4), (4, 4, 4), (8, 1, 4), (2, 4, 2), (4, 8, 8), (1, 8, 2)]:
        def fd(i, bm=bm, nb=nb, warps=warps):
            _d_kernel[(triton.cdiv(M, bm),)](ws[i], x, out, M, ws[i].stride(0), N_BLOCKS=NBLK, BM=bm, NB=nb,
                                             num_warps=warps)
        us = timeit(fd, n_sets)
        fd(0)
        rows.append((f"D bm={bm} nb={nb} w={warps}", us, nbytes, float((out - ref).abs().max())))
    for bm, warps, stages in [(2, 4, 1), (4, 4, 1)]:
        def fb(i, bm=bm, warps=warps, stages=stages):
            _b_kernel[(triton.cdiv(M, bm),)](ws[i], x, out, M, ws[i].stride(0), N_BLOCKS=NBLK, BM=bm,
                                             num_warps=warps, num_stages=stages)
        us = timeit(fb, n_sets)
        fb(0)
        rows.append((f"B bm={bm} w={warps} st={stages}", us, nbytes, float((out - ref).abs().max())))
    # C: repack (exact float32 sub-block scales, as gguf computes d * sc and dmin * m)
    packs = []
    for w in ws:
        blk = w.view(M * NBLK, 144)
        full = dequantize(w, Q4K, (M, K)).view(M * NBLK, 8, 32)
        qs = blk[:, 16:].contiguous().view(M, NBLK * 128)
        # recover (d*sc, dmin*m) exactly: value = s*q - m; q=0 gives -m; use the decoded scales directly
        d = blk[:, 0:2].contiguous().view(torch.float16).float()
        dmin = blk[:, 2:4].contiguous().view(torch.float16).float()
        sc_b = blk[:, 4:16].int()
        j = torch.arange(8, device=dev)
        lo = j % 4
        a, b, c = sc_b[:, lo], sc_b[:, lo + 4], sc_b[:, lo + 8]
        first = j < 4
        sc = torch.where(first, a & 63, (c & 15) | ((a >> 6) << 4)).float()
        mn = torch.where(first, b & 63, (c >> 4) | ((b >> 6) << 4)).float()
        sm = torch.stack([d * sc, dmin * mn], dim=-1).view(M, NBLK * 16).contiguous()
        del full
        packs.append((qs, sm))
    cbytes = packs[0][0].numel() + packs[0][1].numel() * 4
    for bm, warps, stages in [(4, 4, 1), (8, 4, 1)]:
        def fc(i, bm=bm, warps=warps, stages=stages):
            qs, sm = packs[i]
            _c_kernel[(triton.cdiv(M, bm),)](qs, sm, x, out, M, N_BLOCKS=NBLK, BM=bm, num_warps=warps,
                                             num_stages=stages)
        us = timeit(fc, n_sets)
        fc(0)
        rows.append((f"C bm={bm} w={warps} st={stages}", us, cbytes, float((out - ref).abs().max())))
    print("| variant | us | GB/s | max err |\n|---|---:|---:|---:|")
    for name, us, nb_, err in rows:
        print(f"| {name} | {us:.2f} | {nb_ / us / 1e3:.0f} | {err:.1e} |")


if __name__ == "__main__":
    main()
