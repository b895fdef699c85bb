"""The next RMSNorm done by a down product's last program (`outputs.norm_tail`, ops feature `nfused`), in the
integer and byte down kernels (not the word kernels: it nearly doubled their registers): the product's output bit
for bit as without it, the norm as `decode_ops.rms_norm` of that output in each output form (xn, permuted copy,
X24; poisoned first), the counter left zero (two launches). CUDA when available, else Triton's interpreter
(tests/conftest.py sets it before any test module loads)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from support.kernel_checks import quant_weights, vec

from moerun.kernels.torch_ops import NormOut, permute_k4
from moerun.kernels.triton import decode_ops as dk
from moerun.kernels.triton import imatvec as ik
from moerun.kernels.triton import qmatvec as qk

Q4_K, F16 = int(T.Q4_K), int(T.F16)
E, F, IDS = 4, 256, [2, 0, 3]


def _check(run: Callable[..., torch.Tensor], n: int, outs: str, device: torch.device, gen) -> None:
    """run(out, norm=None|NormOut, counter=None|tensor) launches the product into out [n]."""
    nw = vec(gen, n).to(device)
    plain = run(torch.empty(n, device=device))
    want = dk.rms_norm(plain, nw, 1e-5, torch.empty(n, device=device))
    cnt = torch.zeros(1, dtype=torch.int32, device=device)
    for _ in range(2):
        xn = torch.full((n,), float("nan"), device=device)
        perm = torch.full((n,), float("nan"), device=device) if "perm" in outs else None
        x24 = ik.X24.empty((n,), device) if "x24" in outs else None
        for t in x24 or ():
            t.view(torch.uint8).fill_(0xFF)
        out = run(torch.full((n,), float("nan"), device=device), norm=NormOut(nw, 1e-5, xn, perm, x24), counter=cnt)
        assert torch.equal(out, plain)
        torch.testing.assert_close(xn, want, rtol=1e-6, atol=1e-6)
        if perm is not None:
            assert torch.equal(perm, permute_k4(xn))
        if x24 is not None:
            q = ik.quantize_x24_ref(xn.cpu())
            assert ((x24.hi.cpu().int() * 256 + x24.lo.cpu().int()) - (q.hi.int() * 256 + q.lo.int())).abs().max() <= 1
            torch.testing.assert_close(x24.s.cpu(), q.s, rtol=1e-6, atol=0)
        assert int(cnt.item()) == 0
    with pytest.raises(ValueError, match="norm needs counter"):
        run(out, norm=NormOut(nw, 1e-5, xn))


def _routing(gen, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    wts = torch.from_numpy(gen.uniform(0.05, 1.0, len(IDS)).astype(np.float32))
    return torch.tensor(IDS, dtype=torch.int32, device=device), wts.to(device)


@pytest.mark.parametrize("n,outs,words", [(256, "perm+x24", ik.WORDS_PER_THREAD), (96, "x24", ik.PAIR_WORDS)])
def test_integer_down(n, outs, words, device, rng) -> None:
    gen, _ = rng
    w, _ = quant_weights(Q4_K, (E, n), F, gen, device)
    ids, wts = _routing(gen, device)
    hq = ik.quantize_x24(vec(gen, len(IDS), F).to(device))
    r = vec(gen, n).to(device)
    _check(lambda out, **kw: ik.moe_down_i(w, hq, ids, wts, r, out, words=words, **kw), n, outs, device, gen)


@pytest.mark.parametrize("qtype,n,outs", [(F16, 96, "x24")], ids=str)
def test_byte_down(qtype, n, outs, device, rng) -> None:
    gen, _ = rng
    w, _ = quant_weights(qtype, (E, n), F, gen, device)
    ids, wts = _routing(gen, device)
    h = vec(gen, len(IDS), F).to(device)
    r = vec(gen, n).to(device)
    _check(lambda out, **kw: qk.moe_down(w, qtype, h, ids, wts, r, out, **kw), n, outs, device, gen)
