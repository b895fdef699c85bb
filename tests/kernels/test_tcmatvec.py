"""The tensor-core Q4_K matvec (kernels/triton/tcmatvec.py) vs `dequantize(...) @ x` in float64, on fresh random
blocks and activations of very different magnitudes; and its x preparation against plain torch.

CUDA when available, else Triton's interpreter (set before import).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from support.kernel_checks import check_bound, matvec_case, quant_weights, vec  # noqa: E402

from moerun.kernels.reference import ACTIVATIONS  # noqa: E402
from moerun.kernels.triton import tcmatvec as tc  # noqa: E402

Q4_K, Q6_K, Q8_0 = int(T.Q4_K), int(T.Q6_K), int(T.Q8_0)
TOL = 2e-6  # x split into two f16 parts: ~2^-22 relative each, then float32 accumulation


def test_column_order_is_a_permutation() -> None:
    cols = tc.tc_column_weights()
    assert sorted(cols.tolist()) == list(range(256))
    assert cols[:8].tolist() == [0, 2, 1, 3, 32, 34, 33, 35]  # word 0: bytes 0/2, 1/3 low, then high nibbles


@pytest.mark.parametrize("scale", [1.0, 3e4, 1e-6])
def test_prepare_x(scale, device, rng) -> None:
    gen, seed = rng
    k = 512
    x = vec(gen, k) * scale
    x[300:310] *= 1e3  # one sub-block with a much larger range than the others
    x[64:96] = 0.0  # and an empty one
    p = tc.prepare_x(x.to(device))
    xb, g, xs = (t.cpu() for t in p)
    cols = tc.tc_column_weights()
    sub = cols // 32  # sub-block (within the block) of each column's weight
    xd = x.double()
    mx = xd.view(-1, 32).abs().amax(1)
    assert (g > mx).all() and ((g <= 2 * mx) | (mx == 0)).all(), f"g not just above max |x| (seed {seed})"
    assert torch.equal(torch.log2(g), torch.log2(g).round())  # powers of two
    for b in range(k // 256):
        tile = xb[b].double()  # [256, 16]
        mask = torch.zeros(256, 16, dtype=torch.bool)
        mask[torch.arange(256), 2 * sub] = True
        mask[torch.arange(256), 2 * sub + 1] = True
        assert (tile[~mask] == 0).all(), f"off-diagonal entries (seed {seed})"
        gw = g[b * 8 + sub].double()  # each column's scale
        back = (tile[torch.arange(256), 2 * sub] + tile[torch.arange(256), 2 * sub + 1]) * gw
        err = ((back - xd[b * 256 + cols]).abs() / mx[b * 8 + sub].clamp_min(1e-300)).max().item()
        assert err <= 2**-21, f"x = g (hi + lo) off by {err:.3g} x max |x| of its 32 (seed {seed})"
    sums, scale_sums = xd.view(-1, 32).sum(1), xd.view(-1, 32).abs().sum(1)  # float32 sums of 32: ~1e-7 x sum|x|
    assert ((xs.double() - sums).abs() <= 1e-6 * scale_sums).all(), f"sums (seed {seed})"


@pytest.mark.parametrize("m,n_blk,res,split", [(1, 1, False, None), (37, 3, True, 1), (37, 3, True, 3),
                                               (130, 2, False, None), (130, 4, True, 4), (70, 4, False, 2)])
def test_qmatvec_tc(m, n_blk, res, split, device, rng) -> None:
    """split > 1: parts summed by each row block's last program (counters must be left at zero)."""
    gen, seed = rng
    k = 256 * n_blk
    raw, dense = quant_weights(Q4_K, (m,), k, gen, device)
    x = vec(gen, k)
    x[:7] *= 50.0  # uneven magnitudes inside a block
    out, residual, ref, bound = matvec_case(dense, x, res, gen, device)  # out aliases residual if res
    xp = tc.prepare_x(x.to(device))
    got = tc.qmatvec_tc(raw, xp, out, residual, split=split)
    assert got is out
    check_bound(out, ref, bound, seed, f"Q4_K tensor-core matvec M={m} K={k} split={split}", tol=TOL)
    if not res:  # the same bits again (fixed summation order), counters back at zero
        again = tc.qmatvec_tc(raw, xp, torch.full_like(out, float("nan")), split=split)
        assert torch.equal(again, out)
    for _part, count in tc._SCRATCH.values():
        assert (count == 0).all()


