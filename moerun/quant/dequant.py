"""Torch dequantizers for GGML block types, bit-exact with `gguf.quants.dequantize`.

Every function maps uint8 blocks `[n, type_size]` to float32 values `[n, block_size]` and
repeats gguf-py's float32 operations in the same order, so results agree to the bit. Pure
torch ops: they run on whatever device the blocks live on.
"""

from __future__ import annotations

import torch

QK_K = 256  # weights per K-quant super-block


def _shifts(step: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """uint8 shift amounts 0, step, 2*step, ... < 8 shaped for broadcasting (arange: no host copy)."""
    return torch.arange(0, 8, step, dtype=torch.uint8, device=device).view(shape)


def _nibbles(b: torch.Tensor, groups: int) -> torch.Tensor:
    """Bytes `[n, groups * m]` -> uint8 `[n, groups, 2, m]`: per group, all low nibbles then all high."""
    b = b.reshape(b.shape[0], groups, 1, -1)
    return torch.cat([b & 0x0F, b >> 4], dim=2)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes `[n, 2]` -> float32 `[n, 1]`."""
    return b.contiguous().view(torch.float16).float()


def dequant_f32(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 4]` -> `[n, 1]`, always a copy: never a view of (possibly read-only, mmapped) raw bytes."""
    return blocks.contiguous().view(torch.float32).clone()


def dequant_f16(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 2]` -> `[n, 1]`, keeping NaN payloads as numpy does (torch's CPU cast canonicalizes NaN)."""
    x = _f16(blocks)  # [n, 1]
    nan = x.isnan()
    if x.is_cpu and not nan.any():  # the common case; on GPUs always patch rather than sync
        return x
    h = blocks.contiguous().view(torch.int16).to(torch.int32)  # [n, 1]
    bits = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x03FF) << 13)  # numpy's widening of a NaN
    return torch.where(nan, bits.view(torch.float32), x)


def dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 2]` -> `[n, 1]`: bf16 is the top half of an fp32, so shift the bits (NaNs kept as they are)."""
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 34]` -> `[n, 32]`: x = q * d."""
    d = _f16(blocks[:, :2])  # [n, 1]
    x = blocks[:, 2:].view(torch.int8).float()  # [n, 32]
    return x * d


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 18]` -> `[n, 32]`: x = d * (q - 8); low nibbles are weights 0..15, high 16..31."""
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])  # [n, 1]
    q = _nibbles(blocks[:, 2:], 1).reshape(n, 32).to(torch.int8) - 8  # [n, 32]
    return d * q.float()


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 22]` -> `[n, 32]`: x = d * (q - 16); bit i of the 32-bit qh is bit 4 of weight i."""
    n = blocks.shape[0]
    d = _f16(blocks[:, :2])  # [n, 1]
    qh = blocks[:, 2:6].reshape(n, 4, 1) >> _shifts(1, (1, 1, 8), blocks.device)  # [n, 4, 8]
    qh = (qh & 0x01).reshape(n, 32)  # [n, 32], little-endian bit order
    ql = _nibbles(blocks[:, 6:], 1).reshape(n, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 16  # [n, 32]
    return d * q.float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12 bytes of 6-bit scales and mins of Q4_K/Q5_K: `[n, 12]` -> two uint8 `[n, 8]`."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [n, 8]
    return sc, mn


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 144]` -> `[n, 256]`: 8 sub-blocks of 32, x = (d * sc) * q - (dmin * m)."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1]
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # [n, 8]
    d = (d * sc.float()).view(n, 8, 1)
    dm = (dmin * mn.float()).view(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 4).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 176]` -> `[n, 256]`: as Q4_K with a fifth bit per weight from qh."""
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [n, 1]
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # [n, 8]
    d = (d * sc.float()).view(n, 8, 1)
    dm = (dmin * mn.float()).view(n, 8, 1)
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> _shifts(1, (1, 1, 8, 1), blocks.device)
    qh = (qh & 0x01).reshape(n, 8, 32)
    ql = _nibbles(blocks[:, 48:], 4).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()  # [n, 8, 32]
    return (d * q - dm).reshape(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """`[n, 210]` -> `[n, 256]`: 16 sub-blocks of 16, x = (d * scale) * (q - 32), int8 scales."""
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    d = _f16(blocks[:, 208:210])  # [n, 1]
    d = (d * scales).view(n, 16, 1)
    ql = _nibbles(blocks[:, :128], 2).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(2, (1, 1, 4, 1), blocks.device)
    qh = (qh & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32  # [n, 8, 32]
    return (d * q.view(n, 16, 16).float()).reshape(n, QK_K)
