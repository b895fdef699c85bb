"""Choosing the device and compute dtype."""

from __future__ import annotations

import os

import torch

from moerun.errors import MoerunError

DTYPES = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
KV_DTYPES = DTYPES | {"float16": torch.float16, "f16": torch.float16}  # the KV cache may also be float16


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device`, else $MOERUN_DEVICE, else CUDA when available, else the CPU."""
    choice = device or os.environ.get("MOERUN_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(choice)
    except (RuntimeError, TypeError) as e:
        raise MoerunError(f"invalid device {choice!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoerunError(f"device {choice!r} requested but CUDA is not available (torch {torch.__version__})")
    return dev


def pick_dtype(dtype: str | torch.dtype, table: dict[str, torch.dtype] = DTYPES, what: str = "compute") -> torch.dtype:
    """A torch dtype from a dtype or its name, among those of `table` (compute: float32 / bfloat16)."""
    if isinstance(dtype, torch.dtype) and dtype in table.values():
        return dtype
    if isinstance(dtype, str) and dtype in table:
        return table[dtype]
    raise MoerunError(f"unsupported {what} dtype {dtype!r}; use one of {', '.join(table)}")
