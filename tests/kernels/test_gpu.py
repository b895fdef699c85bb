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


def test_resident_per_sm() -> None:
    """Occupancy from a compiled kernel's registers, warps and shared memory (CUDA occupancy calculator figures for
    compute capability 9.0)."""
    h100 = gpu.GPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20)
    assert gpu.resident_per_sm(h100, 4, 64, 0) == 8   # 64 x 128 threads: 8 x 8192 registers
    assert gpu.resident_per_sm(h100, 4, 80, 0) == 6   # 10240 registers a program
    assert gpu.resident_per_sm(h100, 4, 81, 0) == 5   # rounded up to 88 a thread (256 a warp)
    assert gpu.resident_per_sm(h100, 8, 48, 0) == 5
    assert gpu.resident_per_sm(h100, 1, 32, 0) == 32  # the blocks limit
    assert gpu.resident_per_sm(h100, 16, 32, 0) == 4  # the threads limit
    assert gpu.resident_per_sm(h100, 4, 32, 100 << 10) == 2  # shared memory (+1 KB reserved a block)
    assert gpu.resident_per_sm(h100, 32, 255, 0) == 1  # never below one
    if torch.cuda.is_available():
        g = gpu.gpu(torch.device("cuda"))
        assert g.regs_per_sm >= 65536 and g.threads_per_sm >= 1024 and g.smem_per_sm > 0
