"""Q4_K, Q6_K and Q8_0 matvec kernels for batch-1 decode on integer dot products (Triton + PTX `dp2a` / `dp4a`).

The word kernels (wmatvec.py) turn every weight into a float and spend ~5.5 instructions on it (static sm_90
SASS, NOTES.md 7m); here x is quantized once per product input to 24-bit integers with a scale per 32 values
(`quantize_x24`: x ~ s X, |X| <= 2^23 - 1, s = max |x| / (2^23 - 1): float32's own precision for the group's
largest value), held as X = 256 hi + lo (hi int16, lo uint8), and four weights meet four x values in three
instructions: two `dp2a` (int16 pairs x unsigned bytes) for hi, one `dp4a` (unsigned bytes) for lo, 32-bit sums.
A Q4_K word (8 weights) costs an and, a shift-and and six dot instructions. Per sub-block of 32 weights

    sum_i (d sc q_i - dmin m) x_i ~ d sc s_g (256 sum_i q_i hi_i + sum_i q_i lo_i) - dmin m sum_i x_i

with both integer sums exact (< 32 * 15 * 32768 < 2^24) and sum_i x_i the float sum of the unquantized x. So
the weights stay exact and x is rounded about as float32 rounds it: the products match the float kernels' to
~1e-7 of sum |w| |x| (a 16-bit x alone, two dp2a per 4 weights, missed the tests' 1e-4 logit bound on the tiny
models, NOTES.md 7n).

Q6_K and Q8_0 are read from load-time copies with one signed byte per weight (`COPIES`: layouts Q6I, with q - 32,
and Q8I), so their words go to the dot instructions as they are and the scales apply per 16 / 32 weights
(NOTES.md 7o, 7p). The producers write x quantized (decode_ops `store_x24`: RMSNorm, the router's RMSNorm, the
attention reduce); for down, the gate/up launch itself (`_quantize_h_group`).

- `quantize_x24`    x [..., K] -> X24
- `qmatvec_i`       out[M] = W[M, K] @ x[K] (+ residual[M])
- `moe_gate_up_i`   out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x)
- `moe_down_i`      out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i])

Under TRITON_INTERPRET=1 the dot instructions are computed from their definition (the interpreter runs no PTX),
so the CPU tests check every other line of these kernels. Fixed summation order; the only atomics are gate/up's
arrival counters, which choose who quantizes a group, not what it holds: bit-identical run to run.
"""

from __future__ import annotations

import os
from functools import partial

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moerun.kernels.torch_ops import X24, Route
from moerun.kernels.triton.decode_ops import (
    down_route_args,
    expert_id,
    ranked_experts,
    route_args,
)
from moerun.kernels.triton.outputs import store_x24
from moerun.kernels.triton.pdl import begin, launch_args, trigger, wait
from moerun.kernels.triton.qmatvec import (
    ACTIVATIONS,
    EXPERTS_AHEAD,
    experts_group,
    routing_after_wait,
    zero_after_barrier,
)
from moerun.kernels.triton.wmatvec import (
    BYTES_Q6,
    WTile,
    _half,
    _scale_min,
    _store_h,
    _total,
    _words,
    bytes_q6k,
    wtile_for,
)

Q8_0, Q4_K, Q6_K = 8, 12, 14
Q6I = 2014  # layout code: Q6_K as signed bytes q - 32 (`wmatvec.bytes_q6k(signed=True)`)
Q8I = 2008  # layout code: Q8_0 as 256 bytes then the 8 scales as float32 per 256 weights (`bytes_q8_0`)
BYTES_Q8I = 288
# per type: (the kernels' layout code, bytes per 256 weights in it); Q6_K and Q8_0 from a load-time copy (COPIES)
LAYOUTS = {Q4_K: (Q4_K, 144), Q6_K: (Q6I, BYTES_Q6), Q8_0: (Q8I, BYTES_Q8I)}
# the products on the integer kernels: all of them, measured faster on the H200 (Q4_K_M: NOTES.md 7o; Q8_0 and Q6_K
# gate/up: 7v, Q8_0 tg128 +20%)
INT_KINDS = {t: ("mv", "gate_up", "down") for t in LAYOUTS}
X_GROUP = 32  # x values per scale
X_MAX = 8388607.0  # 2^23 - 1
_EMU = os.environ.get("TRITON_INTERPRET", "0") == "1"


def supports(qtype: int, k: int, kind: str, kinds: dict[int, tuple[str, ...]] = INT_KINDS) -> bool:
    """True when an integer-dot kernel takes products of this type over K inputs in product `kind` (of those
    `kinds` enables)."""
    return kind in kinds.get(qtype, ()) and k % 256 == 0


def quantize_x24_ref(x: torch.Tensor) -> X24:
    """Plain-torch twin of `quantize_x24` (float32, outputs.store_x24's arithmetic)."""
    g = x.float().reshape(*x.shape[:-1], -1, X_GROUP)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, X_MAX / amax, torch.zeros_like(amax))
    q = torch.floor(g * inv[..., None] + 0.5).clamp(-X_MAX, X_MAX).to(torch.int32).reshape(x.shape)
    return X24((q >> 8).to(torch.int16), (q & 255).to(torch.uint8), amax / X_MAX, g.sum(-1))


def dequantize_x24(x: X24) -> torch.Tensor:
    """s X as float32 [..., K] (X = 256 hi + lo, exact in float64 before the product)."""
    q = (x.hi.double() * 256 + x.lo.double()).reshape(*x.s.shape, X_GROUP)
    return (q * x.s.double()[..., None]).reshape(x.hi.shape).float()


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _quant_x24_kernel(x_ptr, hi_ptr, lo_ptr, s_ptr, sum_ptr, N_GROUPS, G: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(N_GROUPS, BLOCK),). x f32 [N_GROUPS G] -> hi int16 / lo uint8 [N_GROUPS G], s / sum f32
    [N_GROUPS]."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = g < N_GROUPS
    x = tl.load(x_ptr + (g[:, None] * G + tl.arange(0, G)[None, :]), mask=ok[:, None], other=0.0)
    store_x24(x, g, ok, hi_ptr, lo_ptr, s_ptr, sum_ptr, G)


@triton.jit
def _byte(q, K: tl.constexpr, SIGNED: tl.constexpr):
    """Byte K of int32 q, unsigned or sign-extended (the dot instructions' operand types; interpreter only)."""
    if SIGNED:
        return (q << (24 - 8 * K)) >> 24
    else:
        return (q >> (8 * K)) & 255


