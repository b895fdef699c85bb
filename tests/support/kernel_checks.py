"""Tensor helpers for the kernel tests (tests/kernels/): random inputs, NaN-poisoned outputs, closeness checks.

Imports torch only (never triton), so a test module may import it before or after setting TRITON_INTERPRET.
"""

from __future__ import annotations

import torch

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
