"""Triton kernels for the non-matmul parts of batched prompt processing (T tokens at once): residual add +
RMSNorm, QK-norm + RoPE + KV-cache store, the router's logits (split-K float32 products) and softmax/top-k.
Each wrapper is one launch.

The row-batched counterparts of moerun/kernels/triton/decode_ops.py (same math, same helpers: the RoPE table
from decode_ops.rope_table, bf16 stores rounded to nearest even, softmax_topk). Every wrapper writes into
caller-provided outputs; nothing is allocated or synced. All math is float32; outputs and caches may be
f32, f16 or bf16 (rounded on store). No atomics: results are bit-identical run to run.

Plain-torch definitions: moerun/kernels/reference.py (rms_norm, rope_angles/apply_rope, route).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.decode_ops import QK_NORM_KINDS, ROPE_STYLES, _cast_store, _np2, rope_pairs, softmax_topk

# ----------------------------------------------------------------------------------------------------------------------
# Residual add + RMSNorm
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, out_ptr, out2_ptr, eps, N, x_st, h_st, h_kst, out_st, out2_st,
                         HAS_H: tl.constexpr, KH: tl.constexpr, OUT_BF16: tl.constexpr, HAS_OUT2: tl.constexpr,
                         OUT2_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """One row per program. x: [T, N] f32 (updated in place to x + sum_k h[:, k] when HAS_H), h: [T, KH, N]
    f32 (KH parts added in order k = 0..KH-1, then to x), w: [N] f32
    -> out: [T, N] (f32/f16/bf16) = x * rsqrt(mean(x^2) + eps) * w."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_st + offs, mask=mask, other=0.0)
    if HAS_H:
        hs = tl.load(h_ptr + row * h_st + offs, mask=mask, other=0.0)
        for k in tl.static_range(1, KH):
            hs += tl.load(h_ptr + row * h_st + k * h_kst + offs, mask=mask, other=0.0)
        x = x + hs
        tl.store(x_ptr + row * x_st + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / N + eps)
    y = x * r * w
    _cast_store(out_ptr + row * out_st + offs, y, mask, OUT_BF16)
    if HAS_OUT2:  # the same values in a second dtype (e.g. the bf16 input of the following GEMMs)
        _cast_store(out2_ptr + row * out2_st + offs, y, mask, OUT2_BF16)


def add_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 h: torch.Tensor | None = None, out2: torch.Tensor | None = None) -> torch.Tensor:
    """With h: x += h (in place; h [T, K, N] adds the sum of its K parts, e.g. each token's expert outputs),
    then out = x * rsqrt(mean(x^2) + eps) * w, per row.

    x: [T, N] f32 (the residual stream; rows may be strided, stride(1) == 1), w: [N] f32, h: [T, N] or
    [T, K, N] f32 or None, out: [T, N] f32 / f16 / bf16 (rounded to nearest on store), out2: an optional second
    [T, N] output of another dtype (same values, rounded to it). N <= 16384. One launch of T programs. Returns out.
    """
    t, n = x.shape
    h3 = None if h is None else (h[:, None] if h.dim() == 2 else h)  # [T, K, N]
    assert x.stride(1) == 1 and out.stride(1) == 1 and (h3 is None or h3.stride(2) == 1)
    assert out.shape == x.shape and (h3 is None or (h3.shape[0], h3.shape[2]) == (t, n)) and w.shape == (n,)
    block = _np2(n)
    hh = x[:, None] if h3 is None else h3
    o2 = out if out2 is None else out2
    assert o2.shape == out.shape and o2.stride(1) == 1
    _add_rms_norm_kernel[(t,)](x, hh, w, out, o2, float(eps), n, x.stride(0), hh.stride(0), hh.stride(1),
                               out.stride(0), o2.stride(0), HAS_H=h is not None, KH=hh.shape[1],
                               OUT_BF16=out.dtype == torch.bfloat16, HAS_OUT2=out2 is not None,
                               OUT2_BF16=o2.dtype == torch.bfloat16, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# QK-norm + RoPE + KV store
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_rope_heads(x_ptr, w_ptr, cs_ptr, eps, NH: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     QK_NORM: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """All NH heads of one token: x at x_ptr [NH*D] f32, optionally RMS-normed (QK_NORM 1: per head with w [D];
    2: over all NH*D with w [NH*D]), then RoPE'd on each head's first R dims with cos at cs_ptr[0:R/2], sin at
    cs_ptr[R/2:R]. Returns (y [BLOCK_H, BLOCK_D] f32, offsets h*D + d [BLOCK_H, BLOCK_D], mask)."""
    HALF: tl.constexpr = R // 2
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rot, partner, fi, sign = rope_pairs(d, R, NEOX)
    hmask = (hh < NH)[:, None]
    mask = hmask & (d < D)[None, :]
    pmask = hmask & rot[None, :]
    offs = hh[:, None] * D + d[None, :]
    poffs = hh[:, None] * D + partner[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    xp = tl.load(x_ptr + poffs, mask=pmask, other=0.0)
    if QK_NORM == 1:
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / D + eps)  # [BLOCK_H]
        x = x * r[:, None] * tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :]
        xp = xp * r[:, None] * tl.load(w_ptr + partner, mask=rot, other=0.0)[None, :]
    elif QK_NORM == 2:
        r = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(x * x, 1), 0) / (NH * D) + eps)
        x = x * r * tl.load(w_ptr + offs, mask=mask, other=0.0)
        xp = xp * r * tl.load(w_ptr + poffs, mask=pmask, other=0.0)
    c = tl.load(cs_ptr + fi, mask=rot, other=1.0)[None, :]
    s = tl.load(cs_ptr + HALF + fi, mask=rot, other=0.0)[None, :]
    y = tl.where(rot[None, :], x * c + sign[None, :] * (xp * s), x)
    return y, hh, d, mask


