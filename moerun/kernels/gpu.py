"""The GPU the kernels size their launches from: its own SM count and L2 cache, read once per device.

Tile tables (rows per program, programs per SM, attention splits) are sized from `sm_count`, so any NVIDIA
GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper, Blackwell) gets launches that fill it; the
per-type constants in them were measured on the GPUs in TUNED_GPUS (benchmarks/NOTES.md), and
`warn_if_untuned` says so once per device elsewhere.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch

# name substrings of the GPUs the decode tiles were measured on (H100: the default tiles fastest of bench_qmatvec's
# candidates for Q4_K and Q8_0 gate/up and down, NOTES.md 8g)
TUNED_GPUS = ("H200", "H100")
MIN_CAPABILITY = (8, 0)  # Ampere: the oldest architecture the kernels are written for (dp4a, bf16, cp.async)
CPU_SMS = 4  # the CPU interpreter: few, big programs


@dataclass(frozen=True)
class GPU:
    """What launches are sized from, as the driver reports it."""

    name: str
    capability: tuple[int, int]
    sm_count: int
    l2_bytes: int

    @property
    def tuned(self) -> bool:
        return any(t in self.name for t in TUNED_GPUS)

    def describe(self) -> str:
        return (f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]}, {self.sm_count} SMs, "
                f"L2 {self.l2_bytes / (1 << 20):.0f} MiB)")


@functools.cache
def _gpu(index: int) -> GPU:
    p = torch.cuda.get_device_properties(index)
    return GPU(p.name, (p.major, p.minor), p.multi_processor_count, int(getattr(p, "L2_cache_size", 0)))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def gpu(device: torch.device) -> GPU:
    """The CUDA device's properties (cached per device)."""
    return _gpu(_index(device))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; CPU_SMS for the CPU interpreter."""
    return gpu(device).sm_count if device.type == "cuda" else CPU_SMS


_warned: set[int] = set()


def untuned_message(g: GPU) -> str | None:
    """Why the decode kernels may run below their best on `g`, or None where they were measured."""
    if g.capability < MIN_CAPABILITY:
        major, minor = MIN_CAPABILITY
        return (f"moerun's Triton kernels are written for compute capability >= {major}.{minor} (Ampere or newer); "
                f"{g.describe()} is older and untested: pass ops='torch' (--ops torch) if a "
                "kernel fails to compile")
    if not g.tuned:
        return (f"moerun's decode tiles were measured on {', '.join(TUNED_GPUS)}; on {g.describe()} they are sized "
                "from its SM count but their per-type constants are untuned (benchmarks/bench_qmatvec.py --sweep "
                "measures them; benchmarks/NOTES.md says how)")
    return None


def warn_if_untuned(device: torch.device) -> None:
    """Warn once per CUDA device whose tiles were not measured (`untuned_message`)."""
    if device.type != "cuda":
        return
    idx = _index(device)
    if idx in _warned:
        return
    _warned.add(idx)
    msg = untuned_message(_gpu(idx))
    if msg:
        warnings.warn(msg, stacklevel=3)
