"""Flash-decoding attention of one query over the KV cache, for batch-1 decode: the KV range cut into splits
(one program per head and split), each split's partial softmax, then their combine, in one launch where counters
are given (the last program of a head to finish combines). Optionally the launch first does QK-norm + RoPE + the KV
store of this step's row (`RopeStore`, decode_ops' arithmetic). The variants of the split loop (`AttnVariant`), one
per phase of the context's length, are chosen by kernels/triton_ops.py.

Every wrapper only launches (outputs and scratch passed in); the KV length is read on the device, so a captured
CUDA graph replays it for every token. Results are bit-identical run to run (the counters only elect which program
combines; the partials are combined in index order). All math is float32; caches may be f32, f16 or bf16.

Plain-torch definition: moerun/kernels/reference.py `attention`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.decode_ops import QK_NORM_KINDS, ROPE_STYLES, _cast, _head_loads, _head_math, _np2
from moerun.kernels.triton.outputs import perm_slot, store_x24, x24_args
from moerun.kernels.triton.pdl import begin, launch_args, trigger, wait

LOG2E = 1.4426950408889634

ATTN_BLOCK_N = 64  # KV positions per loaded tile
# the fewest KV positions a split takes while the live length leaves splits idle: 64 (one tile) against 128, H100
# Q4_K_M tg128 @ d512 +7.3%, F16 +4.2%, other depths within noise (NOTES.md 8t)
ATTN_MIN_SPLIT = 64
NO_WINDOW = 1 << 30
# programs per SM the split policy aims at: the split kernel's 160 registers (sm_90, OLMoE's shape, NOTES.md 7z) leave
# room for 3 programs of 4 warps per SM (4 per SM, two waves at long contexts, measured 5% slower at depth 4096: 8a)
ATTN_PROGRAMS_PER_SM = 3


class AttnVariant(NamedTuple):
    """How the split kernel walks a split, one variant per phase of the context's length (a plain tuple of these
    fields in this order is one too: `TritonOps` and the ops features pass them so)."""

    block_n: int  # KV positions per tile
    warps: int
    programs_per_sm: int  # what the split policy aims at (`attention_splits`)
    early: bool  # the first tile loaded with the RoPE prologue's loads (`_attn_split_kernel` EARLY)
    ahead: bool  # each next tile's loads before the tile before's arithmetic (AHEAD)
    dot: bool  # q.k and p.v on the tensor cores where the caches are f16 (DOT)


ATTN_SHORT = AttnVariant(ATTN_BLOCK_N, 4, ATTN_PROGRAMS_PER_SM, True, False, False)
# the first tile after the RoPE prologue (128 registers at OLMoE's shape, no spills) so 4 programs fit an SM; at
# depth 0 its extra round trip costs 3% (NOTES.md 8n)
ATTN_LONG = AttnVariant(ATTN_BLOCK_N, 4, 4, False, False, False)
# the long phase where the caches are f16 (OLMoE's default): q.k and p.v on the tensor cores, tiles of 32 positions,
# each next tile's loads ahead of the tile before's arithmetic (159 registers: 3 programs per SM). H200 Q4_K_M tg128
# @ d2048 +3.0%, @ d4096 +0.1% against ATTN_LONG (NOTES.md 9i)
ATTN_LONG_F16 = AttnVariant(32, 4, 3, False, True, True)


def attention_long_from(n_ctx: int, n_head: int, sm_count: int, short: AttnVariant, long: AttnVariant,
                        min_split: int = ATTN_MIN_SPLIT) -> int | None:
    """The KV length from which the `long` variant runs instead of `short`: the first at which `short`'s split
    policy has every split live (`_live_splits`); None where it never does (a context `short`'s splits already cut
    into min_split-position pieces) or where `long` is `short`. (`long` may have more splits than `short`, 4
    programs per SM against 3, or as many, walked differently.)"""
    short, long = AttnVariant(*short), AttnVariant(*long)
    s_short = attention_splits(n_ctx, n_head, sm_count, short.block_n, short.programs_per_sm)
    start = max(min_split, short.block_n) * s_short + 1
    return start if long != short and start <= n_ctx else None


def attention_splits(n_ctx: int, n_head: int, sm_count: int, block_n: int = ATTN_BLOCK_N,
                     programs_per_sm: int = ATTN_PROGRAMS_PER_SM) -> int:
    """Split policy: KV splits per head, fixed for a context size (so a captured graph's grid never changes).

    Aim for ~programs_per_sm x sm_count programs in all (H x splits), but never more splits than there are
    block_n-position tiles in the context. How many of them work is decided on the device from the live KV length
    (`_live_splits`: one per ATTN_MIN_SPLIT positions, at most S): a short context leaves the rest idle at once.
    OLMoE on an H200 (H=16, 132 SMs, n_ctx 4096): 25 splits, 400 programs, 192 positions (96 KB of f16 KV) each.
    """
    tiles = max(1, -(-n_ctx // block_n))
    return max(1, min(tiles, -(-programs_per_sm * sm_count // n_head)))


def attention_scratch(n_head: int, head_dim_v: int, n_splits: int,
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate (once, outside the graph) the partials: m [H, S] f32, l [H, S] f32, acc [H, S, Dv] f32."""
    return (torch.empty(n_head, n_splits, device=device, dtype=torch.float32),
            torch.empty(n_head, n_splits, device=device, dtype=torch.float32),
            torch.empty(n_head, n_splits, head_dim_v, device=device, dtype=torch.float32))


@triton.jit
def _live_splits(len_ptr, window, N_SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """-> (kv_len, start, live, n): the attended KV range [start, kv_len) of n positions is cut into
    live = min(N_SPLITS, ceil(n / MIN_SPLIT)) >= 1 splits (`_attn_split_kernel`); the rest idle."""
    kv_len = tl.load(len_ptr).to(tl.int32)
    start = tl.maximum(kv_len - window, 0)
    n = kv_len - start
    live = tl.maximum(tl.minimum(tl.cdiv(n, MIN_SPLIT), N_SPLITS), 1)
    return kv_len, start, live, n


@triton.jit
def _kv_rows(base, n0, hi, sn, d, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache rows n0 .. n0 + BLOCK_N - 1 below hi (zeros past it) of one head at base: [BLOCK_N, BLOCK_D], in the
    cache's dtype."""
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(base + n.to(tl.int64)[:, None] * sn + d[None, :], mask=(n < hi)[:, None] & (d < D)[None, :],
                   other=0.0)


@triton.jit
def _kv_tile(k_base, v_base, n0, hi, k_sn, v_sn, d, dv, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] rows n0 .. n0 + BLOCK_N - 1 below hi (zeros past it), in the
    caches' dtype; V issued with K (the reductions after them synchronise the warps, and no load moves across)."""
    return _kv_rows(k_base, n0, hi, k_sn, d, D, BLOCK_N), _kv_rows(v_base, n0, hi, v_sn, dv, DV, BLOCK_N)


@triton.jit
def _attn_tile(q, k, v, nmask, m_i, l_i, acc):
    """One tile of the online softmax: q [BLOCK_D] f32 (log2-scaled), k [BLOCK_N, BLOCK_D] / v [BLOCK_N, BLOCK_DV] f32,
    nmask [BLOCK_N] the live rows; the running max m_i, sum l_i and acc [BLOCK_DV] -> updated."""
    s = tl.sum(k * q[None, :], 1)  # [BLOCK_N]
    s = tl.where(nmask, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha + tl.sum(p[:, None] * v, 0)
    return m_new, l_i, acc


@triton.jit
def _split16(x):
    """x [N] f32 -> [16, N] f16: row 0 x rounded to f16, row 8 the rest (x - row 0) rounded to f16, other rows 0; the
    two rows hold x to ~22 bits, so a tensor-core product of them, summed over the rows, is ~ x's f32 product."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    r = tl.arange(0, 16)[:, None]
    return tl.where(r == 0, hi[None, :], tl.where(r == 8, lo[None, :], 0.0)).to(tl.float16)


@triton.jit
def _attn_tile_dot(q2, k, v, nmask, m_i, l_i, acc2):
    """`_attn_tile` on the tensor cores: q2 [16, BLOCK_D] f16 (`_split16` of the log2-scaled q), k [BLOCK_N, BLOCK_D]
    / v [BLOCK_N, BLOCK_DV] f16, nmask [BLOCK_N]; acc2 [16, BLOCK_DV] f32 (rows 0 and 8 hold the sum acc, f32
    accumulation) -> (m, l, acc2) updated. No f16 -> f32 conversions of the tile, the reductions over D and over the
    tile's positions inside the mma."""
    s = tl.sum(tl.dot(q2, tl.trans(k)), 0)  # [BLOCK_N] q . k (the two rows' sum)
    s = tl.where(nmask, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    acc2 = tl.dot(_split16(p), v, acc2 * alpha)
    return m_new, l_i, acc2


@triton.jit
def _attn_step(q, k, v, nmask, m_i, l_i, acc, DOT: tl.constexpr):
    """One tile in the caches' dtype: `_attn_tile_dot` (q [16, BLOCK_D], acc [16, BLOCK_DV]) or `_attn_tile` on the
    tile converted to f32 (q [BLOCK_D], acc [BLOCK_DV])."""
    if DOT:
        m_i, l_i, acc = _attn_tile_dot(q, k, v, nmask, m_i, l_i, acc)
    else:
        m_i, l_i, acc = _attn_tile(q, k.to(tl.float32), v.to(tl.float32), nmask, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, window,
                       k_sn, k_sh, v_sn, v_sh,
                       kr_ptr, vr_ptr, qw_ptr, kw_ptr, cs_ptr, eps,
                       out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr, cnt_ptr,
                       G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, N_SPLITS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       ROPE: tl.constexpr, H: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
                       NEOX: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr, BLOCK_FQ: tl.constexpr,
                       BLOCK_FK: tl.constexpr, FUSED: tl.constexpr, BLOCK_S: tl.constexpr, PERM: tl.constexpr,
                       X24: tl.constexpr, MIN_SPLIT: tl.constexpr, EARLY: tl.constexpr = True,
                       AHEAD: tl.constexpr = False, DOT: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (h, s): head h's partial softmax over its chunk of [max(0, len-window), len); programs of the idle
    splits (s >= live, `_live_splits`) return at once.

    q: [H, D] f32; caches [n_ctx, Hkv, D|DV]; len: [1] int. Writes m [H, S] (max of log2-scaled scores),
    l [H, S] (sum of exp2(score - m)), acc [H, S, DV] (sum of exp2(score - m) * v); empty chunk -> (-inf, 0, 0).

    ROPE: q is the raw projection [H*D] and this launch first does `_qk_norm_rope_store_kernel`'s work at
    position len-1 (the same arithmetic): each program norms and rotates its q head and its kv head's raw k
    [Hkv*D] (kr), and the program whose chunk holds len-1 stores that k and the raw v head (vr) [Hkv*DV] in the
    caches there (a GQA group's programs store the same values), and where its loop reads that row back, a CTA
    barrier first.

    FUSED: the last of head h's programs to finish (an acq_rel counter cnt [H] after a CTA barrier; it resets the
    counter) also combines the head's partials (`_attn_combine`, the reduce launch's work and outputs); where the
    head has one live split (a live length up to MIN_SPLIT) that program writes the output at once, no partials.

    The chunk's first K / V tile is loaded with the prologue's loads, one dependent round trip after the length
    instead of three (length; q / k / v and the RoPE row; the stored row read back); with ROPE the row at len-1 in
    that tile is this step's k / v from registers, cast to the cache's dtype (what the store and a load back give),
    so no barrier waits for the store unless a later tile holds the row (NOTES.md 7z, 8a). EARLY False (with ROPE):
    the first tile is loaded after the prologue instead, behind a CTA barrier, so the prologue's registers are free
    first (128 per thread at OLMoE's shape instead of 160: 4 programs per SM; NOTES.md 8j); the same arithmetic.
    AHEAD: the second tile's loads are issued after the prologue, before the first tile's arithmetic, and in the loop
    each next tile's before the current one's (a register double buffer; the same arithmetic; NOTES.md 9c). DOT
    (f16 caches, BLOCK_N / BLOCK_D / BLOCK_DV >= 16): q.k and p.v as tensor-core products (`_attn_tile_dot`: q and p
    split into two f16 rows each, f32 accumulation), the tiles never converted to f32 (NOTES.md 9e). (The first
    tile, or its K rows, before the PDL wait under a 128-register cap lost 2-4% at depth 4096: NOTES.md 9a; every
    tile in one software-pipelined loop, copies straight into shared memory, lost 2-7%: NOTES.md 9i.)

    PDL with ROPE: the length and the idle splits' return come before the PDL wait, and where a head has more than one
    live split the first tile's loads (EARLY) too: only earlier steps write the length and the
    rows before len-1 (the step's first kernel waits for the step before, `_embed_kernel`), and the row len-1 comes from
    registers or after the store. With one live split (a short context) the wait comes before the tile (NOTES.md 8o).
    The next kernel may launch only after the wait (launched at once, its programs took the SMs the q/k/v product's
    later programs still needed: F16 -1.6% at depth 512, NOTES.md 8o). H100: Q4_K_M tg128 +2.8% at depth 512, +4.1% at
    2048 (8o), +1.2% at depth 0, +0.7% at 4096 (8r). Without ROPE q is the kernel before's output: wait first.
    """
    if not ROPE:
        begin(PDL)
    sp = tl.program_id(1)
    kv_len, start, live, n_live = _live_splits(len_ptr, window, N_SPLITS, MIN_SPLIT)
    if sp >= live:
        return
    if ROPE:
        if live == 1:  # a short context: the wait first, the tile's loads with q / k / v's (NOTES.md 8o)
            wait(PDL)
    h = tl.program_id(0)
    kvh = (h // G).to(tl.int64)
    chunk = tl.cdiv(tl.cdiv(n_live, live), BLOCK_N) * BLOCK_N
    lo = start + sp * chunk
    hi = tl.minimum(lo + chunk, kv_len)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k_base = k_ptr + kvh * k_sh
    v_base = v_ptr + kvh * v_sh
    if EARLY or not ROPE:
        kt, vt = _kv_tile(k_base, v_base, lo, hi, k_sn, v_sn, d, dv, D, DV, BLOCK_N)  # the first tile, with q's loads
    if ROPE:
        wait(PDL)  # q, k, v: this step's (a no-op where it came above)
        trigger(PDL)
        pos = kv_len - 1
        pos64 = pos.to(tl.int64)
        cs = cs_ptr + pos64 * R
        wq = qw_ptr
        if QK_NORM == 2:
            wq = qw_ptr + h * D
        # k and v of this step in every program (L2 reads, their loads issued with q's), stored by the writer
        HKV: tl.constexpr = H // G
        wk = kw_ptr
        if QK_NORM == 2:
            wk = kw_ptr + kvh * D
        vn = tl.load(vr_ptr + kvh * DV + dv, mask=dv < DV, other=0.0)
        lq = _head_loads(q_ptr + h * D, q_ptr, wq, cs, H * D, D, R, QK_NORM, NEOX, BLOCK_D, BLOCK_FQ)
        lk = _head_loads(kr_ptr + kvh * D, kr_ptr, wk, cs, HKV * D, D, R, QK_NORM, NEOX, BLOCK_D, BLOCK_FK)
        q = _head_math(lq, eps, H * D, D, R, QK_NORM, NEOX, BLOCK_D)
        kn = _head_math(lk, eps, HKV * D, D, R, QK_NORM, NEOX, BLOCK_D)
        kc = _cast(k_ptr, kn, K_BF16)  # this step's cache rows (also the first tile's row len-1 where it holds it)
        vc = _cast(v_ptr, vn, V_BF16)
        if (lo <= pos) & (pos < hi):
            tl.store(k_ptr + pos64 * k_sn + kvh * k_sh + d, kc, mask=d < D)
            tl.store(v_ptr + pos64 * v_sn + kvh * v_sh + dv, vc, mask=dv < DV)
            if pos >= lo + BLOCK_N:  # the loop below reads the row back (the first tile takes it from registers)
                tl.debug_barrier()
        q = q * qk_scale
        if not EARLY:
            tl.debug_barrier()  # the prologue's values dead (and the row stored) before the tile's loads are issued
            kt, vt = _kv_tile(k_base, v_base, lo, hi, k_sn, v_sn, d, dv, D, DV, BLOCK_N)
    else:
        q = tl.load(q_ptr + h * D + d, mask=d < D, other=0.0) * qk_scale  # [BLOCK_D], log2 domain
    m_i = tl.full([], -float("inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    if DOT:
        acc = tl.zeros([16, BLOCK_DV], dtype=tl.float32)  # rows 0 and 8 (`_attn_tile_dot`)
        q = _split16(q)  # [16, BLOCK_D] f16
    else:
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    n0 = lo + BLOCK_N
    if AHEAD:  # the second tile's loads before the first tile's arithmetic (after the prologue's store)
        kn, vn = _kv_tile(k_base, v_base, n0, hi, k_sn, v_sn, d, dv, D, DV, BLOCK_N)
    # the first tile, loaded above (an empty chunk: what the loop would leave, m -inf, l 0, acc 0)
    n = lo + tl.arange(0, BLOCK_N)
    if not DOT:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    if ROPE:  # the row len-1 (stale in memory until this launch stores it) from registers
        at = n == pos
        kt = tl.where(at[:, None], kc.to(kt.dtype)[None, :], kt)
        vt = tl.where(at[:, None], vc.to(vt.dtype)[None, :], vt)
    if DOT:
        m1, l1, a1 = _attn_tile_dot(q, kt, vt, n < hi, m_i, l_i, acc)
    else:
        m1, l1, a1 = _attn_tile(q, kt, vt, n < hi, m_i, l_i, acc)
    some = lo < hi
    m_i = tl.where(some, m1, m_i)
    l_i = tl.where(some, l1, l_i)
    acc = tl.where(some, a1, acc)
    while n0 < hi:  # (a while loop: the interpreter cannot range() over a loaded bound)
        if AHEAD:  # this tile's arithmetic with the next tile's loads in flight (a register double buffer)
            k, v = kn, vn
            kn, vn = _kv_tile(k_base, v_base, n0 + BLOCK_N, hi, k_sn, v_sn, d, dv, D, DV, BLOCK_N)
        else:
            k, v = _kv_tile(k_base, v_base, n0, hi, k_sn, v_sn, d, dv, D, DV, BLOCK_N)
        m_i, l_i, acc = _attn_step(q, k, v, n0 + tl.arange(0, BLOCK_N) < hi, m_i, l_i, acc, DOT)
        n0 += BLOCK_N
    if DOT:
        acc = tl.sum(acc, 0)  # [BLOCK_DV]: rows 0 + 8
    if FUSED and live == 1:  # the head's only split: its output directly (what the combine of one split gives)
        _attn_out(h, acc / l_i, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr, DV, BLOCK_DV, PERM, X24)
    else:
        slot = h * N_SPLITS + sp
        tl.store(m_ptr + slot, m_i)
        tl.store(l_ptr + slot, l_i)
        tl.store(acc_ptr + slot.to(tl.int64) * DV + dv, acc, mask=dv < DV)
        if FUSED:
            tl.debug_barrier()  # every thread's stores before the release below
            if tl.atomic_add(cnt_ptr + h, 1, sem="acq_rel", scope="gpu") == live - 1:
                _attn_combine(h, live, m_ptr, l_ptr, acc_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr,
                              DV, N_SPLITS, BLOCK_S, BLOCK_DV, PERM, X24, True)
                tl.atomic_xchg(cnt_ptr + h, 0, sem="relaxed", scope="gpu")


@triton.jit
def _attn_combine(h, live, m_ptr, l_ptr, acc_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr,
                  DV: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                  PERM: tl.constexpr, X24: tl.constexpr, VOLATILE: tl.constexpr):
    """Head h: out[h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the live splits s < live (the
    others wrote nothing), combined in index order.

    m, l: [H, S] f32, acc: [H, S, DV] f32 -> out: [H, DV] f32 (with PERM also perm: out flattened, in the
    word kernels' order `perm_slot`; with X24 out flattened and quantized for the integer-dot kernels, DV % 32 == 0).
    VOLATILE: the partials were written by other programs of this launch (loads past L1).
    """
    base = h * N_SPLITS
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    mx = tl.full([BLOCK_S], -float("inf"), tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        mx = tl.maximum(mx, tl.load(m_ptr + base + s0 + s, mask=s0 + s < live, other=-float("inf"),
                                    volatile=VOLATILE))
    big_m = tl.max(mx, 0)
    l_tot = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, N_SPLITS, BLOCK_S):
        smask = s0 + s < live
        m = tl.load(m_ptr + base + s0 + s, mask=smask, other=-float("inf"), volatile=VOLATILE)
        w = tl.where(smask, tl.exp2(m - big_m), 0.0)
        l_tot += w * tl.load(l_ptr + base + s0 + s, mask=smask, other=0.0, volatile=VOLATILE)
        a = tl.load(acc_ptr + (base + s0 + s)[:, None] * DV + dv[None, :],
                    mask=smask[:, None] & (dv < DV)[None, :], other=0.0, volatile=VOLATILE)
        acc += w[:, None] * a
    _attn_out(h, tl.sum(acc, 0) / tl.sum(l_tot, 0), out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr, DV,
              BLOCK_DV, PERM, X24)


@triton.jit
def _attn_out(h, out, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
              PERM: tl.constexpr, X24: tl.constexpr):
    """Head h's output out [BLOCK_DV] f32 into out [H, DV] (with PERM also perm in `perm_slot` order, with X24
    quantized for the integer-dot kernels)."""
    dv = tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + h * DV + dv, out, mask=dv < DV)
    if PERM:
        tl.store(perm_ptr + perm_slot(h * DV + dv), out, mask=dv < DV)
    if X24:
        g = tl.arange(0, BLOCK_DV // 32)
        store_x24(tl.reshape(out, [BLOCK_DV // 32, 32]), h * (DV // 32) + g, g * 32 < DV, hi_ptr, lo_ptr, xs_ptr,
                  xsum_ptr, 32)


@triton.jit
def _attn_reduce_kernel(len_ptr, window, m_ptr, l_ptr, acc_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr,
                        DV: tl.constexpr, N_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                        PERM: tl.constexpr, X24: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Program h: `_attn_combine` of head h's live splits."""
    live = _live_splits(len_ptr, window, N_SPLITS, MIN_SPLIT)[2]
    _attn_combine(tl.program_id(0), live, m_ptr, l_ptr, acc_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, xs_ptr, xsum_ptr,
                  DV, N_SPLITS, BLOCK_S, BLOCK_DV, PERM, X24, False)


class RopeStore(NamedTuple):
    """What `qk_norm_rope_store` takes besides q, for `attention_decode(rope=...)` to do its work in the same
    launch: the raw k [Hkv*D] and v [Hkv*Dv] f32, the norm weights (or None), the RoPE table (`rope_table`),
    eps, qk_norm ("none" | "head" | "full") and rope_style ("norm" | "neox")."""

    k: torch.Tensor
    v: torch.Tensor
    q_norm_w: torch.Tensor | None
    k_norm_w: torch.Tensor | None
    rope_cs: torch.Tensor
    eps: float
    qk_norm: str
    rope_style: str


def dot_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether `_attn_split_kernel` DOT can run on these caches: f16, and tiles of at least 16 (a tensor-core
    product's smallest side) along positions, D and Dv."""
    return (k_cache.dtype == v_cache.dtype == torch.float16
            and min(block_n, _np2(k_cache.shape[2]), _np2(v_cache.shape[2])) >= 16)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len_t: torch.Tensor,
                     scale: float, window: int, out: torch.Tensor,
                     scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     block_n: int = ATTN_BLOCK_N, num_warps: int = 4,
                     split: bool = True, reduce: bool = True, out_perm: torch.Tensor | None = None,
                     rope: RopeStore | None = None, out_x24: Any = None,
                     counters: torch.Tensor | None = None, min_split: int = ATTN_MIN_SPLIT,
                     early: bool = True, ahead: bool = False, dot: bool = False) -> torch.Tensor:
    """Flash-decoding attention of one query over cache positions max(0, L-window)..L-1 (window 0: 0..L-1).

    q: [H, D] f32; k_cache: [n_ctx, Hkv, D], v_cache: [n_ctx, Hkv, Dv] (f32/f16/bf16, rows contiguous; head h
    reads kv head h // (H/Hkv)); kv_len_t: [1] int device tensor L (= pos + 1, 1 <= L <= n_ctx);
    scratch: attention_scratch(H, Dv, S) with S from attention_splits; out: [H, Dv] f32. Two launches:
    H x S split programs, then H reduce programs (split / reduce=False skip one: a benchmark hook). out_perm
    ([H * Dv], H * Dv % 256 == 0): also receives out flattened in wmatvec.permute_k4 order; out_x24 (imatvec.X24
    of [H * Dv], Dv % 32 == 0) out flattened and quantized for the integer-dot kernels. Returns out.
    With GQA the G query heads of a kv head are adjacent programs reading the same K/V tiles (mostly L2 hits).
    rope: q is the raw projection (q.view(H, D)) and the launch first does `qk_norm_rope_store`'s work at position
    L-1 (the cache row this step writes), with the same arithmetic: one launch less per layer.
    counters: int32 zeros [>= H] (left zero): the split launch also does the reduce (the last program of each head
    combines its partials, `_attn_combine`; the same arithmetic), one launch less again.
    min_split: the live splits are min(S, ceil(live length / min_split)) (rounded up to block_n), the rest idle.
    early (with rope): the first K / V tile loaded with the prologue's loads (the default) or after it
    (`_attn_split_kernel` EARLY); ahead: each next tile's loads issued before the tile before's arithmetic (AHEAD);
    dot: q.k and p.v on the tensor cores (DOT) where both caches are f16 and block_n, D, Dv >= 16 (else ignored);
    with rope and PDL the length and, with several live splits, the first tile (early) come before the PDL wait, its
    trigger after it.
    """
    h, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    m_s, l_s, acc_s = scratch
    n_splits = m_s.shape[1]
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and h % hkv == 0
    if out_perm is not None and (h * dv) % 256:
        raise ValueError(f"out_perm needs H * Dv % 256 == 0, got {h} x {dv}")
    xa = x24_args(out_x24, dv, "out_x24", out)
    outs = (out, out if out_perm is None else out_perm, *xa)
    oconst = dict(BLOCK_S=min(_np2(n_splits), 32), PERM=out_perm is not None, X24=out_x24 is not None,
                  MIN_SPLIT=max(min_split, block_n))
    win = int(window) if window > 0 else NO_WINDOW
    fused = counters is not None and split and reduce
    if fused and (counters.numel() < h or counters.dtype != torch.int32):
        raise ValueError(f"counters must be int32 zeros [>= {h}], got {counters.dtype} [{counters.numel()}]")
    if split:
        if rope is None:
            rargs, rconst = (q, q, q, q, q, 0.0), dict(ROPE=False, H=h, R=2, QK_NORM=0, NEOX=0, K_BF16=False,
                                                       V_BF16=False, BLOCK_FQ=1, BLOCK_FK=1)
        else:
            norm = QK_NORM_KINDS[rope.qk_norm]
            r = 2 * rope.rope_cs.shape[-1]
            assert r <= d and r % 2 == 0
            rargs = (rope.k, rope.v, rope.q_norm_w if norm else q, rope.k_norm_w if norm else q, rope.rope_cs,
                     float(rope.eps))
            rconst = dict(ROPE=True, H=h, R=r, QK_NORM=norm, NEOX=ROPE_STYLES[rope.rope_style],
                          K_BF16=k_cache.dtype == torch.bfloat16, V_BF16=v_cache.dtype == torch.bfloat16,
                          BLOCK_FQ=_np2(h * d) if norm == 2 else 1, BLOCK_FK=_np2(hkv * d) if norm == 2 else 1)
        _attn_split_kernel[(h, n_splits)](
            q, k_cache, v_cache, kv_len_t, m_s, l_s, acc_s, float(scale) * LOG2E,
            win, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), *rargs,
            *outs, counters if fused else m_s,
            G=h // hkv, D=d, DV=dv, N_SPLITS=n_splits, BLOCK_N=block_n, BLOCK_D=_np2(d), BLOCK_DV=_np2(dv),
            **rconst, FUSED=fused, **oconst, EARLY=bool(early), AHEAD=bool(ahead),
            DOT=bool(dot) and dot_ok(k_cache, v_cache, block_n),
            num_warps=num_warps, **launch_args(q.device))
    if reduce and not fused:
        _attn_reduce_kernel[(h,)](kv_len_t, win, m_s, l_s, acc_s, *outs, DV=dv, N_SPLITS=n_splits,
                                  BLOCK_DV=_np2(dv), **oconst, num_warps=4)
    return out
