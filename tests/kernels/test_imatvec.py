"""Integer-dot Q4_K kernels (kernels/triton/imatvec.py) against float64 products of gguf's dequantized weights.

Two references per product: the float64 product with x24's dequantized x (what the kernel computes, up to float32
rounding: RTOL of sum |w| |x|) and with the original x (x's 24-bit rounding: under 2^-22 of each group's largest
value per element, float32's roundings in the quantizer included, so well inside RTOL too). Without a GPU the kernels
run in Triton's interpreter.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from support.kernel_checks import check_bound, quant_weights, vec  # noqa: E402

from moerun.kernels.reference import ACTIVATIONS  # noqa: E402
from moerun.kernels.triton import imatvec as ik  # noqa: E402
from moerun.kernels.triton import wmatvec as wk  # noqa: E402
from moerun.kernels.triton.decode_ops import route_topk  # noqa: E402

Q8_0, Q4_K, Q6_K = int(T.Q8_0), int(T.Q4_K), int(T.Q6_K)


def _iweights(qtype: int, lead: tuple[int, ...], k: int, gen, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights in the layout the integer kernels read (Q4_K's rows; Q6_K / Q8_0 through imatvec.COPIES) and
    their float64 values."""
    raw, dense = quant_weights(qtype, lead, k, gen, device)
    return (raw if qtype == Q4_K else ik.COPIES[qtype](raw)), dense
X_TOL = 2e-5  # against the unquantized x
TILES = [None, wk.WTile(1, 1), wk.WTile(4, 2, 1, 1), wk.WTile(2, 4, 2, 2)]


def _x24(x: torch.Tensor, device: torch.device) -> tuple[ik.X24, torch.Tensor]:
    """x24 from the kernel (checked against the twin) and its dequantized x, float64 on the CPU."""
    xq = ik.quantize_x24(x.to(device))
    ref = ik.quantize_x24_ref(x)
    got_q = xq.hi.cpu().int() * 256 + xq.lo.cpu().int()
    assert (got_q - (ref.hi.int() * 256 + ref.lo.int())).abs().max() <= 1  # the GPU's division may round otherwise
    torch.testing.assert_close(xq.s.cpu(), ref.s, rtol=1e-6, atol=0)
    torch.testing.assert_close(xq.sum.cpu(), ref.sum, rtol=1e-5, atol=1e-5)
    return xq, ik.dequantize_x24(ik.X24(*(t.cpu() for t in xq))).double()


def test_quantize_x24_bound(device, rng) -> None:
    gen, seed = rng
    x = vec(gen, 3, 96) * torch.logspace(-3, 3, 96)  # groups of very different size
    x[1, 32:64] = 0.0  # an all-zero group
    x[2, 64] = -x[2, 64:96].abs().max() * 1.5  # the group's largest value negative: X = -(2^23 - 1)
    xq, xd = _x24(x, device)
    big = x.abs().reshape(3, 3, 32).amax(-1, keepdim=True).expand(3, 3, 32).reshape(3, 96)
    # half a step s = max / (2^23 - 1) from rounding, and the quantizer's float32 roundings (of 1 / s, of x / s near
    # 2^23, of s itself) up to ~1.3 more: 1.47 and 1.53 steps seen (CI seeds 3852666082037259362, 9891836488364108355)
    err = (xd - x.double()).abs() / (big.double() * 2.0 ** -23)
    assert (err[big > 0] <= 2.0).all(), f"seed {seed}: {err[big > 0].max():.3f} steps"
    assert (xq.hi.cpu()[1, 32:64] == 0).all() and (xq.lo.cpu()[1, 32:64] == 0).all() and xq.s.cpu()[1, 1] == 0
    assert -(2 ** 23 - 1) <= int(xq.hi.cpu()[2, 64]) * 256 + int(xq.lo.cpu()[2, 64]) <= -(2 ** 23 - 2)


@pytest.mark.parametrize("tile,words", [(t, ik.WORDS_PER_THREAD) for t in TILES] + [(None, 4), (wk.WTile(1, 2), 4)],
                         ids=str)
