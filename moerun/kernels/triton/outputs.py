"""What a kernel writes for the product that reads its output next: the word kernels' permuted order
(`perm_slot`), x quantized for the integer-dot kernels (`store_x24`), and the next RMSNorm done by a product's
last program (`norm_tail`). Shared by the decode kernels (decode_ops, qmatvec, wmatvec, imatvec); imports none of
them."""

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


@triton.jit
def norm_tail(x_ptr, w_ptr, out_ptr, perm_ptr, hi_ptr, lo_ptr, s_ptr, sum_ptr, eps, N, cnt_ptr, BLOCK: tl.constexpr,
              CH: tl.constexpr, PERM: tl.constexpr, X24: tl.constexpr):
    """At the end of a program that wrote its part of x [N]: the last program of the launch to get here (a CTA
    barrier so that all its threads' stores precede an acq_rel counter cnt [1]) writes the RMSNorm of the whole x
    (`_rms_norm_kernel`'s outputs), then resets the counter (left zero for the next launch or graph replay).
    In chunks of CH values (a power of two <= BLOCK), so that the tail adds few registers to the program: the sum
    of squares first, then x again (volatile loads both times: x was written by other programs of the launch)."""
    tl.debug_barrier()
    n_prog = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == n_prog - 1:
        ss = tl.zeros([CH], dtype=tl.float32)
        for c in tl.static_range(0, BLOCK, CH):
            offs = c + tl.arange(0, CH)
            x = tl.load(x_ptr + offs, mask=offs < N, other=0.0, volatile=True)
            ss += x * x
        r = 1.0 / tl.sqrt_rn(tl.sum(ss, 0) / N + eps)
        for c in tl.static_range(0, BLOCK, CH):
            offs = c + tl.arange(0, CH)
            mask = offs < N
            y = tl.load(x_ptr + offs, mask=mask, other=0.0, volatile=True) * r * tl.load(w_ptr + offs, mask=mask,
                                                                                         other=0.0)
            tl.store(out_ptr + offs, y, mask=mask)
            if PERM:
                tl.store(perm_ptr + perm_slot(offs), y, mask=mask)
            if X24:
                g = c // 32 + tl.arange(0, CH // 32)
                store_x24(tl.reshape(y, [CH // 32, 32]), g, g * 32 < N, hi_ptr, lo_ptr, s_ptr, sum_ptr, 32)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


NORM_TAIL_CHUNK = 256  # values per chunk of `norm_tail` (registers: 2048 at once took a down kernel to 238)


def norm_args(norm: Any, counter: torch.Tensor | None, x: torch.Tensor) -> tuple[tuple, dict]:
    """A product's launch arguments for `norm_tail` of its output x [N]: (w, out, perm, hi, lo, s, sum, eps,
    counter) and the constexprs NORM, NPERM, NX24, NBLOCK, NCH; placeholders when norm (a torch_ops.NormOut) is None."""
    if norm is None:
        return (x,) * 7 + (0.0, x), dict(NORM=False, NPERM=False, NX24=False, NBLOCK=32, NCH=32)
    n = x.shape[-1]
    if counter is None or counter.dtype != torch.int32 or counter.numel() < 1:
        raise ValueError("norm needs counter: int32 zeros [>= 1]")
    if norm.out_perm is not None and n % 256:
        raise ValueError(f"norm.out_perm needs N % 256 == 0, got N = {n}")
    xa = x24_args(norm.out_x24, n, "norm.out_x24", x)
    block = triton.next_power_of_2(n)
    return ((norm.weight, norm.out, x if norm.out_perm is None else norm.out_perm, *xa, float(norm.eps), counter),
            dict(NORM=True, NPERM=norm.out_perm is not None, NX24=norm.out_x24 is not None, NBLOCK=block,
                 NCH=min(block, NORM_TAIL_CHUNK)))


def x24_args(x24: Any, n: int, what: str, placeholder: torch.Tensor) -> tuple:
    """(hi, lo, s, sum) of an imatvec.X24 output, or placeholders (unused pointers); checks N % 32 == 0."""
    if x24 is None:
        return (placeholder,) * 4
    if n % 32:
        raise ValueError(f"{what} needs N % 32 == 0, got N = {n}")
    return tuple(x24)
