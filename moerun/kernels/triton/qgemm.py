"""Quantized matrix-matrix products for prompt processing (Triton, tensor cores).

C[p, n] = sum_k A[a_row(p), k] * W[e(p), n, k], with W dequantized tile by tile inside the kernel from
its GGUF bytes (never materialised): uint8 `[M, row_bytes]` for a matrix, `[E, M, row_bytes]` for
stacked experts, exactly as in the file (F32/F16/BF16 as typed elements). One kernel serves:

- `qgemm`          dense projection: out[T, M] = A[T, K] @ W[M, K]^T
- `moe_gate_up`    grouped over experts: H[p, F] = act(A[tok(p)] @ Wg[e]^T) * (A[tok(p)] @ Wu[e]^T)
- `moe_down`       grouped, scattered back: Y[a(p), N] = w_route[a(p)] * (H[p] @ Wd[e]^T)

Grouping (`moe_align`, torch ops on the device, no host sync): the T*K (token, slot) assignments are
sorted by expert and each expert's list padded to a multiple of BLOCK_M, so every BLOCK_M-row block of
the padded order belongs to one expert. `rows[p]` is the assignment index at padded position p (-1 for
padding) and `block_expert[b]` the expert of block b (-1: unused block, its programs exit at once).
The grid has the static upper bound of blocks, so nothing depends on the routing on the host.

Each program computes a [BLOCK_M, BLOCK_N] tile: K is walked in steps of BK = 64 weights; a step loads
the A tile, decodes the [BLOCK_N, 64] weight tile (`deq_tile`, natural K order) and multiplies on the
tensor cores in bf16 (or in float32 with input_precision="ieee", the exact mode) accumulating in
float32. No atomics: every output element is written once, so results are deterministic.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.moe_align import Routing, moe_align, moe_align_torch, padded_rows  # noqa: F401 (re-exported)
from moerun.kernels.triton.qblocks import _f16
from moerun.kernels.triton.qmatvec import ACTIVATIONS, GEOMETRY, SUPPORTED, _act, _typed

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU interpreter: emulate bf16 (see _mma)
BK = 64  # weights of K per step: one Q4_K/Q5_K/Q6_K 64-weight chunk, two 32-blocks, 64 floats
_PREFETCH_K = {8: 64, 12: 256, 14: 512}  # types the kernel can load one step ahead, when K is a multiple
# of this (word-aligned rows)


def _prefetch(k: int, tile: GemmTile, *qtypes: int) -> bool:
    """Whether the kernel loads the raw weights one step ahead (one type for both streams, in tile.prefetch)."""
    q = qtypes[0]
    return len(set(qtypes)) == 1 and q in tile.prefetch and q in _PREFETCH_K and k % _PREFETCH_K[q] == 0


class GemmTile(NamedTuple):
    """Launch shape: rows of A (tokens) and of W (outputs) per program, warps, pipelining stages, and the
    GGML types whose raw weights are loaded one step ahead (Q8_0 = 8, Q4_K = 12, Q6_K = 14; see
    _qgemm_kernel's PREFETCH; which pays depends on the type and the product, benchmarks/NOTES.md 6f)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    prefetch: frozenset[int] = frozenset({8, 14})
    swap: bool = False  # compute out^T = W A^T: decoded weights as the MMA's register operand (NOTES 6g)
    q8_words: bool = False  # prefetched Q8_0 read as int32 words instead of bytes (NOTES 6h)


DEFAULT_TILE = GemmTile()


# ------------------------------------------------------------------------------------ weight tile decoders
# Each returns the float32 weights [BN, BK] of rows `wr` ([BN] pointers to row starts; bytes, or typed
# elements for floats) at K positions k0 .. k0+BK-1 (k0 a multiple of BK); rows outside `nm` and K
# positions >= K read as 0. Q4_K, and Q6_K when K % 512 == 0, read int32 words through `wr` cast to int32
# pointers (so their loads are >= 32 bits wide, which Triton's pipeliner turns into cp.async copies ahead of
# use): the weight tensor must be 4-byte aligned (GGUF tensor data is 32-byte aligned, torch allocations
# 256); Q4_K rows are 144-byte multiples and Q6_K rows (K % 512 == 0) 420-byte ones, so every row then is too.


@triton.jit
def _two_blocks(wr, nm, k0, K, TS: tl.constexpr, BKC: tl.constexpr):
    """32-weight blocks: pointers [BN, BK] to the block of each element, the element's index in its
    block [BK], its half (0/1: which of the step's two blocks) and masks, plus both blocks' d [BN]."""
    j = tl.arange(0, BKC)
    h = j // 32
    b0 = k0 // 32
    m2 = nm[:, None] & ((k0 + j) < K)[None, :]
    bp = wr[:, None] + (b0 + h)[None, :] * TS  # [BN, BK]
    d0 = _f16(wr + b0 * TS, nm)  # [BN]
    d1 = _f16(wr + (b0 + 1) * TS, nm & (k0 + 32 < K))
    d = tl.where(h[None, :] == 0, d0[:, None], d1[:, None])  # [BN, BK]
    return bp, j % 32, m2, d


@triton.jit
def _tile_q8_0(wr, nm, k0, K, BKC: tl.constexpr):
    """Q8_0, 34-byte blocks: d f16, qs[32] int8; w = d * q."""
    bp, i, m2, d = _two_blocks(wr, nm, k0, K, 34, BKC)
    q = tl.load(bp + 2 + i[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
    return d * q.to(tl.float32)


@triton.jit
def _ld_q8_0(wr, nm, k0, K, BKC: tl.constexpr):
    """Raw bytes of the Q8_0 step at k0 when K % 64 == 0 (its two 34-byte blocks are 17 words from a 4-byte
    boundary): q [BN, BK] uint8 and the words holding d0 (low half of word 0) and d1 (high half of word 8)
    [BN] int32; a step at k0 >= K reads nothing (zeros). Loaded one step ahead by the kernel (PREFETCH):
    byte loads are too narrow for Triton's asynchronous-copy pipelining."""
    j = tl.arange(0, BKC)
    m = nm & (k0 < K)
    bp = wr + (k0 // 64) * 68  # [BN] start of the step's block pair
    bw = bp.to(tl.pointer_type(tl.int32), bitcast=True)
    dw0 = tl.load(bw, mask=m, other=0)
    dw1 = tl.load(bw + 8, mask=m, other=0)
    q = tl.load(bp[:, None] + (2 + j + 2 * (j // 32))[None, :], mask=m[:, None] & (j >= 0)[None, :], other=0)
    return q, dw0, dw1


@triton.jit
def _dq_q8_0(raw, BKC: tl.constexpr):
    """Weights [BN, BK] float32 d * q from `_ld_q8_0`'s raw step."""
    q, dw0, dw1 = raw
    h = (tl.arange(0, BKC) // 32)[None, :]
    d0 = (dw0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    d1 = ((dw1 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    d = tl.where(h == 0, d0[:, None], d1[:, None])
    return d * q.to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _ld_q8_0_words(wr, nm, k0, K, BKC: tl.constexpr):
    """Raw int32 words of the Q8_0 step at k0 when K % 64 == 0: the step's two 34-byte blocks are the 17
    words W[0..16] from a 4-byte boundary (W0 = d0 | q0[0:2] << 16, W1..W7 = q0[2:30], W8 = q0[30:32] |
    d1 << 16, W9..W16 = q1). Returns W[0:8], W[1:9], W[9:17] [BN, 8] and W0, W8 [BN]; a step at k0 >= K
    reads nothing. Word loads (the byte loads of `_ld_q8_0` cost one instruction per weight)."""
    m = nm & (k0 < K)
    bw = (wr + (k0 // 64) * 68).to(tl.pointer_type(tl.int32), bitcast=True)  # [BN] start of the block pair
    i = tl.arange(0, BKC // 8)[None, :]
    p = bw[:, None] + i
    m2 = m[:, None] & (i >= 0)
    return _word(p, m2), _word(p + 1, m2), _word(p + 9, m2), _word(bw, m), _word(bw + 8, m)


@triton.jit
def _i8f(x, sh: tl.constexpr):
    """Signed byte at bit sh of int32 words x, as float32 (I2F.S8 reads the byte in place)."""
    return (x >> sh).to(tl.int8).to(tl.float32)


@triton.jit
def _dq_q8_0_words(raw, BKC: tl.constexpr):
    """Weights [BN, BK] float32 d * q from `_ld_q8_0_words`' words: block 0's q[4i:4i+4] are the high
    half of W[i] and the low half of W[i+1], block 1's are W[9+i]."""
    lo, lo1, hi, dw0, dw1 = raw
    BN: tl.constexpr = lo.shape[0]
    d0 = (dw0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    d1 = ((dw1 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
    w0 = _j4(d0 * _i8f(lo, 16), d0 * _i8f(lo, 24), d0 * _i8f(lo1, 0), d0 * _i8f(lo1, 8))  # [BN, 8, 4]
    w1 = _j4(d1 * _i8f(hi, 0), d1 * _i8f(hi, 8), d1 * _i8f(hi, 16), d1 * _i8f(hi, 24))
    return tl.permute(tl.join(w0, w1), (0, 3, 1, 2)).reshape(BN, BKC)


@triton.jit
def _tile_q4_0(wr, nm, k0, K, BKC: tl.constexpr):
    """Q4_0, 18-byte blocks: d, qs[16]; weight i < 16 low nibble of qs[i], i >= 16 high of qs[i-16]."""
    bp, i, m2, d = _two_blocks(wr, nm, k0, K, 18, BKC)
    q = (tl.load(bp + 2 + (i % 16)[None, :], mask=m2, other=0).to(tl.int32) >> (4 * (i // 16))[None, :]) & 15
    return d * (q - 8).to(tl.float32)


@triton.jit
def _tile_q5_0(wr, nm, k0, K, BKC: tl.constexpr):
    """Q5_0, 22-byte blocks: d, qh[4] (bit i = 5th bit of weight i), qs[16] (as Q4_0); w = d*(q-16)."""
    bp, i, m2, d = _two_blocks(wr, nm, k0, K, 22, BKC)
    q = (tl.load(bp + 6 + (i % 16)[None, :], mask=m2, other=0).to(tl.int32) >> (4 * (i // 16))[None, :]) & 15
    hb = (tl.load(bp + 2 + (i // 8)[None, :], mask=m2, other=0).to(tl.int32) >> (i % 8)[None, :]) & 1
    return d * ((q | (hb << 4)) - 16).to(tl.float32)


@triton.jit
def _k4_scale_min_at(sp, s, nm):
    """6-bit (scale, min) of sub-block `s` (scalar 0..7) of Q4_K/Q5_K for rows sp [BN] -> float32 [BN] x2."""
    lo = s & 3
    a = tl.load(sp + lo, mask=nm, other=0).to(tl.int32)
    b = tl.load(sp + lo + 4, mask=nm, other=0).to(tl.int32)
    c = tl.load(sp + lo + 8, mask=nm, other=0).to(tl.int32)
    first = s < 4
    sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_chunk(wr, nm, k0, TS: tl.constexpr, BKC: tl.constexpr):
    """K-quant step = one 64-weight chunk c of super-block sb: its block pointers [BN], c, the element's
    sub-block half h [BK] (sub-block 2c + h) and index within the sub-block [BK]."""
    j = tl.arange(0, BKC)
    bp = wr + (k0 // 256) * TS
    return bp, (k0 % 256) // 64, j // 32, j % 32


@triton.jit
def _k4_weights(bp, nm, c, h, q):
    """d*sc*q - dmin*m for the two sub-blocks 2c, 2c+1 of Q4_K/Q5_K (q: [BN, BK] int32)."""
    d = _f16(bp, nm)
    dmin = _f16(bp + 2, nm)
    sc0, mn0 = _k4_scale_min_at(bp + 4, 2 * c, nm)
    sc1, mn1 = _k4_scale_min_at(bp + 4, 2 * c + 1, nm)
    first = h[None, :] == 0
    scale = tl.where(first, (d * sc0)[:, None], (d * sc1)[:, None])
    off = tl.where(first, (dmin * mn0)[:, None], (dmin * mn1)[:, None])
    return scale * q.to(tl.float32) - off


@triton.jit
def _word(p, nm):
    """int32 at word pointers p (any shape; rows outside nm read as 0)."""
    return tl.load(p, mask=nm, other=0)


@triton.jit
def _j4(x0, x1, x2, x3):
    """Four [BN, W] tensors -> [BN, W, 4] with x_i at [..., i]: tl.join keeps the new axis in-thread."""
    return tl.join(tl.join(x0, x2), tl.join(x1, x3)).reshape(x0.shape[0], x0.shape[1], 4)


@triton.jit
def _byte(w, sh):
    return (w >> sh) & 255


@triton.jit
def _k4_sm(w1, w2, w3, sh, first):
    """6-bit (scale, min) of Q4_K/Q5_K sub-block s from the scale words w1..w3 (scales[0:4], [4:8], [8:12])
    [BN]: sh = 8 * (s % 4), first = s < 4 -> float32 [BN] x2."""
    a = _byte(w1, sh)
    b = _byte(w2, sh)
    c = _byte(w3, sh)
    sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _nib4(x, sh: tl.constexpr, scale, off):
    """Nibbles at bit sh (0 or 4) of the 4 bytes of words x [BN, W] -> [BN, W, 4] floats scale * q - off."""
    s = scale[:, None]
    o = off[:, None]
    q0 = (((x >> sh) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    q1 = (((x >> (sh + 8)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    q2 = (((x >> (sh + 16)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    q3 = (((x >> (sh + 24)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return _j4(s * q0 - o, s * q1 - o, s * q2 - o, s * q3 - o)


@triton.jit
def _ld_q4_k(wr, nm, k0, K, BKC: tl.constexpr):
    """Raw int32 words of the Q4_K step at k0 (see _tile_q4_k); a step at k0 >= K reads nothing: the header
    words w0 = d | dmin << 16, w1..w3 = scales [BN] and the chunk's 8 qs words [BN, 8]."""
    c = (k0 % 256) // 64
    m = nm & (k0 < K)
    bw = (wr + (k0 // 256) * 144).to(tl.pointer_type(tl.int32), bitcast=True)  # [BN] block words
    i = tl.arange(0, BKC // 8)[None, :]
    qw = _word(bw[:, None] + 4 + 8 * c + i, m[:, None] & (i >= 0))  # [BN, 8] the chunk's qs words
    return _word(bw, m), _word(bw + 1, m), _word(bw + 2, m), _word(bw + 3, m), qw


@triton.jit
def _dq_q4_k(raw, k0, BKC: tl.constexpr):
    """Weights [BN, BK] float32 of the Q4_K step at k0 from `_ld_q4_k`'s words."""
    w0, w1, w2, w3, qw = raw
    BN: tl.constexpr = qw.shape[0]
    c = (k0 % 256) // 64
    qe, qo = tl.split(qw.reshape(BN, BKC // 16, 2))  # even, odd words [BN, 4]
    d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sh = 16 * (c % 2)  # sub-blocks 2c, 2c + 1: bytes 2c % 4, 2c % 4 + 1 of the scale words
    sc0, mn0 = _k4_sm(w1, w2, w3, sh, c < 2)
    sc1, mn1 = _k4_sm(w1, w2, w3, sh + 8, c < 2)
    s0, o0, s1, o1 = d * sc0, dmin * mn0, d * sc1, dmin * mn1
    lo = tl.join(_nib4(qe, 0, s0, o0), _nib4(qo, 0, s0, o0))  # [BN, 4, 4, 2]
    hi = tl.join(_nib4(qe, 4, s1, o1), _nib4(qo, 4, s1, o1))
    w = tl.join(lo, hi)  # [BN, 4 (word pair), 4 (byte), 2 (odd word), 2 (h)]: K = 32h + 8p + 4o + b
    return tl.permute(w, (0, 4, 1, 3, 2)).reshape(BN, BKC)


@triton.jit
def _tile_q4_k(wr, nm, k0, K, BKC: tl.constexpr):
    """Q4_K, 144-byte blocks: d, dmin, scales[12], qs[128]; chunk c = qs[32c:32c+32], low nibbles are
    sub-block 2c, high nibbles 2c+1. Read as int32 words (blocks are 16-byte multiples): header words
    w0 = d | dmin << 16, w1..w3 = scales, and the chunk's 8 qs words, even and odd apart so that each
    thread holds pairs of consecutive words (8 consecutive weights) after the in-thread joins."""
    return _dq_q4_k(_ld_q4_k(wr, nm, k0, K, BKC), k0, BKC)


@triton.jit
def _tile_q5_k(wr, nm, k0, K, BKC: tl.constexpr):
    """Q5_K, 176-byte blocks: d, dmin, scales[12], qh[32], qs[128]; as Q4_K, 5th bit of sub-block s,
    weight i = bit s of qh[i]."""
    bp, c, h, i = _k_chunk(wr, nm, k0, 176, BKC)
    m2 = nm[:, None] & (h >= 0)[None, :]
    p = bp[:, None] + i[None, :]
    q = (tl.load(p + 48 + 32 * c, mask=m2, other=0).to(tl.int32) >> (4 * h)[None, :]) & 15
    hb = (tl.load(p + 16, mask=m2, other=0).to(tl.int32) >> (2 * c + h)[None, :]) & 1
    return _k4_weights(bp, nm, c, h, q | (hb << 4))


@triton.jit
def _tile_q6_k(wr, nm, k0, K, BKC: tl.constexpr):
    """Q6_K, 210-byte blocks: ql[128], qh[64], scales[16] int8, d f16; weight e = 128n + 32g + l has
    low 4 bits in ql[64n + 32(g%2) + l] (nibble g//2), high 2 bits in qh[32n + l] >> 2g, scale e // 16;
    w = d * scale * (q - 32). As int32 words when K % 512 == 0 (rows of 420-byte multiples), else bytes."""
    if K % 512 == 0:
        w = _tile_q6_k_words(wr, nm, k0, K, BKC)
    else:
        w = _tile_q6_k_bytes(wr, nm, k0, BKC)
    return w


@triton.jit
def _fsh(lo, hi, sh):
    """Funnel shift: the low 32 bits of the 64-bit {hi:lo} >> sh (0 <= sh < 32), int32 words -> uint32."""
    x = (hi.to(tl.uint32).to(tl.uint64) << 32) | lo.to(tl.uint32).to(tl.uint64)
    return (x >> sh).to(tl.uint32)


@triton.jit
def _q6x4(x, s):
    """Words x [BN, 2, 2, 4] (uint32) of 4 six-bit q each -> [BN, 2, 2, 4, 4] floats s * (q - 32), the byte
    last (s [BN, 2, 2, 1]; magic-number int -> float: (q | 0x4B000000) as float = 2^23 + q)."""
    q0 = ((x & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
    q1 = (((x >> 8) & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
    q2 = (((x >> 16) & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
    q3 = ((x >> 24) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0
    w = tl.join(tl.join(s * q0, s * q2), tl.join(s * q1, s * q3))  # [..., 2, 2]: q_b at [..., b % 2, b // 2]
    return w.reshape(x.shape[0], x.shape[1], x.shape[2], x.shape[3], 4)


@triton.jit
def _ld_q6_k(wr, nm, k0, K):
    """Raw words of the Q6_K step at k0 when K % 512 == 0 (see _tile_q6_k_words); a step at k0 >= K reads
    nothing: ql words and their successors [BN, 2, 2, 4], qh words and successors [BN, 1, 2, 4], the scale
    word and its successor [BN], the word holding d [BN]."""
    b = k0 // 256
    odd = b % 2
    c = (k0 % 256) // 64
    n = c // 2
    m = nm & (k0 < K)
    bw = (wr + b * 210 - 2 * odd).to(tl.pointer_type(tl.int32), bitcast=True)  # [BN] word boundary
    h = tl.arange(0, 2)[None, :, None, None]
    t2 = tl.arange(0, 2)[None, None, :, None]
    v = tl.arange(0, 4)[None, None, None, :]
    p = bw[:, None, None, None]
    m4 = m[:, None, None, None]
    iql = 16 * n + 8 * h + 4 * t2 + v  # [1, 2, 2, 4] ql words
    iqh = 32 + 8 * n + 4 * t2 + v  # [1, 1, 2, 4] qh words (the same for both h)
    return (_word(p + iql, m4), _word(p + iql + 1, m4), _word(p + iqh, m4), _word(p + iqh + 1, m4),
            _word(bw + 48 + c, m), _word(bw + 49 + c, m), _word(bw + 52, m))


@triton.jit
def _dq_q6_k(raw, k0, BKC: tl.constexpr):
    """Weights [BN, BK] float32 of the Q6_K step at k0 from `_ld_q6_k`'s words."""
    l0, l1, h0, h1, s0, s1, dw = raw
    BN: tl.constexpr = l0.shape[0]
    odd = (k0 // 256) % 2
    c = (k0 % 256) // 64
    cc = c % 2
    h = tl.arange(0, 2)[None, :, None, None]
    t2 = tl.arange(0, 2)[None, None, :, None]
    ql = _fsh(l0, l1, 16 * odd + 4 * cc)
    qh = _fsh(h0, h1, 16 * odd + 4 * cc + 2 * h)  # [BN, 2, 2, 4]
    q = (ql & 0x0F0F0F0F) | ((qh & 0x03030303) << 4)  # 4 q (0..63) per word
    sw = _fsh(s0, s1, 16 * odd)  # [BN] scales[4c:4c+4]
    d = ((dw >> (16 * odd)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sc = ((sw[:, None, None, None] >> (8 * (2 * h + t2))) & 255).to(tl.uint8).to(tl.int8, bitcast=True)
    sd = d[:, None, None, None] * sc.to(tl.float32)  # [BN, 2, 2, 1] as (d * scale) * (q - 32) below
    return _q6x4(q, sd).reshape(BN, BKC)


@triton.jit
def _tile_q6_k_words(wr, nm, k0, K, BKC: tl.constexpr):
    """Q6_K when K % 512 == 0: every row starts 4-byte aligned, so block b starts 2 * (b % 2) bytes past the
    word boundary below it (b * 210 = 2b mod 4), and so does each of its fields (offsets 0, 64, 128, 192,
    208 are multiples of 4). Its words W[i] are read from that boundary and realigned by funnel shifts,
    (W[i+1]:W[i]) >> 16 for odd blocks (one extra word per run; never past the block's row: an even block
    is followed by the odd one in the same row). A step is chunk c = 2n + cc of the block: weights
    j = 0..63 have ql bytes 64n + j (nibble cc), qh bytes 32n + j % 32 (bits 2(2cc + j // 32)), scales
    4c + j // 16. Tiles [BN, 2 (h = j // 32), 2 (t2 = j // 16 % 2), 4 (w = j // 4 % 4)] of words, so that
    each 16-weight group's scale is one value per (row, h, t2), and K order is the plain reshape."""
    return _dq_q6_k(_ld_q6_k(wr, nm, k0, K), k0, BKC)


@triton.jit
def _tile_q6_k_bytes(wr, nm, k0, BKC: tl.constexpr):
    """Q6_K byte by byte (any K)."""
    j = tl.arange(0, BKC)
    bp = wr + (k0 // 256) * 210
    e = (k0 % 256) + j  # [BK] position in the super-block
    n = e // 128
    g = (e % 128) // 32
    lpos = e % 32
    m2 = nm[:, None] & (j >= 0)[None, :]
    p = bp[:, None]
    ql = tl.load(p + (64 * n + 32 * (g % 2) + lpos)[None, :], mask=m2, other=0).to(tl.int32)
    qh = tl.load(p + (128 + 32 * n + lpos)[None, :], mask=m2, other=0).to(tl.int32)
    q = ((ql >> (4 * (g // 2))[None, :]) & 15) | (((qh >> (2 * g)[None, :]) & 3) << 4)
    sc = tl.load(p + (192 + e // 16)[None, :], mask=m2, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = _f16(bp + 208, nm)
    return (d[:, None] * sc) * (q - 32).to(tl.float32)


@triton.jit
def _tile_float(wr, nm, k0, K, BKC: tl.constexpr):
    """F32 / F16 / BF16: `wr` points at typed elements."""
    k = k0 + tl.arange(0, BKC)
    return tl.load(wr[:, None] + k[None, :], mask=nm[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def deq_tile(wr, nm, k0, K, QTYPE: tl.constexpr, BKC: tl.constexpr):
    """Weights [BN, BK] float32 of rows `wr` at K positions k0.. (dispatch on the GGML type id)."""
    if QTYPE == 12:
        w = _tile_q4_k(wr, nm, k0, K, BKC)
    elif QTYPE == 14:
        w = _tile_q6_k(wr, nm, k0, K, BKC)
    elif QTYPE == 8:
        w = _tile_q8_0(wr, nm, k0, K, BKC)
    elif QTYPE == 13:
        w = _tile_q5_k(wr, nm, k0, K, BKC)
    elif QTYPE == 2:
        w = _tile_q4_0(wr, nm, k0, K, BKC)
    elif QTYPE == 6:
        w = _tile_q5_0(wr, nm, k0, K, BKC)
    else:
        w = _tile_float(wr, nm, k0, K, BKC)
    return w


@triton.jit
def ld_raw(wr, nm, k0, K, QTYPE: tl.constexpr, BKC: tl.constexpr, Q8W: tl.constexpr):
    """The raw loads of a step (a tuple of int tensors) for the types the kernel prefetches (Q8W: Q8_0 as
    words)."""
    if QTYPE == 8:
        if Q8W:
            raw = _ld_q8_0_words(wr, nm, k0, K, BKC)
        else:
            raw = _ld_q8_0(wr, nm, k0, K, BKC)
    elif QTYPE == 12:
        raw = _ld_q4_k(wr, nm, k0, K, BKC)
    else:
        raw = _ld_q6_k(wr, nm, k0, K)
    return raw


@triton.jit
def dq_raw(raw, k0, QTYPE: tl.constexpr, BKC: tl.constexpr, Q8W: tl.constexpr):
    """Weights [BN, BK] float32 of the step at k0 from `ld_raw`'s tuple."""
    if QTYPE == 8:
        if Q8W:
            w = _dq_q8_0_words(raw, BKC)
        else:
            w = _dq_q8_0(raw, BKC)
    elif QTYPE == 12:
        w = _dq_q4_k(raw, k0, BKC)
    else:
        w = _dq_q6_k(raw, k0, BKC)
    return w


@triton.jit
def _step_weights(raw, wr, nm, k0, K, QTYPE: tl.constexpr, BKC: tl.constexpr, PREFETCH: tl.constexpr,
                  Q8W: tl.constexpr):
    """Weights [BN, BK] float32 of the step at k0, and what the next step decodes: with PREFETCH, decoded
    from `raw` (loaded one step earlier) after issuing step k0 + BK's raw loads; otherwise read and
    decoded now (`raw` passes through unused)."""
    if PREFETCH:
        nxt = ld_raw(wr, nm, k0 + BKC, K, QTYPE, BKC, Q8W)
        w = dq_raw(raw, k0, QTYPE, BKC, Q8W)
    else:
        nxt = raw
        w = deq_tile(wr, nm, k0, K, QTYPE, BKC)
    return w, nxt


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _round_bf16(x):
    """float32 -> float32 holding the nearest bf16 (round to nearest even), by integer ops."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _mma(acc, a, w, EXACT: tl.constexpr, EMULATE: tl.constexpr, SWAP: tl.constexpr = False):
    """acc [BM, BN] += a [BM, BK] @ w [BN, BK]^T; bf16 tensor cores, or float32 ("ieee") when EXACT.
    SWAP: acc [BN, BM] += w @ a^T instead (the weights become the MMA's first operand, which Hopper's
    wgmma can read from registers; the activations its second, from shared memory).

    EMULATE (Triton's CPU interpreter, whose bf16 dot and conversions are not IEEE): operands rounded
    to bf16 by integer ops, then multiplied in float32 — the same products a bf16 tensor core forms."""
    if SWAP:
        if EXACT:
            acc = tl.dot(w, tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
        elif EMULATE:
            acc = tl.dot(_round_bf16(w), tl.trans(_round_bf16(a.to(tl.float32))), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16)), acc)
    elif EXACT:
        acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    elif EMULATE:
        acc = tl.dot(_round_bf16(a.to(tl.float32)), tl.trans(_round_bf16(w)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)), acc)
    return acc


@triton.jit
def _qgemm_kernel(
    a_ptr, w_ptr, w2_ptr, out_ptr, rows_ptr, bexp_ptr, scale_ptr,
    n_a, M, stride_a, stride_out, stride_we, stride_wm, stride_w2e, stride_w2m, topk,
    K: tl.constexpr, QTYPE: tl.constexpr, QTYPE2: tl.constexpr, GROUPED: tl.constexpr, GATHER: tl.constexpr,
    SCATTER: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, EXACT: tl.constexpr, EMULATE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BKC: tl.constexpr, PREFETCH: tl.constexpr = False,
    SWAP: tl.constexpr = False, Q8W: tl.constexpr = False,
):
    """Grid (cdiv(P, BM), cdiv(M, BN)); P = rows of the (padded) product.

    GROUPED: block b uses expert bexp[b] (-1: nothing to do) and rows[p] (assignment, -1 = padding);
    GATHER: A row of p = rows[p] // topk (else p); SCATTER: output row = rows[p], scaled by
    scale[rows[p]] (else p); GATED: out = act(A W^T) * (A W2^T). Not GROUPED: rows p < n_a, expert 0.
    PREFETCH (Q8_0 with K % 64 == 0, Q4_K with K % 256 == 0, Q6_K with K % 512 == 0; QTYPE2 == QTYPE): the
    raw weights of step k0 + BK are loaded before step k0's decode and product (a register double buffer:
    Q8_0's byte loads are too narrow for Triton's asynchronous-copy pipelining, Q6_K's unaligned words
    too small for 16-byte copies). SWAP: see _mma. Q8W: prefetched Q8_0 read as words (_ld_q8_0_words).
    """
    pid_m = tl.program_id(0)
    p = pid_m * BM + tl.arange(0, BM)  # [BM]
    if GROUPED:
        e = tl.load(bexp_ptr + pid_m)
        r = tl.load(rows_ptr + p)
        valid = r >= 0
        e = tl.maximum(e, 0)
        live = tl.load(bexp_ptr + pid_m) >= 0
    else:
        e = pid_m * 0
        r = p
        valid = p < n_a
        live = True
    if live:
        arow = (r // topk) if GATHER else p
        arow = tl.where(valid, arow, 0).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
        nm = n < M
        wr = w_ptr + e.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wm
        ACC_SHAPE: tl.constexpr = [BN, BM] if SWAP else [BM, BN]
        acc = tl.zeros(ACC_SHAPE, dtype=tl.float32)
        if GATED:
            wr2 = w2_ptr + e.to(tl.int64) * stride_w2e + n.to(tl.int64) * stride_w2m
            acc2 = tl.zeros(ACC_SHAPE, dtype=tl.float32)
        kk = tl.arange(0, BKC)
        raw = 0  # with PREFETCH: the raw loads of the step about to be decoded
        raw2 = 0
        if PREFETCH:
            raw = ld_raw(wr, nm, 0, K, QTYPE, BKC, Q8W)
            if GATED:
                raw2 = ld_raw(wr2, nm, 0, K, QTYPE2, BKC, Q8W)
        for k0 in range(0, K, BKC):
            k = k0 + kk
            a = tl.load(a_ptr + arow[:, None] * stride_a + k[None, :], mask=valid[:, None] & (k < K)[None, :],
                        other=0.0)  # [BM, BK]
            w, raw = _step_weights(raw, wr, nm, k0, K, QTYPE, BKC, PREFETCH, Q8W)
            acc = _mma(acc, a, w, EXACT, EMULATE, SWAP)
            if GATED:
                w2, raw2 = _step_weights(raw2, wr2, nm, k0, K, QTYPE2, BKC, PREFETCH, Q8W)
                acc2 = _mma(acc2, a, w2, EXACT, EMULATE, SWAP)
        if SWAP:  # back to [BM, BN] for the epilogue (one layout conversion per tile)
            acc = tl.trans(acc)
            if GATED:
                acc2 = tl.trans(acc2)
        if GATED:
            acc = _act(acc, ACT) * acc2
        if SCATTER:
            orow = tl.where(valid, r, 0).to(tl.int64)
            acc = acc * tl.load(scale_ptr + orow, mask=valid, other=0.0)[:, None]
        else:
            orow = p.to(tl.int64)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            acc = _round_bf16(acc)  # exact conversion below, whatever the rounding mode
        tl.store(out_ptr + orow[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & nm[None, :])


@triton.jit
def _dequant_bf16_kernel(w_ptr, out_ptr, M, K, stride_w, stride_out, QTYPE: tl.constexpr, BN: tl.constexpr,
                         BKC: tl.constexpr, STEPS: tl.constexpr):
    """Grid (cdiv(M, BN), cdiv(K, BKC * STEPS)): out [M, K] int16 = the bits of each weight rounded to bf16;
    each program decodes [BN, BKC] tiles at STEPS consecutive K positions."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < M
    wr = w_ptr + n.to(tl.int64) * stride_w
    orow = out_ptr + n.to(tl.int64)[:, None] * stride_out
    for s in tl.static_range(STEPS):
        k0 = (tl.program_id(1) * STEPS + s) * BKC
        w = deq_tile(wr, nm, k0, K, QTYPE, BKC)  # [BN, BKC] float32
        bits = (_round_bf16(w).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        k = k0 + tl.arange(0, BKC)
        tl.store(orow + k[None, :], bits, mask=nm[:, None] & (k < K)[None, :])


# ---------------------------------------------------------------------------------------------- wrappers


def _check(qtype: int) -> None:
    if qtype not in SUPPORTED:
        raise NotImplementedError(f"no quantized GEMM for GGML type {qtype} (supported: {sorted(SUPPORTED)})")


def _k_ok(qtype: int, k: int, w: torch.Tensor) -> None:
    if k % GEOMETRY[qtype][0] or (GEOMETRY[qtype][0] == 256 and k % BK):
        raise ValueError(f"K = {k} is not a whole number of blocks of GGML type {qtype}")
    if w.data_ptr() % 4:  # the Q4_K / Q6_K decoders read the blocks as 32-bit words
        raise ValueError(f"weights of GGML type {qtype} must start at a 4-byte aligned address")


def qgemm(a: torch.Tensor, w: torch.Tensor, qtype: int, out: torch.Tensor, *, exact: bool = False,
          tile: GemmTile = DEFAULT_TILE) -> torch.Tensor:
    """out[T, M] = A[T, K] @ W[M, K]^T, W decoded from its GGUF bytes inside the kernel.

    a: float32/bf16 [T, K] (rows contiguous); w: uint8 [M, row_bytes]; out: float32 or bf16 [T, M].
    exact: float32 products (else bf16 inputs, float32 accumulation). Returns out.
    """
    _check(qtype)
    T, K = a.shape
    M = w.shape[0]
    _k_ok(qtype, K, w)
    wt = _typed(w, qtype)
    grid = (triton.cdiv(T, tile.block_m), triton.cdiv(M, tile.block_n))
    _qgemm_kernel[grid](
        a, wt, wt, out, a, a, a, T, M, a.stride(0), out.stride(0), 0, wt.stride(0), 0, wt.stride(0), 1,
        K=K, QTYPE=qtype, QTYPE2=qtype, GROUPED=False, GATHER=False, SCATTER=False, GATED=False, ACT=0,
        EXACT=exact, EMULATE=_INTERPRET, PREFETCH=_prefetch(K, tile, qtype), SWAP=tile.swap, Q8W=tile.q8_words,
        BM=tile.block_m, BN=tile.block_n, BKC=BK, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out


COPY_TILE = (16, 4, 1)  # dequantize_bf16's rows per program, warps, 64-wide K steps (NOTES.md 6h)


def dequantize_bf16(w: torch.Tensor, qtype: int, out: torch.Tensor, *, tile: tuple[int, ...] = COPY_TILE
                    ) -> torch.Tensor:
    """out[M, K] bf16 = W dequantized and rounded to nearest bf16 (the values the bf16 GEMM multiplies), for
    the prefill's dense products: a bf16 copy then cuBLAS beats decoding each weight once per token block
    (benchmarks/NOTES.md 6h). w: uint8 [M, row_bytes] (GGUF bytes); out: bf16 [M, K] rows contiguous;
    tile: (rows per program, a power of two; warps[; steps]), each program decoding [rows, 64 * steps] weights."""
    _check(qtype)
    M, K = out.shape
    bs, ts, _ = GEOMETRY[qtype]
    if w.shape[0] != M or w.shape[-1] != K // bs * ts or K % bs:
        raise ValueError(f"weights {tuple(w.shape)} of GGML type {qtype} do not hold a [{M}, {K}] matrix")
    _k_ok(qtype, K, w)
    wt = _typed(w, qtype)
    o16 = out.view(torch.int16)
    rows, warps, steps = (*tile, 1)[:3]
    _dequant_bf16_kernel[(triton.cdiv(M, rows), triton.cdiv(K, BK * steps))](
        wt, o16, M, K, wt.stride(0), o16.stride(0), QTYPE=qtype, BN=rows, BKC=BK, STEPS=steps, num_warps=warps)
    return out


def moe_gate_up(a: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, qtype_gate: int, qtype_up: int,
                routing: Routing, out: torch.Tensor, act: str = "silu", *, exact: bool = False,
                tile: GemmTile = DEFAULT_TILE) -> torch.Tensor:
    """out[p, F] = act(A[tok] @ Wg[e]^T) * (A[tok] @ Wu[e]^T) for each padded position p of `routing`
    (tok = rows[p] // topk, e = its block's expert; padding rows are left untouched).

    a: [T, K] float32/bf16; w_gate/w_up: uint8 [E, F, row_bytes]; out: [P, F] float32/bf16."""
    _check(qtype_gate)
    _check(qtype_up)
    K, F = a.shape[1], w_gate.shape[1]
    _k_ok(qtype_gate, K, w_gate)
    _k_ok(qtype_up, K, w_up)
    assert routing.block_m == tile.block_m, "routing was aligned for another BLOCK_M"
    wg, wu = _typed(w_gate, qtype_gate), _typed(w_up, qtype_up)
    P = routing.rows.shape[0]
    grid = (P // tile.block_m, triton.cdiv(F, tile.block_n))
    _qgemm_kernel[grid](
        a, wg, wu, out, routing.rows, routing.block_expert, a, a.shape[0], F, a.stride(0), out.stride(0),
        wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), routing.topk,
        K=K, QTYPE=qtype_gate, QTYPE2=qtype_up, GROUPED=True, GATHER=True, SCATTER=False, GATED=True,
        ACT=ACTIVATIONS[act], EXACT=exact, EMULATE=_INTERPRET, PREFETCH=_prefetch(K, tile, qtype_gate, qtype_up),
        SWAP=tile.swap, Q8W=tile.q8_words, BM=tile.block_m, BN=tile.block_n, BKC=BK,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out


def moe_down(h: torch.Tensor, w_down: torch.Tensor, qtype: int, routing: Routing, route_w: torch.Tensor,
             out: torch.Tensor, *, exact: bool = False, tile: GemmTile = DEFAULT_TILE) -> torch.Tensor:
    """out[a, N] = route_w[a] * (H[p] @ Wd[e]^T) for every assignment a = rows[p] (each written once).

    h: [P, F] from moe_gate_up; w_down: uint8 [E, N, row_bytes]; route_w: float32 [T * topk];
    out: float32 [T * topk, N] (sum over each token's topk rows afterwards)."""
    _check(qtype)
    F, N = h.shape[1], w_down.shape[1]
    _k_ok(qtype, F, w_down)
    assert routing.block_m == tile.block_m, "routing was aligned for another BLOCK_M"
    wd = _typed(w_down, qtype)
    P = routing.rows.shape[0]
    grid = (P // tile.block_m, triton.cdiv(N, tile.block_n))
    _qgemm_kernel[grid](
        h, wd, wd, out, routing.rows, routing.block_expert, route_w, P, N, h.stride(0), out.stride(0),
        wd.stride(0), wd.stride(1), 0, 0, routing.topk,
        K=F, QTYPE=qtype, QTYPE2=qtype, GROUPED=True, GATHER=False, SCATTER=True, GATED=False, ACT=0,
        EXACT=exact, EMULATE=_INTERPRET, PREFETCH=_prefetch(F, tile, qtype), SWAP=tile.swap, Q8W=tile.q8_words,
        BM=tile.block_m, BN=tile.block_n, BKC=BK, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