@pytest.mark.parametrize("m,n_sb,res", [(1, 1, False), (37, 3, True), (130, 2, False)])
def test_qmatvec_i(m, n_sb, res, tile, words, device, rng) -> None:
    gen, seed = rng
    k = 256 * n_sb
    raw, dense = quant_weights(Q4_K, (m,), k, gen, device)
    x = vec(gen, k)
    xq, xd = _x24(x, device)
    out = torch.full((m,), float("nan"), device=device)
    r = vec(gen, m) if res else torch.zeros(m)
    if res:
        out.copy_(r.to(device))
    got = ik.qmatvec_i(raw, xq, out, out if res else None, tile=tile, words=words)
    assert got is out
    what = f"Q4_K imatvec M={m} K={k} tile={tile} words={words}"
    check_bound(out, dense @ xd + r.double(), dense.abs() @ xd.abs() + r.double().abs(), seed, what)
    check_bound(out, dense @ x.double() + r.double(), dense.abs() @ x.double().abs() + r.double().abs(), seed,
                what + " (unquantized x)", tol=X_TOL)


@pytest.mark.parametrize("words", [ik.WORDS_PER_THREAD, 4])
def test_qmatvec_i_extremes(words, device) -> None:
    """The integer sums at their largest: every nibble 15 under the largest 6-bit scales and every x at its group's
    largest value (X = 2^23 - 1 throughout), dmin 0, against gguf's dequantization: no int32 sum overflows."""
    m, k = 3, 512
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(2.0 ** -10).tobytes(), dtype=np.uint8)  # d; dmin (bytes 2-3) 0
    block[4:] = 0xFF  # the 12 scale bytes (all scales and mins 63) and every nibble 15
    raw = np.tile(block, (m, k // 256))
    w = torch.from_numpy(gguf_dequantize(raw, T.Q4_K).astype(np.float64))  # [m, k]
    x = torch.full((k,), 3.0)  # X = 2^23 - 1: hi 32767, lo 255 everywhere
    xq, xd = _x24(x, device)
    out = ik.qmatvec_i(torch.from_numpy(raw).to(device), xq, torch.full((m,), float("nan"), device=device),
                       words=words)
    check_bound(out, w @ xd, w.abs() @ xd.abs(), 0, f"Q4_K extremes words={words}")


def test_bytes_q6k_signed_exact(device, rng) -> None:
    """The signed bytes copy (q - 32 per byte, then scales and d) dequantizes to gguf's values exactly."""
    gen, _ = rng
    raw, dense = quant_weights(Q6_K, (3,), 512, gen, device)
    c = wk.bytes_q6k(raw.cpu(), signed=True).reshape(3, 2, wk.BYTES_Q6)
    q = c[..., :256].view(torch.int8).double()
    sc = c[..., 256:272].view(torch.int8).double()
    d = c[..., 272:274].contiguous().view(torch.float16).double()  # [3, 2, 1]
    got = (d * sc.repeat_interleave(16, -1) * q).reshape(3, 512)
    assert torch.equal(got, dense)


@pytest.mark.parametrize("tile", [None, wk.WTile(1, 1), wk.WTile(4, 2, 1, 1), wk.WTile(2, 4, 2, 2)], ids=str)
@pytest.mark.parametrize("m,n_sb,res", [(1, 1, False), (37, 3, True), (130, 2, False)])
@pytest.mark.parametrize("qtype", [Q6_K, Q8_0])
def test_qmatvec_i_bytes(qtype, m, n_sb, res, tile, device, rng) -> None:
    """Q6_K and Q8_0 through their byte copies (imatvec.Q6I, Q8I)."""
    gen, seed = rng
    k = 256 * n_sb
    raw, dense = quant_weights(qtype, (m,), k, gen, device)
    w = ik.COPIES[qtype](raw)
    assert ik.takes(qtype, w, k) and not ik.takes(qtype, raw, k)
    xq, xd = _x24(vec(gen, k), device)
    out = torch.full((m,), float("nan"), device=device)
    r = vec(gen, m) if res else torch.zeros(m)
    if res:
        out.copy_(r.to(device))
    ik.qmatvec_i(w, xq, out, out if res else None, qtype=qtype, tile=tile)
    check_bound(out, dense @ xd + r.double(), dense.abs() @ xd.abs() + r.double().abs(), seed,
                f"{T(qtype).name} imatvec M={m} K={k} tile={tile}")


def test_bytes_q8_0_exact(device, rng) -> None:
    """The Q8I copy (256 bytes, then the 8 scales as float32) holds gguf's values exactly."""
    gen, _ = rng
    raw, dense = quant_weights(Q8_0, (3,), 512, gen, device)
    c = ik.bytes_q8_0(raw.cpu()).reshape(3, 2, ik.BYTES_Q8I)
    q = c[..., :256].view(torch.int8).double()
    d = c[..., 256:].contiguous().view(torch.float32).double()  # [3, 2, 8]
    assert torch.equal((d.repeat_interleave(32, -1) * q).reshape(3, 512), dense)


def test_qmatvec_i_rejects_file_rows(device) -> None:
    w = torch.zeros(4, 210, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="Q6_K matrix .* no integer-dot kernel"):  # the file's rows
        ik.qmatvec_i(w, ik.X24.empty((256,), device), torch.empty(4, device=device), qtype=Q6_K)


@pytest.mark.parametrize("qtype,tile,words", [(Q4_K, t, ik.WORDS_PER_THREAD) for t in TILES] + [(Q4_K, None, 4)]
                         + [(q, t, 8) for q in (Q6_K, Q8_0) for t in (None, wk.WTile(1, 1))], ids=str)
def test_moe_gate_up_i(qtype, tile, words, device, rng) -> None:
    gen, seed = rng
    e, f, k = 5, 37, 768
    wg, dg = _iweights(qtype, (e, f), k, gen, device)
    wu, du = _iweights(qtype, (e, f), k, gen, device)
    xq, xd = _x24(vec(gen, k), device)
    for ids_list, act, dtype in [([4, 1, 4], "silu", torch.int64), ([2], "gelu_tanh", torch.int32)]:
        ids = torch.tensor(ids_list, dtype=dtype)
        g, u = dg[ids] @ xd, du[ids] @ xd
        a = ACTIVATIONS[act](g)
        bound = 1.2 * (dg[ids].abs() @ xd.abs()) * u.abs() + a.abs() * (du[ids].abs() @ xd.abs())
        out = torch.full((len(ids_list), f), float("nan"), device=device)
        ik.moe_gate_up_i(wg, wu, xq, ids.to(device), out, act, tile=tile, words=words, qtype=qtype)
        check_bound(out, a * u, bound, seed, f"{T(qtype).name} igate_up ids={ids_list} {act} tile={tile}")


@pytest.mark.parametrize("tile", [None, wk.WTile(2, 1, 1, 1)], ids=str)
def test_moe_gate_up_i_quantizes_h(tile, device, rng) -> None:
    """h_out: the launch also quantizes h for the integer down (each 32-value group by the last of its programs to
    finish, counters left zero); routed, so the ids come from the same launch (the same ids, weights and h as
    route_topk's choice followed by the plain launch). Twice, so the counters' reset shows."""
    gen, _ = rng
    e, f, k, n_sel = 5, 64, 256, 2
    wg, _ = quant_weights(Q4_K, (e, f), k, gen, device)
    wu, _ = quant_weights(Q4_K, (e, f), k, gen, device)
    xq, _ = _x24(vec(gen, k), device)
    cnt = torch.zeros(n_sel * f // 32, dtype=torch.int32, device=device)
    for _ in range(2):
        logits = vec(gen, e).to(device)
        ids = torch.full((n_sel,), -1, dtype=torch.int32, device=device)
        out = torch.full((n_sel, f), float("nan"), device=device)
        h24 = ik.X24.empty((n_sel, f), device)
        route = wk.Route(logits, torch.full((n_sel,), float("nan"), device=device), True)
        ik.moe_gate_up_i(wg, wu, xq, ids, out, route=route, h_out=h24, counters=cnt, tile=tile)
        want_w, want_ids = torch.empty(n_sel, device=device), torch.empty(n_sel, dtype=torch.int32, device=device)
        route_topk(logits, n_sel, True, want_w, want_ids)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(route.weights_out, want_w, rtol=2e-7, atol=0)
        plain = ik.moe_gate_up_i(wg, wu, xq, want_ids, torch.empty(n_sel, f, device=device), tile=tile)
        assert torch.equal(out, plain)
        want = ik.quantize_x24_ref(out.cpu())
        got_q = h24.hi.cpu().int() * 256 + h24.lo.cpu().int()
        assert (got_q - (want.hi.int() * 256 + want.lo.int())).abs().max() <= 1
        torch.testing.assert_close(h24.s.cpu(), want.s, rtol=1e-6, atol=0)
        assert int(cnt.abs().sum()) == 0


def test_moe_gate_up_i_h_out_checked(device) -> None:
    w = torch.zeros(2, 48, 144, dtype=torch.uint8, device=device)
    x = ik.X24.empty((256,), device)
    with pytest.raises(ValueError, match="h_out needs"):
        ik.moe_gate_up_i(w, w, x, torch.zeros(1, dtype=torch.int32, device=device),
                         torch.zeros(1, 48, device=device), h_out=ik.X24.empty((1, 64), device),
                         counters=torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("tile", [None, wk.WTile(1, 1), wk.WTile(2, 2, 1, 1)], ids=str)
@pytest.mark.parametrize("qtype", [Q6_K, Q8_0])
def test_moe_down_i_bytes(qtype, tile, device, rng) -> None:
    """Q6_K and Q8_0 experts through their byte copies."""
    gen, seed = rng
    e, n, f = 4, 37, 512
    w, dw = _iweights(qtype, (e, n), f, gen, device)
    ids = torch.tensor([2, 0, 2], dtype=torch.int32)
    hq, hd = _x24(vec(gen, 3, f), device)
    wts = torch.from_numpy(gen.uniform(0.05, 1.0, 3).astype(np.float32))
    r = vec(gen, n)
    ref = r.double() + (wts.double()[:, None] * torch.einsum("snf,sf->sn", dw[ids], hd)).sum(0)
    bound = r.double().abs() + (wts.double()[:, None] * torch.einsum("snf,sf->sn", dw[ids].abs(), hd.abs())).sum(0)
    out = r.to(device)
    ik.moe_down_i(w, hq, ids.to(device), wts.to(device), out, out, qtype=qtype, tile=tile)
    check_bound(out, ref, bound, seed, f"{T(qtype).name} idown tile={tile}")


@pytest.mark.parametrize("tile,words", [(t, ik.WORDS_PER_THREAD) for t in TILES] + [(None, 4)], ids=str)
def test_moe_down_i(tile, words, device, rng) -> None:
    gen, seed = rng
    e, n, f = 5, 37, 768
    w, dw = quant_weights(Q4_K, (e, n), f, gen, device)
    for ids_list, dtype in [([3, 0, 3], torch.int32), ([1], torch.int64)]:
        n_sel = len(ids_list)
        ids = torch.tensor(ids_list, dtype=dtype)
        hq, hd = _x24(vec(gen, n_sel, f), device)
        wts = torch.from_numpy(gen.uniform(0.05, 1.0, n_sel).astype(np.float32))
        r = vec(gen, n)
        parts = torch.einsum("snf,sf->sn", dw[ids], hd)
        bounds = torch.einsum("snf,sf->sn", dw[ids].abs(), hd.abs())
        ref = r.double() + (wts.double()[:, None] * parts).sum(0)
        bound = r.double().abs() + (wts.double()[:, None] * bounds).sum(0)
        out = r.to(device)  # out aliases residual
        ik.moe_down_i(w, hq, ids.to(device), wts.to(device), out, out, tile=tile, words=words)
        check_bound(out, ref, bound, seed, f"Q4_K idown ids={ids_list} tile={tile} words={words}")


def _idown_case(qtype: int, e: int, n: int, f: int, ids: torch.Tensor, gen, device) -> tuple[tuple, torch.Tensor,
                                                                                            torch.Tensor]:
    """Experts `ids` of e of an [n, f] down product in the integer kernels' layout: moe_down_i's arguments up to
    out (w, h, weights, residual; ids not included), the float64 reference (x24's dequantized h) with the
    residual, and its error bound."""
    w, dw = _iweights(qtype, (e, n), f, gen, device)
    hq, hd = _x24(vec(gen, len(ids), f), device)
    wts = torch.from_numpy(gen.uniform(0.05, 1.0, len(ids)).astype(np.float32))
    r = vec(gen, n)
    ref = r.double() + (wts.double()[:, None] * torch.einsum("snf,sf->sn", dw[ids], hd)).sum(0)
    bound = r.double().abs() + (wts.double()[:, None] * torch.einsum("snf,sf->sn", dw[ids].abs(), hd.abs())).sum(0)
    return (w, hq, wts.to(device), r.to(device)), ref, bound


@pytest.mark.parametrize("qtype,f", [(Q4_K, 768), (Q4_K, 512), (Q6_K, 512), (Q8_0, 768)])
def test_moe_down_i_experts_ahead(qtype, f, device, rng) -> None:
    """Experts loaded ahead of their arithmetic (the default, 2; 3 -> 2; 4 of 4; every K-step unrolled): within the
    bound of the float64 product, poisoned output rows, the same bits on a second run, and the same sums in the same
    order as the one-expert loop: bit for bit, except Q4_K on a GPU, where ptxas contracts its scale and min products
    into FMAs differently in the two code shapes (measured on the H100: last-bit differences), so there within 1e-6
    of the bound."""
    gen, seed = rng
    n, ids = 37, torch.tensor([3, 0, 3, 1], dtype=torch.int32)
    (w, hq, wts, r), ref, bound = _idown_case(qtype, 5, n, f, ids, gen, device)
    args = (w, hq, ids.to(device), wts, r)
    one = ik.moe_down_i(*args, torch.full((n,), float("nan"), device=device), qtype=qtype, experts_ahead=1)
    check_bound(one, ref, bound, seed, f"{T(qtype).name} idown one expert at a time")
    same_bits = qtype != Q4_K or torch.device(device).type == "cpu"
    for ahead in (None, 2, 3, 4):  # None: the default, EXPERTS_AHEAD
        kw = {} if ahead is None else {"experts_ahead": ahead}
        out = ik.moe_down_i(*args, torch.full((n,), float("nan"), device=device), qtype=qtype, **kw)
        check_bound(out, ref, bound, seed, f"{T(qtype).name} idown experts_ahead={ahead}")
        again = ik.moe_down_i(*args, torch.full((n,), float("nan"), device=device), qtype=qtype, **kw)
        assert torch.equal(out, again), f"experts_ahead={ahead}: two runs differ"
        if same_bits:
            assert torch.equal(out, one), f"experts_ahead={ahead} differs from the one-expert loop"
        else:
            check_bound(out, one.cpu().double(), bound, seed, f"experts_ahead={ahead} against one", tol=1e-6)


@pytest.mark.parametrize("qtype,f,ahead", [(Q4_K, 512, 2), (Q8_0, 768, 2), (Q6_K, 512, 4)])
def test_moe_down_i_route(qtype, f, ahead, device, rng) -> None:
    """route (`droute`): the kernel ranks the experts itself from the router's logits (top-4 of 6, a tie at the
    lowest rank broken to the lower index, as the gate/up's `topk_logits`) and never reads ids (poisoned out of
    range); the result is the one with the ids given, bit for bit. Refused with experts_ahead 1 or too many
    experts."""
    from moerun.kernels.torch_ops import Route

    gen, seed = rng
    n, ids = 37, torch.tensor([1, 3, 0, 5], dtype=torch.int32)
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 0.25, 0.5])  # best: 1, 3, then 0 and 5 tied (0), 4
    (w, hq, wts, r), ref, bound = _idown_case(qtype, 6, n, f, ids, gen, device)
    want = ik.moe_down_i(w, hq, ids.to(device), wts, r, torch.full((n,), float("nan"), device=device), qtype=qtype,
                         experts_ahead=ahead)
    route = Route(logits.to(device), wts, False)
    bad = torch.full((4,), 1 << 30, dtype=torch.int32, device=device)  # read as ids, these would fault or NaN
    got = ik.moe_down_i(w, hq, bad, wts, r, torch.full((n,), float("nan"), device=device), qtype=qtype,
                        experts_ahead=ahead, route=route)
    check_bound(got, ref, bound, seed, f"{T(qtype).name} idown route")
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="experts_ahead > 1"):
        ik.moe_down_i(w, hq, bad, wts, r, got, qtype=qtype, experts_ahead=1, route=route)
    many = Route(torch.zeros(300, device=device), wts, False)
    with pytest.raises(ValueError, match="at most 256 experts"):
        ik.moe_down_i(w, hq, bad, wts, r, got, qtype=qtype, route=many)


def test_qmatvec_i2(device, rng) -> None:
    """Two matrices of different layouts (a Q4_K q/k run, a Q6_K or Q8_0 v) in one launch: each output bit for bit
    what `qmatvec_i` gives it alone (poisoned first)."""
    gen, _ = rng
    k = 512
    xq, _ = _x24(vec(gen, k), device)
    w, _ = _iweights(Q4_K, (37,), k, gen, device)
    for qt2, m2 in [(Q6_K, 19), (Q8_0, 6)]:
        w2, _ = _iweights(qt2, (m2,), k, gen, device)
        want = ik.qmatvec_i(w, xq, torch.empty(37, device=device))
        want2 = ik.qmatvec_i(w2, xq, torch.empty(m2, device=device), qtype=qt2)
        out, out2 = torch.full((37,), float("nan"), device=device), torch.full((m2,), float("nan"), device=device)
        ik.qmatvec_i2(w, Q4_K, out, w2, qt2, out2, xq)
        assert torch.equal(out, want) and torch.equal(out2, want2)


def test_deterministic(device, rng) -> None:
    gen, _ = rng
    raw, _ = quant_weights(Q4_K, (130,), 512, gen, device)
    xq, _ = _x24(vec(gen, 512), device)
    a = ik.qmatvec_i(raw, xq, torch.empty(130, device=device))
    b = ik.qmatvec_i(raw, xq, torch.empty(130, device=device))
    assert torch.equal(a, b)
