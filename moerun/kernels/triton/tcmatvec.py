"""Q4_K, Q6_K and Q8_0 products for batch-1 decode on tensor cores (Triton `tl.dot`: f16 inputs, float32
accumulation).

Why (benchmarks/NOTES.md 7e): the word kernels (wmatvec.py) spend ~5.5-10 instructions per weight (static sm_90
SASS), the byte kernels ~25, and a batch-1 product has no reuse for the tensor cores to exploit. But the
tensor cores can take the multiply-adds off the ALUs anyway, if the weights reach them cheaply and exactly:

- quantized values become f16 by bit operations on their 32-bit words: ``(w & 0x000F000F) | 0x64006400`` is the
  f16 pair (1024 + q, 1024 + q') of a Q4_K word's bytes 0 and 2 (mask 0x00F000F0: 1024 + 16 q, the high
  nibbles); a Q6_K value adds its two qh bits by one more and-or; a Q8_0 byte pair is ``(w & 0x00FF00FF) ^
  0x64806480`` (1024 + q + 128). One HADD2 per pair removes the offset. Every value is an exact integer, so the
  tensor cores' products are exact and only the float32 accumulation rounds.
- x enters as the MMA's other operand, block-diagonal: an f16 tile [K-tile, 16] per 256 (Q6_K: 128) weights whose
  column 2c holds x_hi of scale sub-block c and column 2c + 1 its x_lo (x = g (x_hi + x_lo), two f16 parts of
  ~22 bits together and g a power of two per 32 weights, so neither overflows). One product Q[64 rows, K-tile]
  @ XB gives every row's sub-block sums (hi and lo parts) in float32; the epilogue scales them by the row's
  sub-block scales (and, for Q4_K, subtracts dmin m times the sub-block sums of x), in float32.

So a weight costs ~1-2.5 instructions of decoding, a shared-memory store and load per pair (Triton feeds decoded
registers to the MMA through shared memory) and a share of the header work: 2.7-3.9 instructions per weight for
Q4_K, 3.3-4.7 for Q8_0, 5.7-7.0 for Q6_K (`benchmarks/sass_wmatvec.py --kinds tcmv,tcgate_up,tcdown,...`).

- `prepare_x`       x f32 [K] -> TcX(xb f16 [K/256, 256, 16], g f32 [K/32], xs f32 [K/32]) in a type's layout
- `qmatvec_tc`      out[M] = W[M, K] @ x[K] (+ residual[M]), x prepared
- `moe_gate_up_tc`  h[i] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x), h written as f32 or prepared (TcX)
- `moe_down_tc`     out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]), h prepared

Small products split K (down: its experts) across programs (`tc_split`); each output's last program to finish
sums the parts in a fixed order (bit-identical run to run). The tile row order of each decoder (and so the
layout `prepare_x` writes, `_tc_slot`) is given at its block function. No allocation inside the kernels, no host
sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.qmatvec import ACTIVATIONS, GEOMETRY, _act, sm_count
from moerun.kernels.triton.wmatvec import _scale_min, _words

Q8_0, Q4_K, Q6_K = 8, 12, 14
FORMATS = {Q4_K: 4, Q6_K: 6, Q8_0: 8}  # the TcX layout each type's decoder reads
TC_BN = 64  # rows per program: one warpgroup's MMA height (wgmma m64), 4 warps
PROGRAMS_PER_SM = 2  # K is split until the grid has this many programs per SM (unmeasured)
MAGIC, LO_NIB, HI_NIB, HI2 = 0x64006400, 0x000F000F, 0x00F000F0, 0x00300030  # runtime args (wmatvec.FQ_MASK)
M1 = {Q4_K: LO_NIB, Q6_K: LO_NIB, Q8_0: 0x00FF00FF}  # the decoders' masks (Q8_0: bytes, then the sign flip)
M2 = {Q4_K: HI_NIB, Q6_K: HI2, Q8_0: 0x64806480}


class TcX(NamedTuple):
    """x prepared for the tensor-core kernels: xb f16 [K/256, 256, 16] (per block the hi/lo parts on the
    diagonal, in the decoder's column order; every other entry zero, and never written again), g f32 [K/32]
    (x = g (hi + lo) per 32 weights, a power of two) and xs f32 [K/32] (the sums of x per 32)."""

    xb: torch.Tensor
    g: torch.Tensor
    xs: torch.Tensor


def empty_x(k: int, device: torch.device, lead: int = 1) -> TcX:
    """Buffers for `lead` prepared vectors of K (xb zeroed once: producers write only its diagonal)."""
    return TcX(torch.zeros(lead * k // 256, 256, 16, dtype=torch.float16, device=device),
               torch.empty(lead * k // 32, dtype=torch.float32, device=device),
               torch.empty(lead * k // 32, dtype=torch.float32, device=device))


def tc_column_weights() -> torch.Tensor:
    """int64 [256]: the weight (index within its 256-block) that tile column j of the decoder holds."""
    j = torch.arange(256)
    w, h, s, p = j // 8, (j // 4) % 2, (j // 2) % 2, j % 2
    return 64 * (w // 8) + 32 * h + 4 * (w % 8) + s + 2 * p


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tc_slot(k, FMT: tl.constexpr):
    """Where x position k goes in a TcX's xb (format FMT: 4, 6, 8 for the Q4_K, Q6_K, Q8_0 decoders): the offset of its
    row's column 0, and its column pair 2c (c: the scale sub-block within the tile)."""
    wi = k % 256
    if FMT == 4:  # wi = 64 c + 32 h + 4 t + q -> row 8 (8 c + t) + 4 h + 2 (q % 2) + q // 2 of a 256-row tile
        j = 8 * (8 * (wi // 64) + (wi // 4) % 8) + 4 * ((wi // 32) % 2) + 2 * (wi % 2) + (wi // 2) % 2
        return (k // 256) * 4096 + j * 16, 2 * (wi // 32)
    elif FMT == 8:  # wi = 64 p + 32 h + 4 i + q -> row 64 p + 8 i + 4 h + 2 (q % 2) + q // 2, c = 2 p + h
        j = 64 * (wi // 64) + 8 * ((wi % 32) // 4) + 4 * ((wi // 32) % 2) + 2 * (wi % 2) + (wi // 2) % 2
        return (k // 256) * 4096 + j * 16, 2 * (wi // 32)
    else:  # l = wi % 128 = 64 h + 4 t + q -> row 8 t + 4 (q % 2) + 2 h + q // 2 of a 128-row tile, c = 4 h + t // 4
        l = wi % 128
        t = (l % 64) // 4
        j = 8 * t + 4 * (l % 2) + 2 * (l // 64) + (l // 2) % 2
        return (k // 128) * 2048 + j * 16, 2 * (4 * (l // 64) + t // 4)


@triton.jit
def _tc_store_x(v, k, xb_ptr, g_ptr, xs_ptr, NSUB: tl.constexpr, FMT: tl.constexpr = 4):
    """Write x values v f32 [32 NSUB] at positions k [32 NSUB] (whole, aligned runs of 32: k = k0 + arange,
    k0 % 32 == 0) into TcX buffers of format FMT: per 32, g = the power of two just above max |v| (so |v / g| < 1
    and the f16 parts neither overflow nor lose the small values), hi = f16(v / g), lo = f16(v / g - hi), the
    sum of v (`_sum32`: the same bits whoever writes it)."""
    v2 = tl.reshape(v, [NSUB, 32])
    k2 = tl.reshape(k, [NSUB, 32])
    e = tl.minimum((tl.max(tl.abs(v2), axis=1).to(tl.int32, bitcast=True) >> 23) & 255, 252)  # [NSUB]
    g = ((e + 1) << 23).to(tl.float32, bitcast=True)  # 2^(e - 126)
    inv = ((253 - e) << 23).to(tl.float32, bitcast=True)  # 1 / g, exact
    vs = v2 * inv[:, None]
    hi = vs.to(tl.float16)
    lo = (vs - hi.to(tl.float32)).to(tl.float16)
    row, cp = _tc_slot(k2, FMT)
    dst = xb_ptr + row + cp
    tl.store(dst, hi)
    tl.store(dst + 1, lo)
    sub = tl.min(k2, axis=1) // 32
    tl.store(g_ptr + sub, g)
    tl.store(xs_ptr + sub, _sum32(v2))


@triton.jit
def _sum32(v):
    """v [R, 32] -> [R]: sums of 32 in a fixed pairwise order (elementwise adds), so every producer's layout and
    warp count gives the same bits (tl.sum's order follows the layout)."""
    R: tl.constexpr = v.shape[0]
    s = v
    for n in tl.static_range(5):
        a, b = tl.split(tl.reshape(s, [R, 16 >> n, 2]))
        s = a + b
    return tl.reshape(s, [R])


@triton.jit
def _prep_x_kernel(x_ptr, xb_ptr, g_ptr, xs_ptr, FMT: tl.constexpr):
    """Grid (K/256,): block b of x into TcX buffers of format FMT."""
    k = tl.program_id(0) * 256 + tl.arange(0, 256)
    _tc_store_x(tl.load(x_ptr + k), k, xb_ptr, g_ptr, xs_ptr, 8, FMT)


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
def _xb_tile(xb_ptr, kb):
    """Block kb of a TcX's xb: f16 [256, 16]."""
    return tl.load(xb_ptr + kb * 4096 + tl.arange(0, 256)[:, None] * 16 + tl.arange(0, 16)[None, :])


@triton.jit
def _tc_block(acc, bp, ok, xb, g_ptr, xs_ptr, kb, scale, magic, lo_nib, hi_nib, BN: tl.constexpr):
    """Tile rows (`_q4k_tile`): j = 8 w + 4 h + 2 s + p for qs word w (0..31), nibble h (0 low, 1 high), byte pair s
    (0: bytes 0 and 2, 1: bytes 1 and 3) and half p (0: byte s, 1: byte s + 2); Q4_K's qs word w = 8 c + t, byte k,
    nibble h holds weight 64 c + 32 h + 4 t + k (sub-block 2 c + h).

    acc [BN, 16] += one Q4_K block of BN rows (bp: int32 pointers [BN] to each row's block) times x's block kb
    (xb its tile, g/xs its TcX scales and sums), times `scale` (a routing weight, or 1). sum(acc, axis=1) is
    then the rows' dot products: column 2c + i holds sub-block c's sum over x's part i scaled by d sc_c, and
    column 2c also minus dmin m_c times the sub-block's sum of x."""
    c8 = tl.arange(0, 8)
    qs = tl.load(bp[:, None] + 4 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0)  # [BN, 32]
    p = tl.dot(_q4k_tile(qs, magic, lo_nib, hi_nib, BN), xb)  # [BN, 16]: sub-block sums, hi and lo parts
    h0 = tl.load(bp, mask=ok, other=0)
    h1 = tl.load(bp + 1, mask=ok, other=0)[:, None]
    h2 = tl.load(bp + 2, mask=ok, other=0)[:, None]
    h3 = tl.load(bp + 3, mask=ok, other=0)[:, None]
    d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    dmin = (h0 >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    sc, mn = _scale_min(h1, h2, h3, c8[None, :])  # [BN, 8]
    gh = tl.load(g_ptr + kb * 8 + c8) * tl.where(c8 % 2 == 1, 1.0 / 16.0, 1.0)  # high nibbles hold 16 q
    s = d[:, None] * sc * gh[None, :]
    mterm = dmin[:, None] * mn * tl.load(xs_ptr + kb * 8 + c8)[None, :]
    return acc + p * tl.reshape(tl.join(s, s), [BN, 16]) - tl.reshape(tl.join(mterm, tl.zeros_like(mterm)),
                                                                      [BN, 16])


@triton.jit
def _q6k_half(ql, qh, m_lo, m_hi2, magic, BN: tl.constexpr):
    """One half-block of Q6_K rows: ql int32 [BN, 2, 8] (its ql words t = 8 r + u), qh int32 [BN, 1, 8] (its qh
    words u) -> f16 [BN, 128] of q - 32, exact, tile row j = 8 t + 4 s + 2 h + p: the value whose low nibble is
    nibble h of byte s + 2 p of ql word t (weight 64 h + 4 t + s + 2 p of the half, sub-block 4 h + t // 4) and
    whose two high bits sit in the same byte of qh word u at bit 2 (2 h + r)."""
    r2 = 2 * tl.arange(0, 2)[None, :, None]  # qh bit of the low nibbles' high bits: 0 (t < 8) or 2
    pairs = ()
    for h in tl.static_range(2):
        for s in tl.static_range(2):
            a = ql >> (4 * h + 8 * s)
            if h == 0 and s == 0:
                b = qh << (4 - r2)
            else:
                b = qh >> (r2 + (4 * h + 8 * s - 4))
            pairs = pairs + ((a & m_lo) | (b & m_hi2) | magic,)  # (1024 + q6) in both halves, [BN, 2, 8]
    v = tl.join(tl.join(pairs[0], pairs[1]), tl.join(pairs[2], pairs[3]))  # [BN, 2, 8, s, h]
    return tl.reshape(_f16_pairs(tl.reshape(v, [BN, 64])), [BN, 128]) - 1056.0


@triton.jit
def _funnel(wp, j, odd):
    """Words at word offsets j (any shape) from wp, or with `odd` (a scalar) the words starting 2 bytes later."""
    a = tl.load(wp + j)
    b = tl.load(wp + j + 1)
    return tl.where(odd, ((a >> 16) & 0xFFFF) | (b << 16), a)


@triton.jit
def _tc6_block(acc, wp, kb, ok, xb_ptr, g_ptr, xk, scale, magic, lo_nib, hi2, BN: tl.constexpr):
    """acc [BN, 16] += block kb of BN Q6_K rows (wp: int32 row pointers [BN], rows of an even number of blocks:
    block kb starts at halfword 105 kb, so odd blocks are 2 bytes off a word) times x's block xk (a format-6
    TcX), times `scale`. Rows outside `ok` must still be readable (the wrapper clamps their pointers)."""
    hw0 = kb * 105
    wb = hw0 >> 1  # first word of the block (odd blocks: the word holding its first halfword)
    odd = (hw0 & 1) != 0
    c8 = tl.arange(0, 8)
    u = tl.arange(0, 8)[None, None, :]
    r = tl.arange(0, 2)[None, :, None]
    w3 = wp[:, None, None]
    dw = tl.load(wp + ((hw0 + 104) >> 1))  # d: one halfword
    d = tl.where(odd, dw >> 16, dw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    for hf in tl.static_range(2):
        ql = _funnel(w3, wb + 16 * hf + 8 * r + u, odd)  # [BN, 2, 8]: ql word t = 8 r + u of this half
        qh = _funnel(w3, wb + 32 + 8 * hf + u, odd)  # [BN, 1, 8]
        xb = tl.load(xb_ptr + (2 * xk + hf) * 2048 + tl.arange(0, 128)[:, None] * 16 + tl.arange(0, 16)[None, :])
        p = tl.dot(_q6k_half(ql, qh, lo_nib, hi2, magic, BN), xb)  # [BN, 16]
        s0 = _funnel(wp, wb + 48 + 2 * hf, odd)[:, None]  # scale bytes 8 hf .. 8 hf + 3
        s1 = _funnel(wp, wb + 49 + 2 * hf, odd)[:, None]
        sh = (24 - 8 * (c8 % 4))[None, :]
        sc = (tl.where(c8[None, :] < 4, s0 << sh, s1 << sh) >> 24).to(tl.float32)  # int8 scale, sub-block 8 hf + c
        s = d[:, None] * sc * tl.load(g_ptr + xk * 8 + 4 * hf + c8 // 2)[None, :]
        acc += p * tl.reshape(tl.join(s, s), [BN, 16])
    return acc


@triton.jit
def _tc8_block(acc, wp, kb, ok, xb_ptr, g_ptr, xk, scale, magic, m_byte, flip, BN: tl.constexpr):
    """acc [BN, 16] += 256-weight group kb of BN Q8_0 rows (wp: int32 row pointers [BN]; a group is 8 blocks = 68
    words) times x's block xk (a format-8 TcX), times `scale`. Block pair p of the group is words 17 p ..: block 0's
    quads straddle two words (funnel-shifted), block 1's are words 17 p + 9 + i; d0 = the low half of word 17 p,
    d1 the high half of word 17 p + 8. A byte pair becomes f16 by (w & 0x00FF00FF) ^ 0x64806480 = 1024 + (q + 128)
    (the xor flips q's sign bit and sets the exponent), minus 1152 = q, exact; tile row j = 64 p + 8 i + 4 h + 2 s
    + p' for byte s + 2 p' of quad i of block h of pair p (weight 64 p + 32 h + 4 i + s + 2 p', block 2 p + h)."""
    c8 = tl.arange(0, 8)
    base = kb * 68 + 17 * tl.arange(0, 4)[None, :, None] + tl.arange(0, 8)[None, None, :]  # [1, 4, 8]: word 17 p + i
    okc = ok[:, None, None]
    w3 = wp[:, None, None]
    a0 = tl.load(w3 + base, mask=okc, other=0)
    a1 = tl.load(w3 + base + 1, mask=okc, other=0)
    q1 = tl.load(w3 + base + 9, mask=okc, other=0)
    q0 = ((a0 >> 16) & 0xFFFF) | (a1 << 16)
    qw = tl.join(q0, q1)  # [BN, 4, 8, h]
    v = tl.join((qw & m_byte) ^ flip, ((qw >> 8) & m_byte) ^ flip)  # [BN, 4, 8, h, s]
    q = tl.reshape(_f16_pairs(tl.reshape(v, [BN, 128])), [BN, 256]) - 1152.0
    xb = _xb_tile(xb_ptr, xk)
    p = tl.dot(q, xb)  # [BN, 16]
    dword = tl.load(wp[:, None] + kb * 68 + 17 * (c8 // 2)[None, :] + 8 * (c8 % 2)[None, :], mask=ok[:, None], other=0)
    d = tl.where((c8 % 2 == 1)[None, :], dword >> 16, dword & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    s = d.to(tl.float32) * scale * tl.load(g_ptr + xk * 8 + c8)[None, :]  # [BN, 8]: block c = 2 p + h
    return acc + p * tl.reshape(tl.join(s, s), [BN, 16])


@triton.jit
def _tc_step(acc, wp, kb, ok, xb_ptr, g_ptr, xs_ptr, xk, scale, magic, m1, m2, QTYPE: tl.constexpr,
             BN: tl.constexpr):
    """acc [BN, 16] += 256-weight block kb of BN rows of type QTYPE (wp: int32 row pointers) times x's block xk,
    times scale: `_tc_block` (Q4_K; m1, m2 = M1, M2 of the type), `_tc6_block` (Q6_K) or `_tc8_block` (Q8_0)."""
    if QTYPE == 12:
        return _tc_block(acc, wp + kb * 36, ok, _xb_tile(xb_ptr, xk), g_ptr, xs_ptr, xk, scale, magic, m1, m2, BN)
    elif QTYPE == 14:
        return _tc6_block(acc, wp, kb, ok, xb_ptr, g_ptr, xk, scale, magic, m1, m2, BN)
    else:
        return _tc8_block(acc, wp, kb, ok, xb_ptr, g_ptr, xk, scale, magic, m1, m2, BN)


@triton.jit
def _row_words(QTYPE: tl.constexpr, N_BLOCKS: tl.constexpr):
    """int32 words per row of N_BLOCKS 256-weight blocks (a constant, so row starts stay aligned)."""
    if QTYPE == 12:
        return 36 * N_BLOCKS
    elif QTYPE == 14:
        return 105 * N_BLOCKS // 2
    else:
        return 68 * N_BLOCKS


@triton.jit
def _grid_rows(M, BN: tl.constexpr):
    """For a grid (row blocks, splits): the row block, the split, its BN rows and which of them exist (< M)."""
    blk = tl.program_id(0)
    row = blk * BN + tl.arange(0, BN)
    return blk, tl.program_id(1), row, row < M


@triton.jit
def _split_sum(v, part_ptr, count_ptr, cnt, sp, stride, off, ok, SPLIT: tl.constexpr):
    """K split epilogue: store this program's part v [R] at part[sp * stride + off]; the last of the SPLIT programs
    sharing counter `cnt` to arrive (an acq_rel counter after a CTA barrier; it resets the counter) gets
    (True, the parts summed in order 0 .. SPLIT-1), the others (False, zeros)."""
    tl.store(part_ptr + sp * stride + off, v, mask=ok)
    tl.debug_barrier()  # every thread's stores before the release below
    last = tl.atomic_add(count_ptr + cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    total = tl.zeros_like(v)
    if last:
        for j in range(SPLIT):
            total += tl.load(part_ptr + j * stride + off, mask=ok, other=0.0, volatile=True)
        tl.atomic_xchg(count_ptr + cnt, 0, sem="relaxed", scope="gpu")
    return last, total


@triton.jit
def _tcmv_kernel(w_ptr, xb_ptr, g_ptr, xs_ptr, res_ptr, out_ptr, part_ptr, count_ptr, M, magic, m1, m2,
                 QTYPE: tl.constexpr, N_BLOCKS: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr,
                 HAS_RES: tl.constexpr):
    """Grid (cdiv(M, BN), SPLIT): program (i, s) takes rows i BN .. + BN over blocks s NB/SPLIT .. (s + 1) NB/SPLIT.
    w: int32 [M, `_row_words`] (Q6_K: N_BLOCKS even); xb/g/xs: `TcX` in the
    type's format; res/out: f32 [M]; part: f32 [SPLIT, M] and count: int32 [cdiv(M, BN)] (zeros; left zero) when
    SPLIT > 1 (`_split_sum`)."""
    SW: tl.constexpr = _row_words(QTYPE, N_BLOCKS)
    NBS: tl.constexpr = N_BLOCKS // SPLIT
    blk, sp, row, ok = _grid_rows(M, BN)
    wp = w_ptr + tl.minimum(row, M - 1).to(tl.int64) * SW  # rows past M read the last one (Q6_K loads are unmasked)
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for i in range(NBS):
        kb = sp * NBS + i
        acc = _tc_step(acc, wp, kb, ok, xb_ptr, g_ptr, xs_ptr, kb, 1.0, magic, m1, m2, QTYPE, BN)
    out = tl.sum(acc, axis=1)
    last = True
    if SPLIT > 1:
        last, out = _split_sum(out, part_ptr, count_ptr, blk, sp, M, row, ok, SPLIT)
    if last:
        if HAS_RES:
            out += tl.load(res_ptr + row, mask=ok, other=0.0)
        tl.store(out_ptr + row, out, mask=ok)


@triton.jit
def _tcgate_up_kernel(wg_ptr, wu_ptr, xb_ptr, g_ptr, xs_ptr, ids_ptr, out_ptr, hb_ptr, hg_ptr, hs_ptr, part_ptr,
                      count_ptr, F, stride_ge, stride_ue, magic, m1, m2, QTYPE: tl.constexpr, N_BLOCKS: tl.constexpr,
                      BN: tl.constexpr, SPLIT: tl.constexpr, ACT: tl.constexpr, OUT_FMT: tl.constexpr):
    """Grid (cdiv(F, BN), n_sel, SPLIT): rows i BN .. + BN of expert ids[e]'s gate and up matrices over blocks
    s NB/SPLIT .., x shared. wg/wu: int32 [E, F, words per row] of type QTYPE; xb/g/xs: `TcX` of x (the type's
    format); out: f32 [n_sel, F] gets
    h = act(gate) * up (OUT_FMT 0), or the TcX of h in format OUT_FMT (4 or 6) as one vector of n_sel F (hb/hg/hs;
    F % 256 == 0) for a tensor-core down product. part: f32 [SPLIT, 2, n_sel, F] and count: int32
    [n_sel, cdiv(F, BN)] when SPLIT > 1."""
    SW: tl.constexpr = _row_words(QTYPE, N_BLOCKS)
    NBS: tl.constexpr = N_BLOCKS // SPLIT
    blk = tl.program_id(0)
    sel = tl.program_id(1)
    sp = tl.program_id(2)
    n_sel = tl.num_programs(1)
    row = blk * BN + tl.arange(0, BN)
    ok = row < F
    eid = tl.load(ids_ptr + sel).to(tl.int64)
    gp = wg_ptr + eid * stride_ge + tl.minimum(row, F - 1).to(tl.int64) * SW
    up = wu_ptr + eid * stride_ue + tl.minimum(row, F - 1).to(tl.int64) * SW
    acc_g = tl.zeros([BN, 16], dtype=tl.float32)
    acc_u = tl.zeros([BN, 16], dtype=tl.float32)
    for i in range(NBS):
        kb = sp * NBS + i
        acc_g = _tc_step(acc_g, gp, kb, ok, xb_ptr, g_ptr, xs_ptr, kb, 1.0, magic, m1, m2, QTYPE, BN)
        acc_u = _tc_step(acc_u, up, kb, ok, xb_ptr, g_ptr, xs_ptr, kb, 1.0, magic, m1, m2, QTYPE, BN)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    last = True
    if SPLIT > 1:  # gate and up parts side by side, one counter per (expert, row block)
        rr = tl.join(row, row)  # [BN, 2]
        off = rr + tl.join(sel * F + tl.zeros_like(row), (n_sel + sel) * F + tl.zeros_like(row))
        last, gu = _split_sum(tl.join(g, u), part_ptr, count_ptr, sel * tl.num_programs(0) + blk, sp,
                              2 * n_sel * F, off, rr < F, SPLIT)
        g, u = tl.split(gu)
    if last:
        h = _act(g, ACT) * u
        if OUT_FMT != 0:
            _tc_store_x(h, sel * F + row, hb_ptr, hg_ptr, hs_ptr, BN // 32, OUT_FMT)
        else:
            tl.store(out_ptr + sel * F + row, h, mask=ok)


@triton.jit
def _tcdown_kernel(w_ptr, hb_ptr, hg_ptr, hs_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, part_ptr, count_ptr, N,
                   stride_e, magic, m1, m2, QTYPE: tl.constexpr, N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr,
                   BN: tl.constexpr, SPLIT: tl.constexpr):
    """Grid (cdiv(N, BN), SPLIT): rows i BN .. + BN of out = res + sum_e wts[e] Wd[ids[e]] @ h_e, program s taking
    experts s N_SEL/SPLIT .. (summed in order; the routing weight folded into the scales). w: int32 [E, N, words
    per row] (stride_e in words); hb/hg/hs: the TcX of h (the type's format) as one vector of N_SEL F
    (F = 256 N_BLOCKS); res/out: f32 [N]; part: f32 [SPLIT, N] and count: int32 [cdiv(N, BN)] when SPLIT > 1."""
    SW: tl.constexpr = _row_words(QTYPE, N_BLOCKS)
    NES: tl.constexpr = N_SEL // SPLIT
    blk, sp, row, ok = _grid_rows(N, BN)
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for i in range(NES):
        e = sp * NES + i
        wp = w_ptr + tl.load(ids_ptr + e).to(tl.int64) * stride_e + tl.minimum(row, N - 1).to(tl.int64) * SW
        wt = tl.load(wts_ptr + e)
        for kb in range(N_BLOCKS):
            acc = _tc_step(acc, wp, kb, ok, hb_ptr, hg_ptr, hs_ptr, e * N_BLOCKS + kb, wt, magic, m1, m2, QTYPE, BN)
    out = tl.sum(acc, axis=1)
    last = True
    if SPLIT > 1:
        last, out = _split_sum(out, part_ptr, count_ptr, blk, sp, N, row, ok, SPLIT)
    if last:
        tl.store(out_ptr + row, out + tl.load(res_ptr + row, mask=ok, other=0.0), mask=ok)


# ---------------------------------------------------------------------------------------------- wrappers


def prepare_x(x: torch.Tensor, out: TcX | None = None, fmt: int = 4) -> TcX:
    """x f32 [K] (K % 256 == 0, natural order) -> TcX of format `fmt` (FORMATS: 4 Q4_K, 6 Q6_K, 8 Q8_0) for the
    tensor-core kernels (into `out`'s buffers if given, which must come from `empty_x`)."""
    k = x.shape[0]
    if x.dim() != 1 or k % 256 or x.dtype != torch.float32:
        raise ValueError(f"prepare_x takes float32 [K] with K % 256 == 0, got {x.dtype} {tuple(x.shape)}")
    if fmt not in FORMATS.values():
        raise ValueError(f"no TcX format {fmt} (formats: {sorted(FORMATS.values())})")
    out = out or empty_x(k, x.device)
    _prep_x_kernel[(k // 256,)](x.contiguous(), out.xb, out.g, out.xs, FMT=fmt, num_warps=4)
    return out


def supports_tc(qtype: int, k: int) -> bool:
    """Whether a tensor-core kernel takes [*, K] matrices of this type (Q4_K, Q8_0: K % 256 == 0; Q6_K:
    K % 512 == 0, so rows stay word-aligned)."""
    return qtype in FORMATS and k % (512 if qtype == Q6_K else 256) == 0


def _rows(w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """int32 view of Q4_K / Q6_K / Q8_0 rows (uint8 [..., row_bytes], contiguous, 4-byte aligned)."""
    if not supports_tc(qtype, k):
        raise ValueError(f"no tensor-core kernel for GGML type {qtype} at K = {k}")
    if qtype == Q4_K:
        return _words(w, k)
    bs, ts, _ = GEOMETRY[qtype]
    rb = k // bs * ts
    if w.shape[-1] != rb or not w.is_contiguous() or w.data_ptr() % 4:
        raise ValueError(f"GGML type {qtype} rows must be contiguous {rb}-byte rows from a 4-byte aligned start, "
                         f"got shape {tuple(w.shape)} strides {w.stride()}")
    return w.view(torch.int32)


def tc_split(m: int, n_blocks: int, device: torch.device, groups: int = 1) -> int:
    """K splits for `groups` [M, 256 n_blocks] products in one launch: the smallest power of two dividing
    n_blocks that gives PROGRAMS_PER_SM programs per SM (the row blocks alone are too few for 2048 rows)."""
    split, row_blocks = 1, triton.cdiv(m, TC_BN) * groups
    while row_blocks * split < PROGRAMS_PER_SM * sm_count(device) and n_blocks % (split * 2) == 0:
        split *= 2
    return split


_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch(n_parts: int, n_counts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Parts f32 [n_parts] and counters int32 [n_counts] (zero, and left zero by every launch) per size,
    allocated once (so a CUDA graph may capture the launch)."""
    key = (device, n_parts, n_counts)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(n_parts, dtype=torch.float32, device=device),
                         torch.zeros(n_counts, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def _check_split(split: int, n: int, what: str) -> None:
    if n % split:
        raise ValueError(f"split {split} does not divide the {n} {what}")


def qmatvec_tc(w: torch.Tensor, x: TcX, out: torch.Tensor, residual: torch.Tensor | None = None,
               *, qtype: int = Q4_K, split: int | None = None) -> torch.Tensor:
    """out[M] = W[M, K] @ x[K] (+ residual[M]) for a Q4_K, Q6_K or Q8_0 matrix on tensor cores.

    w: uint8 [M, row_bytes] (rows contiguous); x: `prepare_x(x, fmt=FORMATS[qtype])`; out/residual: f32 [M] (out
    may be residual); split: K splits (a power of two dividing K / 256; default `tc_split`). Returns out.
    """
    m, nb = w.shape[0], x.xb.shape[0]
    split = split or tc_split(m, nb, w.device)
    _check_split(split, nb, f"blocks of K = {256 * nb}")
    ww = _rows(w, qtype, 256 * nb)
    part, count = _scratch(split * m, triton.cdiv(m, TC_BN), w.device) if split > 1 else (out, out)
    _tcmv_kernel[(triton.cdiv(m, TC_BN), split)](
        ww, x.xb, x.g, x.xs, out if residual is None else residual, out, part, count, m, MAGIC, M1[qtype], M2[qtype],
        QTYPE=qtype, N_BLOCKS=nb, BN=TC_BN, SPLIT=split, HAS_RES=residual is not None, num_warps=4, num_stages=2,
    )
    return out


def moe_gate_up_tc(w_gate: torch.Tensor, w_up: torch.Tensor, x: TcX, ids: torch.Tensor, out: torch.Tensor | TcX,
                   act: str = "silu", *, qtype: int = Q4_K, out_fmt: int = 4, split: int | None = None
                   ) -> torch.Tensor | TcX:
    """h[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x) for experts of one type (Q4_K, Q6_K, Q8_0) on tensor cores,
    in one launch.

    w_gate/w_up: uint8 [E, F, row_bytes]; x: `prepare_x(x, fmt=FORMATS[qtype])`; ids: int [n_sel] on the device;
    out: f32 [n_sel, F], or a TcX of n_sel F (`empty_x(F, device, n_sel)`, F % 256 == 0) in format out_fmt to
    feed `moe_down_tc`.
    Returns out.
    """
    f, nb, n_sel = w_gate.shape[1], x.xb.shape[0], ids.shape[0]
    out_tc = isinstance(out, TcX)
    if out_tc and (f % 256 or out.xb.shape[0] != n_sel * f // 256):
        raise ValueError(f"a TcX h needs F % 256 == 0 and {n_sel} x {f} values, got F = {f}, xb {tuple(out.xb.shape)}")
    split = split or tc_split(f, nb, w_gate.device, n_sel)
    _check_split(split, nb, f"blocks of K = {256 * nb}")
    wg, wu = _rows(w_gate, qtype, 256 * nb), _rows(w_up, qtype, 256 * nb)
    part, count = (_scratch(split * 2 * n_sel * f, n_sel * triton.cdiv(f, TC_BN), wg.device) if split > 1
                   else (wg, wg))
    h = out.xb if out_tc else out
    _tcgate_up_kernel[(triton.cdiv(f, TC_BN), n_sel, split)](
        wg, wu, x.xb, x.g, x.xs, ids, h, h, out.g if out_tc else h, out.xs if out_tc else h, part, count, f,
        wg.stride(0), wu.stride(0), MAGIC, M1[qtype], M2[qtype], QTYPE=qtype, N_BLOCKS=nb, BN=TC_BN, SPLIT=split,
        ACT=ACTIVATIONS[act], OUT_FMT=out_fmt if out_tc else 0, num_warps=4, num_stages=2,
    )
    return out


def moe_down_tc(w_down: torch.Tensor, h: TcX, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
                out: torch.Tensor, *, qtype: int = Q4_K, split: int | None = None) -> torch.Tensor:
    """out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]) for Q4_K, Q6_K or Q8_0 experts on tensor cores,
    summed in order. w_down: uint8 [E, N, row_bytes]; h: TcX of n_sel F in the type's format (`moe_gate_up_tc`'s);
    ids: int [n_sel]; weights: f32 [n_sel]; residual/out: f32 [N] (out may be residual); split: experts per program
    = n_sel / split (default `tc_split` over the experts). Returns out."""
    n, n_sel = w_down.shape[1], ids.shape[0]
    nb = h.xb.shape[0] // n_sel
    split = split or tc_split(n, n_sel, w_down.device)
    _check_split(split, n_sel, "selected experts")
    wd = _rows(w_down, qtype, 256 * nb)
    part, count = _scratch(split * n, triton.cdiv(n, TC_BN), wd.device) if split > 1 else (out, out)
    _tcdown_kernel[(triton.cdiv(n, TC_BN), split)](
        wd, h.xb, h.g, h.xs, ids, weights, residual, out, part, count, n, wd.stride(0), MAGIC, M1[qtype], M2[qtype],
        QTYPE=qtype, N_BLOCKS=nb, N_SEL=n_sel, BN=TC_BN, SPLIT=split, num_warps=4, num_stages=2,
    )
    return out
