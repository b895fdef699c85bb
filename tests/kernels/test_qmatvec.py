"""Fused quantized matvec kernels vs `dequantize(...) @ x` in float64, on fresh random valid blocks.

Runs on CUDA when available, else on the CPU through Triton's interpreter (TRITON_INTERPRET=1 must be
set before triton is imported, hence the environment line above the imports).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from support.kernel_checks import check_bound as _check  # noqa: E402
from support.kernel_checks import quant_weights as _weights  # noqa: E402
from support.kernel_checks import router_logits  # noqa: E402
from support.kernel_checks import vec as _vec  # noqa: E402

from moerun.kernels.reference import ACTIVATIONS  # noqa: E402
from moerun.kernels.torch_ops import Route  # noqa: E402
from moerun.kernels.triton.decode_ops import route_topk  # noqa: E402
from moerun.kernels.triton.qmatvec import GEOMETRY, SUPPORTED, Tile, moe_down, moe_gate_up, qmatvec  # noqa: E402

# silu / gelu_tanh divide by 1 + exp(-z): exp overflows to inf for very negative inputs (exactly right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.Q5_0, T.F16, T.BF16, T.F32]
SB = 256  # K is a whole number of 256-weight super-blocks (valid for every type)


def _small_tile(qtype: int) -> Tile:
    """Few rows, a K-step of 512 weights: several programs and a masked tail for K = 3 super-blocks."""
    return Tile(block_m=4, nb=512 // GEOMETRY[qtype][0], num_warps=4)


def test_supported() -> None:
    assert SUPPORTED == frozenset(int(t) for t in TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(
    "m,n_sb,small,res",
    [(1, 1, False, False), (3, 2, False, True), (130, 1, False, True), (37, 3, True, True)],
)
def test_qmatvec(qtype, m, n_sb, small, res, device, rng) -> None:
    gen, seed = rng
    k = n_sb * SB
    raw, dense = _weights(qtype, (m,), k, gen, device)
    x = _vec(gen, k)
    ref = dense @ x.double()
    bound = dense.abs() @ x.double().abs()
    out = torch.full((m,), float("nan"), device=device)
    residual = None
    if res:  # out aliases residual
        r = _vec(gen, m)
        out.copy_(r.to(device))
        residual = out
        ref, bound = ref + r.double(), bound + r.double().abs()
    tile = _small_tile(qtype) if small else None
    got = qmatvec(raw, int(qtype), x.to(device), out, residual, tile=tile)
    assert got is out
    _check(out, ref, bound, seed, f"{qtype.name} M={m} K={k} tile={tile}")


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n_sb,small", [(1, 1, False), (130, 3, True), (37, 2, False)])
def test_qmatvec_pre(qtype, m, n_sb, small, device, rng) -> None:
    """pre (the default): the first K-step's weights loaded ahead (before the PDL wait on a GPU): one step (the
    whole row), several with a masked tail (K = 3 super-blocks in 512-weight steps), and a residual, within the
    float64 bound; in the interpreter the plain kernel's sums bit for bit (on an H100 the one-step F16 case failed
    that equality: the two kernels compile to different code; NOTES.md 8i)."""
    gen, seed = rng
    k = n_sb * SB
    raw, dense = _weights(qtype, (m,), k, gen, device)
    x = _vec(gen, k)
    r = _vec(gen, m)
    ref, bound = dense @ x.double() + r.double(), dense.abs() @ x.double().abs() + r.double().abs()
    tile = _small_tile(qtype) if small else None
    want = qmatvec(raw, int(qtype), x.to(device), r.to(device).clone(), r.to(device), tile=tile, pre=False)
    got = torch.full((m,), float("nan"), device=device)
    qmatvec(raw, int(qtype), x.to(device), got, r.to(device), tile=tile)
    if device.type == "cpu":
        assert torch.equal(got, want), f"{qtype.name} M={m} K={k} tile={tile} (seed {seed})"
    _check(got, ref, bound, seed, f"pre {qtype.name} M={m} K={k} tile={tile}")


@pytest.mark.parametrize("e,n_sel,renorm,ties", [(6, 3, False, True), (64, 8, True, False), (37, 2, True, True),
                                                 (128, 8, False, True)])
@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q5_K], ids=lambda t: t.name)
def test_moe_gate_up_routes(qtype, e, n_sel, renorm, ties, device, rng) -> None:
    """With `route` the byte gate/up launch chooses the experts itself: ids (poisoned before), weights
    (NaN before) and h equal route_topk's choice followed by the plain launch, bit for bit."""
    gen, seed = rng
    f, k = 37, 2 * SB
    wg, _ = _weights(qtype, (e, f), k, gen, device)
    wu, _ = _weights(qtype, (e, f), k, gen, device)
    x = _vec(gen, k).to(device)
    logits = router_logits(gen, e, n_sel, ties).to(device)
    want_w = torch.full((n_sel,), float("nan"), device=device)
    want_ids = torch.full((n_sel,), -1, device=device, dtype=torch.int32)
    route_topk(logits, n_sel, renorm, want_w, want_ids)
    tile = Tile(4, 2 * SB // GEOMETRY[qtype][0] // 2, 4)  # several programs per expert, two K-steps
    want = moe_gate_up(wg, wu, int(qtype), int(qtype), x, want_ids, torch.empty(n_sel, f, device=device), tile=tile)
    got_w, got_ids = torch.full_like(want_w, float("nan")), torch.full_like(want_ids, -1)
    got = moe_gate_up(wg, wu, int(qtype), int(qtype), x, got_ids, torch.full((n_sel, f), float("nan"), device=device),
                      route=Route(logits, got_w, renorm), tile=tile)
    msg = f"seed={seed} {qtype.name} E={e} n_sel={n_sel} logits={logits.tolist()}"
    assert torch.equal(got_ids, want_ids), msg
    torch.testing.assert_close(got_w, want_w, rtol=2e-7, atol=0, msg=msg)
    assert torch.equal(got, want), msg


@pytest.mark.parametrize(
    "qg,qu", [(q, q) for q in TYPES] + [(T.Q4_K, T.Q8_0), (T.Q6_K, T.F16)], ids=lambda t: t.name
)
def test_moe_gate_up(qg, qu, device, rng) -> None:
    gen, seed = rng
    e, f, k = 5, 37, 2 * SB
    wg, dg = _weights(qg, (e, f), k, gen, device)
    wu, du = _weights(qu, (e, f), k, gen, device)
    x = _vec(gen, k)
    xd = x.double()
    for ids_list, act, dtype, small in [([4, 1, 4], "silu", torch.int64, False), ([2], "gelu_tanh", torch.int32, True)]:
        ids = torch.tensor(ids_list, dtype=dtype)
        g, u = dg[ids] @ xd, du[ids] @ xd  # [n_sel, F]
        gb, ub = dg[ids].abs() @ xd.abs(), du[ids].abs() @ xd.abs()
        a = ACTIVATIONS[act](g)
        ref = a * u
        bound = 1.2 * gb * u.abs() + a.abs() * ub  # |act'| <= 1.13 for silu and gelu_tanh
        out = torch.full((len(ids_list), f), float("nan"), device=device)
        tile = Tile(4, 2 * SB // GEOMETRY[qg][0] // 2, 4) if small else None
        moe_gate_up(wg, wu, int(qg), int(qu), x.to(device), ids.to(device), out, act, tile=tile)
        _check(out, ref, bound, seed, f"gate_up {qg.name}/{qu.name} ids={ids_list} {act} tile={tile}")


def _down_ref(dw: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, wts: torch.Tensor, r: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 r + sum_i wts[i] Wd[ids[i]] @ h[i] and its bound (the same with every term's magnitude): [N] each."""
    parts = torch.einsum("snf,sf->sn", dw[ids], h.double())  # [n_sel, N]
    bounds = torch.einsum("snf,sf->sn", dw[ids].abs(), h.double().abs())
    return (r.double() + (wts.double()[:, None] * parts).sum(0),
            r.double().abs() + (wts.double()[:, None] * bounds).sum(0))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_moe_down(qtype, device, rng) -> None:
    gen, seed = rng
    e, n, f = 5, 37, 3 * SB
    w, dw = _weights(qtype, (e, n), f, gen, device)
    for ids_list, dtype, small in [([3, 0, 3], torch.int32, False), ([1], torch.int64, True)]:
        n_sel = len(ids_list)
        ids = torch.tensor(ids_list, dtype=dtype)
        h = _vec(gen, n_sel, f)
        wts = torch.from_numpy(gen.uniform(0.05, 1.0, n_sel).astype(np.float32))
        r = _vec(gen, n)
        ref, bound = _down_ref(dw, ids, h, wts, r)
        out = r.to(device)  # out aliases residual
        tile = _small_tile(qtype) if small else None
        moe_down(w, int(qtype), h.to(device), ids.to(device), wts.to(device), out, out, tile=tile)
        _check(out, ref, bound, seed, f"down {qtype.name} ids={ids_list} tile={tile}")


@pytest.mark.parametrize("qtype,f,ahead", [(T.F16, 512, 2), (T.BF16, 768, 2), (T.F32, 512, 4)], ids=str)
def test_moe_down_route(qtype, f, ahead, device, rng) -> None:
    """route (the default after a routed byte gate/up): the byte down ranks the experts itself from the router's
    logits (top-4 of 6, a tie at the lowest rank broken to the lower index, as the gate/up's `topk_logits`) and never
    reads ids (poisoned out of range); within the float64 bound and, in the interpreter, the ids-given result bit
    for bit. Refused with experts_ahead 1, a quantized type (one expert at a time) or too many experts."""
    gen, seed = rng
    e, n = 6, 37
    ids = torch.tensor([1, 3, 0, 5], dtype=torch.int32)
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.25, 0.5])  # best: 1, 3, then 0 and 5 tied (0), 4
    w, dw = _weights(qtype, (e, n), f, gen, device)
    h = _vec(gen, 4, f)
    wts = torch.from_numpy(gen.uniform(0.05, 1.0, 4).astype(np.float32))
    r = _vec(gen, n)
    ref, bound = _down_ref(dw, ids, h, wts, r)
    h, wts, r = h.to(device), wts.to(device), r.to(device)
    want = moe_down(w, int(qtype), h, ids.to(device), wts, r, torch.full((n,), float("nan"), device=device),
                    experts_ahead=ahead)
    route = Route(logits.to(device), wts, False)
    bad = torch.full((4,), 1 << 30, dtype=torch.int32, device=device)  # read as ids, these would fault or NaN
    got = moe_down(w, int(qtype), h, bad, wts, r, torch.full((n,), float("nan"), device=device), experts_ahead=ahead,
                   route=route)
    _check(got, ref, bound, seed, f"down {qtype.name} route ahead={ahead}")
    if device.type == "cpu":
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="experts_ahead > 1"):
        moe_down(w, int(qtype), h, bad, wts, r, got, experts_ahead=1, route=route)
    wq, _ = _weights(T.Q8_0, (e, n), f, gen, device)
    with pytest.raises(ValueError, match="experts_ahead > 1"):
        moe_down(wq, int(T.Q8_0), h, bad, wts, r, got, route=route)
    with pytest.raises(ValueError, match="at most 256 experts"):
        moe_down(w, int(qtype), h, bad, wts, r, got, route=Route(torch.zeros(300, device=device), wts, False))


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.F32, T.Q4_K], ids=lambda t: t.name)
def test_moe_down_experts_ahead(qtype, device, rng) -> None:
    """Experts loaded ahead of their arithmetic (F32 / F16 / BF16; other types ignore it): bit for bit the one-expert
    loop, with three K-steps (a small tile) and one longer than K (the default tile: 1,024 of 768, masked), 2 / 3
    (-> 2) / 4 of 4 experts ahead, poisoned outputs."""
    gen, seed = rng
    e, n, f = 5, 37, 3 * SB
    w, dw = _weights(qtype, (e, n), f, gen, device)
    ids = torch.tensor([3, 0, 3, 1], dtype=torch.int32)
    h = _vec(gen, 4, f)
    wts = torch.from_numpy(gen.uniform(0.05, 1.0, 4).astype(np.float32))
    r = _vec(gen, n)
    ref, bound = _down_ref(dw, ids, h, wts, r)
    args = (w, int(qtype), h.to(device), ids.to(device), wts.to(device), r.to(device))
    for tile in (None, Tile(block_m=4, nb=256 // GEOMETRY[qtype][0], num_warps=2)):
        one = moe_down(*args, torch.full((n,), float("nan"), device=device), tile=tile, experts_ahead=1)
        for ahead in (None, 2, 3, 4):  # None: the default, EXPERTS_AHEAD
            out = torch.full((n,), float("nan"), device=device)
            moe_down(*args, out, tile=tile, **({} if ahead is None else {"experts_ahead": ahead}))
            _check(out, ref, bound, seed, f"down {qtype.name} experts_ahead={ahead} tile={tile}")
            assert torch.equal(out, one), f"{qtype.name} experts_ahead={ahead} tile={tile}"


def test_deterministic(device, rng) -> None:
    gen, _ = rng
    raw, _ = _weights(T.Q4_K, (130,), 2 * SB, gen, device)
    x = _vec(gen, 2 * SB).to(device)
    a = qmatvec(raw, int(T.Q4_K), x, torch.empty(130, device=device))
    b = qmatvec(raw, int(T.Q4_K), x, torch.empty(130, device=device))
    assert torch.equal(a, b)


def test_unsupported(device) -> None:
    with pytest.raises(NotImplementedError, match="GGML type 10"):
        qmatvec(torch.zeros(1, 84, dtype=torch.uint8), 10, torch.zeros(256), torch.zeros(1))


def test_triton_ops_routes_the_byte_down_after_its_gate_up(device, rng) -> None:
    """TritonOps pairs a byte down with the routed F16 gate/up launched just before it (`late`): that down ranks the
    experts itself (the ids the gate/up wrote give the same sums); a down with no such gate/up before it reads ids,
    even when given the route (ids set to other experts than the logits rank first change the result)."""
    from moerun.kernels.ops import make_ops

    gen, seed = rng
    e, f, k, n, n_sel = 6, 64, 256, 37, 2
    ops = make_ops("triton")
    wg, _ = _weights(T.F16, (e, f), k, gen, device)
    wu, _ = _weights(T.F16, (e, f), k, gen, device)
    wd, _ = _weights(T.F16, (e, n), f, gen, device)
    x = _vec(gen, k).to(device)
    r = _vec(gen, n).to(device)
    route = Route(torch.tensor([0.5, 2.0, -1.0, 1.5, 0.25, 0.0], device=device),
                  torch.full((n_sel,), float("nan"), device=device), False)  # ranks experts 1, 3
    ids = torch.full((n_sel,), -1, dtype=torch.int32, device=device)
    h = torch.full((n_sel, f), float("nan"), device=device)
    ops.moe_gate_up(wg, wu, int(T.F16), int(T.F16), x, ids, h, route=route)
    assert ids.tolist() == [1, 3]
    got = ops.moe_down(wd, int(T.F16), h, ids, route.weights_out, r, torch.full_like(r, float("nan")), route=route)
    want = moe_down(wd, int(T.F16), h, ids, route.weights_out, r, torch.empty_like(r))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"seed {seed}")
    other = torch.tensor([4, 0], dtype=torch.int32, device=device)
    got = ops.moe_down(wd, int(T.F16), h, other, route.weights_out, r, torch.full_like(r, float("nan")), route=route)
    want = moe_down(wd, int(T.F16), h, other, route.weights_out, r, torch.empty_like(r))
    assert torch.equal(got, want), f"a down with no late gate/up before it ranked the experts itself (seed {seed})"
