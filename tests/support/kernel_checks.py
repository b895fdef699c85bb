"""Tensor helpers for the kernel tests (tests/kernels/): random inputs, NaN-poisoned outputs, closeness checks.

Imports torch only (never triton), so a test module may import it before or after setting TRITON_INTERPRET.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moerun.kernels.torch_ops import X24
from moerun.quant import dequantize, random_blocks

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RTOL = 1e-5


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEV)


def nan(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    """Relative error against the reference's scale (elementwise rtol plus a tiny absolute floor)."""
    atol = rtol * float(want.abs().max()) * 1e-1 + 1e-30
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def quant_weights(qtype: int, lead: tuple[int, ...], k: int, rng: np.random.Generator,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random valid blocks as raw bytes uint8 [*lead, row_bytes] on `device`, and their values float64 [*lead, k]."""
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    n_rows = int(np.prod(lead))
    raw = torch.from_numpy(random_blocks(qtype, n_rows * k // bs, rng, scale=0.5)).reshape(*lead, k // bs * ts)
    dense = dequantize(raw, qtype, (*lead, k)).double()
    return raw.to(device), dense


def vec(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    """float32 N(0, 1) on the CPU."""
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def check_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, seed: int, what: str,
                tol: float = RTOL) -> None:
    """|out - ref| <= tol * bound elementwise, bound = sum |w| |x| (float32 accumulation), no NaN."""
    out = out.cpu().double()
    assert not out.isnan().any(), f"{what}: NaN in output (seed {seed})"
    err = (out - ref).abs()
    worst = (err / (bound + 1e-30)).max().item()
    assert (err <= tol * bound + 1e-30).all(), f"{what}: error {worst:.3g} x sum|w||x| (seed {seed})"


def matvec_case(dense: torch.Tensor, x: torch.Tensor, res: bool, rng: np.random.Generator, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A matvec's NaN-poisoned output on `device`, its residual (None, or a random one that the output aliases,
    res=True) and the float64 reference and bound (sum |w| |x| (+ |residual|)): (out, residual, ref, bound).
    dense: float64 [M, K] (quant_weights'), x: float32 [K] on the CPU."""
    m = dense.shape[0]
    ref, bound = dense @ x.double(), dense.abs() @ x.double().abs()
    out = torch.full((m,), float("nan"), device=device)
    if not res:
        return out, None, ref, bound
    r = vec(rng, m)
    out.copy_(r.to(device))
    return out, out, ref + r.double(), bound + r.double().abs()


def router_logits(rng: np.random.Generator, e: int, n_sel: int, ties: bool) -> torch.Tensor:
    """float32 [E] router logits on the CPU; with `ties` repeated values, one tie straddling the n_sel-th place and
    signed zeros (equal values), for kernels that rank experts themselves (ties go to the lower index)."""
    logits = torch.tensor(rng.standard_normal(e) * 2, dtype=torch.float32)
    if ties:
        logits = torch.round(logits * 2) / 2
        top = torch.sort(logits, descending=True).values
        logits[logits == top[n_sel]] = top[n_sel - 1]
        logits[logits == 0] = torch.tensor([0.0, -0.0]).repeat(e)[: int((logits == 0).sum())]
    return logits


def poisoned_x24(*shape: int) -> X24:
    """An X24 output with every byte set (so a value the kernel does not write shows)."""
    x = X24.empty(shape, DEV)
    for t in x:
        t.view(torch.uint8).fill_(0xFF)
    return x


def check_x24(got: X24, x: torch.Tensor) -> None:
    """got is imatvec's quantization of x [..., K] (its plain-torch twin; the division may round differently on
    the GPU: X within 1, s and the sums within float32 rounding)."""
    from moerun.kernels.triton.imatvec import quantize_x24_ref

    want = quantize_x24_ref(x.cpu())
    q = got.hi.cpu().int() * 256 + got.lo.cpu().int()
    assert (q - (want.hi.int() * 256 + want.lo.int())).abs().max() <= 1
    torch.testing.assert_close(got.s.cpu(), want.s, rtol=1e-6, atol=0)
    close(got.sum.cpu(), want.sum)