def test_rejects_bad_shapes(device) -> None:
    with pytest.raises(ValueError, match="K % 256"):
        tc.prepare_x(torch.zeros(300, device=device))
    raw = torch.zeros(4, 3 * 144, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="split 2 does not divide"):
        tc.qmatvec_tc(raw, tc.prepare_x(torch.zeros(768, device=device)), torch.empty(4, device=device), split=2)


def test_split_heuristic() -> None:
    cpu = torch.device("cpu")  # 4 "SMs" for the interpreter
    assert tc.tc_split(50304, 8, cpu) == 1 and tc.tc_split(64, 8, cpu) == 8 and tc.tc_split(64, 3, cpu) == 1


def test_triton_ops_dispatch(device, rng) -> None:
    """TritonOps(tc=True) sends Q4_K matvecs (K % 256 == 0) to the tensor-core kernel, x prepared into one buffer."""
    from moerun.kernels.triton_ops import TritonOps

    gen, seed = rng
    raw, dense = quant_weights(Q4_K, (40,), 512, gen, device)
    x = vec(gen, 512)
    ops = TritonOps(tc=True)
    out = ops.qmatvec(raw, Q4_K, x.to(device), torch.full((40,), float("nan"), device=device))
    check_bound(out, dense @ x.double(), dense.abs() @ x.double().abs(), seed, "TritonOps(tc=True)", tol=TOL)
    assert list(ops._tc_x) == [(512, 4, x.to(device).device)]
    assert ops.h_layout(Q4_K, Q4_K, Q4_K, 1024) == "tc4" and ops.h_layout(Q4_K, Q4_K, Q6_K, 1024) == "tc6"
    assert ops.h_layout(Q4_K, Q4_K, Q6_K, 768) is False and ops.h_layout(Q4_K, Q4_K, Q8_0, 1024) == "tc8"
    assert ops.h_layout(Q4_K, Q4_K, int(T.Q5_K), 1024) is False  # no kernel of either kind
    assert ops.h_layout(Q4_K, Q4_K, Q4_K, 1000) is False and TritonOps().h_layout(Q4_K, Q4_K, Q4_K, 1024) is True
    want = tc.qmatvec_tc(raw, tc.prepare_x(x.to(device)), torch.empty(40, device=device))
    assert torch.equal(out, want)
    # a normed x: rms_norm prepares it as it writes it, and the product reads that preparation (no launch)
    xn, nw = torch.empty(512, device=device), vec(gen, 512).to(device)
    ops.rms_norm(x.to(device), nw, 1e-6, xn)
    assert (xn.data_ptr(), 512, 4) in ops._tc_made
    got = ops.qmatvec(raw, Q4_K, xn, torch.empty(40, device=device))
    xd = xn.cpu().double()
    check_bound(got, dense @ xd, dense.abs() @ xd.abs(), seed, "TritonOps(tc=True), x prepared by rms_norm", tol=TOL)
    assert len(ops._tc_x) == 1  # no second preparation buffer
    # a Q8_0 product of xn prepares it once itself, and from the next rms_norm on gets it from there
    raw8, _ = quant_weights(Q8_0, (40,), 512, gen, device)
    want8 = tc.qmatvec_tc(raw8, tc.prepare_x(xn, fmt=8), torch.empty(40, device=device), qtype=Q8_0)
    assert torch.equal(ops.qmatvec(raw8, Q8_0, xn, torch.empty(40, device=device)), want8)
    assert ops._tc_want[(xn.data_ptr(), 512)] == [4, 8] and (xn.data_ptr(), 512, 8) not in ops._tc_made
    x2 = vec(gen, 512).to(device)  # the next step: new values, both layouts written by rms_norm
    ops.rms_norm(x2, nw, 1e-6, xn)
    assert (xn.data_ptr(), 512, 8) in ops._tc_made
    assert torch.equal(ops.qmatvec(raw8, Q8_0, xn, torch.empty(40, device=device)),
                       tc.qmatvec_tc(raw8, tc.prepare_x(xn, fmt=8), torch.empty(40, device=device), qtype=Q8_0))
    assert torch.equal(ops.qmatvec(raw, Q4_K, xn, torch.empty(40, device=device)),
                       tc.qmatvec_tc(raw, tc.prepare_x(xn), torch.empty(40, device=device)))
    assert len(ops._tc_x) == 2


