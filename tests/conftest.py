"""Shared pytest set-up.

- makes `tests/support` importable as the `support` package;
- without a GPU, runs Triton kernels in Triton's interpreter (TRITON_INTERPRET=1 must be set before
  triton is first imported, so it is set here, before any test module loads);
- fails the session if any kernel test was skipped: CI must exercise every fast kernel's logic.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_skipped_kernel_tests: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and report.nodeid.startswith("tests/kernels/"):
        _skipped_kernel_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_kernel_tests:
        print(f"\nerror: {len(_skipped_kernel_tests)} kernel test(s) skipped, e.g. {_skipped_kernel_tests[0]}",
              file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
