"""Batched prefill kernels (moerun/kernels/triton/prefill_ops.py) vs the plain-torch reference on fresh random inputs.

Runs on CUDA when available, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). Every output is poisoned with NaN first; the seed is printed (shown on failure).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.kernel_checks import DEV, RTOL, close, nan, randn  # noqa: E402

from moerun.kernels import reference as ref  # noqa: E402
from moerun.kernels.triton import decode_ops as dk  # noqa: E402
from moerun.kernels.triton import prefill_ops as ops  # noqa: E402

HALF_RTOL = {torch.float32: RTOL, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_h", [False, True])
@pytest.mark.parametrize("t,n", [(5, 96), (7, 200), (3, 4096)])
def test_add_rms_norm(gen: torch.Generator, t: int, n: int, with_h: bool, out_dtype: torch.dtype) -> None:
    x0, w = randn(gen, t, n, scale=3.0), randn(gen, n)
    h = randn(gen, t, n) if with_h else None
    x = x0.clone()
    out = nan(t, n, dtype=out_dtype)
    ops.add_rms_norm(x, w, 1e-6, out, h)
    want_x = x0 + h if with_h else x0
    assert torch.equal(x, want_x)  # updated in place exactly (or left alone)
    want = ref.rms_norm(want_x, w, 1e-6)
    if out_dtype == torch.float32:
        close(out, want, 1e-6)
    else:
        close(out, want.to(out_dtype), HALF_RTOL[out_dtype])


@pytest.mark.parametrize("k", [1, 3, 8])
def test_add_rms_norm_sums_parts(gen: torch.Generator, k: int) -> None:
    """h [T, K, N] (each token's weighted expert outputs) adds sum_k h[:, k] to x, in order k = 0..K-1."""
    x0, w, h = randn(gen, 5, 96, scale=3.0), randn(gen, 96), randn(gen, 5, k, 96)
    x = x0.clone()
    out = nan(5, 96)
    ops.add_rms_norm(x, w, 1e-6, out, h)
    parts = h[:, 0].clone()
    for i in range(1, k):
        parts += h[:, i]
    assert torch.equal(x, x0 + parts)
    close(out, ref.rms_norm(x0 + parts, w, 1e-6), 1e-6)


def test_add_rms_norm_second_output(gen: torch.Generator) -> None:
    """out2 holds the same values in its own dtype: bf16 equal to torch's cast of the f32 output."""
    x, w, h = randn(gen, 6, 200, scale=3.0), randn(gen, 200), randn(gen, 6, 2, 200)
    out32, out16 = nan(6, 200), nan(6, 200, dtype=torch.bfloat16)
    ops.add_rms_norm(x, w, 1e-5, out32, h, out2=out16)
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_add_rms_norm_bf16_rounds_to_nearest(gen: torch.Generator) -> None:
    """The bf16 output is torch's own (round-to-nearest-even) cast of the kernel's f32 output, bit for bit."""
    x, w = randn(gen, 7, 200, scale=3.0), randn(gen, 200)
    out32, out16 = nan(7, 200), nan(7, 200, dtype=torch.bfloat16)
    ops.add_rms_norm(x, w, 1e-5, out32)
    ops.add_rms_norm(x, w, 1e-5, out16)
    assert torch.equal(out16, out32.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------------


def qk_reference(q, k, v, qw, kw, pos0, h, hkv, d, dv, rope_dim, base, scale, ff, qk_norm, rope_style, eps):
    """What moerun/engine/fast_prefill.py's _attention computes with the reference functions."""
    t = q.shape[0]
    if qk_norm == "full":
        q, k = ref.rms_norm(q, qw, eps), ref.rms_norm(k, kw, eps)
    q, k, v = q.reshape(t, h, d), k.reshape(t, hkv, d), v.reshape(t, hkv, dv)
    if qk_norm == "head":
        q, k = ref.rms_norm(q, qw, eps), ref.rms_norm(k, kw, eps)
    cos, sin = ref.rope_angles(torch.arange(pos0, pos0 + t, device=DEV), rope_dim, base, scale, ff)
    return ref.apply_rope(q, cos, sin, rope_style), ref.apply_rope(k, cos, sin, rope_style), v


@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float16)])
@pytest.mark.parametrize("rope_style", ["neox", "norm"])
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("t,h,hkv,d,dv,rope_dim,fused", [(5, 3, 1, 32, 32, 16, True), (7, 3, 1, 32, 32, 32, False),
                                                          (6, 4, 2, 24, 16, 16, True)])