@pytest.mark.parametrize("split", [None, 1, 2])
@pytest.mark.parametrize("out_tc", [False, True], ids=["f32", "tcx"])
def test_moe_gate_up_tc(out_tc, split, device, rng) -> None:
    gen, seed = rng
    e, f, k = 5, (256 if out_tc else 100), 512
    wg, dg = quant_weights(Q4_K, (e, f), k, gen, device)
    wu, du = quant_weights(Q4_K, (e, f), k, gen, device)
    x = vec(gen, k)
    ids = torch.tensor([4, 1, 3], dtype=torch.int32)
    g, u = dg[ids.long()] @ x.double(), du[ids.long()] @ x.double()  # [n_sel, F]
    a = ACTIVATIONS["silu"](g)
    ref = a * u
    xa = x.double().abs()
    bound = 1.2 * (dg[ids.long()].abs() @ xa) * u.abs() + a.abs() * (du[ids.long()].abs() @ xa)
    xp = tc.prepare_x(x.to(device))
    if out_tc:
        h = tc.moe_gate_up_tc(wg, wu, xp, ids.to(device), tc.empty_x(f, device, len(ids)), split=split)
        cols = tc.tc_column_weights()
        got_h = torch.stack([(h.xb[b, :, 0::2].double() + h.xb[b, :, 1::2].double()).sum(1) for b in
                             range(h.xb.shape[0])])  # [blocks, 256]: hi + lo of each column (one nonzero pair)
        gw = h.g.cpu().double().view(-1, 8)[:, (cols // 32)]  # [blocks, 256]
        vals = torch.empty(h.xb.shape[0], 256, dtype=torch.float64)
        vals[:, cols] = got_h.cpu() * gw
        # h is stored as g (hi + lo): ~2^-22 of the largest |h| of its 32, on top of the products' rounding
        group_max = ref.abs().reshape(-1, 32).amax(1).repeat_interleave(32)
        check_bound(vals.reshape(-1), ref.reshape(-1), bound.reshape(-1) + 0.25 * group_max, seed,
                    "gate/up into a TcX", tol=TOL)
    else:
        out = torch.full((len(ids), f), float("nan"), device=device)
        got = tc.moe_gate_up_tc(wg, wu, xp, ids.to(device), out, split=split)
        assert got is out
        check_bound(out, ref, bound, seed, f"Q4_K tensor-core gate/up split={split}", tol=TOL)
    for _part, count in tc._SCRATCH.values():
        assert (count == 0).all()


@pytest.mark.parametrize("split", [None, 1, 3])
def test_moe_down_tc(split, device, rng) -> None:
    gen, seed = rng
    e, n, f = 6, 70, 512
    wd, dd = quant_weights(Q4_K, (e, n), f, gen, device)
    ids = torch.tensor([5, 0, 2], dtype=torch.int32)
    h = torch.from_numpy(gen.standard_normal((3, f)).astype(np.float32)) * torch.tensor([[1.0], [1e3], [1e-3]])
    wts = torch.tensor([0.5, 0.25, 0.125])
    res = vec(gen, n)
    ref = res.double() + sum(wts[i].double() * (dd[ids[i]] @ h[i].double()) for i in range(3))
    bound = res.double().abs() + sum(wts[i].double() * (dd[ids[i]].abs() @ h[i].double().abs()) for i in range(3))
    out = torch.full((n,), float("nan"), device=device)
    hx = tc.prepare_x(h.reshape(-1).to(device))
    got = tc.moe_down_tc(wd, hx, ids.to(device), wts.to(device), res.to(device), out, split=split)
    assert got is out
    check_bound(out, ref, bound, seed, f"Q4_K tensor-core down split={split}", tol=TOL)
    again = tc.moe_down_tc(wd, hx, ids.to(device), wts.to(device), res.to(device), torch.empty_like(out), split=split)
    assert torch.equal(again, out)


@pytest.mark.parametrize("layout,qd", [("tc4", Q4_K), ("tc6", Q6_K), (False, Q4_K)])
def test_triton_ops_ffn(layout, qd, device, rng) -> None:
    """TritonOps(tc=True)'s FFN: gate/up hands h to down prepared (in the down type's layout) or as f32."""
    from moerun.kernels.triton_ops import TritonOps

    gen, seed = rng
    e, f, n = 4, 512, 256  # F = 512: a Q6_K down product needs K % 512 == 0
    wg, dg = quant_weights(Q4_K, (e, f), n, gen, device)
    wu, du = quant_weights(Q4_K, (e, f), n, gen, device)
    wd, dd = quant_weights(qd, (e, n), f, gen, device)
    x, res = vec(gen, n), vec(gen, n)
    ids, wts = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([0.7, 0.3])
    ops = TritonOps(tc=True)
    if layout:  # what the decode step would ask for (False: as for a down product without a tensor-core kernel)
        assert ops.h_layout(Q4_K, Q4_K, qd, f) == layout
    h = torch.full((2, f), float("nan"), device=device)
    ops.moe_gate_up(wg, wu, Q4_K, Q4_K, x.to(device), ids.to(device), h, perm_out=layout)
    href = ACTIVATIONS["silu"](dg[ids.long()] @ x.double()) * (du[ids.long()] @ x.double())
    if layout:
        assert h.isnan().all()  # h went to the prepared buffer instead
        out = ops.moe_down(wd, qd, h, ids.to(device), wts.to(device), res.to(device),
                           torch.empty(n, device=device), h_perm=layout)
        ref = res.double() + sum(wts[i].double() * (dd[ids[i]] @ href[i]) for i in range(2))
        bound = res.double().abs() + sum(wts[i].double() * (dd[ids[i]].abs() @ href[i].abs()) for i in range(2))
        check_bound(out, ref, bound, seed, "TritonOps tc gate/up -> down", tol=1e-5)
    else:
        torch.testing.assert_close(h.cpu().double(), href, rtol=1e-4, atol=1e-4 * href.abs().max().item())


def test_rms_norm_writes_prepared_x(device, rng) -> None:
    """decode_ops.rms_norm(out_tc=...) prepares its result as prepare_x would: xb and g bit for bit, the sums of 32
    within float32 rounding (on the GPU the compiler may fuse the norm's last multiply into the first adds of
    the sum: an FMA, one rounding fewer than summing the stored values)."""
    from moerun.kernels.triton import decode_ops as dk

    gen, seed = rng
    x, w = vec(gen, 512).to(device), vec(gen, 512).to(device)
    out, xt = torch.empty(512, device=device), tc.empty_x(512, device)
    dk.rms_norm(x, w, 1e-6, out, out_tc=[(4, xt)])
    want = tc.prepare_x(out)
    assert torch.equal(xt.xb, want.xb) and torch.equal(xt.g, want.g), f"seed {seed}"
    od = out.cpu().double().view(-1, 32)
    err = (xt.xs.cpu().double() - od.sum(1)).abs()
    assert (err <= 1e-6 * od.abs().sum(1)).all(), f"sums of 32 off by {err.max().item():.3g} (seed {seed})"
    with pytest.raises(ValueError, match="out_tc needs"):
        dk.rms_norm(x[:384], w[:384], 1e-6, out[:384], out_tc=[(4, xt)])


def _unprepare(x: tc.TcX, fmt: int) -> torch.Tensor:
    """The values a TcX holds, back in natural order (float64): g (hi + lo) at each position's slot."""
    k = x.g.numel() * 32
    pos = torch.arange(k)
    wi = pos % 256
    if fmt == 4:
        j = 8 * (8 * (wi // 64) + (wi // 4) % 8) + 4 * ((wi // 32) % 2) + 2 * (wi % 2) + (wi // 2) % 2
        row, cp = (pos // 256) * 256 + j, 2 * (wi // 32)
    elif fmt == 8:
        j = 64 * (wi // 64) + 8 * ((wi % 32) // 4) + 4 * ((wi // 32) % 2) + 2 * (wi % 2) + (wi // 2) % 2
        row, cp = (pos // 256) * 256 + j, 2 * (wi // 32)
    else:
        li = pos % 128
        t = (li % 64) // 4
        j = 8 * t + 4 * (li % 2) + 2 * (li // 64) + (li // 2) % 2
        row, cp = (pos // 128) * 128 + j, 2 * (4 * (li // 64) + t // 4)
    xb = x.xb.cpu().double().view(-1, 16)
    return (xb[row, cp] + xb[row, cp + 1]) * x.g.cpu().double()[pos // 32]


@pytest.mark.parametrize("fmt", [4, 6, 8])
def test_prepare_x_formats(fmt, device, rng) -> None:
    """Both layouts hold every value once (hi + lo on the diagonal, zeros elsewhere)."""
    gen, seed = rng
    x = vec(gen, 512) * 7.0
    p = tc.prepare_x(x.to(device), fmt=fmt)
    back = _unprepare(p, fmt)
    err = ((back - x.double()).abs() / x.double().abs().view(-1, 32).amax(1).repeat_interleave(32)).max().item()
    assert err <= 2**-21, f"format {fmt}: off by {err:.3g} (seed {seed})"
    assert int((p.xb != 0).sum()) <= 2 * 512  # only the diagonal pairs


@pytest.mark.parametrize("qtype,m,n_blk,res,split", [
    (Q6_K, 1, 2, False, None), (Q6_K, 37, 2, True, 2), (Q6_K, 70, 4, False, 1),
    (Q8_0, 1, 1, False, None), (Q8_0, 37, 3, True, 3), (Q8_0, 70, 2, False, 1)])
def test_qmatvec_tc_other_types(qtype, m, n_blk, res, split, device, rng) -> None:
    """Q6_K (n_blk even): odd blocks start 2 bytes off a word; Q8_0: 34-byte blocks read as 68-word groups of 8,
    every other block's quads funnel-shifted."""
    gen, seed = rng
    k = 256 * n_blk
    raw, dense = quant_weights(qtype, (m,), k, gen, device)
    x = vec(gen, k)
    x[5:9] *= 300.0
    x[40:45] *= 1e4
    out, residual, ref, bound = matvec_case(dense, x, res, gen, device)  # out aliases residual if res
    tc.qmatvec_tc(raw, tc.prepare_x(x.to(device), fmt=tc.FORMATS[qtype]), out, residual, qtype=qtype, split=split)
    check_bound(out, ref, bound, seed, f"{qtype} tensor-core matvec M={m} K={k} split={split}", tol=TOL)


@pytest.mark.parametrize("qgu,qd,split", [(Q4_K, Q6_K, None), (Q4_K, Q6_K, 3), (Q8_0, Q8_0, None),
                                         (Q6_K, Q6_K, 1), (Q4_K, Q8_0, 3)])
def test_ffn_tc_other_types(qgu, qd, split, device, rng) -> None:
    """Gate/up writing h prepared in the down type's layout, then that down product (Q4_K gate/up with a Q6_K down:
    a Q4_K_M file's odd layers); split: experts per down program."""
    gen, seed = rng
    e, f, n, n_sel = 5, 512, 512, 3
    wg, dg = quant_weights(qgu, (e, f), n, gen, device)
    wu, du = quant_weights(qgu, (e, f), n, gen, device)
    wd, dd = quant_weights(qd, (e, n), f, gen, device)
    x, res = vec(gen, n), vec(gen, n)
    ids, wts = torch.tensor([3, 0, 4], dtype=torch.int32), torch.tensor([0.5, 0.3, 0.2])
    fmt = tc.FORMATS[qd]
    h = tc.moe_gate_up_tc(wg, wu, tc.prepare_x(x.to(device), fmt=tc.FORMATS[qgu]), ids.to(device),
                          tc.empty_x(f, device, n_sel), qtype=qgu, out_fmt=fmt)
    href = ACTIVATIONS["silu"](dg[ids.long()] @ x.double()) * (du[ids.long()] @ x.double())  # [n_sel, F]
    got_h = _unprepare(h, fmt).view(n_sel, f)
    assert ((got_h - href).abs() <= 1e-5 * href.abs().amax(1, keepdim=True)).all(), f"h (seed {seed})"
    out = tc.moe_down_tc(wd, h, ids.to(device), wts.to(device), res.to(device), torch.empty(n, device=device),
                         qtype=qd, split=split)
    ref = res.double() + sum(wts[i].double() * (dd[ids[i]] @ href[i]) for i in range(n_sel))
    bound = res.double().abs() + sum(wts[i].double() * (dd[ids[i]].abs() @ href[i].abs()) for i in range(n_sel))
    check_bound(out, ref, bound, seed, f"{qgu} gate/up -> {qd} down on tensor cores, split={split}", tol=1e-5)


def test_attention_writes_prepared_x(device, rng) -> None:
    """The attention reduce prepares its output in up to two layouts, as prepare_x would, bit for bit."""
    from moerun.kernels.triton import decode_ops as dk

    gen, seed = rng
    h, hkv, d, n_ctx = 4, 2, 64, 40
    q = vec(gen, h, d).to(device)
    kc, vc = vec(gen, n_ctx, hkv, d).to(device), vec(gen, n_ctx, hkv, d).to(device)
    kv_len = torch.tensor([29], device=device)
    scratch = dk.attention_scratch(h, d, dk.attention_splits(n_ctx, h, 4), device)
    out = torch.empty(h, d, device=device)
    bufs = [(4, tc.empty_x(h * d, device)), (8, tc.empty_x(h * d, device))]
    dk.attention_decode(q, kc, vc, kv_len, 0.125, 0, out, scratch, out_tc=bufs)
    for fmt, xt in bufs:
        want = tc.prepare_x(out.reshape(-1), fmt=fmt)
        for a, b in zip(xt, want, strict=True):
            assert torch.equal(a, b), f"layout {fmt} (seed {seed})"
