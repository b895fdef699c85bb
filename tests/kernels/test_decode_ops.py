"""Decode kernels (moerun/kernels/triton/decode_ops.py) vs the plain-torch reference on fresh random inputs
(the attention's: test_attention.py).

Runs on CUDA when available, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). Every output and scratch buffer is poisoned with NaN first; the seed is printed (shown on failure).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.kernel_checks import DEV, RTOL, check_x24, close, nan, poisoned_x24, randn  # noqa: E402

from moerun.kernels import reference as ref  # noqa: E402
from moerun.kernels.torch_ops import permute_k4  # noqa: E402
from moerun.kernels.triton import decode_ops as ops  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 37, 2048, 8192])
def test_rms_norm(gen: torch.Generator, n: int) -> None:
    x, w = randn(gen, n, scale=3.0), randn(gen, n)
    out = nan(n)
    ops.rms_norm(x, w, 1e-6, out)
    close(out, ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("n", [256, 2048])
def test_rms_norm_x24(gen: torch.Generator, n: int) -> None:
    """With out_x24 the same launch also quantizes its output for the integer-dot kernels (imatvec.X24)."""
    x, w = randn(gen, 3, n, scale=3.0), randn(gen, n)
    out, x24 = nan(3, n), poisoned_x24(3, n)
    ops.rms_norm(x, w, 1e-6, out, out_x24=x24)
    close(out, ref.rms_norm(x, w, 1e-6))
    check_x24(x24, out)


def test_rms_norm_rows(gen: torch.Generator) -> None:
    x, w = randn(gen, 5, 129), randn(gen, 129)
    out = nan(5, 129)
    ops.rms_norm(x, w, 1e-5, out)
    close(out, ref.rms_norm(x, w, 1e-5))


# ---------------------------------------------------------------------------------------------------------------------


def test_rope_table_matches_reference(gen: torch.Generator) -> None:
    ff = (torch.rand(8, generator=gen) * 4 + 0.5).to(DEV)
    table = ops.rope_table(96, 16, 10000.0, 4.0, ff, device=DEV)  # [96, 2, 8]
    pos = torch.tensor([0, 5, 95], device=DEV)
    cos, sin = ref.rope_angles(pos, 16, 10000.0, 4.0, ff)
    assert torch.equal(table[pos, 0], cos) and torch.equal(table[pos, 1], sin)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rope_style", ["neox", "norm"])
@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize("h,hkv,d,dv,rope_dim", [(3, 1, 16, 16, 8), (3, 3, 32, 32, 32), (4, 2, 32, 16, 24)])
def test_qk_norm_rope_store(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, rope_dim: int, qk_norm: str,
                            rope_style: str, cache_dtype: torch.dtype) -> None:
    n_ctx, eps = 96, 1e-6
    pos = int(torch.randint(0, n_ctx, (1,), generator=gen))
    q, k, v = randn(gen, h * d), randn(gen, hkv * d), randn(gen, hkv * dv)
    width = {"none": (d, d), "head": (d, d), "full": (h * d, hkv * d)}[qk_norm]
    qw, kw = randn(gen, width[0]), randn(gen, width[1])
    ff = (torch.rand(rope_dim // 2, generator=gen) + 0.5).to(DEV)
    table = ops.rope_table(n_ctx, rope_dim, 1000.0, 2.0, ff, device=DEV)
    k_cache, v_cache = nan(n_ctx, hkv, d, dtype=cache_dtype), nan(n_ctx, hkv, dv, dtype=cache_dtype)
    q_out = nan(h, d)
    pos_t = torch.tensor([pos], device=DEV, dtype=torch.int32)
    ops.qk_norm_rope_store(q, k, v, qw, kw, table, pos_t, k_cache, v_cache, q_out, eps, qk_norm, rope_style)

    # the reference, as in models/transformer.py
    qr, kr = q[None], k[None]
    if qk_norm == "full":
        qr, kr = ref.rms_norm(qr, qw, eps), ref.rms_norm(kr, kw, eps)
    qr, kr = qr.view(1, h, d), kr.view(1, hkv, d)
    if qk_norm == "head":
        qr, kr = ref.rms_norm(qr, qw, eps), ref.rms_norm(kr, kw, eps)
    cos, sin = ref.rope_angles(torch.tensor([pos], device=DEV), rope_dim, 1000.0, 2.0, ff)
    qr, kr = ref.apply_rope(qr, cos, sin, rope_style)[0], ref.apply_rope(kr, cos, sin, rope_style)[0]
    close(q_out, qr)
    ctol = {torch.float32: RTOL, torch.float16: 1e-3, torch.bfloat16: 8e-3}[cache_dtype]
    close(k_cache[pos], kr.to(cache_dtype), ctol)
    assert torch.equal(v_cache[pos], v.view(hkv, dv).to(cache_dtype))
    others = torch.arange(n_ctx, device=DEV) != pos
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()


# ---------------------------------------------------------------------------------------------------------------------


def lowest_index_topk(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k ids, ties to the lower index (torch.topk on CPU does not promise any tie order)."""
    return torch.sort(probs, descending=True, stable=True).indices[:k]


