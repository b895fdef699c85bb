"""The tensor-core Q4_K matvec (kernels/triton/tcmatvec.py) vs `dequantize(...) @ x` in float64, on fresh random
blocks and activations of very different magnitudes; and its x preparation against plain torch.

CUDA when available, else Triton's interpreter (set before import).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from support.kernel_checks import check_bound, quant_weights, vec  # noqa: E402

from moerun.kernels.triton import tcmatvec as tc  # noqa: E402

Q4_K = int(T.Q4_K)
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
    x[300:310] *= 1e3  # one block with a much larger range than the other
    p = tc.prepare_x(x.to(device))
    xb, g, xs = (t.cpu() for t in p)
    cols = tc.tc_column_weights()
    for b in range(k // 256):
        xv = x[b * 256:(b + 1) * 256].double()
        assert g[b] > xv.abs().max() and g[b] <= 2 * xv.abs().max()  # power of two just above max |x|
        assert torch.log2(g[b]).item() == round(torch.log2(g[b]).item())
        sub = cols // 32  # sub-block of each column's weight
        tile = xb[b].double()  # [256, 16]
        mask = torch.zeros(256, 16, dtype=torch.bool)
        mask[torch.arange(256), 2 * sub] = True
        mask[torch.arange(256), 2 * sub + 1] = True
        assert (tile[~mask] == 0).all(), f"off-diagonal entries (seed {seed})"
        back = (tile[torch.arange(256), 2 * sub] + tile[torch.arange(256), 2 * sub + 1]) * g[b].double()
        err = (back - xv[cols]).abs().max().item()
        assert err <= 2**-21 * xv.abs().max().item(), f"x = g (hi + lo) off by {err:.3g} (seed {seed})"
        sums, scale_sums = xv.view(8, 32).sum(1), xv.view(8, 32).abs().sum(1)  # float32 sums of 32: ~1e-7 x sum|x|
        assert ((xs[b * 8:(b + 1) * 8].double() - sums).abs() <= 1e-6 * scale_sums).all(), f"sums (seed {seed})"


@pytest.mark.parametrize("m,n_blk,res,split", [(1, 1, False, None), (37, 3, True, 1), (37, 3, True, 3),
                                               (130, 2, False, None), (130, 4, True, 4), (70, 4, False, 2)])
def test_qmatvec_tc(m, n_blk, res, split, device, rng) -> None:
    """split > 1: parts summed by each row block's last program (counters must be left at zero)."""
    gen, seed = rng
    k = 256 * n_blk
    raw, dense = quant_weights(Q4_K, (m,), k, gen, device)
    x = vec(gen, k)
    x[:7] *= 50.0  # uneven magnitudes inside a block
    ref, bound = dense @ x.double(), dense.abs() @ x.double().abs()
    out = torch.full((m,), float("nan"), device=device)
    residual = None
    if res:  # out aliases residual
        r = vec(gen, m)
        out.copy_(r.to(device))
        residual = out
        ref, bound = ref + r.double(), bound + r.double().abs()
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
    assert list(ops._tc_x) == [(512, x.to(device).device)]
    want = tc.qmatvec_tc(raw, tc.prepare_x(x.to(device)), torch.empty(40, device=device))
    assert torch.equal(out, want)