@triton.jit
def _dp4(xa, xb, q, SIGNED: tl.constexpr, EMU: tl.constexpr):
    """x0 q0 + x1 q1 + x2 q2 + x3 q3 (int32): xa / xb hold the int16 pairs (x0, x1) / (x2, x3), q the bytes
    q0..q3 (unsigned, or signed with SIGNED). Two PTX dp2a (16-bit x 8-bit pairs); under the interpreter, their
    definition."""
    if EMU:
        return (((xa << 16) >> 16) * _byte(q, 0, SIGNED) + (xa >> 16) * _byte(q, 1, SIGNED)
                + ((xb << 16) >> 16) * _byte(q, 2, SIGNED) + (xb >> 16) * _byte(q, 3, SIGNED))
    elif SIGNED:
        return tl.inline_asm_elementwise(
            "{ .reg .s32 t; dp2a.lo.s32.s32 t, $1, $3, 0; dp2a.hi.s32.s32 $0, $2, $3, t; }",
            "=r,r,r,r", [xa, xb, q], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .s32 t; dp2a.lo.s32.u32 t, $1, $3, 0; dp2a.hi.s32.u32 $0, $2, $3, t; }",
            "=r,r,r,r", [xa, xb, q], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4u(xu, q, SIGNED: tl.constexpr, EMU: tl.constexpr):
    """x0 q0 + x1 q1 + x2 q2 + x3 q3 (int32) over the unsigned bytes of xu and the bytes of q (unsigned, or signed
    with SIGNED): one PTX dp4a."""
    if EMU:
        return ((xu & 255) * _byte(q, 0, SIGNED) + ((xu >> 8) & 255) * _byte(q, 1, SIGNED)
                + ((xu >> 16) & 255) * _byte(q, 2, SIGNED) + ((xu >> 24) & 255) * _byte(q, 3, SIGNED))
    elif SIGNED:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, 0;", "=r,r,r", [xu, q], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.u32 $0, $1, $2, 0;", "=r,r,r", [xu, q], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _cidx(T: tl.constexpr, STRIDE: tl.constexpr):
    """[4, 8 / T, T]: STRIDE c + tt for qs word 8c + tt of a block (tt = T s + t; a thread holds T consecutive
    words)."""
    S: tl.constexpr = 8 // T
    tt = tl.arange(0, S)[:, None] * T + tl.arange(0, T)[None, :]
    return tl.arange(0, 4)[:, None, None] * STRIDE + tt[None]


@triton.jit
def _ix_tiles(xh_ptr, xl_ptr, xs_ptr, xsum_ptr, kb, NB: tl.constexpr, T: tl.constexpr):
    """x24 of blocks kb .. kb+NB-1 in the words' layout, for word (c, tt) of each block: its low nibbles' weights
    are 64c + 4tt + 0..3 and its high nibbles' 64c + 32 + 4tt + 0..3; per side the int16 pairs of hi (a, b) and
    the four lo bytes (u), [NB, 4, S, T] int32 each; scales and sums of sub-blocks 2c / 2c + 1 [NB, 4].
    xh_ptr: the int16 hi as int64, xl_ptr: the uint8 lo as int32 (both indexed (64c + 4tt) / 4 = 16c + tt)."""
    blk = kb + tl.arange(0, NB)
    xo = blk[:, None, None, None] * 64 + _cidx(T, 16)[None]
    h0 = tl.load(xh_ptr + xo)
    h1 = tl.load(xh_ptr + xo + 8)
    sb = blk[:, None] * 8 + 2 * tl.arange(0, 4)[None, :]
    return (h0.to(tl.int32), (h0 >> 32).to(tl.int32), tl.load(xl_ptr + xo),
            h1.to(tl.int32), (h1 >> 32).to(tl.int32), tl.load(xl_ptr + xo + 8),
            tl.load(xs_ptr + sb), tl.load(xs_ptr + sb + 1), tl.load(xsum_ptr + sb), tl.load(xsum_ptr + sb + 1))


@triton.jit
def _dot24(xa, xb, xu, q, AX: tl.constexpr, SIGNED: tl.constexpr, EMU: tl.constexpr):
    """Sum along axis AX (a thread's words) of sum_k q_k X_k over each word's 4 bytes q_k (unsigned, or signed with
    SIGNED) and X_k = 256 hi + lo (xa, xb: hi pairs, xu: lo bytes) -> float32, AX removed."""
    hi = tl.sum(_dp4(xa, xb, q, SIGNED, EMU), axis=AX)
    lo = tl.sum(_dp4u(xu, q, SIGNED, EMU), axis=AX)
    return hi.to(tl.float32) * 256.0 + lo.to(tl.float32)


@triton.jit
def _q4k_qs(wp, bo, ok, T: tl.constexpr):
    """The qs words [NB, 4, S, T] of the Q4_K blocks starting at words bo [NB] from wp (`_cidx`'s order)."""
    return tl.load(wp + (bo[:, None, None, None] + 4 + _cidx(T, 8)[None]), mask=ok, other=0)


@triton.jit
def _q4k_hwords(wp, bo, ok):
    """The header words of the Q4_K blocks starting at words bo [NB] from wp: h0 (d, dmin) [NB] and the three scale
    words h1-h3 [NB, 1]."""
    h0 = tl.load(wp + bo, mask=ok, other=0)
    h1 = tl.load(wp + bo + 1, mask=ok, other=0)[:, None]
    h2 = tl.load(wp + bo + 2, mask=ok, other=0)[:, None]
    h3 = tl.load(wp + bo + 3, mask=ok, other=0)[:, None]
    return h0, h1, h2, h3


@triton.jit
def _q4k_dots(qs, xt, EMU: tl.constexpr):
    """sum q X per sub-block of qs words [NB, 4, S, T] against x tiles xt (`_ix_tiles`): low and high nibbles, each
    [NB, 4, S] float32."""
    a0, b0, u0, a1, b1, u1 = xt[0], xt[1], xt[2], xt[3], xt[4], xt[5]
    s_lo = _dot24(a0, b0, u0, qs & 0x0F0F0F0F, 3, False, EMU)
    s_hi = _dot24(a1, b1, u1, (qs >> 4) & 0x0F0F0F0F, 3, False, EMU)
    return s_lo, s_hi


@triton.jit
def _q4k_acc(s_lo, s_hi, hw, xt, scale, acc, accm):
    """acc [NB, 4, S] += d sc s_x (the dots `_q4k_dots`) per sub-block, accm [NB, 4] += dmin m sum x, from the blocks'
    header words hw (`_q4k_hwords`); d and dmin times scale (a scalar or [NB]). A row's dot product is sum(acc) -
    sum(accm)."""
    sx_lo, sx_hi, sum_lo, sum_hi = xt[6], xt[7], xt[8], xt[9]
    h0, h1, h2, h3 = hw
    d = (_half(h0) * scale)[:, None]
    dmin = (_half(h0 >> 16) * scale)[:, None]
    c2 = 2 * tl.arange(0, 4)[None, :]
    sc_l, mn_l = _scale_min(h1, h2, h3, c2)  # [NB, 4]
    sc_h, mn_h = _scale_min(h1, h2, h3, c2 + 1)
    acc += (d * sc_l * sx_lo)[:, :, None] * s_lo + (d * sc_h * sx_hi)[:, :, None] * s_hi
    accm += dmin * (mn_l * sum_lo + mn_h * sum_hi)
    return acc, accm


