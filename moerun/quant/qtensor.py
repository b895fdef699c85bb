"""QTensor: a GGUF tensor kept in its quantized bytes, dequantized on demand."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType

from moerun.errors import ShapeMismatch
from moerun.quant.registry import QuantType, dequantize, quant_type


class QTensor:
    """Quantized tensor of logical torch shape `[*lead, cols]`, stored as uint8 `[*lead, row_bytes]`."""

    def __init__(self, name: str, file: str, raw: torch.Tensor, qtype: QuantType, shape: tuple[int, ...]):
        self.name = name
        self.file = file
        self.raw = raw  # uint8 [*lead, row_bytes]; may view a read-only memmap: never write through it
        self.qtype = qtype
        self.shape = tuple(shape)

    @classmethod
    def from_numpy(
        cls,
        name: str,
        file: str,
        ggml_type: int | GGMLQuantizationType,
        shape: tuple[int, ...],
        data: np.ndarray,
    ) -> QTensor:
        """Wrap the bytes of a tensor (e.g. `ReaderTensor.data`, any dtype) without copying.

        shape: torch order `[*lead, cols]`. Raises ShapeMismatch if the byte count disagrees.
        """
        qt = quant_type(ggml_type, tensor=name, file=file)
        shape = tuple(int(s) for s in shape)
        if not shape or shape[-1] % qt.block_size:
            raise ShapeMismatch(
                f"{file}: tensor {name} of shape {shape} is not a whole number of {qt.name} blocks "
                f"({qt.block_size} weights) per row"
            )
        row_bytes = qt.row_bytes(shape[-1])
        expected = math.prod(shape[:-1]) * row_bytes
        u8 = data.view(np.uint8) if data.dtype != np.uint8 else data
        if u8.size != expected:
            raise ShapeMismatch(
                f"{file}: tensor {name} of {qt.name} shape {shape} needs {expected} bytes, "
                f"but the file holds {u8.size}"
            )
        u8 = u8.reshape(*shape[:-1], row_bytes)  # no copy for contiguous data
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            raw = torch.from_numpy(u8)
        return cls(name, file, raw, qt, shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Return the values as `[*shape]` of `dtype` on this tensor's device."""
        out = dequantize(self.raw, self.qtype.ggml, self.shape)
        return out if dtype == torch.float32 else out.to(dtype)

    def __getitem__(self, idx: int | slice | torch.Tensor | tuple) -> QTensor:
        """Index leading dims only (an expert of `[E, rows, cols]`, rows of an embedding); no dequant."""
        parts = idx if isinstance(idx, tuple) else (idx,)
        if self.ndim < 2 or len(parts) > self.ndim - 1 or any(p is Ellipsis or p is None for p in parts):
            raise IndexError(f"tensor {self.name}: QTensor of shape {self.shape} indexes leading dims only")
        raw = self.raw[idx]  # [*lead', row_bytes]
        return QTensor(self.name, self.file, raw, self.qtype, (*raw.shape[:-1], self.shape[-1]))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QTensor:
        """Copy the raw bytes to `device` (a no-op if already there)."""
        return QTensor(
            self.name, self.file, self.raw.to(device, non_blocking=non_blocking), self.qtype, self.shape
        )

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QTensor({self.name!r}, {self.qtype.name}, shape={self.shape}, device={self.device})"
