"""benchmarks/sass_attention.py --check: every attention variant's sm_90 registers and shared memory (compiled with
Triton's bundled ptxas, no GPU) leave room for the programs per SM its split policy aims at; a variant that asks for
more is reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_attention.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled, in a process of its own (never the interpreter)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def test_every_variant_fits_its_programs_per_sm() -> None:
    r = _run("--check")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| long | 64, 4 |" in r.stdout and "| short |" in r.stdout and "| long_f16 | 32, 4 |" in r.stdout


def test_a_variant_asking_for_too_many_is_reported() -> None:
    r = _run("--check", "--variants", "long@5")  # 128 registers: 4 programs of 4 warps fit, not 5
    assert r.returncode == 1
    assert "long@5: 4 programs per SM fit (128 registers" in r.stdout
