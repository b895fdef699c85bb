"""What a kernel writes for the product that reads its output next: the word kernels' permuted order
(`perm_slot`) and x quantized for the integer-dot kernels (`store_x24`, `x24_args`). Shared by the decode kernels
(decode_ops, qmatvec, wmatvec, imatvec); imports none of them."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def perm_slot(i):
    """Where element i of a vector goes in the word kernels' order (wmatvec.permute_k4): inside each block of
    256, element 4 a + k goes to slot 64 k + a."""
    return (i // 256) * 256 + (i % 4) * 64 + (i % 256) // 4


@triton.jit
def store_x24(x, g, ok, hi_ptr, lo_ptr, s_ptr, sum_ptr, G: tl.constexpr):
    """Quantize groups x [n, G] (f32; their group indices g [n], stored where ok [n]) into an imatvec X24 at
    hi/lo/s/sum_ptr: X = round(x 8388607 / max |x|) = 256 hi + lo. The arithmetic of `imatvec.quantize_x24_ref`;
    shared by the quantizer and the kernels that produce x (RMSNorm)."""
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 8388607.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.minimum(tl.maximum(tl.floor(x * inv[:, None] + 0.5), -8388607.0), 8388607.0).to(tl.int32)
    offs = g[:, None] * G + tl.arange(0, G)[None, :]
    tl.store(hi_ptr + offs, (q >> 8).to(tl.int16), mask=ok[:, None])
    tl.store(lo_ptr + offs, (q & 255).to(tl.uint8), mask=ok[:, None])
    tl.store(s_ptr + g, amax / 8388607.0, mask=ok)
    tl.store(sum_ptr + g, tl.sum(x, axis=1), mask=ok)


def x24_args(x24: Any, n: int, what: str, placeholder: torch.Tensor) -> tuple:
    """(hi, lo, s, sum) of an imatvec.X24 output, or placeholders (unused pointers); checks N % 32 == 0."""
    if x24 is None:
        return (placeholder,) * 4
    if n % 32:
        raise ValueError(f"{what} needs N % 32 == 0, got N = {n}")
    return tuple(x24)