@pytest.mark.parametrize("renormalise", [False, True])
@pytest.mark.parametrize("e,k,ties", [(7, 3, True), (7, 3, False), (64, 8, True), (256, 16, False), (128, 1, True)])
def test_route_topk(gen: torch.Generator, e: int, k: int, ties: bool, renormalise: bool) -> None:
    logits = randn(gen, e, scale=2.0)
    if ties:  # repeated values, including a tie straddling the k-th place
        logits = torch.round(logits * 2) / 2
        top = torch.sort(logits, descending=True).values
        logits[logits == top[k]] = top[k - 1]
    w_out, id_out = nan(k), torch.full((k,), -1, device=DEV, dtype=torch.int32)
    ops.route_topk(logits, k, renormalise, w_out, id_out)
    w_ref, _ = ref.route(logits[None], k, renormalise)
    close(w_out, w_ref[0])
    assert torch.equal(id_out.long(), lowest_index_topk(logits.softmax(-1), k))


@pytest.mark.parametrize("e,n,k", [(7, 37, 3), (64, 300, 8)])
def test_router_topk(gen: torch.Generator, e: int, n: int, k: int) -> None:
    x, w = randn(gen, n), randn(gen, e, n, scale=0.1)
    logits, w_out, id_out = nan(e), nan(k), torch.full((k,), -1, device=DEV, dtype=torch.int32)
    ops.router_topk(x, w, k, True, logits, w_out, id_out)
    want_logits = (x[None] @ w.T)[0]
    close(logits, want_logits)
    w_ref, id_ref = ref.route(want_logits[None], k, True)
    close(w_out, w_ref[0])
    assert torch.equal(id_out.long(), id_ref[0])


@pytest.mark.parametrize("e,n,perm", [(7, 37, False), (64, 512, True), (3, 8192, True), (5, 256, False)])
def test_norm_router(gen: torch.Generator, e: int, n: int, perm: bool) -> None:
    """RMSNorm + router in one launch: the normalised x equals rms_norm's, bit for bit (every element written
    once, by one of the E programs); the logits equal the router's product of it. With N % 32 == 0 also x
    quantized (imatvec.X24, every 32-value group written by one program)."""
    x, nw, w = randn(gen, n, scale=3.0), randn(gen, n), randn(gen, e, n, scale=0.1)
    logits, xn, xp = nan(e), nan(n), nan(n) if perm else None
    x24 = poisoned_x24(n) if n % 32 == 0 else None
    ops.norm_router(x, nw, 1e-6, w, logits, xn, xp, x24)
    want_xn = ops.rms_norm(x, nw, 1e-6, nan(n))
    assert torch.equal(xn, want_xn)
    if perm:
        assert torch.equal(xp, permute_k4(want_xn))
    if x24 is not None:
        check_x24(x24, want_xn)
    close(logits, (w.double() @ want_xn.double()).float())


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [1, 5000, 50304, 262144])
def test_argmax(gen: torch.Generator, v: int) -> None:
    logits = randn(gen, v)
    scratch = tuple(t.fill_(-1) for t in ops.argmax_scratch(v, DEV))
    out = torch.full((1,), -1, device=DEV, dtype=torch.int64)
    for _ in range(2):  # a repeated maximum: the first one wins, also across chunks
        ops.argmax(logits, out, scratch)
        assert int(out) == int(torch.argmax(logits))
        idx = torch.randint(0, v, (3,), generator=gen).to(DEV)
        logits[idx] = float(logits.max()) + 1.0
        first = int(idx.min())
        ops.argmax(logits, out, scratch)
        assert int(out) == first
        logits[idx] = 0.0


@pytest.mark.parametrize("v,chunk", [(5000, 2048), (50304, 2048), (7, 16), (2048, 2048)])
def test_argmax_fused(gen: torch.Generator, v: int, chunk: int) -> None:
    """counter: the last chunk program reduces (one launch): the two launches' index and chained inputs, the counter
    left zero (so a second call works), a repeated maximum's first index across chunks, one chunk alone."""
    logits = randn(gen, v)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    for _ in range(2):
        idx = torch.randint(0, v, (3,), generator=gen).to(DEV)
        logits[idx] = float(logits.max()) + 1.0
        outs = []
        for cnt in (None, counter):
            tok, pos, kv_len, out = (torch.tensor([x], device=DEV, dtype=torch.int64) for x in (-1, 41, 42, -1))
            scratch = tuple(t.fill_(-1) for t in ops.argmax_scratch(v, DEV, chunk))
            ops.argmax(logits, out, scratch, chunk=chunk, chain=(tok, pos, kv_len), counter=cnt)
            outs.append((int(out), int(tok), int(pos), int(kv_len)))
        assert outs[0] == outs[1] == (int(idx.min()), int(idx.min()), 42, 43), outs
        assert int(counter) == 0
        logits[idx] = 0.0
    with pytest.raises(ValueError, match="counter must be int32"):
        ops.argmax(logits, out, ops.argmax_scratch(v, DEV, chunk), chunk=chunk, counter=torch.zeros(1, device=DEV))


def test_argmax_chains_the_next_step(gen: torch.Generator) -> None:
    """chain=(tok, pos, kv_len): the chosen id also becomes the next step's token, and both counters move on."""
    logits = randn(gen, 5000)
    tok, pos, kv_len, out = (torch.tensor([v], device=DEV, dtype=torch.int64) for v in (-1, 41, 42, -1))
    ops.argmax(logits, out, ops.argmax_scratch(5000, DEV), chain=(tok, pos, kv_len))
    assert int(out) == int(tok) == int(torch.argmax(logits)) and (int(pos), int(kv_len)) == (42, 43)
