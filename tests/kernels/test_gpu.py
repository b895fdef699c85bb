"""moerun/kernels/gpu.py: launches sized from the device's own properties, and the warning where tiles are untuned."""

from __future__ import annotations

import warnings

import torch

from moerun.kernels import gpu


def test_untuned_message() -> None:
    h200 = gpu.GPU("NVIDIA H200", (9, 0), 132, 60 << 20)
    a100 = gpu.GPU("NVIDIA A100-SXM4-80GB", (8, 0), 108, 40 << 20)
    t4 = gpu.GPU("Tesla T4", (7, 5), 40, 4 << 20)
    assert h200.tuned and gpu.untuned_message(h200) is None
    msg = gpu.untuned_message(a100)
    assert msg is not None and "A100" in msg and "108 SMs" in msg and "L2 40 MiB" in msg and "untuned" in msg
    msg = gpu.untuned_message(t4)
    assert msg is not None and "7.5" in msg and "--ops torch" in msg


def test_cpu_sizes_and_no_warning() -> None:
    cpu = torch.device("cpu")
    assert gpu.sm_count(cpu) == gpu.CPU_SMS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpu.warn_if_untuned(cpu)  # nothing to say about the CPU
