"""Quantized GEMM kernels for prefill (kernels/triton/qgemm.py) vs dequantize-then-matmul in float64.

Fresh random valid blocks of every type, odd sizes (rows, tokens and experts that are not tile
multiples), outputs poisoned with NaN first. Runs on CUDA when available, else on the CPU through
Triton's interpreter (TRITON_INTERPRET=1 is set before triton is imported).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from moerun.kernels.reference import ACTIVATIONS  # noqa: E402
from moerun.kernels.triton.moe_align import moe_align_torch  # noqa: E402
from moerun.kernels.triton.qgemm import (  # noqa: E402
    GemmTile,
    dequantize_bf16,
    moe_align,
    moe_down,
    moe_gate_up,
    padded_rows,
    qgemm,
)
from moerun.kernels.triton.qmatvec import GEOMETRY  # noqa: E402
from moerun.quant import dequantize, random_blocks  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.Q5_0, T.F16, T.BF16, T.F32]
TILE = GemmTile(16, 32, 4, 1)  # small: several programs per dimension at these sizes
EXACT_TOL = 1e-5  # relative to sum |a||w|: float32 products
BF16_TOL = 1.6e-2  # bf16 inputs: 2 roundings of 2^-9 each, float32 accumulation


def _weights(qtype: int, lead: tuple[int, ...], k: int, gen: np.random.Generator, device: torch.device):
    bs, ts, _ = GEOMETRY[qtype]
    n = int(np.prod(lead))
    raw = torch.from_numpy(random_blocks(qtype, n * k // bs, gen, scale=0.5)).reshape(*lead, k // bs * ts)
    return raw.to(device), dequantize(raw, qtype, (*lead, k)).double()


def _mat(gen: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(gen.standard_normal(shape).astype(np.float32))


def _check(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, tol: float, what: str) -> None:
    out = out.cpu().double()
    assert not out.isnan().any(), f"{what}: NaN in output"
    worst = ((out - ref).abs() / (bound + 1e-30)).max().item()
    assert worst <= tol, f"{what}: error {worst:.3g} x sum|a||w|"


def _check_dense(qtype, t: int, m: int, k: int, tile: GemmTile, exact: bool, device, gen, what: str
                 ) -> torch.Tensor:
    """qgemm of fresh random [t, k] inputs by fresh [m, k] weights of `qtype` (NaN-poisoned output) against
    the float64 product of the dequantized weights; returns the inputs a [t, k] (CPU)."""
    raw, w = _weights(qtype, (m,), k, gen, device)
    a = _mat(gen, t, k)
    out = torch.full((t, m), float("nan"), device=device)
    qgemm(a.to(device), raw, int(qtype), out, exact=exact, tile=tile)
    _check(out, a.double() @ w.T, a.double().abs() @ w.abs().T, EXACT_TOL if exact else BF16_TOL, what)
    return a


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("exact", [True, False], ids=["f32", "bf16"])
def test_qgemm(qtype, exact, device, rng) -> None:
    gen, seed = rng
    k = 320 if GEOMETRY[qtype][0] == 32 else 512  # 32-blocks: K not a multiple of the 64-weight step
    _check_dense(qtype, 21, 37, k, TILE, exact, device, gen, f"{qtype.name} seed {seed}")


@pytest.mark.parametrize("qtype,k", [(T.Q8_0, 288), (T.Q8_0, 320), (T.Q6_K, 512), (T.Q6_K, 768), (T.Q4_K, 512)],
                         ids=["Q8_0-K288", "Q8_0-K320", "Q6_K-K512", "Q6_K-K768", "Q4_K-K512"])
@pytest.mark.parametrize("prefetch", [True, False, "q8 words"], ids=["prefetch", "plain", "q8words"])
def test_prefetch_paths(qtype, k, prefetch, device, rng) -> None:
    """Q8_0 / Q6_K / Q4_K with the raw weights loaded one step ahead (where K allows) and without; Q8_0
    prefetched as int32 words (GemmTile.q8_words)."""
    tile = TILE._replace(prefetch=frozenset({8, 12, 14}) if prefetch else frozenset(), q8_words=prefetch == "q8 words")
    gen, seed = rng
    _check_dense(qtype, 19, 45, k, tile, True, device, gen, f"{qtype.name} K={k} seed {seed}")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("exact", [True, False], ids=["f32", "bf16"])
def test_swapped_operands(qtype, exact, device, rng) -> None:
    """GemmTile.swap (out^T = W A^T on the tensor cores): dense and grouped products as the plain order."""
    gen, seed = rng
    tile = TILE._replace(swap=True)
    t, k = 21, 512
    a = _check_dense(qtype, t, 37, k, tile, exact, device, gen, f"{qtype.name} swapped seed {seed}")
    e, topk, f = 3, 2, 256
    wg, _ = _weights(qtype, (e, f), k, gen, device)
    wu, _ = _weights(qtype, (e, f), k, gen, device)
    wd, _ = _weights(qtype, (e, k), f, gen, device)
    ids = torch.from_numpy(np.stack([gen.permutation(e)[:topk] for _ in range(t)]))
    rw = torch.from_numpy(gen.uniform(0.05, 1.0, (t, topk)).astype(np.float32))
    r = moe_align(ids.to(device).int(), e, tile.block_m)
    outs = []
    for tl_ in (TILE, tile):
        h = torch.full((r.rows.shape[0], f), float("nan"), device=device)
        moe_gate_up(a.to(device), wg, wu, int(qtype), int(qtype), r, h, "silu", exact=True, tile=tl_)
        y = torch.full((t * topk, k), float("nan"), device=device)
        moe_down(h, wd, int(qtype), r, rw.reshape(-1).to(device), y, exact=True, tile=tl_)
        outs.append(y.cpu())
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * float(outs[0].abs().max()))


def test_moe_align(device, rng) -> None:
    gen, _ = rng
    e, topk, t, bm = 7, 3, 29, 16
    ids = torch.from_numpy(np.stack([gen.permutation(e)[:topk] for _ in range(t)])).to(device)
    r = moe_align(ids.int(), e, bm)
    rows, bexp = r.rows.cpu(), r.block_expert.cpu()
    assert rows.shape[0] == padded_rows(t * topk, e, bm) and rows.shape[0] % bm == 0
    assigned = rows[rows >= 0]
    assert sorted(assigned.tolist()) == list(range(t * topk))  # every assignment exactly once
    flat = ids.cpu().reshape(-1)
    for b in range(rows.shape[0] // bm):
        blk = rows[b * bm:(b + 1) * bm]
        live = blk[blk >= 0]
        if bexp[b] < 0:
            assert live.numel() == 0
        else:
            assert (flat[live.long()] == bexp[b]).all(), "a block holds one expert's assignments"
            assert torch.equal(live, live.sort().values), "token order kept within an expert"


@pytest.mark.parametrize("t,topk,e,bm,skew", [(29, 3, 7, 16, False), (1100, 8, 64, 64, False),
                                               (300, 2, 9, 16, True), (1, 1, 1, 16, False)])
def test_moe_align_kernel_matches_torch(t, topk, e, bm, skew, device, rng) -> None:
    """The Triton grouping equals its torch twin, incl. more ids than one scan chunk and all tokens on
    the same few experts (long runs, many empty experts)."""
    gen, _ = rng
    pool = min(e, topk + 1) if skew else e
    ids = torch.from_numpy(np.stack([gen.permutation(pool)[:topk] for _ in range(t)])).int().to(device)
    got, ref = moe_align(ids, e, bm), moe_align_torch(ids, e, bm)
    assert torch.equal(got.rows.cpu(), ref.rows.cpu())
    assert torch.equal(got.block_expert.cpu(), ref.block_expert.cpu())


@pytest.mark.parametrize("qg,qd", [(q, q) for q in TYPES] + [(T.Q4_K, T.Q6_K)], ids=lambda t: t.name)
def test_moe_gate_up_down(qg, qd, device, rng) -> None:
    gen, seed = rng
    e, topk, t, n, f = 5, 2, 11, 256, 320 if GEOMETRY[qd][0] == 32 else 512
    wg, dg = _weights(qg, (e, f), n, gen, device)
    wu, du = _weights(qg, (e, f), n, gen, device)
    wd, dd = _weights(qd, (e, n), f, gen, device)
    x = _mat(gen, t, n)
    ids = torch.from_numpy(np.stack([gen.permutation(e)[:topk] for _ in range(t)]))
    rw = torch.from_numpy(gen.uniform(0.05, 1.0, (t, topk)).astype(np.float32))
    for act in ("silu", "gelu_tanh"):
        r = moe_align(ids.to(device).int(), e, TILE.block_m)
        h = torch.full((r.rows.shape[0], f), float("nan"), device=device)
        moe_gate_up(x.to(device), wg, wu, int(qg), int(qg), r, h, act, exact=True, tile=TILE)
        xd = x.double()
        g = torch.einsum("tkfn,tn->tkf", dg[ids], xd)  # [T, K, F]
        u = torch.einsum("tkfn,tn->tkf", du[ids], xd)
        hb = ACTIVATIONS[act](g) * u
        bound = 1.2 * torch.einsum("tkfn,tn->tkf", dg[ids].abs(), xd.abs()) * u.abs() + \
            ACTIVATIONS[act](g).abs() * torch.einsum("tkfn,tn->tkf", du[ids].abs(), xd.abs())
        rows = r.rows.cpu()
        live = rows >= 0
        got_h = h.cpu()[live]  # [T*K, F] in padded order
        a_idx = rows[live].long()
        _check(got_h, hb.reshape(-1, f)[a_idx], bound.reshape(-1, f)[a_idx], EXACT_TOL, f"gate_up {act} {seed}")
        y = torch.full((t * topk, n), float("nan"), device=device)
        moe_down(h, wd, int(qd), r, rw.reshape(-1).to(device), y, exact=True, tile=TILE)
        ref = rw.double()[..., None] * torch.einsum("tknf,tkf->tkn", dd[ids], hb)  # [T, K, N]
        bnd = rw.double()[..., None] * torch.einsum("tknf,tkf->tkn", dd[ids].abs(), hb.abs())
        _check(y, ref.reshape(-1, n), bnd.reshape(-1, n), EXACT_TOL, f"down {qd.name} {seed}")


def test_deterministic(device, rng) -> None:
    gen, _ = rng
    raw, _ = _weights(T.Q4_K, (40,), 512, gen, device)
    a = _mat(gen, 19, 512).to(device)
    outs = [qgemm(a, raw, int(T.Q4_K), torch.empty(19, 40, device=device), tile=TILE) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


def test_unsupported_and_bad_k(device) -> None:
    with pytest.raises(NotImplementedError, match="GGML type 10"):
        qgemm(torch.zeros(1, 256), torch.zeros(1, 84, dtype=torch.uint8), 10, torch.zeros(1, 1))
    with pytest.raises(ValueError, match="K = 100"):
        qgemm(torch.zeros(1, 100), torch.zeros(1, 100, dtype=torch.uint8), 8, torch.zeros(1, 1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_bf16(qtype, device, rng) -> None:
    """The bf16 copy dense prefill products multiply: every weight rounded to nearest bf16, bit for bit."""
    gen, _ = rng
    k = 320 if GEOMETRY[qtype][0] == 32 else 512
    raw, w = _weights(qtype, (37,), k, gen, device)
    out = torch.full((37, k), float("nan"), device=device, dtype=torch.bfloat16)
    dequantize_bf16(raw, int(qtype), out)
    assert torch.equal(out.cpu().view(torch.int16), w.float().bfloat16().view(torch.int16))
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_bf16(raw, int(qtype), out[:, :-32])


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("tile", [(64, 4), (2, 1), (8, 2, 4), (16, 4, 3)], ids=str)
def test_dequantize_bf16_tiles(tile, qtype, device, rng) -> None:
    """Other copy tiles (the benchmark's candidates; K steps that overrun K) give the same bits."""
    gen, _ = rng
    k = 320 if qtype == T.Q8_0 else 512
    raw, w = _weights(qtype, (37,), k, gen, device)
    out = torch.full((37, k), float("nan"), device=device, dtype=torch.bfloat16)
    dequantize_bf16(raw, int(qtype), out, tile=tile)
    assert torch.equal(out.cpu().view(torch.int16), w.float().bfloat16().view(torch.int16))
