"""Triton kernels for the non-matmul parts of batch-1 decode: RMSNorm, QK-norm + RoPE + KV store, router
softmax/top-k (with an optional F32 router matvec) and argmax; the attention is in attention.py (it takes its
QK-norm + RoPE prologue from here).

Every wrapper only launches: outputs and scratch are passed in, nothing is allocated or synced, and
every per-token scalar (position, KV length) is read by the kernel from a 1-element device tensor, so
the launches can be captured once in a CUDA graph and replayed for every token. Results are bit-identical run to
run (the one-launch argmax's atomic counter only elects which program reduces; the reduction order is fixed). All
math is float32; caches may be f32, f16 or bf16.

Plain-torch definitions: moerun/kernels/reference.py (rms_norm, rope_angles/apply_rope, route).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moerun.kernels import reference as ref
from moerun.kernels.torch_ops import Route
from moerun.kernels.triton.outputs import perm_slot, store_x24, x24_args
from moerun.kernels.triton.pdl import begin, launch_args, trigger, wait

QK_NORM_KINDS = {"none": 0, "head": 1, "full": 2}
ROPE_STYLES = {"norm": 0, "neox": 1}


def _np2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


# ----------------------------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, s_ptr, sum_ptr, eps, N, BLOCK: tl.constexpr,
                     PERM: tl.constexpr, X24: tl.constexpr, PDL: tl.constexpr = False):
    """One row per program. x: [rows, N] f32, w: [N] f32 -> out: [rows, N] f32 (and with PERM the same row
    in the word kernels' order, wmatvec.permute_k4: element 256 b + 4 a + k at slot 256 b + 64 k + a; with X24
    quantized for the integer-dot kernels, imatvec.X24, N % 32 == 0). w is loaded before the PDL wait (nothing in
    a step writes weights: its round trip overlaps the kernel before; NOTES.md 8g), x after it."""
    trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    wait(PDL)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / N + eps)
    y = x * r * w
    tl.store(out_ptr + row * N + offs, y, mask=mask)
    if PERM:
        tl.store(perm_ptr + row * N + perm_slot(offs), y, mask=mask)
    if X24:
        g = tl.arange(0, BLOCK // 32)
        store_x24(tl.reshape(y, [BLOCK // 32, 32]), row * (N // 32) + g, g * 32 < N, hi_ptr, lo_ptr, s_ptr, sum_ptr,
                  32)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
             out_perm: torch.Tensor | None = None, out_x24: Any = None) -> torch.Tensor:
    """out = x * rsqrt(mean(x^2) + eps) * w. x: [N] or [rows, N] f32 contiguous, w: [N] f32, out like x (N <= 16384).

    out_perm (like out, N % 256 == 0): also receives the result in wmatvec.permute_k4 order; out_x24 (an
    imatvec.X24 like out, N % 32 == 0): the result quantized for the integer-dot kernels."""
    n = x.shape[-1]
    rows = x.numel() // n
    block = _np2(n)
    if out_perm is not None and n % 256:
        raise ValueError(f"out_perm needs N % 256 == 0, got N = {n}")
    xa = x24_args(out_x24, n, "out_x24", out)
    _rms_norm_kernel[(rows,)](x, w, out, out if out_perm is None else out_perm, *xa, float(eps), n,
                              BLOCK=block, PERM=out_perm is not None, X24=out_x24 is not None,
                              num_warps=8 if block >= 4096 else 4, **launch_args(x.device))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# QK-norm + RoPE + KV store
# ----------------------------------------------------------------------------------------------------------------------


def rope_table(n_ctx: int, rope_dim: int, base: float, scale: float = 1.0,
               freq_factors: torch.Tensor | None = None, device: torch.device | str | None = None) -> torch.Tensor:
    """Precomputed RoPE table for positions 0..n_ctx-1: [n_ctx, 2, rope_dim/2] f32 (cos, sin).

    Built once at load time with reference.rope_angles, so the kernel's angles equal the reference's bit for bit.
    """
    pos = torch.arange(n_ctx, device=device)
    ff = None if freq_factors is None else freq_factors.to(device)
    cos, sin = ref.rope_angles(pos, rope_dim, base, scale, ff)  # each [n_ctx, R/2]
    return torch.stack([cos, sin], dim=1).contiguous()


@triton.jit
def rope_pairs(d, R: tl.constexpr, NEOX: tl.constexpr):
    """RoPE pairing of head dims d [BLOCK_D]: (rotated mask d < R, each dim's partner, its frequency index,
    the sign of the partner's sine term). NEOX pairs d with d +- R/2, the GPT-J style pairs 2i with 2i+1;
    partner and index are 0 outside the rotated dims."""
    HALF: tl.constexpr = R // 2
    rot = d < R
    if NEOX:
        lo = d < HALF
        partner = tl.where(lo, d + HALF, d - HALF)
        fi = tl.where(lo, d, d - HALF)
        sign = tl.where(lo, -1.0, 1.0)
    else:
        partner = d ^ 1
        fi = d // 2
        sign = tl.where((d % 2) == 0, -1.0, 1.0)
    return rot, tl.where(rot, partner, 0), tl.where(rot, fi, 0), sign


@triton.jit
def _head_loads(x_ptr, full_ptr, w_ptr, cs_ptr, WIDTH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                QK_NORM: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FULL: tl.constexpr):
    """Everything `_norm_rope_head` reads, as one tuple for `_head_math`: issue several heads' loads before any of
    their math (a reduction synchronises the warps, and no load moves across that barrier)."""
    HALF: tl.constexpr = R // 2
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    rot, partner, fi, sign = rope_pairs(d, R, NEOX)
    x = tl.load(x_ptr + d, mask=dmask, other=0.0)
    xp = tl.load(x_ptr + partner, mask=rot, other=0.0)
    c = tl.load(cs_ptr + fi, mask=rot, other=1.0)
    s = tl.load(cs_ptr + HALF + fi, mask=rot, other=0.0)
    w = 1.0
    wp = 1.0
    xf = 0.0
    if QK_NORM != 0:
        w = tl.load(w_ptr + d, mask=dmask, other=0.0)
        wp = tl.load(w_ptr + partner, mask=rot, other=0.0)
    if QK_NORM == 2:
        f = tl.arange(0, BLOCK_FULL)
        xf = tl.load(full_ptr + f, mask=f < WIDTH, other=0.0)
    return x, xp, c, s, w, wp, xf


@triton.jit
def _head_math(loads, eps, WIDTH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
               NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    x, xp, c, s, w, wp, xf = loads
    rot, partner, fi, sign = rope_pairs(tl.arange(0, BLOCK_D), R, NEOX)
    if QK_NORM == 1:
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
        x = x * r * w
        xp = xp * r * wp
    elif QK_NORM == 2:
        r = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / WIDTH + eps)
        x = x * r * w
        xp = xp * r * wp
    return tl.where(rot, x * c + sign * (xp * s), x)


@triton.jit
def _norm_rope_head(x_ptr, full_ptr, w_ptr, cs_ptr, eps,
                    WIDTH: tl.constexpr, D: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr,
                    NEOX: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_FULL: tl.constexpr):
    """One head [D] at x_ptr, optionally RMS-normed (per head, or over the WIDTH floats at full_ptr; w_ptr already
    points at this head's D weights), then RoPE'd on its first R dims with cos at cs_ptr[0:R/2], sin at cs_ptr[R/2:R].
    Returns [BLOCK_D] f32 (lanes >= D are garbage-free zeros)."""
    loads = _head_loads(x_ptr, full_ptr, w_ptr, cs_ptr, WIDTH, D, R, QK_NORM, NEOX, BLOCK_D, BLOCK_FULL)
    return _head_math(loads, eps, WIDTH, D, R, QK_NORM, NEOX, BLOCK_D)


@triton.jit
def _cast(ptr, y, BF16: tl.constexpr):
    """f32 y in the dtype ptr points at (what a store there and a load back give); bf16 rounds to nearest even by
    integer ops (bit-identical on the GPU and in Triton's interpreter, whose own f32 -> bf16 cast truncates)."""
    if BF16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(ptr.dtype.element_ty)


@triton.jit
def _cast_store(ptr, y, mask, BF16: tl.constexpr):
    """Store f32 y at ptr in the pointer's dtype (`_cast`)."""
    tl.store(ptr, _cast(ptr, y, BF16), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, kc_ptr, vc_ptr, qo_ptr, eps,
                               kc_sn, kc_sh, vc_sn, vc_sh,
                               H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                               R: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr,
                               K_BF16: tl.constexpr, V_BF16: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_DV: tl.constexpr, BLOCK_FQ: tl.constexpr, BLOCK_FK: tl.constexpr):
    """Programs 0..H-1: q head -> q_out [H, D] f32. Programs H..H+HKV-1: k head -> k_cache[pos], v head -> v_cache[pos].

    q: [H*D], k: [HKV*D], v: [HKV*DV] f32; cs: [n_ctx, 2, R/2] f32; pos: [1] int; caches [n_ctx, HKV, D|DV].
    """
    pid = tl.program_id(0)
    pos = tl.load(pos_ptr).to(tl.int64)
    cs = cs_ptr + pos * R
    d = tl.arange(0, BLOCK_D)
    if pid < H:
        wq = qw_ptr
        if QK_NORM == 2:
            wq = qw_ptr + pid * D
        y = _norm_rope_head(q_ptr + pid * D, q_ptr, wq, cs, eps, H * D, D, R, QK_NORM, NEOX, BLOCK_D, BLOCK_FQ)
        tl.store(qo_ptr + pid * D + d, y, mask=d < D)
    else:
        j = pid - H
        wk = kw_ptr
        if QK_NORM == 2:
            wk = kw_ptr + j * D
        y = _norm_rope_head(k_ptr + j * D, k_ptr, wk, cs, eps, HKV * D, D, R, QK_NORM, NEOX, BLOCK_D, BLOCK_FK)
        kdst = kc_ptr + pos * kc_sn + j * kc_sh
        _cast_store(kdst + d, y, d < D, K_BF16)
        dv = tl.arange(0, BLOCK_DV)
        v = tl.load(v_ptr + j * DV + dv, mask=dv < DV, other=0.0)
        vdst = vc_ptr + pos * vc_sn + j * vc_sh
        _cast_store(vdst + dv, v, dv < DV, V_BF16)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                       rope_cs: torch.Tensor, pos_t: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor,
                       eps: float, qk_norm: str = "none", rope_style: str = "neox") -> torch.Tensor:
    """QK-norm ("none" | "head" | "full") + RoPE of q and k at position pos_t[0]; stores k, v in the caches there.

    q: [H*D] f32, k: [Hkv*D] f32, v: [Hkv*Dv] f32 (raw projections of one token);
    q_norm_w / k_norm_w: [D] ("head") or [H*D] / [Hkv*D] ("full") f32, unused for "none";
    rope_cs: [n_ctx, 2, R/2] f32 from rope_table (R = rope_dim <= D, rotating the first R dims);
    pos_t: [1] int32/int64 device tensor; k_cache: [n_ctx, Hkv, D], v_cache: [n_ctx, Hkv, Dv] (f32/f16/bf16,
    rows contiguous); q_out: [H, D] f32. One launch of H + Hkv programs. Returns q_out.
    """
    h, d = q_out.shape
    n_ctx, hkv, dk = k_cache.shape
    dv = v_cache.shape[2]
    r = 2 * rope_cs.shape[-1]
    assert dk == d and r <= d and r % 2 == 0 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    norm = QK_NORM_KINDS[qk_norm]
    qw = q_norm_w if norm else q
    kw = k_norm_w if norm else k
    _qk_norm_rope_store_kernel[(h + hkv,)](
        q, k, v, qw, kw, rope_cs, pos_t, k_cache, v_cache, q_out, float(eps),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=h, HKV=hkv, D=d, DV=dv, R=r, QK_NORM=norm, NEOX=ROPE_STYLES[rope_style],
        K_BF16=k_cache.dtype == torch.bfloat16, V_BF16=v_cache.dtype == torch.bfloat16,
        BLOCK_D=_np2(d), BLOCK_DV=_np2(dv),
        BLOCK_FQ=_np2(h * d) if norm == 2 else 1, BLOCK_FK=_np2(hkv * d) if norm == 2 else 1,
        num_warps=4)
    return q_out


# ----------------------------------------------------------------------------------------------------------------------
# Router: softmax + top-k (+ optional F32 router matvec)
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def softmax_topk(logits, e, emask, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Device helper (inline it into a consumer kernel): logits [BLOCK_E] f32 (lanes e, valid where emask) ->
    (weights [BLOCK_K] f32, ids [BLOCK_K] int32), softmax over all experts then the K largest probabilities in
    descending order, ties to the lower index; lanes >= K hold (0, 0). RENORM divides by the K weights' sum."""
    x = tl.where(emask, logits, -float("inf"))
    ex = tl.where(emask, tl.exp(x - tl.max(x, 0)), 0.0)
    p = ex / tl.sum(ex, 0)
    p_sel = tl.where(emask, p, -1.0)
    kk = tl.arange(0, BLOCK_K)
    wv = tl.zeros([BLOCK_K], dtype=tl.float32)
    iv = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p_sel, 0)
        idx = tl.min(tl.where(p_sel == best, e, BLOCK_E), 0)
        wv = tl.where(kk == j, best, wv)
        iv = tl.where(kk == j, idx, iv)
        p_sel = tl.where(e == idx, -2.0, p_sel)
    if RENORM:
        wv = wv / tl.sum(wv, 0)
    return wv, iv


ROUTE_MAX_E = 256  # most experts `topk_logits` ranks inside a gate/up launch


@triton.jit
def topk_logits(logits_ptr, E, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, CG: tl.constexpr = False):
    """Device helper: the BLOCK_K largest of the logits [E] f32 at logits_ptr, descending, ties to the lower index
    -> (ids [BLOCK_K] int32, their logits [BLOCK_K] f32, all the logits x [BLOCK_E] f32, -inf on lanes >= E).

    Softmax keeps the order, so the first K are `softmax_topk`'s choice. One bitonic `tl.topk` over int64 keys:
    the logit's bits made order-preserving as a signed int (high word) over BLOCK_E - 1 - e (low word, the tie
    rule). Two logits that differ but round to the same probability keep their logit order here (softmax_topk:
    the lower index first; their weights are equal either way). CG: the logits loaded past L1 (`.cg`)."""
    e = tl.arange(0, BLOCK_E)
    if CG:
        x = tl.load(logits_ptr + e, mask=e < E, other=-float("inf"), cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + e, mask=e < E, other=-float("inf"))
    x = x + 0.0  # -0.0 -> +0.0: equal keys for equal values
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # negative floats reversed: signed int order = float order
    top = tl.topk((o.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64), BLOCK_K)  # [BLOCK_K] descending
    ids = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    ot = (top >> 32).to(tl.int32)
    xt = tl.where(ot < 0, ot ^ 0x7FFFFFFF, ot).to(tl.float32, bitcast=True)
    return ids, xt, x


@triton.jit
def store_topk(ids, xt, x, E, w_out_ptr, id_out_ptr, K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Device helper: from `topk_logits`' (ids, xt, x), store the K best softmax weights [K] f32 (softmax over all
    E, descending; renormalised to sum 1 with RENORM) and their ids [K] int32."""
    emask = tl.arange(0, BLOCK_E) < E
    mx = tl.max(x, 0)
    s = tl.sum(tl.where(emask, tl.exp(x - mx), 0.0), 0)
    kk = tl.arange(0, BLOCK_K)
    wv = tl.where(kk < K, tl.exp(xt - mx) / s, 0.0)
    if RENORM:
        wv = wv / tl.sum(wv, 0)
    tl.store(w_out_ptr + kk, wv, mask=kk < K)
    tl.store(id_out_ptr + kk, ids, mask=kk < K)


@triton.jit
def expert_id(ids_ptr, route_ptr, wts_ptr, E, ROUTE: tl.constexpr, N_SEL: tl.constexpr, RENORM: tl.constexpr,
              BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The expert of this gate/up program's selection slot (program_id(1)), int64: ids[slot]; or with ROUTE
    the slot-th best expert of the router logits [E] at route_ptr (top-k of the softmax, `topk_logits`), and then
    program (0, 0) also stores the N_SEL chosen ids and weights into ids / wts for the down product."""
    sel = tl.program_id(1)
    if ROUTE:
        ids, xt, x = topk_logits(route_ptr, E, BLOCK_E, BLOCK_K)
        if (sel == 0) & (tl.program_id(0) == 0):
            store_topk(ids, xt, x, E, wts_ptr, ids_ptr, N_SEL, RENORM, BLOCK_E, BLOCK_K)
        eid = tl.sum(tl.where(tl.arange(0, BLOCK_K) == sel, ids, 0), 0)
    else:
        eid = tl.load(ids_ptr + sel)
    return eid.to(tl.int64)


def route_args(route: Route | None, ids: torch.Tensor) -> tuple[tuple, dict]:
    """The routing arguments of the gate/up kernels: (route_ptr, wts_ptr, E) and their constexprs."""
    if route is None:
        return (ids, ids, 1), dict(ROUTE=False, N_SEL=ids.shape[0], RENORM=False, BLOCK_E=1, BLOCK_K=1)
    e = route.logits.shape[-1]
    if e > ROUTE_MAX_E:
        raise ValueError(f"gate/up routes at most {ROUTE_MAX_E} experts itself, got {e}: route_topk first")
    return ((route.logits, route.weights_out, e),
            dict(ROUTE=True, N_SEL=ids.shape[0], RENORM=bool(route.renormalise), BLOCK_E=_np2(e),
                 BLOCK_K=_np2(ids.shape[0])))


@triton.jit
def ranked_experts(route_ptr, E, N_SEL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The N_SEL best experts of the router's logits [E] (`topk_logits`, as the gate/up launch chose them), int64,
    one tuple; the logits read from L2 (`.cg`: written by the kernel two before a routed down)."""
    ids, _, _ = topk_logits(route_ptr, E, BLOCK_E, BLOCK_K, True)
    kk = tl.arange(0, BLOCK_K)
    eids = ()
    for i in tl.static_range(N_SEL):
        eids = eids + (tl.sum(tl.where(kk == i, ids, 0), 0).to(tl.int64),)
    return eids


def down_route_args(route: Route | None, ids: torch.Tensor, eu: int, kernel: str) -> tuple[tuple, dict]:
    """The routing arguments (route_ptr, E) and constexprs of a down launch that ranks the experts itself from
    route.logits (`ranked_experts`); (ids, 1) and none without a route. Raises ValueError where it cannot: one expert
    at a time (eu 1) or more than ROUTE_MAX_E experts."""
    if route is None:
        return (ids, 1), {}
    e = route.logits.shape[-1]
    if eu == 1 or e > ROUTE_MAX_E:
        raise ValueError(f"{kernel} ranks experts itself only with experts_ahead > 1 (here {eu}) and at most "
                         f"{ROUTE_MAX_E} experts (here {e})")
    return (route.logits, e), dict(ROUTE=True, BLOCK_E=_np2(e), BLOCK_K=_np2(ids.shape[0]))


@triton.jit
def _route_topk_kernel(logits_ptr, w_out_ptr, id_out_ptr, E, K: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program. logits: [E] f32 -> weights_out [K] f32, ids_out [K] int32."""
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    x = tl.load(logits_ptr + e, mask=emask, other=-float("inf"))
    wv, iv = softmax_topk(x, e, emask, K, RENORM, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    tl.store(w_out_ptr + kk, wv, mask=kk < K)
    tl.store(id_out_ptr + kk, iv, mask=kk < K)


def route_topk(logits: torch.Tensor, k: int, renormalise: bool, weights_out: torch.Tensor,
               ids_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all E experts, top-k (descending, ties to the lower index), optional renormalisation.

    logits: [E] f32 (E <= 1024) -> weights_out [k] f32, ids_out [k] int32. One program.
    """
    e = logits.shape[-1]
    _route_topk_kernel[(1,)](logits, weights_out, ids_out, e, K=k, RENORM=bool(renormalise),
                             BLOCK_E=_np2(e), BLOCK_K=_np2(k), num_warps=4)
    return weights_out, ids_out


@triton.jit
def _matvec_f32_kernel(x_ptr, w_ptr, out_ptr, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: out[p*BLOCK_R : (p+1)*BLOCK_R] = W[rows] @ x. x: [N] f32, W: [M, N] f32 (M % BLOCK_R == 0)."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        km = k0 + kk < N
        x = tl.load(x_ptr + k0 + kk, mask=km, other=0.0)
        w = tl.load(w_ptr + rows[:, None] * N + (k0 + kk)[None, :], mask=km[None, :], other=0.0)
        acc += w * x[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, 1))


def router_logits(x: torch.Tensor, w_router: torch.Tensor, logits_out: torch.Tensor) -> torch.Tensor:
    """logits_out = W x. x: [N] f32, w_router: [E, N] f32 contiguous -> logits_out [E] f32. One program per expert
    row (a full row per program: no split-K, so no atomics and a fixed summation order)."""
    e, n = w_router.shape
    _matvec_f32_kernel[(e,)](x, w_router, logits_out, N=n, BLOCK_R=1, BLOCK_K=min(_np2(n), 1024), num_warps=4)
    return logits_out


@triton.jit
def _norm_router_kernel(x_ptr, nw_ptr, w_ptr, out_ptr, xn_ptr, xp_ptr, hi_ptr, lo_ptr, s_ptr, sum_ptr, eps, N, E,
                        BLOCK: tl.constexpr, PERM: tl.constexpr, X24: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program e (of E): y = x * rsqrt(mean(x^2) + eps) * nw (`_rms_norm_kernel`'s arithmetic, so the same bits
    at the same BLOCK and warps), out[e] = W[e] . y; lanes i with i % E == e store y into xn (and into xp at
    `perm_slot(i)` with PERM), so the E programs write y once between them. x, nw: [N] f32, W: [E, N] f32.
    nw and the router row are loaded before the PDL wait (weights), x after it."""
    trigger(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    nw = tl.load(nw_ptr + offs, mask=mask, other=0.0)
    wr = tl.load(w_ptr + e.to(tl.int64) * N + offs, mask=mask, other=0.0)
    wait(PDL)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / N + eps)
    y = x * r * nw
    tl.store(out_ptr + e, tl.sum(wr * y, 0))
    mine = mask & (offs % E == e)
    tl.store(xn_ptr + offs, y, mask=mine)
    if PERM:
        tl.store(xp_ptr + perm_slot(offs), y, mask=mine)
    if X24:  # groups g with g % E == e
        g = tl.arange(0, BLOCK // 32)
        store_x24(tl.reshape(y, [BLOCK // 32, 32]), g, (g * 32 < N) & (g % E == e), hi_ptr, lo_ptr, s_ptr, sum_ptr,
                  32)


def norm_router(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_router: torch.Tensor, logits_out: torch.Tensor,
                xn_out: torch.Tensor, xn_perm: torch.Tensor | None = None, xn_x24: Any = None) -> torch.Tensor:
    """RMSNorm + router matvec in one launch: xn_out = rms_norm(x) * norm_w (as `rms_norm`, bit for bit),
    logits_out = W xn_out. x, norm_w: [N] f32 (N <= 16384); w_router: [E, N] f32 contiguous; logits_out [E];
    xn_perm ([N], N % 256 == 0): also receives xn_out in permute_k4 order; xn_x24 (imatvec.X24 of [N], N % 32 == 0)
    xn_out quantized for the integer-dot kernels. The weights are loaded before the PDL wait (as `rms_norm`). E
    programs. Returns logits_out."""
    e, n = w_router.shape
    if xn_perm is not None and n % 256:
        raise ValueError(f"xn_perm needs N % 256 == 0, got N = {n}")
    block = _np2(n)
    xa = x24_args(xn_x24, n, "xn_x24", xn_out)
    _norm_router_kernel[(e,)](x, norm_w, w_router, logits_out, xn_out, xn_out if xn_perm is None else xn_perm,
                              *xa, float(eps), n, e, BLOCK=block, PERM=xn_perm is not None,
                              X24=xn_x24 is not None, num_warps=8 if block >= 4096 else 4,
                              **launch_args(x.device))
    return logits_out


def router_topk(x: torch.Tensor, w_router: torch.Tensor, k: int, renormalise: bool, logits_scratch: torch.Tensor,
                weights_out: torch.Tensor, ids_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Router matvec + softmax/top-k in two launches (E programs for the 0.5-1 MB of F32 weights, then one).

    x: [N] f32, w_router: [E, N] f32, logits_scratch: [E] f32 -> weights_out [k] f32, ids_out [k] int32.
    """
    router_logits(x, w_router, logits_scratch)
    return route_topk(logits_scratch, k, renormalise, weights_out, ids_out)


# ----------------------------------------------------------------------------------------------------------------------
# Argmax (greedy sampling)
# ----------------------------------------------------------------------------------------------------------------------

ARGMAX_CHUNK = 2048


def argmax_scratch(vocab: int, device: torch.device | str,
                   chunk: int = ARGMAX_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk partials for argmax: values [P] f32, indices [P] int32, P = ceil(V / chunk)."""
    p = -(-vocab // chunk)
    return (torch.empty(p, device=device, dtype=torch.float32), torch.empty(p, device=device, dtype=torch.int32))


@triton.jit
def _argmax_chunk_kernel(x_ptr, val_ptr, idx_ptr, V, out_ptr, tok_ptr, pos_ptr, len_ptr, cnt_ptr, P,
                         CHUNK: tl.constexpr, BLOCK_P: tl.constexpr = 1, FUSED: tl.constexpr = False,
                         CHAIN: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program p: (max, first index of it) of x[p*CHUNK : (p+1)*CHUNK]. x: [V] f32 -> val [P] f32, idx [P] int32.
    FUSED: the last of the P programs to finish (an acq_rel counter cnt [1] after a CTA barrier; it resets the counter)
    also does `_argmax_reduce_kernel`'s work (`_argmax_pick`), one launch less."""
    begin(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + offs, mask=offs < V, other=-float("inf"))
    m = tl.max(x, 0)
    i = tl.min(tl.where((x == m) & (offs < V), offs, 2147483647), 0)
    tl.store(val_ptr + pid, m)
    tl.store(idx_ptr + pid, i)
    if FUSED:
        tl.debug_barrier()  # every thread's stores before the release below
        if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == P - 1:
            _argmax_pick(val_ptr, idx_ptr, out_ptr, tok_ptr, pos_ptr, len_ptr, P, BLOCK_P, CHAIN, True)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _argmax_pick(val_ptr, idx_ptr, out_ptr, tok_ptr, pos_ptr, len_ptr, P, BLOCK_P: tl.constexpr, CHAIN: tl.constexpr,
                 VOLATILE: tl.constexpr):
    """The first chunk holding the global max gives the index: val, idx [P] -> out [1] int64; with CHAIN also
    tok = out, pos += 1, len += 1. VOLATILE: the partials read past L1 (other programs of this launch wrote them)."""
    p = tl.arange(0, BLOCK_P)
    v = tl.load(val_ptr + p, mask=p < P, other=-float("inf"), volatile=VOLATILE)
    m = tl.max(v, 0)
    first = tl.min(tl.where((v == m) & (p < P), p, BLOCK_P), 0)
    best = tl.load(idx_ptr + first, volatile=VOLATILE).to(tl.int64)
    tl.store(out_ptr, best)
    if CHAIN:
        tl.store(tok_ptr, best)
        tl.store(pos_ptr, tl.load(pos_ptr) + 1)
        tl.store(len_ptr, tl.load(len_ptr) + 1)


@triton.jit
def _argmax_reduce_kernel(val_ptr, idx_ptr, out_ptr, tok_ptr, pos_ptr, len_ptr, P, BLOCK_P: tl.constexpr,
                          CHAIN: tl.constexpr, PDL: tl.constexpr = False):
    """One program: `_argmax_pick`. val, idx: [P] -> out [1] int64; with CHAIN also tok = out, pos += 1, len += 1
    ([1] int64 each: the next decode step's inputs)."""
    begin(PDL)
    _argmax_pick(val_ptr, idx_ptr, out_ptr, tok_ptr, pos_ptr, len_ptr, P, BLOCK_P, CHAIN, False)


def argmax(logits: torch.Tensor, out_id: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor],
           chunk: int = ARGMAX_CHUNK,
           chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           counter: torch.Tensor | None = None) -> torch.Tensor:
    """First index of the maximum. logits: [V] f32 -> out_id [1] int64 (device); scratch from argmax_scratch.
    chain: (tok, pos, kv_len) [1] int64 device buffers, set for the next decode step: tok = the index,
    pos += 1, kv_len += 1 (no extra launch).

    Two launches: ceil(V / chunk) chunk programs, then one reduce program; with counter (int32 zeros [>= 1], left
    zero) one: the last chunk program to finish reduces (`_argmax_chunk_kernel` FUSED), the same result. (NaN logits
    are not handled.)
    """
    v = logits.shape[-1]
    vals, idx = scratch
    p = vals.shape[0]
    tok, pos, kv_len = chain if chain is not None else (out_id, out_id, out_id)
    if counter is not None and (counter.numel() < 1 or counter.dtype != torch.int32):
        raise ValueError(f"counter must be int32 zeros [>= 1], got {counter.dtype} [{counter.numel()}]")
    fused = counter is not None
    _argmax_chunk_kernel[(p,)](logits, vals, idx, v, out_id, tok, pos, kv_len, counter if fused else idx, p,
                               CHUNK=chunk, BLOCK_P=_np2(p), FUSED=fused, CHAIN=chain is not None, num_warps=8,
                               **launch_args(logits.device))
    if not fused:
        _argmax_reduce_kernel[(1,)](vals, idx, out_id, tok, pos, kv_len, p, BLOCK_P=_np2(p), CHAIN=chain is not None,
                                    num_warps=4, **launch_args(logits.device))
    return out_id
