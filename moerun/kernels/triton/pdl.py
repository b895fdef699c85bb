"""Programmatic dependent launch (PDL, compute capability 9.0+) for the decode step's kernels (on by default).

A kernel launched with PDL may start while the kernel before it in the stream is still running: it lets its own
dependents launch at once (`griddepcontrol.launch_dependents`) and then waits until its predecessor has finished
and its writes are visible (`griddepcontrol.wait`) before it reads or writes anything. So each launch's front end
(scheduling its programs onto the SMs) overlaps the kernel before it, where a plain launch waits for that kernel
to finish first. Inside a CUDA graph the launches become programmatic edges.

`launches(True)` around a step turns it on for the kernels that take a `PDL` constexpr (`begin` as their first
statement) and pass `launch_args(device)` to their launch; off (the default), those kernels compile as before.
Only kernels that call `begin` before any load or store may be launched so: a kernel without it, or a torch op,
between two of them simply starts after its predecessor has finished (no trigger, no wait).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moerun.kernels.gpu import gpu

MIN_CAPABILITY = (9, 0)  # griddepcontrol: sm_90 and newer
_on = [False]


@contextmanager
def launches(on: bool) -> Iterator[None]:
    """Kernels launched inside take PDL where `on` and the device can (`launch_args`)."""
    before = _on[0]
    _on[0] = on
    try:
        yield
    finally:
        _on[0] = before


def launch_args(device: torch.device) -> dict[str, Any]:
    """The launch arguments of a PDL-capable kernel on `device`: its PDL constexpr, and Triton's launch_pdl where
    PDL is on (`launches`) and the device is a CUDA GPU of compute capability 9.0 or newer."""
    on = _on[0] and device.type == "cuda" and gpu(device).capability >= MIN_CAPABILITY  # cached per device
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def begin(PDL: tl.constexpr):
    """A PDL kernel's first statement: let the next kernel launch, then wait for the one before to finish."""
    trigger(PDL)
    wait(PDL)


@triton.jit
def trigger(PDL: tl.constexpr):
    """Let the next kernel launch (its programs then wait in their `wait`)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible: before the first access to anything it
    or a kernel before it writes (loads of weights, which nothing in the step writes, may come before)."""
    if PDL:
        gdc_wait()
