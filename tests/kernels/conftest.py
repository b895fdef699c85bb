"""Fixtures shared by the kernel tests: the device and freshly seeded random generators.

Imports no triton: tests/conftest.py sets TRITON_INTERPRET (without a GPU) before any test module loads.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(8), "little") % (1 << 63)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = int.from_bytes(os.urandom(8), "little")
    return np.random.default_rng(seed), seed