@triton.jit
def _q_rows(q_ptr, qw_ptr, cs, qo_ptr, qo_sh, eps, H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
            QK_NORM: tl.constexpr, NEOX: tl.constexpr, Q_BF16: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_D: tl.constexpr):
    """One token's H q heads [H*D] at q_ptr -> q_out rows at qo_ptr (head stride qo_sh)."""
    y, hh, d, mask = _norm_rope_heads(q_ptr, qw_ptr, cs, eps, H, D, R, QK_NORM, NEOX, BLOCK_H, BLOCK_D)
    _cast_store(qo_ptr + hh[:, None] * qo_sh + d[None, :], y, mask, Q_BF16)


@triton.jit
def _kv_rows(k_ptr, v_ptr, kw_ptr, cs, kc_ptr, kc_sh, vc_ptr, vc_sh, eps, HKV: tl.constexpr, D: tl.constexpr,
             DV: tl.constexpr, R: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr, K_BF16: tl.constexpr,
             V_BF16: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One token's HKV k heads [HKV*D] at k_ptr -> cache row kc_ptr; its v heads [HKV*DV] at v_ptr -> vc_ptr."""
    y, hh, d, mask = _norm_rope_heads(k_ptr, kw_ptr, cs, eps, HKV, D, R, QK_NORM, NEOX, BLOCK_HKV, BLOCK_D)
    _cast_store(kc_ptr + hh[:, None] * kc_sh + d[None, :], y, mask, K_BF16)
    dv = tl.arange(0, BLOCK_DV)
    vmask = (hh < HKV)[:, None] & (dv < DV)[None, :]
    v = tl.load(v_ptr + hh[:, None] * DV + dv[None, :], mask=vmask, other=0.0)
    _cast_store(vc_ptr + hh[:, None] * vc_sh + dv[None, :], v, vmask, V_BF16)


@triton.jit
def _qk_norm_rope_rows_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cs_ptr, pos0, kc_ptr, vc_ptr, qo_ptr, eps,
                              q_st, k_st, v_st, qo_st, qo_sh, kc_sn, kc_sh, vc_sn, vc_sh,
                              H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                              R: tl.constexpr, QK_NORM: tl.constexpr, NEOX: tl.constexpr,
                              Q_BF16: tl.constexpr, K_BF16: tl.constexpr, V_BF16: tl.constexpr,
                              BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_DV: tl.constexpr):
    """Program (t, 0): token t's H q heads -> q_out[t]. Program (t, 1): its HKV k heads -> k_cache[pos0 + t] and
    v heads -> v_cache[pos0 + t].

    q: [T, H*D], k: [T, HKV*D], v: [T, HKV*DV] f32 (row strides q_st, k_st, v_st); cs: [n_ctx, 2, R/2] f32;
    caches [n_ctx, HKV, D|DV]; q_out [T, H, D].
    """
    t = tl.program_id(0).to(tl.int64)
    pos = pos0 + t
    cs = cs_ptr + pos * R
    # (each branch in its own helper: a runtime if/else may not bind one name to tiles of different shapes)
    if tl.program_id(1) == 0:
        _q_rows(q_ptr + t * q_st, qw_ptr, cs, qo_ptr + t * qo_st, qo_sh, eps, H, D, R, QK_NORM, NEOX, Q_BF16,
                BLOCK_H, BLOCK_D)
    else:
        _kv_rows(k_ptr + t * k_st, v_ptr + t * v_st, kw_ptr, cs, kc_ptr + pos * kc_sn, kc_sh, vc_ptr + pos * vc_sn,
                 vc_sh, eps, HKV, D, DV, R, QK_NORM, NEOX, K_BF16, V_BF16, BLOCK_HKV, BLOCK_D, BLOCK_DV)


