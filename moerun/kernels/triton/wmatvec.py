"""Q4_K, Q6_K and Q8_0 matvec kernels for batch-1 decode that read the blocks as 32-bit words (Triton).

The faster twin of qmatvec.py's Q4_K path (benchmarks/NOTES.md section 7): same products, same GGUF bytes,
but shaped after what the sm_90 code of qmatvec's byte decoders spent its time on (~25 instructions per
weight, NOTES.md section 3):

- the rows are read as int32 words (16-byte loads), addressed by int32 offsets from one int64 base per
  program;
- a program holds R rows as R separate word tiles of one layout (unrolled), so the thread that holds a word
  position holds it for every row and each x register serves R rows (and 2R for gate + up);
- x comes permuted (`permute_k4`): inside each 256-weight block, slot 64 k + a holds weight 4 a + k. The x
  tile of one nibble position over the block's words is then a contiguous run, loaded straight into the
  words' layout (no gather, no layout conversion);
- a nibble q becomes the float f = 1 + q / 16 by a shift and one and-or (its bits under the exponent of
  1.0; no int -> float conversion), and per sub-block
  sum_i (d sc q_i - dmin m) x_i = 16 d sc sum_i f_i x_i - (16 d sc + dmin m) sum_i x_i:
  one FMA per weight, the scales once per word and sub-block.

Q4_K block = 36 words: w0 = d | dmin << 16 (f16 bits), w1..w3 = the 12 scale bytes, w4..w35 = qs. qs word
8c + tt (c < 4, tt < 8), byte k, nibble h holds weight 64c + 32h + 4tt + k (sub-block 2c + h), so after
`permute_k4` its x sits at slot 64k + 16c + 8h + tt.

- `qmatvec_w`      out[M] = W[M, K] @ x[K] (+ residual[M])
- `moe_gate_up_w`  out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x), optionally stored permuted (the input
                   of a word-kernel down product)
- `moe_down_w`     out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]), h permuted

Q6_K (a Q4_K_M file's output matrix, attn_v and half its down matrices) and Q8_0 follow the same plan with
one accumulator tile per row (`*_w6`, `*_w8`; their layouts are described at their section below).

All take x (or h) permuted, K a multiple of 256, and accumulate in float32 in a fixed order (no atomics:
bit-identical run to run). No allocation, no host sync: capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from moerun.kernels.gpu import sm_count
from moerun.kernels.torch_ops import Route, permute_k4
from moerun.kernels.triton.decode_ops import expert_id, route_args
from moerun.kernels.triton.outputs import perm_slot
from moerun.kernels.triton.qgemm import _i8f
from moerun.kernels.triton.qmatvec import ACTIVATIONS, _act

Q4_K, Q6_K, Q8_0 = 12, 14, 8
# f = 1 + q/16: mask of mantissa bits 19-22 and the bits of 1.0f, passed as runtime arguments so the and-or
# compiles to one 3-input LOP3 (as immediates ptxas emits two instructions)
FQ_MASK, FQ_ONE = 0x780000, 0x3F800000
Q6B = 1014  # the kernels' layout code (QT) for Q6_K repacked as bytes (`bytes_q6k`); 14 is Q6_K on its file's rows


class WTile(NamedTuple):
    """Rows per program (R, unrolled), 256-weight blocks per K-step, warps, and the launch's num_stages (which does
    not pipeline these kernels' loops: Triton 3.6 pipelines non-dot loads only in `tl.range(num_stages=)` loops, and
    those measured slower, NOTES.md 8d / 8g)."""

    rows: int
    nb: int
    num_warps: int = 1
    num_stages: int = 2


# Tuned overrides keyed by (kind, M, K) with kind in {"mv", "gate_up", "down"}; else TYPE_WTILES; else `default_wtile`.
WTILES: dict[tuple[str, int, int], WTile] = {}
# Per (kind, type), measured on the H200 at OLMoE sizes (bench_qmatvec, NOTES.md 7h, us): Q6_K down 23.7 -> 18.4
# (the byte kernel: 21.9), Q8_0 down 14.9 -> 13.2, Q8_0 gate+up 17.6 -> 15.7; Q4_K's defaults were already the best
TYPE_WTILES: dict[tuple[str, int], WTile] = {
    ("down", Q6_K): WTile(1, 2), ("down", Q8_0): WTile(1, 2), ("gate_up", Q8_0): WTile(2, 1),
    ("down", Q6B): WTile(1, 2), ("mv", Q6B): WTile(2, 4)}  # Q6_K as bytes: 12.7 and 41.1 / 4.65 us (NOTES.md 7m)
MAX_NB = 4  # blocks per K-step (a power of two dividing K / 256); 8 spills gate/up (static SASS, NOTES 7)
# Rows per program: at most MAX_ROWS[kind] (gate/up holds the rows of two matrices), and only while at least
# PROGRAMS_PER_SM one-warp programs per SM remain. Measured on the H200 (bench_qmatvec.py, OLMoE sizes,
# NOTES.md 7): 2 rows best for the 2048-row attention matrices (4.35 us vs 4.81 at 1), for down (11.3 vs
# 13.7) and for gate/up (13.2 vs 14.3 at 4); 4 for the 50304-row output matrix (33.9 us vs 39.7 at 2).
MAX_ROWS = {"mv": 4, "gate_up": 2, "down": 4}  # measured for Q4_K; Q6_K and Q8_0 use the same (unmeasured)
PROGRAMS_PER_SM = 4


def _fit_nb(nb: int, n_blocks: int) -> int:
    """The largest power of two <= nb dividing n_blocks: K-steps without masks."""
    fit = 1
    while fit * 2 <= nb and n_blocks % (fit * 2) == 0:
        fit *= 2
    return fit


def default_wtile(kind: str, m: int, k: int, n_rows: int, device: torch.device) -> WTile:
    """One warp, MAX_NB blocks per step; rows per program: the largest power of two <= MAX_ROWS[kind] that still
    leaves PROGRAMS_PER_SM programs per SM (n_rows: rows of all the program groups, e.g. 8 experts x F)."""
    r = 1
    while r * 2 <= MAX_ROWS[kind] and n_rows // (r * 2) >= PROGRAMS_PER_SM * sm_count(device):
        r *= 2
    return WTile(r, MAX_NB, 1, 2)


def wtile_for(kind: str, m: int, k: int, n_rows: int, device: torch.device, tile: WTile | None = None,
              qtype: int | None = None) -> WTile:
    """`tile`, else WTILES[(kind, m, k)], else TYPE_WTILES[(kind, qtype)], else the default; its NB fitted to K
    (a divisor of K / 256)."""
    t = tile or WTILES.get((kind, m, k)) or TYPE_WTILES.get((kind, qtype))
    t = t or default_wtile(kind, m, k, n_rows, device)
    return t._replace(nb=_fit_nb(t.nb, k // 256))


def supports(qtype: int, k: int, kind: str | None = None, m: int | None = None) -> bool:
    """True when a word kernel takes (and is the faster for) a [M, K] matrix of this type in product `kind`
    ("mv", "gate_up" or "down"; None: some product); m: its rows, None = some size."""
    kinds = [kind] if kind else list(KERNELS)
    return k % 256 == 0 and any(qtype in KERNELS[kd] and (m is None or m >= MIN_ROWS.get((kd, qtype), 0))
                                for kd in kinds)


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _nib(qs, P: tl.constexpr, fq_mask, fq_one):
    """1 + q / 16 (float32, exact) for the nibble at bit P of every int32 word."""
    if P <= 19:
        v = qs << (19 - P)
    else:
        v = qs >> (P - 19)  # arithmetic shift: the copied sign bits fall outside fq_mask
    return ((v & fq_mask) | fq_one).to(tl.float32, bitcast=True)


@triton.jit
def _half(v):
    """Low 16 bits of int32 `v` as an fp16 bit pattern -> float32."""
    return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_min(h1, h2, h3, j):
    """6-bit scale and min of sub-blocks `j` (0..7) from scale words h1-h3 (bytes 0-3, 4-7, 8-11; any shape
    broadcastable with j) -> two float32 tiles (llama.cpp's get_scale_min_k4)."""
    sh = (j & 3) * 8
    a = (h1 >> sh) & 255
    b = (h2 >> sh) & 255
    c = (h3 >> sh) & 255
    first = j < 4
    sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _x_tiles(x_ptr, kb, NB: tl.constexpr):
    """The permuted x of blocks kb .. kb+NB-1 as 8 tiles [NB, 4, 8], one per nibble position n = 2k + h
    (word (c, tt)'s weight at bit 8k + 4h), and the sums of x per sub-block 2c (low) and 2c + 1 (high) [NB, 4]."""
    blk = kb + tl.arange(0, NB)
    xo = blk[:, None, None] * 256 + tl.arange(0, 4)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    xs = ()
    for n in tl.static_range(8):
        xs = xs + (tl.load(x_ptr + xo + 64 * (n // 2) + 8 * (n % 2)),)
    sum_lo = tl.sum(xs[0] + xs[2] + xs[4] + xs[6], axis=2)
    sum_hi = tl.sum(xs[1] + xs[3] + xs[5] + xs[7], axis=2)
    return xs, sum_lo, sum_hi


@triton.jit
def _row_step(wp, off, ok, kb, xs, sum_lo, sum_hi, scale, acc, accm, fq_mask, fq_one, NB: tl.constexpr):
    """One row's blocks kb .. kb+NB-1: acc [NB, 4, 8] += 16 d sc sum f x per word, accm [NB, 4] += (16 d sc +
    dmin m) sum x per sub-block pair; the row's dot product is sum(acc) - sum(accm). `off`: the row's first
    word from wp (int32), `ok`: the row exists, `scale`: a factor folded into both (a routing weight, or 1)."""
    blk = kb + tl.arange(0, NB)
    bo = off + blk * 36  # [NB]
    c = tl.arange(0, 4)
    t = c[:, None] * 8 + tl.arange(0, 8)[None, :]  # [4, 8] qs word 8c + tt
    qs = tl.load(wp + (bo[:, None, None] + 4 + t[None]), mask=ok, other=0)
    pl = _nib(qs, 0, fq_mask, fq_one) * xs[0]
    ph = _nib(qs, 4, fq_mask, fq_one) * xs[1]
    for k in tl.static_range(1, 4):
        pl += _nib(qs, 8 * k, fq_mask, fq_one) * xs[2 * k]
        ph += _nib(qs, 8 * k + 4, fq_mask, fq_one) * xs[2 * k + 1]
    h0 = tl.load(wp + bo, mask=ok, other=0)
    h1 = tl.load(wp + bo + 1, mask=ok, other=0)[:, None]
    h2 = tl.load(wp + bo + 2, mask=ok, other=0)[:, None]
    h3 = tl.load(wp + bo + 3, mask=ok, other=0)[:, None]
    d = _half(h0) * (16.0 * scale)
    dmin = _half(h0 >> 16) * scale
    sc_l, mn_l = _scale_min(h1, h2, h3, 2 * c[None, :])  # [NB, 4]
    sc_h, mn_h = _scale_min(h1, h2, h3, 2 * c[None, :] + 1)
    ds_l = d[:, None] * sc_l
    ds_h = d[:, None] * sc_h
    acc += ds_l[:, :, None] * pl + ds_h[:, :, None] * ph
    accm += (ds_l + dmin[:, None] * mn_l) * sum_lo + (ds_h + dmin[:, None] * mn_h) * sum_hi
    return acc, accm


@triton.jit
def _zeros_rows(R: tl.constexpr, NB: tl.constexpr):
    accs = ()
    accms = ()
    for _r in tl.static_range(R):
        accs = accs + (tl.zeros([NB, 4, 8], dtype=tl.float32),)
        accms = accms + (tl.zeros([NB, 4], dtype=tl.float32),)
    return accs, accms


@triton.jit
def _rows_dot(wp, row0, M, x_ptr, scale, accs, accms, fq_mask, fq_one,
              N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """Accumulate rows row0 .. row0+R-1 (contiguous rows of 36 N_BLOCKS words from wp) against x over all K
    into accs/accms."""
    SW: tl.constexpr = 36 * N_BLOCKS
    for kb in range(0, N_BLOCKS, NB):
        xs, sum_lo, sum_hi = _x_tiles(x_ptr, kb, NB)
        new_accs = ()
        new_accms = ()
        for r in tl.static_range(R):
            a, am = _row_step(wp, r * SW, row0 + r < M, kb, xs, sum_lo, sum_hi, scale, accs[r], accms[r],
                              fq_mask, fq_one, NB)
            new_accs = new_accs + (a,)
            new_accms = new_accms + (am,)
        accs = new_accs
        accms = new_accms
    return accs, accms


@triton.jit
def _total(acc, accm):
    return tl.sum(tl.sum(tl.sum(acc, axis=2), axis=1), axis=0) - tl.sum(tl.sum(accm, axis=1), axis=0)


@triton.jit
def _wmv_kernel(w_ptr, x_ptr, res_ptr, out_ptr, M, fq_mask, fq_one,
                N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, HAS_RES: tl.constexpr):
    """Grid (cdiv(M, R),). w: int32 [M, 36 N_BLOCKS], x: permuted f32 [K], res/out: f32 [M]."""
    SW: tl.constexpr = 36 * N_BLOCKS  # words per row: a compile-time constant, so row starts are 16-byte aligned
    row0 = tl.program_id(0) * R
    wp = w_ptr + row0.to(tl.int64) * SW
    accs, accms = _zeros_rows(R, NB)
    accs, accms = _rows_dot(wp, row0, M, x_ptr, 1.0, accs, accms, fq_mask, fq_one, N_BLOCKS, R, NB)
    for r in tl.static_range(R):
        row = row0 + r
        v = _total(accs[r], accms[r])
        if HAS_RES:
            v += tl.load(res_ptr + row, mask=row < M, other=0.0)
        tl.store(out_ptr + row, v, mask=row < M)


@triton.jit
def _store_h(out_ptr, row, F, g, u, ACT: tl.constexpr, PERM_OUT: tl.constexpr):
    """h = act(g) * u of one gate/up row into out_ptr's row `row` (< F), at its permute_k4 slot with PERM_OUT."""
    if PERM_OUT:
        dst = perm_slot(row)
    else:
        dst = row
    tl.store(out_ptr + dst, _act(g, ACT) * u, mask=row < F)


@triton.jit
def _wgate_up_kernel(wg_ptr, wu_ptr, x_ptr, ids_ptr, route_ptr, wts_ptr, E, out_ptr, F, stride_ge, stride_ue,
                     stride_out, fq_mask, fq_one, N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr,
                     ACT: tl.constexpr, PERM_OUT: tl.constexpr, ROUTE: tl.constexpr, N_SEL: tl.constexpr,
                     RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(F, R), n_sel). wg/wu: int32 [E, F, 36 N_BLOCKS], x: permuted f32 [K], ids: [n_sel] (written
    with ROUTE, see `_expert_id`), out: [n_sel, F]."""
    SW: tl.constexpr = 36 * N_BLOCKS
    sel = tl.program_id(1)
    row0 = tl.program_id(0) * R
    eid = expert_id(ids_ptr, route_ptr, wts_ptr, E, ROUTE, N_SEL, RENORM, BLOCK_E, BLOCK_K)
    wg = wg_ptr + eid * stride_ge + row0.to(tl.int64) * SW
    wu = wu_ptr + eid * stride_ue + row0.to(tl.int64) * SW
    ga, gm = _zeros_rows(R, NB)
    ua, um = _zeros_rows(R, NB)
    for kb in range(0, N_BLOCKS, NB):  # gate and up rows share each x tile
        xs, sum_lo, sum_hi = _x_tiles(x_ptr, kb, NB)
        nga = ()
        ngm = ()
        nua = ()
        num = ()
        for r in tl.static_range(R):
            ok = row0 + r < F
            a, am = _row_step(wg, r * SW, ok, kb, xs, sum_lo, sum_hi, 1.0, ga[r], gm[r], fq_mask, fq_one, NB)
            nga = nga + (a,)
            ngm = ngm + (am,)
            a, am = _row_step(wu, r * SW, ok, kb, xs, sum_lo, sum_hi, 1.0, ua[r], um[r], fq_mask, fq_one, NB)
            nua = nua + (a,)
            num = num + (am,)
        ga, gm, ua, um = nga, ngm, nua, num
    for r in tl.static_range(R):
        _store_h(out_ptr + sel * stride_out, row0 + r, F, _total(ga[r], gm[r]), _total(ua[r], um[r]), ACT, PERM_OUT)


@triton.jit
def _wdown_kernel(w_ptr, h_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, N, stride_e, stride_h, fq_mask, fq_one,
                  N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """Grid (cdiv(N, R),). w: int32 [E, N, 36 N_BLOCKS], h: permuted f32 [n_sel, F], ids/wts: [n_sel],
    res/out: [N].

    The routing weight is folded into each expert's scales; experts are summed in order 0 .. n_sel-1.
    """
    SW: tl.constexpr = 36 * N_BLOCKS
    row0 = tl.program_id(0) * R
    accs, accms = _zeros_rows(R, NB)
    for i in range(N_SEL):
        eid = tl.load(ids_ptr + i).to(tl.int64)
        wp = w_ptr + eid * stride_e + row0.to(tl.int64) * SW
        accs, accms = _rows_dot(wp, row0, N, h_ptr + i * stride_h, tl.load(wts_ptr + i), accs, accms,
                                fq_mask, fq_one, N_BLOCKS, R, NB)
    for r in tl.static_range(R):
        row = row0 + r
        v = _total(accs[r], accms[r]) + tl.load(res_ptr + row, mask=row < N, other=0.0)
        tl.store(out_ptr + row, v, mask=row < N)


# ---------------------------------------------------------------------------------------------- wrappers


def _words(w: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [..., row_bytes] with contiguous rows -> int32 [..., row_bytes / 4] (a free view)."""
    if w.shape[-1] != 144 * (k // 256) or w.stride(-1) != 1 or (w.dim() > 1 and w.stride(-2) != w.shape[-1]):
        raise ValueError(f"Q4_K rows must be contiguous {144 * (k // 256)}-byte rows for K = {k}, "
                         f"got shape {tuple(w.shape)} strides {w.stride()}")
    return w.view(torch.int32)


def qmatvec_w(w: torch.Tensor, xp: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
              *, tile: WTile | None = None) -> torch.Tensor:
    """out[M] = W[M, K] @ x[K] (+ residual[M]) for a Q4_K matrix.

    w: uint8 [M, row_bytes] (rows contiguous); xp: float32 [K], x in `permute_k4` order; out/residual: f32 [M]
    (out may be residual). Returns out.
    """
    m, k = w.shape[0], xp.shape[0]
    t = wtile_for("mv", m, k, m, w.device, tile)
    ww = _words(w, k)
    _wmv_kernel[(triton.cdiv(m, t.rows),)](
        ww, xp, out if residual is None else residual, out, m, FQ_MASK, FQ_ONE,
        N_BLOCKS=k // 256, R=t.rows, NB=t.nb, HAS_RES=residual is not None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def moe_gate_up_w(w_gate: torch.Tensor, w_up: torch.Tensor, xp: torch.Tensor, ids: torch.Tensor,
                  out: torch.Tensor, act: str = "silu", *, perm_out: bool = False,
                  tile: WTile | None = None, route: Route | None = None) -> torch.Tensor:
    """out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x) for Q4_K experts, in one launch.

    w_gate/w_up: uint8 [E, F, row_bytes]; xp: f32 [K] in permute_k4 order; ids: int32 [n_sel] on the device
    (with `route`, an output: the launch chooses the experts from the router's logits and writes ids and
    route.weights_out); out: f32 [n_sel, F], each row in natural order, or in permute_k4 order with perm_out
    (F % 256 == 0).
    """
    f, k, n_sel = w_gate.shape[1], xp.shape[0], ids.shape[0]
    if perm_out and f % 256:
        raise ValueError(f"perm_out needs F % 256 == 0, got F = {f}")
    t = wtile_for("gate_up", f, k, f * n_sel, w_gate.device, tile)
    wg, wu = _words(w_gate, k), _words(w_up, k)
    rargs, rconst = route_args(route, ids)
    _wgate_up_kernel[(triton.cdiv(f, t.rows), n_sel)](
        wg, wu, xp, ids, *rargs, out, f, wg.stride(0), wu.stride(0), out.stride(0), FQ_MASK, FQ_ONE,
        N_BLOCKS=k // 256, R=t.rows, NB=t.nb, ACT=ACTIVATIONS[act], PERM_OUT=perm_out, **rconst,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def moe_down_w(w_down: torch.Tensor, hp: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               residual: torch.Tensor, out: torch.Tensor, *, tile: WTile | None = None) -> torch.Tensor:
    """out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]) for Q4_K experts, summed in order.

    w_down: uint8 [E, N, row_bytes]; hp: f32 [n_sel, F], rows in permute_k4 order; ids: int [n_sel];
    weights: f32 [n_sel]; residual/out: f32 [N] (out may be residual). Returns out.
    """
    n, f, n_sel = w_down.shape[1], hp.shape[1], hp.shape[0]
    t = wtile_for("down", n, f, n, w_down.device, tile)
    ww = _words(w_down, f)
    _wdown_kernel[(triton.cdiv(n, t.rows),)](
        ww, hp, ids, weights, residual, out, n, ww.stride(0), hp.stride(0), FQ_MASK, FQ_ONE,
        N_BLOCKS=f // 256, N_SEL=n_sel, R=t.rows, NB=t.nb, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


# ------------------------------------------------------------------------------------------ Q6_K and Q8_0
# Both accumulate one tile per row: sum over a word's weights of q * x, times the word's scale.
#
# Q6_K block = 210 bytes = 105 halfwords: ql hw 0..63, qh hw 64..95, scales (int8) bytes 192..207, d hw 104.
# ql word t = 16h + tt (h < 2, tt < 16), byte k, nibble n (0 low, 1 high) holds the low 4 bits of weight
# 128h + 64n + 4tt + k (sub-block 8h + 4n + tt // 4); its 2 high bits sit in qh word 8h + tt % 8 at bit
# 8k + 4n + 2 (tt // 8). After permute_k4 its x is at slot 64k + 32h + 16n + tt. q (6 bits) becomes
# f = 1 + q / 64 (bits 17-22 under the exponent of 1.0): sum_k d sc (q_k - 32) x_k = d sc (64 sum f x - 96 sum x).
# Blocks are only 2-byte aligned (every other block starts at an odd halfword), so each word is assembled from
# the two words around it (a 16-bit funnel shift) where needed; offsets count halfwords (105 per block).
#
# Q8_0 blocks (34 bytes: d f16, q[32] int8) are read in 256-weight groups of 8 blocks = 68 words (rows of
# K % 256 == 0 are word multiples); block pair p of a group is the 17 words W[17p ..]: W0 = d0 | q0[0:2] << 16,
# W1..W7 = q0[2:30], W8 = q0[30:32] | d1 << 16, W9..W16 = q1. Weight 64p + 32h + 4i + k (h: block of the
# pair, i < 8, k < 4) is byte k of word i of block h, which for h = 0 straddles W[i] (bytes 2, 3) and W[i+1]
# (bytes 0, 1); after permute_k4 its x is at slot 64k + 16p + 8h + i. Bytes become floats by I2F.S8, which
# reads the byte in place. Offsets count words (68 per group).
GROUP_UNITS = {Q6_K: 105, Q8_0: 68}  # offset units (Q6_K halfwords, Q8_0 words) per 256 weights
ROW_BYTES = {Q6_K: 210, Q8_0: 272}  # bytes per 256 weights
PADDED_BYTES = 212  # a Q6_K block padded to a whole number of words (`pad_q6k`)
# Q6_K as bytes (`bytes_q6k`, a load-time copy): per 256 weights 72 words = 288 bytes: the 6-bit values q in
# weight order (bytes 0..255: word j, byte k holds weight 4j + k, whose x sits at permuted slot 64k + j), the 16
# int8 scales (bytes 256..271), d (f16, bytes 272..273), zeros. A value decodes as the Q4_K nibbles do, in one
# shift and one and-or (f = 1 + q / 64 at bits 17-22), where the file's layout takes two of each plus its qh word;
# 9 bits per weight instead of 6.56. Word j of a block belongs to sub-block j // 4. Kernels tell it by its row size.
BYTES_Q6 = 288


@triton.jit
def _words_at(wp, hw, ok, ALIGNED: tl.constexpr):
    """The 32-bit words starting at halfword offsets hw (any shape) from wp (int32 pointer): aligned ones read
    directly, the others (odd hw) from the two words around them (a 16-bit funnel shift). ALIGNED: every hw
    is even (padded blocks), one load each."""
    j = hw >> 1
    if ALIGNED:
        return tl.load(wp + j, mask=ok, other=0)
    a = tl.load(wp + j, mask=ok, other=0)
    b = tl.load(wp + j + 1, mask=ok, other=0)
    return tl.where((hw & 1) != 0, ((a >> 16) & 0xFFFF) | (b << 16), a)


@triton.jit
def _f6(ql, vs, P: tl.constexpr):
    """1 + q / 64 for the 6-bit value whose low nibble is at bit P of ql and whose 2 high bits are at bit P
    of vs."""
    if P <= 17:
        a = ql << (17 - P)
    else:
        a = ql >> (P - 17)
    if P <= 21:
        b = vs << (21 - P)
    else:
        b = vs >> (P - 21)
    return ((a & 0x1E0000) | (b & 0x600000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _xt(QT: tl.constexpr, x_ptr, kb, NB: tl.constexpr):
    """Permuted x of groups kb .. kb+NB-1 as the type's tiles: 8 tiles (index 2k + n) and, for Q6_K, the
    per-word sums of x of the low and high nibbles (zeros for Q8_0); Q6B: 4 tiles (byte k) and the sums of x per
    sub-block [NB, 16, 1]."""
    blk = kb + tl.arange(0, NB)
    xs = ()
    if QT == 1014:  # [NB, 16 (s), 4 (jj)] at 64k + 4s + jj, k < 4
        xo = blk[:, None, None] * 256 + tl.arange(0, 16)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
        for k in tl.static_range(4):
            xs = xs + (tl.load(x_ptr + xo + 64 * k),)
        lo = tl.sum(xs[0] + xs[1] + xs[2] + xs[3], axis=2, keep_dims=True)
        hi = 0.0
    elif QT == 14:  # [NB, 2 (h), 16 (tt)] at 64k + 32h + 16n + tt
        xo = blk[:, None, None] * 256 + tl.arange(0, 2)[None, :, None] * 32 + tl.arange(0, 16)[None, None, :]
        xo = tl.max_contiguous(xo, [1, 1, 1])  # scalar loads, in the layout of the words'
        for j in tl.static_range(8):
            xs = xs + (tl.load(x_ptr + xo + 64 * (j // 2) + 16 * (j % 2)),)
        lo = xs[0] + xs[2] + xs[4] + xs[6]
        hi = xs[1] + xs[3] + xs[5] + xs[7]
    else:  # [NB, 4 (p), 8 (i)] at 64k + 16p + 8h + i
        xo = blk[:, None, None] * 256 + tl.arange(0, 4)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
        for j in tl.static_range(8):
            xs = xs + (tl.load(x_ptr + xo + 64 * (j // 2) + 8 * (j % 2)),)
        lo = 0.0
        hi = 0.0
    return xs, lo, hi


@triton.jit
def _q6k_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB: tl.constexpr, GU: tl.constexpr):
    """One Q6_K row's groups kb..: acc [NB, 2, 16] += d sc (64 sum f x - 96 sum x) per ql word and nibble.
    off: the row's first halfword (int32 words from wp, halfwords from hp, bytes from bp at 2 off); GU:
    halfwords per block (105 as in the file, 106 padded: every block word-aligned)."""
    xs, xs_lo, xs_hi = xt
    blk = kb + tl.arange(0, NB)
    bo = off + blk * GU  # [NB] first halfword of each block
    h = tl.arange(0, 2)[None, :, None]
    tt = tl.arange(0, 16)[None, None, :]
    b3 = bo[:, None, None]
    ql = _words_at(wp, b3 + 2 * (16 * h + tt), ok, GU % 2 == 0)  # [NB, 2, 16]
    qh = _words_at(wp, b3 + 64 + 2 * (8 * h + tt % 8), ok, GU % 2 == 0)
    vs = qh >> (2 * (tt // 8))
    pl = _f6(ql, vs, 0) * xs[0]
    ph = _f6(ql, vs, 4) * xs[1]
    for k in tl.static_range(1, 4):
        pl += _f6(ql, vs, 8 * k) * xs[2 * k]
        ph += _f6(ql, vs, 8 * k + 4) * xs[2 * k + 1]
    d = tl.load(hp + bo + 104, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32) * scale  # [NB]
    sub = 8 * h + tt // 4  # sub-block of the low nibbles; the high ones are + 4
    sp = bp + 2 * b3 + 192 + sub
    sc_lo = tl.load(sp, mask=ok, other=0).to(tl.float32)
    sc_hi = tl.load(sp + 4, mask=ok, other=0).to(tl.float32)
    d3 = d[:, None, None]
    acc += (d3 * sc_lo) * (64.0 * pl - 96.0 * xs_lo) + (d3 * sc_hi) * (64.0 * ph - 96.0 * xs_hi)
    return acc


@triton.jit
def _q8_0_step(wp, off, ok, kb, xt, scale, acc, NB: tl.constexpr):
    """One Q8_0 row's groups kb..: acc [NB, 4, 8] += d0 sum_k q0 x + d1 sum_k q1 x per word position.
    off: the row's first word from wp."""
    xs, _lo, _hi = xt
    go = off + (kb + tl.arange(0, NB)) * 68  # [NB] first word of each group
    pw = go[:, None, None] + 17 * tl.arange(0, 4)[None, :, None]  # [NB, 4, 1] block pair starts
    i = tl.arange(0, 8)[None, None, :]
    a = tl.load(wp + pw + i, mask=ok, other=0)  # W[i]     [NB, 4, 8]
    b = tl.load(wp + pw + i + 1, mask=ok, other=0)  # W[i + 1]
    c = tl.load(wp + pw + 9 + i, mask=ok, other=0)  # W[9 + i]: block 1
    p0 = _i8f(a, 16) * xs[0] + _i8f(a, 24) * xs[2] + _i8f(b, 0) * xs[4] + _i8f(b, 8) * xs[6]
    p1 = _i8f(c, 0) * xs[1] + _i8f(c, 8) * xs[3] + _i8f(c, 16) * xs[5] + _i8f(c, 24) * xs[7]
    d0 = _half(tl.load(wp + pw, mask=ok, other=0)) * scale  # [NB, 4, 1]
    d1 = _half(tl.load(wp + pw + 8, mask=ok, other=0) >> 16) * scale
    return acc + d0 * p0 + d1 * p1


@triton.jit
def _f6b(w, K: tl.constexpr):
    """1 + q / 64 (float32, exact) for the 6-bit value in byte K of every int32 word."""
    if 8 * K <= 17:
        v = w << (17 - 8 * K)
    else:
        v = w >> (8 * K - 17)
    return ((v & 0x7E0000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _q6b_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB: tl.constexpr):
    """One Q6B row's blocks kb..: acc [NB, 16, 1] += d sc (64 sum f x - 96 sum x) per sub-block. off: the row's
    first word (int32 from wp; the views hp / bp start at the same byte)."""
    xs, xsum, _hi = xt
    bo = off + (kb + tl.arange(0, NB)) * 72  # [NB] first word of each block
    s = tl.arange(0, 16)[None, :, None]
    w = tl.load(wp + (bo[:, None, None] + 4 * s + tl.arange(0, 4)[None, None, :]), mask=ok, other=0)  # [NB, 16, 4]
    p = _f6b(w, 0) * xs[0] + _f6b(w, 1) * xs[1] + _f6b(w, 2) * xs[2] + _f6b(w, 3) * xs[3]
    d = tl.load(hp + 2 * bo + 136, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32) * scale  # [NB]
    sc = tl.load(bp + 4 * bo[:, None, None] + 256 + s, mask=ok, other=0).to(tl.float32)  # [NB, 16, 1]
    return acc + (d[:, None, None] * sc) * (64.0 * tl.sum(p, axis=2, keep_dims=True) - 96.0 * xsum)


@triton.jit
def _xstep(QT: tl.constexpr, wp, hp, bp, off, ok, kb, xt, scale, acc, NB: tl.constexpr, GU: tl.constexpr):
    if QT == 1014:
        acc = _q6b_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB)
    elif QT == 14:
        acc = _q6k_step(wp, hp, bp, off, ok, kb, xt, scale, acc, NB, GU)
    else:
        acc = _q8_0_step(wp, off, ok, kb, xt, scale, acc, NB)
    return acc


@triton.jit
def _xbase(QT: tl.constexpr, w32_ptr, w16_ptr, w8_ptr, start):
    """Views from unit offset `start` (int64) on, and start's offset from them (int32): Q6_K's at the word
    boundary at or below halfword `start` (offset 0 or 1); Q8_0's at word `start` (offset 0)."""
    if QT == 1014:  # word offsets; the halfword and byte views from the same byte
        wp, hp, bp, lead = w32_ptr + start, w16_ptr + 2 * start, w8_ptr + 4 * start, (start * 0).to(tl.int32)
    elif QT == 14:
        base = start - (start & 1)
        wp, hp, bp, lead = w32_ptr + base // 2, w16_ptr + base, w8_ptr + 2 * base, (start & 1).to(tl.int32)
    else:
        wp, hp, bp, lead = w32_ptr + start, w16_ptr, w8_ptr, (start * 0).to(tl.int32)
    return wp, hp, bp, lead


@triton.jit
def _xzeros(QT: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    accs = ()
    for _r in tl.static_range(R):
        if QT == 1014:
            accs = accs + (tl.zeros([NB, 16, 1], dtype=tl.float32),)
        elif QT == 14:
            accs = accs + (tl.zeros([NB, 2, 16], dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros([NB, 4, 8], dtype=tl.float32),)
    return accs


@triton.jit
def _sum3(acc):
    return tl.sum(tl.sum(tl.sum(acc, axis=2), axis=1), axis=0)


@triton.jit
def _xrows_dot(QT: tl.constexpr, wp, hp, bp, lead, row0, M, x_ptr, scale, accs, GU: tl.constexpr,
               N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr):
    """accs[r] += row row0 + r's products with x over all K (rows of GU N_BLOCKS units from the views, the
    first at unit `lead`)."""
    for kb in range(0, N_BLOCKS, NB):
        xt = _xt(QT, x_ptr, kb, NB)
        new = ()
        for r in tl.static_range(R):
            new = new + (_xstep(QT, wp, hp, bp, lead + r * (GU * N_BLOCKS), row0 + r < M, kb, xt, scale,
                                accs[r], NB, GU),)
        accs = new
    return accs


@triton.jit
def _wmvx_kernel(w32_ptr, w16_ptr, w8_ptr, x_ptr, res_ptr, out_ptr, M, QT: tl.constexpr, GU: tl.constexpr,
                 N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, HAS_RES: tl.constexpr):
    """Grid (cdiv(M, R),). The matrix as int32 / int16 / int8 views of its bytes; x: permuted f32 [K]."""
    row0 = tl.program_id(0) * R
    wp, hp, bp, lead = _xbase(QT, w32_ptr, w16_ptr, w8_ptr, row0.to(tl.int64) * (GU * N_BLOCKS))
    accs = _xrows_dot(QT, wp, hp, bp, lead, row0, M, x_ptr, 1.0, _xzeros(QT, R, NB), GU, N_BLOCKS, R, NB)
    for r in tl.static_range(R):
        row = row0 + r
        v = _sum3(accs[r])
        if HAS_RES:
            v += tl.load(res_ptr + row, mask=row < M, other=0.0)
        tl.store(out_ptr + row, v, mask=row < M)


@triton.jit
def _wgate_upx_kernel(g32_ptr, g16_ptr, g8_ptr, u32_ptr, u16_ptr, u8_ptr, x_ptr, ids_ptr, route_ptr, wts_ptr, E,
                      out_ptr, F, stride_ge, stride_ue, stride_out, QT: tl.constexpr, GU: tl.constexpr,
                      N_BLOCKS: tl.constexpr, R: tl.constexpr, NB: tl.constexpr, ACT: tl.constexpr,
                      PERM_OUT: tl.constexpr, ROUTE: tl.constexpr, N_SEL: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid (cdiv(F, R), n_sel). Experts [E, F, GU N_BLOCKS units] (strides in units); x permuted f32 [K];
    ids / routing as `_wgate_up_kernel`."""
    sel = tl.program_id(1)
    row0 = tl.program_id(0) * R
    eid = expert_id(ids_ptr, route_ptr, wts_ptr, E, ROUTE, N_SEL, RENORM, BLOCK_E, BLOCK_K)
    first = row0.to(tl.int64) * (GU * N_BLOCKS)
    gp, gh, gb, glead = _xbase(QT, g32_ptr, g16_ptr, g8_ptr, eid * stride_ge + first)
    up, uh, ub, ulead = _xbase(QT, u32_ptr, u16_ptr, u8_ptr, eid * stride_ue + first)
    ga = _xzeros(QT, R, NB)
    ua = _xzeros(QT, R, NB)
    for kb in range(0, N_BLOCKS, NB):  # gate and up rows share each x tile
        xt = _xt(QT, x_ptr, kb, NB)
        nga = ()
        nua = ()
        for r in tl.static_range(R):
            ok = row0 + r < F
            nga = nga + (_xstep(QT, gp, gh, gb, glead + r * (GU * N_BLOCKS), ok, kb, xt, 1.0, ga[r], NB, GU),)
            nua = nua + (_xstep(QT, up, uh, ub, ulead + r * (GU * N_BLOCKS), ok, kb, xt, 1.0, ua[r], NB, GU),)
        ga, ua = nga, nua
    for r in tl.static_range(R):
        _store_h(out_ptr + sel * stride_out, row0 + r, F, _sum3(ga[r]), _sum3(ua[r]), ACT, PERM_OUT)


@triton.jit
def _wdownx_kernel(w32_ptr, w16_ptr, w8_ptr, h_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, N, stride_e, stride_h,
                   QT: tl.constexpr, GU: tl.constexpr, N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr,
                   R: tl.constexpr, NB: tl.constexpr):
    """Grid (cdiv(N, R),). Experts [E, N, GU N_BLOCKS units] (stride_e in units), h: permuted f32 [n_sel, F];
    the routing weight folded into the scales, experts summed in order 0 .. n_sel-1."""
    row0 = tl.program_id(0) * R
    accs = _xzeros(QT, R, NB)
    for i in range(N_SEL):
        eid = tl.load(ids_ptr + i).to(tl.int64)
        wp, hp, bp, lead = _xbase(QT, w32_ptr, w16_ptr, w8_ptr, eid * stride_e + row0.to(tl.int64) * (GU * N_BLOCKS))
        accs = _xrows_dot(QT, wp, hp, bp, lead, row0, N, h_ptr + i * stride_h, tl.load(wts_ptr + i), accs,
                          GU, N_BLOCKS, R, NB)
    for r in tl.static_range(R):
        row = row0 + r
        v = _sum3(accs[r]) + tl.load(res_ptr + row, mask=row < N, other=0.0)
        tl.store(out_ptr + row, v, mask=row < N)


def _views(qtype: int, w: torch.Tensor, k: int) -> tuple[tuple[torch.Tensor, ...], int, int, int]:
    """int32 / int16 / int8 views of Q6_K or Q8_0 rows (uint8 [..., ROW_BYTES K / 256], or Q6_K padded by
    `pad_q6k` to PADDED_BYTES or repacked by `bytes_q6k` to BYTES_Q6; contiguous, 4-byte aligned start), the
    stride of the leading (expert) dimension in offset units (0 for a matrix), the offset units per 256 weights
    (GU) and the kernels' layout code (QT: the type, or Q6B)."""
    name, nb = GGMLQuantizationType(qtype).name, k // 256
    sizes = (ROW_BYTES[qtype], PADDED_BYTES, BYTES_Q6) if qtype == Q6_K else (ROW_BYTES[qtype],)
    size = next((b for b in sizes if w.shape[-1] == b * nb), None)
    if k % 256 or size is None or not w.is_contiguous():
        raise ValueError(f"{name} rows must be contiguous {', '.join(str(b * nb) for b in sizes)}-byte rows "
                         f"for K = {k}, got shape {tuple(w.shape)} strides {w.stride()}")
    if w.data_ptr() % 4:
        raise ValueError(f"{name} weights must start at a 4-byte aligned address")
    flat = w.reshape(-1)
    unit = 4 if size == BYTES_Q6 else ROW_BYTES[qtype] // GROUP_UNITS[qtype]  # bytes per offset unit
    stride_e = w.stride(0) // unit if w.dim() == 3 else 0
    # whole words only: the last 2 bytes (an odd Q6_K block's d, read as a halfword) may be left out of the
    # int32 view
    views = (flat[: flat.numel() // 4 * 4].view(torch.int32), flat.view(torch.int16), flat.view(torch.int8))
    return views, stride_e, size // unit, Q6B if size == BYTES_Q6 else qtype


def bytes_q6k(w: torch.Tensor, chunk_blocks: int = 1 << 18, signed: bool = False) -> torch.Tensor:
    """Q6_K rows uint8 [..., 210 n] -> the Q6B copy uint8 [..., 288 n] (layout above BYTES_Q6): each 6-bit value
    in a byte of its own, in weight order, then the block's scales and d. The same values (dequantized: d sc
    (q - 32)), 1.37x the bytes; converted `chunk_blocks` blocks at a time (int32 temporaries). signed: the bytes
    hold q - 32 as int8 (the integer-dot kernels' layout, imatvec.Q6I: dequantized d sc byte)."""
    if w.shape[-1] % ROW_BYTES[Q6_K]:
        raise ValueError(f"Q6_K rows must be whole 210-byte blocks, got rows of {w.shape[-1]} bytes")
    blocks = w.reshape(-1, ROW_BYTES[Q6_K])  # [n, 210]
    out = torch.zeros(blocks.shape[0], BYTES_Q6, dtype=torch.uint8, device=w.device)
    for i in range(0, blocks.shape[0], chunk_blocks):
        b = blocks[i:i + chunk_blocks]
        ql = b[:, :128].reshape(-1, 2, 64).to(torch.int32)  # two halves of 128 weights
        qh = b[:, 128:192].reshape(-1, 2, 32).to(torch.int32)
        lo, hi = ql & 15, ql >> 4
        q = torch.stack([lo[..., :32] | (qh & 3) << 4, lo[..., 32:] | (qh >> 2 & 3) << 4,
                         hi[..., :32] | (qh >> 4 & 3) << 4, hi[..., 32:] | (qh >> 6 & 3) << 4], dim=2)  # [n, 2, 4, 32]
        out[i:i + chunk_blocks, :256] = ((q - 32) & 255 if signed else q).reshape(-1, 256).to(torch.uint8)
        out[i:i + chunk_blocks, 256:274] = b[:, 192:210]  # scales, d
    return out.reshape(*w.shape[:-1], -1)


def pad_q6k(w: torch.Tensor) -> torch.Tensor:
    """Q6_K rows uint8 [..., 210 n] -> a copy with 2 zero bytes after each 210-byte block, uint8 [..., 212 n]:
    every block then starts at a word, so the word kernels read each word with one load (the file's odd blocks
    start at odd halfwords: two loads and a funnel shift). The same values, 1% more bytes."""
    if w.shape[-1] % ROW_BYTES[Q6_K]:
        raise ValueError(f"Q6_K rows must be whole 210-byte blocks, got rows of {w.shape[-1]} bytes")
    blocks = w.reshape(*w.shape[:-1], -1, ROW_BYTES[Q6_K])  # [..., n, 210]
    padded = torch.nn.functional.pad(blocks, (0, PADDED_BYTES - ROW_BYTES[Q6_K]))  # [..., n, 212]
    return padded.reshape(*w.shape[:-1], -1).contiguous()


def _qmatvec_x(qtype: int, w: torch.Tensor, xp: torch.Tensor, out: torch.Tensor,
               residual: torch.Tensor | None = None, *, tile: WTile | None = None) -> torch.Tensor:
    m, k = w.shape[0], xp.shape[0]
    views, _, gu, qt = _views(qtype, w, k)
    t = wtile_for("mv", m, k, m, w.device, tile, qt)
    _wmvx_kernel[(triton.cdiv(m, t.rows),)](
        *views, xp, out if residual is None else residual, out, m, QT=qt, GU=gu,
        N_BLOCKS=k // 256, R=t.rows, NB=t.nb, HAS_RES=residual is not None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def _moe_gate_up_x(qtype: int, w_gate: torch.Tensor, w_up: torch.Tensor, xp: torch.Tensor, ids: torch.Tensor,
                   out: torch.Tensor, act: str = "silu", *, perm_out: bool = False,
                   tile: WTile | None = None, route: Route | None = None) -> torch.Tensor:
    f, k, n_sel = w_gate.shape[1], xp.shape[0], ids.shape[0]
    if perm_out and f % 256:
        raise ValueError(f"perm_out needs F % 256 == 0, got F = {f}")
    (g32, g16, g8), sg, gu, qt = _views(qtype, w_gate, k)
    (u32, u16, u8), su, gu_up, _ = _views(qtype, w_up, k)
    if gu != gu_up:
        raise ValueError("gate and up must have the same layout (rows of the same size)")
    t = wtile_for("gate_up", f, k, f * n_sel, w_gate.device, tile, qt)
    rargs, rconst = route_args(route, ids)
    _wgate_upx_kernel[(triton.cdiv(f, t.rows), n_sel)](
        g32, g16, g8, u32, u16, u8, xp, ids, *rargs, out, f, sg, su, out.stride(0), QT=qt, GU=gu,
        N_BLOCKS=k // 256, R=t.rows, NB=t.nb, ACT=ACTIVATIONS[act], PERM_OUT=perm_out, **rconst,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def _moe_down_x(qtype: int, w_down: torch.Tensor, hp: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                residual: torch.Tensor, out: torch.Tensor, *, tile: WTile | None = None) -> torch.Tensor:
    n, f, n_sel = w_down.shape[1], hp.shape[1], hp.shape[0]
    views, se, gu, qt = _views(qtype, w_down, f)
    t = wtile_for("down", n, f, n, w_down.device, tile, qt)
    _wdownx_kernel[(triton.cdiv(n, t.rows),)](
        *views, hp, ids, weights, residual, out, n, se, hp.stride(0), QT=qt, GU=gu,
        N_BLOCKS=f // 256, N_SEL=n_sel, R=t.rows, NB=t.nb, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


# Q6_K / Q8_0 entry points: the Q4_K functions' signatures and contracts (rows of 210 or 272 bytes per 256 weights)
qmatvec_w6 = partial(_qmatvec_x, Q6_K)
moe_gate_up_w6 = partial(_moe_gate_up_x, Q6_K)
moe_down_w6 = partial(_moe_down_x, Q6_K)
qmatvec_w8 = partial(_qmatvec_x, Q8_0)
moe_gate_up_w8 = partial(_moe_gate_up_x, Q8_0)
moe_down_w8 = partial(_moe_down_x, Q8_0)

# product kind -> GGML type -> word kernel (TritonOps dispatches through this table)
KERNELS: dict[str, dict[int, Callable[..., torch.Tensor]]] = {
    "mv": {Q4_K: qmatvec_w, Q6_K: qmatvec_w6, Q8_0: qmatvec_w8},
    "gate_up": {Q4_K: moe_gate_up_w, Q6_K: moe_gate_up_w6, Q8_0: moe_gate_up_w8},
    "down": {Q4_K: moe_down_w, Q8_0: moe_down_w8, Q6_K: moe_down_w6},
}
# (kind, type) -> the load-time copy whose layout its word kernel reads faster than the file's rows: Q6_K one byte
# per value (H200, OLMoE sizes, us, file's rows -> copy: down 17.4 -> 12.7, 2048 x 2048 5.9 -> 4.65, output
# 57.0 -> 41.1; the byte kernel 21.8 / 5.65 / 69.9; NOTES.md 7m). `pad_q6k`'s word-aligned copy (NOTES.md 7g) stays
# readable by every Q6_K word kernel.
PAD: dict[tuple[str, int], Callable[[torch.Tensor], torch.Tensor]] = {
    ("mv", Q6_K): bytes_q6k, ("down", Q6_K): bytes_q6k, ("gate_up", Q6_K): bytes_q6k}
# (kind, type) -> fewest rows for which the word kernel beats qmatvec's byte kernel. None now: on the file's rows
# the Q6_K matvec lost to it below output sizes (7.9 vs 5.7 us at 2048 x 2048, NOTES.md 7b), on `bytes_q6k`'s copy
# it wins there too (4.65 vs 5.65, NOTES.md 7m)
MIN_ROWS: dict[tuple[str, int], int] = {}
WORD_TYPES: frozenset[int] = frozenset(t for table in KERNELS.values() for t in table)  # types read as words

__all__ = ["KERNELS", "PAD", "WORD_TYPES", "Route", "WTile", "WTILES", "bytes_q6k", "moe_down_w", "moe_down_w6",
           "moe_down_w8", "moe_gate_up_w", "moe_gate_up_w6", "moe_gate_up_w8", "pad_q6k", "permute_k4", "qmatvec_w",
           "qmatvec_w6", "qmatvec_w8", "supports", "wtile_for"]