@triton.jit
def _irow_step(wp, off, ok, kb, xt, scale, acc, accm, NB: tl.constexpr, T: tl.constexpr, EMU: tl.constexpr):
    """One row's blocks kb..: `_q4k_acc` of its words, loaded here (the header after the dots)."""
    bo = off + (kb + tl.arange(0, NB)) * 36  # [NB]
    s_lo, s_hi = _q4k_dots(_q4k_qs(wp, bo, ok, T), xt, EMU)
    return _q4k_acc(s_lo, s_hi, _q4k_hwords(wp, bo, ok), xt, scale, acc, accm)


@triton.jit
def _ib_tiles(xh_ptr, xl_ptr, xs_ptr, kb, NB: tl.constexpr):
    """x24 of blocks kb .. kb+NB-1 for the byte layouts' words (Q6I, Q8I) [NB, 16 (s), 4 (word j)] (word j of
    16-weight run s holds weights 16s + 4j + 0..3): hi pairs (a, b), lo bytes (u), and the x scale of each run
    [NB, 16]."""
    blk = kb + tl.arange(0, NB)
    s = tl.arange(0, 16)
    xo = blk[:, None, None] * 64 + s[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    h = tl.load(xh_ptr + xo)
    return h.to(tl.int32), (h >> 32).to(tl.int32), tl.load(xl_ptr + xo), tl.load(xs_ptr + blk[:, None] * 8 + s // 2)


@triton.jit
def _ibyte_words(wp, bo, ok):
    """The weight words [NB, 16 (run s), 4 (word j)] of the Q6I / Q8I blocks starting at words bo [NB] from wp (word j
    of run s holds weights 16 s + 4 j + 0..3, as `_ib_tiles`)."""
    s = tl.arange(0, 16)
    return tl.load(wp + (bo[:, None, None] + 4 * s[None, :, None] + tl.arange(0, 4)[None, None, :]), mask=ok, other=0)


@triton.jit
def _i6_dbits(hp, bo, ok):
    """The Q6I blocks' scales d as fp16 bits (int16 [NB]); hp: the int16 view of the words that bo [NB] counts in."""
    return tl.load(hp + 2 * bo + 136, mask=ok, other=0)


@triton.jit
def _i6_sc(bp, bo, ok):
    """The Q6I blocks' sub-block scales (int8 [NB, 16]); bp: the int8 view of the words that bo [NB] counts in."""
    return tl.load(bp + 4 * bo[:, None] + 256 + tl.arange(0, 16)[None, :], mask=ok, other=0)


@triton.jit
def _i6_d(dbits, scale):
    """d times scale, float32 [NB], from `_i6_dbits`."""
    return dbits.to(tl.float16, bitcast=True).to(tl.float32) * scale


@triton.jit
def _i6_acc(dots, d, sc, sx, acc):
    """acc [NB, 16] += d sc s_x dots per sub-block (d: `_i6_d`, sc: `_i6_sc`)."""
    return acc + (d[:, None] * sc.to(tl.float32) * sx) * dots


@triton.jit
def _i8_scales(wp, bo, ok):
    """The Q8I groups' block scales d as float32 bits [NB, 16] (one per 16 weights, each of its block's two runs)."""
    return tl.load(wp + (bo[:, None] + 64 + tl.arange(0, 16)[None, :] // 2), mask=ok, other=0)


@triton.jit
def _i8_acc(dots, d, sx, scale, acc):
    """acc [NB, 16] += d s_x dots per 16 weights (`_i8_scales`' d, times scale)."""
    return acc + (d.to(tl.float32, bitcast=True) * scale * sx) * dots


@triton.jit
def _i6_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB: tl.constexpr, EMU: tl.constexpr):
    """One Q6I row's blocks kb..: acc [NB, 16] += d sc s_x sum (q - 32) X per sub-block. off: the row's first word
    from wp (the int16 / int8 views hp / bp start at the same byte)."""
    a, b, u, sx = xt
    bo = off + (kb + tl.arange(0, NB)) * 72  # [NB] first word of each block
    dots = _dot24(a, b, u, _ibyte_words(wp, bo, ok), 2, True, EMU)  # [NB, 16]
    d = _i6_d(_i6_dbits(hp, bo, ok), scale)
    return _i6_acc(dots, d, _i6_sc(bp, bo, ok), sx, acc)


@triton.jit
def _i8_step(wp, off, ok, kb, xt, scale, acc, NB: tl.constexpr, EMU: tl.constexpr):
    """One Q8I row's blocks kb..: acc [NB, 16] += d s_x sum q X per 16 weights (d: their Q8_0 block's scale, as
    float32 after the 256 bytes). off: the row's first word from wp."""
    a, b, u, sx = xt
    bo = off + (kb + tl.arange(0, NB)) * 72  # [NB] first word of each 256-weight group
    dots = _dot24(a, b, u, _ibyte_words(wp, bo, ok), 2, True, EMU)  # [NB, 16]
    return _i8_acc(dots, _i8_scales(wp, bo, ok), sx, scale, acc)


@triton.jit
def _itiles(QT: tl.constexpr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, kb, NB: tl.constexpr, T: tl.constexpr):
    if QT == 12:
        xt = _ix_tiles(xh_ptr, xl_ptr, xs_ptr, xsum_ptr, kb, NB, T)
    else:
        xt = _ib_tiles(xh_ptr, xl_ptr, xs_ptr, kb, NB)
    return xt


@triton.jit
def _istep(QT: tl.constexpr, wp, hp, bp, off, ok, kb, xt, scale, acc, accm, NB: tl.constexpr, T: tl.constexpr,
           EMU: tl.constexpr):
    """One row's step in layout QT (Q4_K: 12, Q6I: 2014, Q8I: 2008) -> (acc, accm)."""
    if QT == 12:
        acc, accm = _irow_step(wp, off, ok, kb, xt, scale, acc, accm, NB, T, EMU)
    elif QT == 2014:
        acc = _i6_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB, EMU)
    else:
        acc = _i8_step(wp, off, ok, kb, xt, scale, acc, NB, EMU)
    return acc, accm


@triton.jit
def _iwords(QT: tl.constexpr, wp, hp, bp, off, ok, kb, NB: tl.constexpr, T: tl.constexpr):
    """One row's words for blocks kb.. in layout QT, loaded and not yet used (`_iwords_acc` takes them): Q4_K (qs,
    header words), Q6I (words, d bits, sc), Q8I (words, d bits)."""
    WORDS: tl.constexpr = 36 if QT == 12 else 72  # per 256 weights
    bo = off + (kb + tl.arange(0, NB)) * WORDS  # [NB] each block's first word
    if QT == 12:
        raw = (_q4k_qs(wp, bo, ok, T), _q4k_hwords(wp, bo, ok))
    elif QT == 2014:
        raw = (_ibyte_words(wp, bo, ok), _i6_dbits(hp, bo, ok), _i6_sc(bp, bo, ok))
    else:
        raw = (_ibyte_words(wp, bo, ok), _i8_scales(wp, bo, ok))
    return raw


@triton.jit
def _ipin(QT: tl.constexpr, raw, z):
    """`_iwords`' words ORed with z, an int32 zero read after a barrier: the arithmetic on them then cannot start
    before that read, so ptxas cannot schedule it (and its waits on the loads) among the loads before the barrier."""
    if QT == 12:
        h0, h1, h2, h3 = raw[1]
        pinned = (raw[0] | z, (h0 | z, h1 | z, h2 | z, h3 | z))
    elif QT == 2014:
        pinned = (raw[0] | z, raw[1] | z.to(tl.int16), raw[2] | z.to(tl.int8))
    else:
        pinned = (raw[0] | z, raw[1] | z)
    return pinned


@triton.jit
def _iwords_acc(QT: tl.constexpr, raw, xt, scale, acc, accm, EMU: tl.constexpr):
    """`_istep`'s arithmetic on words `_iwords` loaded -> (acc, accm)."""
    if QT == 12:
        s_lo, s_hi = _q4k_dots(raw[0], xt, EMU)
        acc, accm = _q4k_acc(s_lo, s_hi, raw[1], xt, scale, acc, accm)
    elif QT == 2014:
        dots = _dot24(xt[0], xt[1], xt[2], raw[0], 2, True, EMU)  # [NB, 16]
        acc = _i6_acc(dots, _i6_d(raw[1], scale), raw[2], xt[3], acc)
    else:
        dots = _dot24(xt[0], xt[1], xt[2], raw[0], 2, True, EMU)
        acc = _i8_acc(dots, raw[1], xt[3], scale, acc)
    return acc, accm


@triton.jit
def _izeros(QT: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr):
    accs = ()
    accms = ()
    for _r in tl.static_range(R):
        if QT == 12:
            accs = accs + (tl.zeros([NB, 4, 8 // T], dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros([NB, 16], dtype=tl.float32),)
        accms = accms + (tl.zeros([NB, 4], dtype=tl.float32),)  # Q6I, Q8I: unused, stays 0
    return accs, accms


@triton.jit
def _itotal_qt(QT: tl.constexpr, acc, accm):
    if QT == 12:
        v = _total(acc, accm)  # wmatvec's: Q4_K's acc [NB, 4, S] less the min terms accm [NB, 4]
    else:
        v = tl.sum(tl.sum(acc, axis=1), axis=0)
    return v


@triton.jit
def _irows_dot(QT: tl.constexpr, wp, hp, bp, row0, M, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, scale, accs, accms,
               SW: tl.constexpr, N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr,
               EMU: tl.constexpr, K0: tl.constexpr = 0):
    """Accumulate rows row0 .. row0+R-1 (contiguous rows of SW words from wp; hp / bp: int16 / int8 views from the
    same byte) against x24 over blocks K0.. of K."""
    for kb in range(K0, N_BLOCKS, NB):
        xt = _itiles(QT, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, kb, NB, T)
        new_accs = ()
        new_accms = ()
        for r in tl.static_range(R):
            a, am = _istep(QT, wp, hp, bp, r * SW, row0 + r < M, kb, xt, scale, accs[r], accms[r], NB, T, EMU)
            new_accs = new_accs + (a,)
            new_accms = new_accms + (am,)
        accs = new_accs
        accms = new_accms
    return accs, accms


@triton.jit
def _imv_rows(pid, w_ptr, w16_ptr, w8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, res_ptr, out_ptr, M, QT: tl.constexpr,
              U: tl.constexpr, N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr,
              HAS_RES: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr = False):
    """Rows pid R .. pid R + R - 1 of `_imv_kernel`'s product. The first K-step's weight words are loaded before
    `pdl.wait` (nothing in the step writes weights; x is the kernel before's output: NOTES.md 7z', 8a)."""
    SW: tl.constexpr = U * N_BLOCKS
    row0 = pid * R
    start = row0.to(tl.int64) * SW
    wp, hp, bp = w_ptr + start, w16_ptr + 2 * start, w8_ptr + 4 * start
    accs, accms = _izeros(QT, R, NB, T)
    raws = ()
    for r in tl.static_range(R):
        raws = raws + (_iwords(QT, wp, hp, bp, r * SW, row0 + r < M, 0, NB, T),)
    wait(PDL)
    xt = _itiles(QT, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, 0, NB, T)
    new_accs = ()
    new_accms = ()
    for r in tl.static_range(R):
        a, am = _iwords_acc(QT, raws[r], xt, 1.0, accs[r], accms[r], EMU)
        new_accs = new_accs + (a,)
        new_accms = new_accms + (am,)
    accs, accms = _irows_dot(QT, wp, hp, bp, row0, M, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, 1.0, new_accs, new_accms,
                             SW, N_BLOCKS, R, NB, T, EMU, NB)
    for r in tl.static_range(R):
        row = row0 + r
        v = _itotal_qt(QT, accs[r], accms[r])
        if HAS_RES:
            v += tl.load(res_ptr + row, mask=row < M, other=0.0)
        tl.store(out_ptr + row, v, mask=row < M)


@triton.jit
def _imv_kernel(w_ptr, w16_ptr, w8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, res_ptr, out_ptr, M, QT: tl.constexpr,
                U: tl.constexpr, N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr,
                HAS_RES: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (cdiv(M, R),). w: int32 [M, U N_BLOCKS] (U words per 256 weights; w16 / w8: its int16 / int8 views,
    read by Q6I); x24 of [K] (hi as int64 [K / 4], lo as int32 [K / 4]); res/out: f32 [M]. The PDL wait comes
    after the first weight loads (`_imv_rows`)."""
    trigger(PDL)
    _imv_rows(tl.program_id(0), w_ptr, w16_ptr, w8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, res_ptr, out_ptr, M, QT, U,
              N_BLOCKS, R, NB, T, HAS_RES, EMU, PDL)


@triton.jit
def _imv2_kernel(w_ptr, w16_ptr, w8_ptr, v_ptr, v16_ptr, v8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, out_ptr, out2_ptr,
                 M, M2, P1, QT: tl.constexpr, U: tl.constexpr, R: tl.constexpr, NB: tl.constexpr,
                 QT2: tl.constexpr, U2: tl.constexpr, R2: tl.constexpr, NB2: tl.constexpr, N_BLOCKS: tl.constexpr,
                 T: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (P1 + cdiv(M2, R2),): two matrices of different layouts over the same x24 of [K] in one launch (a
    layer's q/k and v runs of two types): programs below P1 = cdiv(M, R) do `_imv_kernel`'s work for w [M, ...] ->
    out [M], the rest for v [M2, ...] -> out2 [M2] (no residual). The PDL wait: `_imv_rows`."""
    trigger(PDL)
    pid = tl.program_id(0)
    if pid < P1:
        _imv_rows(pid, w_ptr, w16_ptr, w8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, out_ptr, out_ptr, M, QT, U,
                  N_BLOCKS, R, NB, T, False, EMU, PDL)
    else:
        _imv_rows(pid - P1, v_ptr, v16_ptr, v8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, out2_ptr, out2_ptr, M2, QT2,
                  U2, N_BLOCKS, R2, NB2, T, False, EMU, PDL)


@triton.jit
def _quantize_h_group(h_ptr, row0, sel, F, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, cnt_ptr, R: tl.constexpr):
    """After this program stored its R values of h row `sel` (from row0; f32 at h_ptr, natural order): the last of
    the 32 / R programs of its 32-value group to arrive (an acq_rel counter after a CTA barrier; it resets the
    counter) quantizes the group into the X24 of h [n_sel, F] (hh/hl/hs/hsum_ptr)."""
    grp = sel * (F // 32) + row0 // 32
    tl.debug_barrier()  # every thread's stores before the release below
    if tl.atomic_add(cnt_ptr + grp, 1, sem="acq_rel", scope="gpu") == 32 // R - 1:
        hv = tl.load(h_ptr + (row0 // 32) * 32 + tl.arange(0, 32), volatile=True)
        one = tl.arange(0, 1)
        store_x24(tl.reshape(hv, [1, 32]), grp + one, one == 0, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, 32)
        tl.atomic_xchg(cnt_ptr + grp, 0, sem="relaxed", scope="gpu")


@triton.jit
def _igate_up_kernel(wg_ptr, wg16_ptr, wg8_ptr, wu_ptr, wu16_ptr, wu8_ptr, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, ids_ptr,
                     route_ptr, wts_ptr, E, out_ptr, F, stride_ge, stride_ue, stride_out, hh_ptr, hl_ptr, hs_ptr,
                     hsum_ptr, cnt_ptr, QT: tl.constexpr, U: tl.constexpr, N_BLOCKS: tl.constexpr, R: tl.constexpr,
                     NB: tl.constexpr, T: tl.constexpr, ACT: tl.constexpr, PERM_OUT: tl.constexpr,
                     ROUTE: tl.constexpr, N_SEL: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_K: tl.constexpr, H24: tl.constexpr, EMU: tl.constexpr, PDL: tl.constexpr = False,
                     LATE: tl.constexpr = False):
    """Grid (cdiv(F, R), n_sel). wg/wu: int32 [E, F, U N_BLOCKS] in layout QT (and their int16 / int8 views;
    strides in words); x24 of [K]; ids: [n_sel] (chosen here from the router's logits with ROUTE, as wmatvec's
    `expert_id`); out: f32 [n_sel, F] (rows permuted with PERM_OUT: the input of a word-kernel down product).
    H24: h also quantized into the X24 at hh/hl/hs/hsum_ptr (an integer-dot down's input; `_quantize_h_group`,
    counters cnt [n_sel F / 32] int32 zeros, left zero). LATE: the next kernel may launch only after this one's
    wait (so the router's logits are final before it starts: a routed down, `_idown_kernel` ROUTE)."""
    if LATE:
        wait(PDL)
        trigger(PDL)
    else:
        begin(PDL)
    SW: tl.constexpr = U * N_BLOCKS
    sel = tl.program_id(1)
    row0 = tl.program_id(0) * R
    eid = expert_id(ids_ptr, route_ptr, wts_ptr, E, ROUTE, N_SEL, RENORM, BLOCK_E, BLOCK_K)
    gs = eid * stride_ge + row0.to(tl.int64) * SW
    us = eid * stride_ue + row0.to(tl.int64) * SW
    wg, wg16, wg8 = wg_ptr + gs, wg16_ptr + 2 * gs, wg8_ptr + 4 * gs
    wu, wu16, wu8 = wu_ptr + us, wu16_ptr + 2 * us, wu8_ptr + 4 * us
    ga, gm = _izeros(QT, R, NB, T)
    ua, um = _izeros(QT, R, NB, T)
    for kb in range(0, N_BLOCKS, NB):  # gate and up rows share each x tile
        xt = _itiles(QT, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, kb, NB, T)
        nga = ()
        ngm = ()
        nua = ()
        num = ()
        for r in tl.static_range(R):
            ok = row0 + r < F
            a, am = _istep(QT, wg, wg16, wg8, r * SW, ok, kb, xt, 1.0, ga[r], gm[r], NB, T, EMU)
            nga = nga + (a,)
            ngm = ngm + (am,)
            a, am = _istep(QT, wu, wu16, wu8, r * SW, ok, kb, xt, 1.0, ua[r], um[r], NB, T, EMU)
            nua = nua + (a,)
            num = num + (am,)
        ga, gm, ua, um = nga, ngm, nua, num
    for r in tl.static_range(R):
        _store_h(out_ptr + sel * stride_out, row0 + r, F, _itotal_qt(QT, ga[r], gm[r]), _itotal_qt(QT, ua[r], um[r]),
                 ACT, PERM_OUT)
    if H24:
        _quantize_h_group(out_ptr + sel * stride_out, row0, sel, F, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, cnt_ptr, R)


@triton.jit
def _irows_load(QT: tl.constexpr, wp, hp, bp, row0, M, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, SW: tl.constexpr,
                N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr):
    """`_irows_dot`'s loads, every K-step unrolled and none used: ((x tiles, (row words per row)) per K-step).
    NB divides N_BLOCKS (`wmatvec.wtile_for` fits it): the integer kernels mask rows, not blocks."""
    tl.static_assert(N_BLOCKS % NB == 0)
    pend = ()
    for j in tl.static_range(N_BLOCKS // NB):
        xt = _itiles(QT, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, j * NB, NB, T)
        rws = ()
        for r in tl.static_range(R):
            rws = rws + (_iwords(QT, wp, hp, bp, r * SW, row0 + r < M, j * NB, NB, T),)
        pend = pend + ((xt, rws),)
    return pend


@triton.jit
def _irows_math(QT: tl.constexpr, pend, z, scale, accs, accms, STEPS: tl.constexpr, R: tl.constexpr,
                EMU: tl.constexpr):
    """`_irows_dot`'s arithmetic (the same order) on `_irows_load`'s words for STEPS K-steps, pinned by z (`_ipin`)."""
    for j in tl.static_range(STEPS):
        xt, rws = pend[j]
        new_accs = ()
        new_accms = ()
        for r in tl.static_range(R):
            a, am = _iwords_acc(QT, _ipin(QT, rws[r], z), xt, scale, accs[r], accms[r], EMU)
            new_accs = new_accs + (a,)
            new_accms = new_accms + (am,)
        accs = new_accs
        accms = new_accms
    return accs, accms


@triton.jit
def _irows_words(QT: tl.constexpr, wp, hp, bp, row0, M, SW: tl.constexpr, N_BLOCKS: tl.constexpr, R: tl.constexpr,
                 NB: tl.constexpr, T: tl.constexpr):
    """The weight half of `_irows_load`: ((row words per row) per K-step), loaded and not yet used."""
    ws = ()
    for j in tl.static_range(N_BLOCKS // NB):
        rws = ()
        for r in tl.static_range(R):
            rws = rws + (_iwords(QT, wp, hp, bp, r * SW, row0 + r < M, j * NB, NB, T),)
        ws = ws + (rws,)
    return ws


@triton.jit
def _irows_with_x(QT: tl.constexpr, ws, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, N_BLOCKS: tl.constexpr, NB: tl.constexpr,
                  T: tl.constexpr):
    """`_irows_words`' words with their x tiles loaded now: `_irows_load`'s ((x tiles, (row words)) per K-step)."""
    pend = ()
    for j in tl.static_range(N_BLOCKS // NB):
        pend = pend + ((_itiles(QT, xh_ptr, xl_ptr, xs_ptr, xsum_ptr, j * NB, NB, T), ws[j]),)
    return pend


@triton.jit
def _idown_experts(QT: tl.constexpr, w_ptr, w16_ptr, w8_ptr, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, ids_ptr, wts_ptr,
                   row0, N, stride_e, accs, accms, SW: tl.constexpr, N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr,
                   R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr, EU: tl.constexpr, EMU: tl.constexpr,
                   route_ptr, E, ROUTE: tl.constexpr = False, BLOCK_E: tl.constexpr = 1, BLOCK_K: tl.constexpr = 1,
                   PDL: tl.constexpr = False):
    """`_idown_kernel`'s experts EU at a time: every expert id and weight read first, then per group of EU experts all
    their words and x tiles loaded (`_irows_load`), a CTA barrier so that none of those loads waits behind the group's
    arithmetic, then the arithmetic in `_irows_dot`'s order (the same sums, in the same order). ROUTE: the ids ranked
    here from the router's logits and the first group's words loaded before the PDL wait (nothing in the step writes
    weights), ids_ptr never read; h and the routing weights after it."""
    eids = ()
    if ROUTE:
        eids = ranked_experts(route_ptr, E, N_SEL, BLOCK_E, BLOCK_K)
        first = ()
        for u in tl.static_range(EU):
            start = eids[u] * stride_e + row0.to(tl.int64) * SW
            first = first + (_irows_words(QT, w_ptr + start, w16_ptr + 2 * start, w8_ptr + 4 * start, row0, N, SW,
                                          N_BLOCKS, R, NB, T),)
    eids, wts, pin_ptr = routing_after_wait(ids_ptr, wts_ptr, eids, ROUTE, N_SEL, PDL)
    for g in tl.static_range(0, N_SEL, EU):
        pends = ()
        for u in tl.static_range(EU):
            start = eids[g + u] * stride_e + row0.to(tl.int64) * SW
            xo = (g + u) * (64 * N_BLOCKS)  # h row g + u (as `_idown_kernel`)
            so = (g + u) * (8 * N_BLOCKS)
            if ROUTE and g == 0:
                pends = pends + (_irows_with_x(QT, first[u], hh_ptr + xo, hl_ptr + xo, hs_ptr + so, hsum_ptr + so,
                                               N_BLOCKS, NB, T),)
            else:
                pends = pends + (_irows_load(QT, w_ptr + start, w16_ptr + 2 * start, w8_ptr + 4 * start, row0, N,
                                             hh_ptr + xo, hl_ptr + xo, hs_ptr + so, hsum_ptr + so, SW, N_BLOCKS, R,
                                             NB, T),)
        z = zero_after_barrier(pin_ptr)  # the loads above are issued before any arithmetic below waits on them
        for u in tl.static_range(EU):
            accs, accms = _irows_math(QT, pends[u], z, wts[g + u], accs, accms, N_BLOCKS // NB, R, EMU)
    return accs, accms


@triton.jit
def _idown_kernel(w_ptr, w16_ptr, w8_ptr, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, N,
                  stride_e, QT: tl.constexpr, U: tl.constexpr, N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr,
                  R: tl.constexpr, NB: tl.constexpr, T: tl.constexpr, EU: tl.constexpr, EMU: tl.constexpr,
                  route_ptr, E, ROUTE: tl.constexpr = False, BLOCK_E: tl.constexpr = 1, BLOCK_K: tl.constexpr = 1,
                  PDL: tl.constexpr = False):
    """Grid (cdiv(N, R),). w: int32 [E, N, U N_BLOCKS] (w16 / w8 its views, as `_imv_kernel`; stride_e in words);
    x24 of h [n_sel, F] (hi / lo viewed as in `_imv_kernel`); ids/wts: [n_sel]; res/out: f32 [N]. The routing
    weight folded into the scales, experts summed in order. EU > 1: the experts' loads EU at a time ahead of their
    arithmetic (`_idown_experts`, EU divides N_SEL). ROUTE (EU > 1): the ids ranked from the router's logits [E] at
    route_ptr before the PDL wait, with the first experts' words (`_idown_experts`); the launch before must be a LATE
    gate/up (`_igate_up_kernel`), so that the logits are final when this one starts."""
    tl.static_assert(EU > 1 or not ROUTE)
    if ROUTE:
        trigger(PDL)
    else:
        begin(PDL)
    SW: tl.constexpr = U * N_BLOCKS
    row0 = tl.program_id(0) * R
    accs, accms = _izeros(QT, R, NB, T)
    if EU > 1:
        accs, accms = _idown_experts(QT, w_ptr, w16_ptr, w8_ptr, hh_ptr, hl_ptr, hs_ptr, hsum_ptr, ids_ptr, wts_ptr,
                                     row0, N, stride_e, accs, accms, SW, N_BLOCKS, N_SEL, R, NB, T, EU, EMU,
                                     route_ptr, E, ROUTE, BLOCK_E, BLOCK_K, PDL)
    else:
        for i in range(N_SEL):
            eid = tl.load(ids_ptr + i).to(tl.int64)
            start = eid * stride_e + row0.to(tl.int64) * SW
            xo = i * (64 * N_BLOCKS)  # h row i: its hi / lo viewed 4 values per element, 8 N_BLOCKS groups
            accs, accms = _irows_dot(QT, w_ptr + start, w16_ptr + 2 * start, w8_ptr + 4 * start, row0, N,
                                     hh_ptr + xo, hl_ptr + xo, hs_ptr + i * (8 * N_BLOCKS),
                                     hsum_ptr + i * (8 * N_BLOCKS), tl.load(wts_ptr + i), accs, accms, SW, N_BLOCKS,
                                     R, NB, T, EMU)
    for r in tl.static_range(R):
        row = row0 + r
        v = _itotal_qt(QT, accs[r], accms[r]) + tl.load(res_ptr + row, mask=row < N, other=0.0)
        tl.store(out_ptr + row, v, mask=row < N)


# ---------------------------------------------------------------------------------------------- wrappers

QUANT_BLOCK = 8  # groups of 32 per quantizer program
# T: Q4_K's qs words per thread, 4 or 8 of a sub-block pair as one [.., T] tile. 8, measured: Triton gives a thread
# 4 of them (one 16-byte load per row and block) and two threads sum a sub-block pair (whole pairs per thread, 16
# words, measured slower and deleted: NOTES.md 7q, 7v). Tiles measured on the H200 at OLMoE sizes (bench_qmatvec
# --itiles, us; NOTES.md 7n): attention 2048 x 2048 3.62 at 2 rows (4.35 on the word kernel), gate+up 10.05 at 4
# (13.22), down 8.89 at 2 (11.21), a 50304-row output 23.9 at 4 (34.0)
WORDS_PER_THREAD = 8
ITILES = {("mv", Q4_K): WTile(2, 8), ("mv_big", Q4_K): WTile(4, 8), ("gate_up", Q4_K): WTile(4, 8),
          ("down", Q4_K): WTile(2, 4),
          # Q6I, Q8I: unmeasured, the byte word kernels' best (NOTES.md 7h, 7m)
          ("mv", Q6I): WTile(2, 4), ("gate_up", Q6I): WTile(2, 2), ("down", Q6I): WTile(1, 2),
          ("mv", Q8I): WTile(2, 4), ("gate_up", Q8I): WTile(2, 2), ("down", Q8I): WTile(1, 2)}
BIG_ROWS = 16384  # a matvec with at least this many rows takes ITILES[("mv_big", layout)] where there is one
# down's tiles per experts_ahead (> 1) and layout, where not ITILES': one wave of one-warp programs at the OLMoE sizes
# (static sm_90 SASS, NOTES.md 7x: Q8I at 2 ahead and one row per program needs 138 registers, one wave 128)
AHEAD_TILES = {(2, Q8I): WTile(2, 4)}


def quantize_x24(x: torch.Tensor, out: X24 | None = None) -> X24:
    """x f32 [..., K] (contiguous, K % 32 == 0) -> X24 (hi int16, lo uint8 [..., K], s / sum f32 [..., K / 32])."""
    if x.shape[-1] % X_GROUP or not x.is_contiguous():
        raise ValueError(f"quantize_x24 needs contiguous x with K % {X_GROUP} == 0, got {tuple(x.shape)}")
    out = out or X24.empty(tuple(x.shape), x.device)
    n = x.numel() // X_GROUP
    _quant_x24_kernel[(triton.cdiv(n, QUANT_BLOCK),)](x, *out, n, G=X_GROUP, BLOCK=QUANT_BLOCK,
                                                       num_warps=1)
    return out


def _xviews(x: X24, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' views of an X24 of [..., K]: hi as int64, lo as int32 (4 values each), s, sum."""
    if x.hi.shape[-1] != k or not (x.hi.is_contiguous() and x.lo.is_contiguous()) or x.hi.data_ptr() % 8 \
            or x.lo.data_ptr() % 4:
        raise ValueError(f"x24 must be contiguous [..., {k}] (hi 8-byte, lo 4-byte aligned), got {tuple(x.hi.shape)}")
    return x.hi.view(torch.int64), x.lo.view(torch.int32), x.s, x.sum


def bytes_q8_0(w: torch.Tensor, chunk_groups: int = 1 << 16) -> torch.Tensor:
    """Q8_0 rows uint8 [..., 34 n] (n % 8 == 0) -> the Q8I copy uint8 [..., 288 n / 8]: per 256 weights their 256
    int8 values in weight order (word-aligned, so one load per 4 values), then the 8 block scales d as float32
    (exact). The same values (d q), 1.06x the bytes; `chunk_groups` 256-weight groups at a time."""
    if w.shape[-1] % (34 * 8):
        raise ValueError(f"Q8_0 rows must be whole 256-weight groups (272 bytes), got rows of {w.shape[-1]} bytes")
    groups = w.reshape(-1, 8, 34)  # [n, 8 blocks, 34]
    out = torch.empty(groups.shape[0], BYTES_Q8I, dtype=torch.uint8, device=w.device)
    for i in range(0, groups.shape[0], chunk_groups):
        g = groups[i:i + chunk_groups]
        out[i:i + chunk_groups, :256] = g[..., 2:].reshape(-1, 256)
        d = g[..., :2].contiguous().view(torch.float16).float()  # [n, 8, 1]
        out[i:i + chunk_groups, 256:] = d.reshape(-1, 8).view(torch.uint8)
    return out.reshape(*w.shape[:-1], -1)


COPIES = {Q6_K: partial(bytes_q6k, signed=True), Q8_0: bytes_q8_0}  # the load-time copies the kernels read


def takes(qtype: int, w: torch.Tensor, k: int) -> bool:
    """Whether matrix w (raw rows of this type over K inputs) is in the layout the integer kernels read: Q4_K's
    rows, or the copy of COPIES (not Q6_K / Q8_0's file's rows: where the copy did not fit, other kernels take it)."""
    return qtype in LAYOUTS and k % 256 == 0 and w.shape[-1] == LAYOUTS[qtype][1] * (k // 256)


def _iviews(qtype: int, w: torch.Tensor, k: int) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """(int32, int16, int8 views), words per 256 weights and the layout code of a matrix an integer kernel reads
    (`takes`)."""
    if qtype == Q4_K:
        w32 = _words(w, k)
        return (w32, w32, w32), 36, Q4_K
    if takes(qtype, w, k) and w.is_contiguous() and w.data_ptr() % 4 == 0:
        code, size = LAYOUTS[qtype]
        return (w.view(torch.int32), w.view(torch.int16), w.view(torch.int8)), size // 4, code
    raise ValueError(f"{GGMLQuantizationType(qtype).name} matrix {tuple(w.shape)} has no integer-dot kernel for "
                     f"K = {k} (Q4_K rows, or Q6_K / Q8_0 as their contiguous `imatvec.COPIES` copy)")


def _itile(kind: str, qt: int, m: int) -> WTile:
    return ITILES.get((kind + ("_big" if kind == "mv" and m >= BIG_ROWS else ""), qt)) or ITILES[(kind, qt)]


def qmatvec_i(w: torch.Tensor, x: X24, out: torch.Tensor, residual: torch.Tensor | None = None,
              *, qtype: int = Q4_K, tile: WTile | None = None, words: int = WORDS_PER_THREAD) -> torch.Tensor:
    """out[M] = W[M, K] @ x[K] (+ residual[M]). w: uint8 [M, row_bytes], a Q4_K matrix or (qtype Q6_K / Q8_0) its
    `COPIES` copy; x: X24 of [K]; out/residual: f32 [M] (out may be residual). Returns out."""
    m, k = w.shape[0], x.hi.shape[-1]
    views, units, qt = _iviews(qtype, w, k)
    t = wtile_for("mv", m, k, m, w.device, tile or _itile("mv", qt, m))
    _imv_kernel[(triton.cdiv(m, t.rows),)](
        *views, *_xviews(x, k), out if residual is None else residual, out, m,
        QT=qt, U=units, N_BLOCKS=k // 256, R=t.rows, NB=t.nb, T=words, HAS_RES=residual is not None, EMU=_EMU,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_args(w.device))
    return out


def qmatvec_i2(w: torch.Tensor, qtype: int, out: torch.Tensor, w2: torch.Tensor, qtype2: int, out2: torch.Tensor,
               x: X24, *, words: int = WORDS_PER_THREAD) -> tuple[torch.Tensor, torch.Tensor]:
    """out = W @ x and out2 = W2 @ x in one launch (`_imv2_kernel`), each matrix as `qmatvec_i` takes it (its own
    type, layout and default tile); their tiles must have the same warps. Returns (out, out2)."""
    k = x.hi.shape[-1]
    (views, units, qt), (views2, units2, qt2) = _iviews(qtype, w, k), _iviews(qtype2, w2, k)
    m, m2 = w.shape[0], w2.shape[0]
    t = wtile_for("mv", m, k, m, w.device, _itile("mv", qt, m))
    t2 = wtile_for("mv", m2, k, m2, w2.device, _itile("mv", qt2, m2))
    if t.num_warps != t2.num_warps:
        raise ValueError(f"qmatvec_i2: the two matrices' tiles differ in warps ({t} vs {t2})")
    p1 = triton.cdiv(m, t.rows)
    _imv2_kernel[(p1 + triton.cdiv(m2, t2.rows),)](
        *views, *views2, *_xviews(x, k), out, out2, m, m2, p1, QT=qt, U=units, R=t.rows, NB=t.nb, QT2=qt2,
        U2=units2, R2=t2.rows, NB2=t2.nb, N_BLOCKS=k // 256, T=words, EMU=_EMU, num_warps=t.num_warps,
        num_stages=max(t.num_stages, t2.num_stages), **launch_args(w.device))
    return out, out2


def moe_gate_up_i(w_gate: torch.Tensor, w_up: torch.Tensor, x: X24, ids: torch.Tensor, out: torch.Tensor,
                  act: str = "silu", *, perm_out: bool = False, tile: WTile | None = None,
                  route: Route | None = None, h_out: X24 | None = None, counters: torch.Tensor | None = None,
                  qtype: int = Q4_K, words: int = WORDS_PER_THREAD, late: bool = False) -> torch.Tensor:
    """out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x). w_*: uint8 [E, F, row_bytes], Q4_K or (qtype Q6_K / Q8_0)
    their `COPIES` copy; x: X24 of [K]; ids: int32 [n_sel] (with `route` an output, as wmatvec.moe_gate_up_w); out:
    f32 [n_sel, F], rows in natural order, or in permute_k4 order with perm_out (F % 256 == 0). h_out: also out
    quantized (X24 of [n_sel, F], the input of `moe_down_i`; needs counters: int32 zeros [>= n_sel F / 32], left
    zero). late: with PDL, the next launch may start only after this one's wait (before a `moe_down_i` with route)."""
    f, k, n_sel = w_gate.shape[1], x.hi.shape[-1], ids.shape[0]
    if perm_out and f % 256:
        raise ValueError(f"perm_out needs F % 256 == 0, got F = {f}")
    gv, units, qt = _iviews(qtype, w_gate, k)
    uv, _, _ = _iviews(qtype, w_up, k)
    t = wtile_for("gate_up", f, k, f * n_sel, w_gate.device, tile or _itile("gate_up", qt, f))
    if h_out is not None:
        if perm_out or f % 32 or 32 % t.rows or counters is None or counters.numel() < n_sel * f // 32:
            raise ValueError(f"h_out needs natural-order rows, F % 32 == 0 (F = {f}), rows per program dividing 32 "
                             f"({t.rows}) and n_sel F / 32 = {n_sel * f // 32} int32 counters")
        _xviews(h_out, f)  # checks its shape and alignment (the down kernel's views)
        hargs = (*h_out, counters)  # stored as int16 / uint8 values
    else:
        hargs = (out,) * 5
    rargs, rconst = route_args(route, ids)
    _igate_up_kernel[(triton.cdiv(f, t.rows), n_sel)](
        *gv, *uv, *_xviews(x, k), ids, *rargs, out, f, gv[0].stride(0), uv[0].stride(0), out.stride(0), *hargs,
        QT=qt, U=units, N_BLOCKS=k // 256, R=t.rows, NB=t.nb, T=words, ACT=ACTIVATIONS[act], PERM_OUT=perm_out,
        **rconst, H24=h_out is not None, EMU=_EMU, num_warps=t.num_warps, num_stages=t.num_stages,
        LATE=late, **launch_args(w_gate.device))
    return out


def moe_down_i(w_down: torch.Tensor, h: X24, ids: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor,
               out: torch.Tensor, *, qtype: int = Q4_K, tile: WTile | None = None,
               words: int = WORDS_PER_THREAD, experts_ahead: int = EXPERTS_AHEAD,
               route: Route | None = None) -> torch.Tensor:
    """out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]), experts summed in order. w_down: uint8
    [E, N, row_bytes], Q4_K or (qtype Q6_K / Q8_0) their `COPIES` copy; h: X24 of [n_sel, F]; ids / weights: [n_sel];
    residual / out: f32 [N] (out may be residual). experts_ahead: the experts whose loads a program issues before
    their arithmetic (the largest divisor of n_sel up to it; 1: one expert, one K-step at a time). route (the one a
    gate/up launched with `late` chose ids and weights from; experts_ahead > 1, at most ROUTE_MAX_E experts): the
    kernel ranks the experts itself from route.logits and loads its first experts' words before the PDL wait; ids
    is not read, weights is. Returns out."""
    n, f, n_sel = w_down.shape[1], h.hi.shape[-1], h.hi.shape[0]
    views, units, qt = _iviews(qtype, w_down, f)
    eu = experts_group(n_sel, experts_ahead)
    rargs, rconst = down_route_args(route, ids, eu, "moe_down_i")
    t = wtile_for("down", n, f, n, w_down.device, tile or AHEAD_TILES.get((eu, qt)) or _itile("down", qt, n))
    _idown_kernel[(triton.cdiv(n, t.rows),)](
        *views, *_xviews(h, f), ids, weights, residual, out, n, views[0].stride(0),
        QT=qt, U=units, N_BLOCKS=f // 256, N_SEL=n_sel, R=t.rows, NB=t.nb, T=words, EU=eu, EMU=_EMU,
        route_ptr=rargs[0], E=rargs[1], **rconst, num_warps=t.num_warps, num_stages=t.num_stages,
        **launch_args(w_down.device))
    return out