def qk_norm_rope_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None,
                      table: torch.Tensor, pos0: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      q_out: torch.Tensor, *, eps: float, qk_norm: str = "none",
                      rope_style: str = "neox") -> torch.Tensor:
    """QK-norm ("none" | "head" | "full") + RoPE of T tokens at positions pos0..pos0+T-1; stores their k and v in
    cache rows pos0..pos0+T-1.

    q: [T, H*D], k: [T, Hkv*D], v: [T, Hkv*Dv] f32 raw projections (rows may be strided, e.g. column slices of
    one fused QKV product; stride(1) == 1); q_norm_w / k_norm_w: [D] ("head") or [H*D] / [Hkv*D] ("full") f32,
    unused for "none"; table: [n_ctx, 2, R/2] f32 from decode_ops.rope_table (R = rope_dim <= D, rotating the
    first R dims of each head; "neox" pairs (i, i + R/2), "norm" pairs (2i, 2i + 1));
    k_cache: [n_ctx, Hkv, D], v_cache: [n_ctx, Hkv, Dv] (f32/f16/bf16, innermost dim contiguous);
    q_out: [T, H, D] f32/f16/bf16 (innermost dim contiguous). pos0: host int, pos0 + T <= n_ctx.
    One launch of T x 2 programs (a token's q heads; its k and v heads). Returns q_out.
    """
    t, h, d = q_out.shape
    n_ctx, hkv, dk = k_cache.shape
    dv = v_cache.shape[2]
    r = 2 * table.shape[-1]
    assert dk == d and r <= d and r % 2 == 0 and table.is_contiguous()
    assert q.shape == (t, h * d) and k.shape == (t, hkv * d) and v.shape == (t, hkv * dv)
    assert q.stride(1) == 1 and k.stride(1) == 1 and v.stride(1) == 1 and q_out.stride(2) == 1
    assert k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert 0 <= pos0 and pos0 + t <= min(n_ctx, table.shape[0])
    norm = QK_NORM_KINDS[qk_norm]
    qw = q_norm_w if norm else q
    kw = k_norm_w if norm else k
    if norm:
        want = (d, d) if norm == 1 else (h * d, hkv * d)
        assert qw.numel() == want[0] and kw.numel() == want[1]
    block_d = _np2(d)
    tile = max(_np2(h) * block_d, _np2(hkv) * (block_d + _np2(dv)))
    _qk_norm_rope_rows_kernel[(t, 2)](
        q, k, v, qw, kw, table, int(pos0), k_cache, v_cache, q_out, float(eps),
        q.stride(0), k.stride(0), v.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        H=h, HKV=hkv, D=d, DV=dv, R=r, QK_NORM=norm, NEOX=ROPE_STYLES[rope_style],
        Q_BF16=q_out.dtype == torch.bfloat16, K_BF16=k_cache.dtype == torch.bfloat16,
        V_BF16=v_cache.dtype == torch.bfloat16,
        BLOCK_H=_np2(h), BLOCK_HKV=_np2(hkv), BLOCK_D=block_d, BLOCK_DV=_np2(dv),
        num_warps=8 if tile >= 4096 else 4)
    return q_out


# ----------------------------------------------------------------------------------------------------------------------
# Router: softmax + top-k per row
# ----------------------------------------------------------------------------------------------------------------------


@triton.jit
def _route_topk_rows_kernel(logits_ptr, w_out_ptr, id_out_ptr, E, l_st, p_st, K: tl.constexpr, RENORM: tl.constexpr,
                            PARTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row per program. logits: PARTS x [T, E] f32 (row stride l_st, part stride p_st; added in order
    0 .. PARTS-1) -> weights_out [T, K] f32, ids_out [T, K] int32."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    x = tl.load(logits_ptr + row * l_st + e, mask=emask, other=-float("inf"))
    for p in tl.static_range(1, PARTS):
        x += tl.load(logits_ptr + p * p_st + row * l_st + e, mask=emask, other=0.0)
    wv, iv = softmax_topk(x, e, emask, K, RENORM, BLOCK_E, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    tl.store(w_out_ptr + row * K + kk, wv, mask=kk < K)
    tl.store(id_out_ptr + row * K + kk, iv, mask=kk < K)


def route_topk_rows(logits: torch.Tensor, k: int, renormalise: bool, weights_out: torch.Tensor,
                    ids_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: softmax over all E experts, top-k (descending, ties to the lower index), optional renormalisation
    (weights divided by their sum).

    logits: [T, E] f32 (E <= 1024, stride(1) == 1), or [S, T, E] partial sums (split-K) added in order ->
    weights_out [T, k] f32, ids_out [T, k] int32 (both contiguous). One launch of T programs. Returns
    (weights_out, ids_out).
    """
    parts = logits if logits.dim() == 3 else logits[None]
    s, t, e = parts.shape
    assert parts.stride(2) == 1 and weights_out.is_contiguous() and ids_out.is_contiguous()
    assert weights_out.shape == (t, k) and ids_out.shape == (t, k) and ids_out.dtype == torch.int32
    _route_topk_rows_kernel[(t,)](parts, weights_out, ids_out, e, parts.stride(1), parts.stride(0), K=k,
                                  RENORM=bool(renormalise), PARTS=s, BLOCK_E=_np2(e), BLOCK_K=_np2(k), num_warps=4)
    return weights_out, ids_out
