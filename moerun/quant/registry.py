"""The table of GGML quantization types moerun supports, and whole-tensor dequantization."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moerun.errors import ShapeMismatch, UnsupportedQuantType
from moerun.quant import dequant as dq

T = GGMLQuantizationType


@dataclass(frozen=True)
class QuantType:
    """One GGML block type: `block_size` weights stored in `type_size` bytes."""

    ggml: GGMLQuantizationType
    name: str
    block_size: int  # weights per block (1 for F32/F16/BF16)
    type_size: int  # bytes per block
    dequant: Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, type_size] -> float32 [n, block_size]

    def row_bytes(self, cols: int) -> int:
        """Bytes of one row of `cols` weights; raises ValueError if `cols` is not whole blocks."""
        if cols % self.block_size:
            raise ValueError(
                f"row of {cols} weights is not a whole number of {self.name} blocks ({self.block_size})"
            )
        return cols // self.block_size * self.type_size


_TABLE: list[tuple[GGMLQuantizationType, int, int, Callable[[torch.Tensor], torch.Tensor]]] = [
    (T.F32, 1, 4, dq.dequant_f32),
    (T.F16, 1, 2, dq.dequant_f16),
    (T.BF16, 1, 2, dq.dequant_bf16),
    (T.Q8_0, 32, 34, dq.dequant_q8_0),
    (T.Q4_0, 32, 18, dq.dequant_q4_0),
    (T.Q5_0, 32, 22, dq.dequant_q5_0),
    (T.Q4_K, 256, 144, dq.dequant_q4_k),
    (T.Q5_K, 256, 176, dq.dequant_q5_k),
    (T.Q6_K, 256, 210, dq.dequant_q6_k),
]

QUANT_TYPES: dict[GGMLQuantizationType, QuantType] = {
    g: QuantType(g, g.name, bs, ts, fn) for g, bs, ts, fn in _TABLE
}
for _qt in QUANT_TYPES.values():
    assert GGML_QUANT_SIZES[_qt.ggml] == (_qt.block_size, _qt.type_size), _qt.name


def _type_name(ggml_type: int | GGMLQuantizationType) -> str:
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"unknown GGML type {int(ggml_type)}"


def quant_type(ggml_type: int | GGMLQuantizationType, *, tensor: str = "?", file: str = "?") -> QuantType:
    """Look up a GGML type; raises UnsupportedQuantType naming the file and tensor if moerun lacks it."""
    try:
        return QUANT_TYPES[GGMLQuantizationType(int(ggml_type))]
    except (ValueError, KeyError):
        supported = ", ".join(qt.name for qt in QUANT_TYPES.values())
        raise UnsupportedQuantType(
            f"{file}: tensor {tensor} uses {_type_name(ggml_type)} which moerun does not support "
            f"(supported: {supported})"
        ) from None


def dequantize(
    raw: torch.Tensor, ggml_type: int | GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantize the rows of a GGUF tensor.

    raw: uint8 `[..., row_bytes]` on any device; shape: torch order, last dim = row length.
    Returns float32 `[*shape]` on raw's device, bit-exact with `gguf.quants.dequantize`.
    """
    qt = quant_type(ggml_type)
    shape = tuple(shape)
    if raw.dtype != torch.uint8:
        raise TypeError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    expected = math.prod(shape[:-1]) * qt.row_bytes(shape[-1]) if shape else qt.type_size
    if raw.numel() != expected:
        raise ShapeMismatch(f"{qt.name} tensor of shape {shape} needs {expected} bytes, got {raw.numel()}")
    blocks = raw.reshape(-1, qt.type_size)  # [n_blocks, type_size]
    return qt.dequant(blocks).reshape(shape)
