"""Q4_K matvec for batch-1 decode on tensor cores (Triton `tl.dot`: f16 inputs, float32 accumulation).

Why (benchmarks/NOTES.md 7e): the word kernels (wmatvec.py) spend ~5.5 instructions per weight (static sm_90
SASS), the byte kernels ~25, and a batch-1 product has no reuse for the tensor cores to exploit. But the
tensor cores can take the multiply-adds off the ALUs anyway, if the weights reach them cheaply and exactly:

- a Q4_K nibble becomes an f16 by one and-or of its 32-bit word: ``(w & 0x000F000F) | 0x64006400`` is the f16
  pair (1024 + q, 1024 + q') of bytes 0 and 2 (mask 0x00F000F0: 1024 + 16 q, the high nibbles), and one HADD2
  takes 1024 off both halves. Every value is an exact integer (q or 16 q), so the tensor cores' products are
  exact and only the float32 accumulation rounds.
- x enters as the MMA's other operand, block-diagonal: XB[256, 16] for one 256-weight block, where column 2c
  holds x_hi of sub-block c and column 2c + 1 its x_lo (x = g (x_hi + x_lo), two f16 parts of ~22 bits together
  and g a power of two per block, so neither overflows). One product Q[BN rows, 256] @ XB gives every row's
  eight sub-block sums twice (hi and lo parts) in float32; the epilogue scales them by d sc (and 1/16 for the
  high nibbles) and subtracts dmin m times the sub-block sums of x, per row, in float32.

So a weight costs one and-or per pair, one HADD2 per pair, a shared-memory store and load per pair (Triton
feeds decoded registers to the MMA through shared memory) and a share of the header work: ~2 instructions
against 5.5 (benchmarks/sass_wmatvec.py --kinds tcmv).

- `prepare_x`   x f32 [K] -> TcX(xb f16 [K/256, 256, 16], g f32 [K/256], xs f32 [K/32])
- `qmatvec_tc`  out[M] = W[M, K] @ x[K] (+ residual[M]) for a Q4_K matrix, x prepared

Column order inside a block: the decoder builds the [BN, 256] tile of one block as
j = 8 w + 4 h + 2 s + p for qs word w (0..31), nibble h (0 low, 1 high), byte pair s (0: bytes 0 and 2, 1:
bytes 1 and 3) and half p (0: byte s, 1: byte s + 2); Q4_K's qs word w = 8 c + t, byte k, nibble h holds weight
64 c + 32 h + 4 t + k (sub-block 2 c + h), so tile column j is weight 64 (w // 8) + 32 h + 4 (w % 8) + s + 2 p.
`prepare_x` writes XB in that order. No allocation inside the kernels, no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.qmatvec import sm_count
from moerun.kernels.triton.wmatvec import _scale_min, _words

Q4_K = 12
TC_BN = 64  # rows per program: one warpgroup's MMA height (wgmma m64), 4 warps
PROGRAMS_PER_SM = 2  # K is split until the grid has this many programs per SM (unmeasured)
MAGIC, LO_NIB, HI_NIB = 0x64006400, 0x000F000F, 0x00F000F0  # runtime args: one LOP3 each (see wmatvec.FQ_MASK)


class TcX(NamedTuple):
    """x prepared for the tensor-core kernels: xb f16 [K/256, 256, 16] (block-diagonal hi/lo parts in the
    decoder's column order), g f32 [K/256] (x = g (hi + lo) per block), xs f32 [K/32] (sums of x per 32)."""

    xb: torch.Tensor
    g: torch.Tensor
    xs: torch.Tensor


def tc_column_weights() -> torch.Tensor:
    """int64 [256]: the weight (index within its 256-block) that tile column j of the decoder holds."""
    j = torch.arange(256)
    w, h, s, p = j // 8, (j // 4) % 2, (j // 2) % 2, j % 2
    return 64 * (w // 8) + 32 * h + 4 * (w % 8) + s + 2 * p


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _prep_x_kernel(x_ptr, xb_ptr, g_ptr, xs_ptr):
    """Grid (K/256,): one block's XB [256, 16] (zeros off the diagonal), its power-of-two scale g and its
    eight sums of 32 (in weight order)."""
    b = tl.program_id(0)
    j = tl.arange(0, 256)
    w = j // 8
    h = (j // 4) % 2
    widx = 64 * (w // 8) + 32 * h + 4 * (w % 8) + (j // 2) % 2 + 2 * (j % 2)  # tc_column_weights
    x = tl.load(x_ptr + b * 256 + widx)  # [256] in column order
    m = tl.max(tl.abs(x), axis=0)
    e = tl.minimum((m.to(tl.int32, bitcast=True) >> 23) & 255, 252)  # biased exponent of max |x|
    g = ((e - 126 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 126) > max |x|
    inv = ((253 - e) << 23).to(tl.float32, bitcast=True)  # 1 / g, exact
    xsc = x * inv  # |xsc| < 1
    hi = xsc.to(tl.float16)
    lo = (xsc - hi.to(tl.float32)).to(tl.float16)
    col = tl.arange(0, 16)
    sub = 2 * (w // 8) + h  # [256] sub-block of column j
    tile = tl.where(col[None, :] == 2 * sub[:, None], hi[:, None],
                    tl.where(col[None, :] == 2 * sub[:, None] + 1, lo[:, None], 0.0))
    tl.store(xb_ptr + b * 4096 + j[:, None] * 16 + col[None, :], tile.to(tl.float16))
    tl.store(g_ptr + b, g)
    xw = tl.reshape(tl.load(x_ptr + b * 256 + j), [8, 32])  # weight order: sub-block c = rows of 32
    tl.store(xs_ptr + b * 8 + tl.arange(0, 8), tl.sum(xw, axis=1))


@triton.jit
def _f16_pairs(v):
    """int32 words each holding two f16 bit patterns -> f16 [..., 2] (low half first)."""
    lo = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _q4k_tile(qs, magic, lo_nib, hi_nib, BN: tl.constexpr):
    """qs int32 [BN, 32] (one block's nibble words per row) -> f16 [BN, 256] in the module's column order:
    q for low nibbles, 16 q for high ones, exact."""
    q8 = qs >> 8
    a = tl.join((qs & lo_nib) | magic, (qs & hi_nib) | magic)  # [BN, 32, h]: bytes 0 and 2
    b = tl.join((q8 & lo_nib) | magic, (q8 & hi_nib) | magic)  # bytes 1 and 3
    v = tl.reshape(tl.join(a, b), [BN, 128])  # index 4 w + 2 h + s
    return tl.reshape(_f16_pairs(v), [BN, 256]) - 1024.0  # index 8 w + 4 h + 2 s + p


@triton.jit
def _tcmv_kernel(w_ptr, xb_ptr, g_ptr, xs_ptr, res_ptr, out_ptr, part_ptr, count_ptr, M, magic, lo_nib, hi_nib,
                 N_BLOCKS: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, HAS_RES: tl.constexpr):
    """Grid (cdiv(M, BN), SPLIT): program (i, s) takes rows i BN .. + BN over blocks s NB/SPLIT .. (s + 1) NB/SPLIT.
    w: int32 [M, 36 N_BLOCKS]; xb/g/xs: `TcX`; res/out: f32 [M]; part: f32 [SPLIT, M] and count: int32
    [cdiv(M, BN)] (zeros; left zero) when SPLIT > 1: each program stores its part, and the row block's last one
    to finish (an acq_rel counter after a CTA barrier) writes out = the parts summed in order (+ res)."""
    SW: tl.constexpr = 36 * N_BLOCKS  # words per row (a constant: 16-byte aligned row starts)
    NBS: tl.constexpr = N_BLOCKS // SPLIT
    blk = tl.program_id(0)
    sp = tl.program_id(1)
    row = blk * BN + tl.arange(0, BN)
    ok = row < M
    wp = w_ptr + row.to(tl.int64) * SW  # [BN]
    c8 = tl.arange(0, 8)
    col = tl.arange(0, 16)
    half = tl.where(c8 % 2 == 1, 1.0 / 16.0, 1.0)  # high-nibble sub-blocks hold 16 q
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for i in range(NBS):
        kb = sp * NBS + i
        bp = wp + kb * 36
        qs = tl.load(bp[:, None] + 4 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0)  # [BN, 32]
        xb = tl.load(xb_ptr + kb * 4096 + tl.arange(0, 256)[:, None] * 16 + col[None, :])  # [256, 16] f16
        p = tl.dot(_q4k_tile(qs, magic, lo_nib, hi_nib, BN), xb)  # [BN, 16]: sub-block sums, hi and lo
        h0 = tl.load(bp, mask=ok, other=0)
        h1 = tl.load(bp + 1, mask=ok, other=0)[:, None]
        h2 = tl.load(bp + 2, mask=ok, other=0)[:, None]
        h3 = tl.load(bp + 3, mask=ok, other=0)[:, None]
        d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (h0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc, mn = _scale_min(h1, h2, h3, c8[None, :])  # [BN, 8]
        s = (d * tl.load(g_ptr + kb))[:, None] * sc * half[None, :]
        mterm = dmin[:, None] * mn * tl.load(xs_ptr + kb * 8 + c8)[None, :]
        # column 2c (x_hi) and 2c + 1 (x_lo) scaled by sub-block c's scale; its min term taken once, at 2c
        acc += p * tl.reshape(tl.join(s, s), [BN, 16]) - tl.reshape(tl.join(mterm, tl.zeros_like(mterm)), [BN, 16])
    out = tl.sum(acc, axis=1)
    if SPLIT > 1:
        tl.store(part_ptr + sp * M + row, out, mask=ok)
        tl.debug_barrier()  # every thread's stores before the release below
        if tl.atomic_add(count_ptr + blk, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            out = tl.zeros([BN], dtype=tl.float32)
            for j in range(SPLIT):
                out += tl.load(part_ptr + j * M + row, mask=ok, other=0.0, volatile=True)
            if HAS_RES:
                out += tl.load(res_ptr + row, mask=ok, other=0.0)
            tl.store(out_ptr + row, out, mask=ok)
            tl.atomic_xchg(count_ptr + blk, 0, sem="relaxed", scope="gpu")
    else:
        if HAS_RES:
            out += tl.load(res_ptr + row, mask=ok, other=0.0)
        tl.store(out_ptr + row, out, mask=ok)


# ---------------------------------------------------------------------------------------------- wrappers


def prepare_x(x: torch.Tensor, out: TcX | None = None) -> TcX:
    """x f32 [K] (K % 256 == 0, natural order) -> TcX for the tensor-core kernels (into `out`'s buffers if given)."""
    k = x.shape[0]
    if x.dim() != 1 or k % 256 or x.dtype != torch.float32:
        raise ValueError(f"prepare_x takes float32 [K] with K % 256 == 0, got {x.dtype} {tuple(x.shape)}")
    nb = k // 256
    if out is None:
        out = TcX(torch.empty(nb, 256, 16, dtype=torch.float16, device=x.device),
                  torch.empty(nb, dtype=torch.float32, device=x.device),
                  torch.empty(nb * 8, dtype=torch.float32, device=x.device))
    _prep_x_kernel[(nb,)](x.contiguous(), out.xb, out.g, out.xs, num_warps=4)
    return out


def tc_split(m: int, n_blocks: int, device: torch.device) -> int:
    """K splits for an [M, 256 n_blocks] product: the smallest power of two dividing n_blocks that gives
    PROGRAMS_PER_SM programs per SM (the row blocks alone are too few for a 2048-row matrix)."""
    split, row_blocks = 1, triton.cdiv(m, TC_BN)
    while row_blocks * split < PROGRAMS_PER_SM * sm_count(device) and n_blocks % (split * 2) == 0:
        split *= 2
    return split


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(split: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (device, split, M): the parts f32 [split, M] and the row blocks' counters int32 (zero, and left
    zero by every launch), allocated once (so a CUDA graph may capture the launch)."""
    key = (device, split, m)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(split, m, dtype=torch.float32, device=device),
                         torch.zeros(triton.cdiv(m, TC_BN), dtype=torch.int32, device=device))
    return _SCRATCH[key]


def qmatvec_tc(w: torch.Tensor, x: TcX, out: torch.Tensor, residual: torch.Tensor | None = None,
               *, split: int | None = None) -> torch.Tensor:
    """out[M] = W[M, K] @ x[K] (+ residual[M]) for a Q4_K matrix on tensor cores.

    w: uint8 [M, row_bytes] (rows contiguous); x: `prepare_x(x)`; out/residual: f32 [M] (out may be residual);
    split: K splits (a power of two dividing K / 256; default `tc_split`). Returns out.
    """
    m, nb = w.shape[0], x.xb.shape[0]
    split = split or tc_split(m, nb, w.device)
    if nb % split:
        raise ValueError(f"split {split} does not divide the {nb} blocks of K = {256 * nb}")
    ww = _words(w, 256 * nb)
    part, count = _scratch(split, m, w.device) if split > 1 else (out, out)
    _tcmv_kernel[(triton.cdiv(m, TC_BN), split)](
        ww, x.xb, x.g, x.xs, out if residual is None else residual, out, part, count, m, MAGIC, LO_NIB, HI_NIB,
        N_BLOCKS=nb, BN=TC_BN, SPLIT=split, HAS_RES=residual is not None, num_warps=4, num_stages=2,
    )
    return out