def test_qk_norm_rope_rows(gen: torch.Generator, t: int, h: int, hkv: int, d: int, dv: int, rope_dim: int,
                           fused: bool, qk_norm: str, rope_style: str, q_dtype: torch.dtype,
                           cache_dtype: torch.dtype) -> None:
    n_ctx, eps, base, scale = 48, 1e-6, 1000.0, 2.0
    pos0 = int(torch.randint(0, n_ctx - t + 1, (1,), generator=gen))
    if fused:  # column slices of one [T, (H + 2 Hkv) D] product, as fast_prefill's stacked QKV GEMM gives
        q, k, v = randn(gen, t, (h + hkv) * d + hkv * dv, scale=2.0).split([h * d, hkv * d, hkv * dv], dim=1)
    else:
        q, k, v = randn(gen, t, h * d, scale=2.0), randn(gen, t, hkv * d, scale=2.0), randn(gen, t, hkv * dv)
    width = {"none": (d, d), "head": (d, d), "full": (h * d, hkv * d)}[qk_norm]
    qw, kw = randn(gen, width[0]), randn(gen, width[1])
    ff = (torch.rand(rope_dim // 2, generator=gen) + 0.5).to(DEV)
    table = dk.rope_table(n_ctx, rope_dim, base, scale, ff, device=DEV)
    k_cache, v_cache = nan(n_ctx, hkv, d, dtype=cache_dtype), nan(n_ctx, hkv, dv, dtype=cache_dtype)
    q_out = nan(t, h, d, dtype=q_dtype)
    ops.qk_norm_rope_rows(q, k, v, qw if qk_norm != "none" else None, kw if qk_norm != "none" else None, table,
                          pos0, k_cache, v_cache, q_out, eps=eps, qk_norm=qk_norm, rope_style=rope_style)

    qr, kr, vr = qk_reference(q, k, v, qw, kw, pos0, h, hkv, d, dv, rope_dim, base, scale, ff, qk_norm,
                              rope_style, eps)
    close(q_out, qr.to(q_dtype), HALF_RTOL[q_dtype])
    close(k_cache[pos0:pos0 + t], kr.to(cache_dtype), HALF_RTOL[cache_dtype])
    assert torch.equal(v_cache[pos0:pos0 + t], vr.to(cache_dtype))
    others = (torch.arange(n_ctx, device=DEV) < pos0) | (torch.arange(n_ctx, device=DEV) >= pos0 + t)
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()


def test_qk_norm_rope_rows_matches_decode(gen: torch.Generator) -> None:
    """Row i of the batched kernel is the decode kernel at position pos0 + i, bit for bit (f32)."""
    t, h, hkv, d, rope_dim, n_ctx, pos0 = 5, 3, 1, 32, 16, 32, 9
    q, k, v = randn(gen, t, h * d), randn(gen, t, hkv * d), randn(gen, t, hkv * d)
    qw, kw = randn(gen, h * d), randn(gen, hkv * d)
    table = dk.rope_table(n_ctx, rope_dim, 10000.0, device=DEV)
    kc, vc, qo = nan(n_ctx, hkv, d), nan(n_ctx, hkv, d), nan(t, h, d)
    ops.qk_norm_rope_rows(q, k, v, qw, kw, table, pos0, kc, vc, qo, eps=1e-6, qk_norm="full", rope_style="norm")
    kc1, vc1, qo1 = nan(n_ctx, hkv, d), nan(n_ctx, hkv, d), nan(h, d)
    for i in range(t):
        pos_t = torch.tensor([pos0 + i], device=DEV, dtype=torch.int32)
        dk.qk_norm_rope_store(q[i], k[i], v[i], qw, kw, table, pos_t, kc1, vc1, qo1, 1e-6, "full", "norm")
        close(qo[i], qo1, 1e-6)
    close(kc[pos0:pos0 + t], kc1[pos0:pos0 + t], 1e-6)
    assert torch.equal(vc[pos0:pos0 + t], vc1[pos0:pos0 + t])


# ---------------------------------------------------------------------------------------------------------------------


def lowest_index_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids per row, ties to the lower index (torch.topk on CPU does not promise any tie order)."""
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("t,e,k,ties", [(7, 13, 3, False), (7, 13, 3, True), (5, 64, 8, False), (6, 256, 8, False),
                                        (3, 128, 8, True), (4, 60, 1, False)])
def test_route_topk_rows(gen: torch.Generator, t: int, e: int, k: int, ties: bool, renormalise: bool) -> None:
    logits = randn(gen, t, e, scale=2.0)
    if ties:  # repeated values, including a tie straddling the k-th place in every row
        logits = torch.round(logits * 2) / 2
        top = torch.sort(logits, dim=-1, descending=True).values
        logits = torch.where(logits == top[:, k:k + 1], top[:, k - 1:k], logits)
    w_out, id_out = nan(t, k), torch.full((t, k), -1, device=DEV, dtype=torch.int32)
    ops.route_topk_rows(logits, k, renormalise, w_out, id_out)
    w_ref, id_ref = ref.route(logits, k, renormalise)
    close(w_out, w_ref, 1e-6)
    if ties:
        assert torch.equal(id_out.long(), lowest_index_topk(logits.softmax(-1), k))
    else:
        assert torch.equal(id_out.long(), id_ref)


def test_route_topk_rows_strided(gen: torch.Generator) -> None:
    """Logits as a column slice of a wider product (row stride > E)."""
    t, e, k = 5, 13, 3
    logits = randn(gen, t, e + 7)[:, 3:3 + e]
    w_out, id_out = nan(t, k), torch.full((t, k), -1, device=DEV, dtype=torch.int32)
    ops.route_topk_rows(logits, k, True, w_out, id_out)
    w_ref, id_ref = ref.route(logits, k, True)
    close(w_out, w_ref, 1e-6)
    assert torch.equal(id_out.long(), id_ref)


@pytest.mark.parametrize("t,e,s", [(37, 13, 3), (5, 64, 8), (3, 256, 2)])
def test_route_topk_rows_parts(gen: torch.Generator, t: int, e: int, s: int) -> None:
    """route_topk_rows over S partial sums [S, T, E] equals route_topk_rows over their in-order sum, bit for bit."""
    parts = randn(gen, s, t, e)
    parts[0, 0] *= 100.0  # uneven magnitudes: the order of the additions shows
    summed = parts[0].clone()
    for p in range(1, s):
        summed += parts[p]
    k = min(8, e)
    w1, id1 = nan(t, k), torch.full((t, k), -1, device=DEV, dtype=torch.int32)
    w2, id2 = nan(t, k), torch.full((t, k), -1, device=DEV, dtype=torch.int32)
    ops.route_topk_rows(parts, k, True, w1, id1)
    ops.route_topk_rows(summed, k, True, w2, id2)
    assert torch.equal(w1, w2) and torch.equal(id1, id2)


