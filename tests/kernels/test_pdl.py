"""Programmatic dependent launch (moerun/kernels/triton/pdl.py, ops feature `pdl`): when it is on, and that a PDL
kernel waits for the kernel before it ahead of its first memory access (compiled for sm_90 without a GPU)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from moerun.kernels.triton import pdl  # noqa: E402


def test_launch_args() -> None:
    """Off by default and outside `launches`; never on the CPU; `launches` restores the state it found."""
    cpu = torch.device("cpu")
    assert pdl.launch_args(cpu) == {"PDL": False}
    with pdl.launches(True):
        assert pdl.launch_args(cpu) == {"PDL": False}  # the interpreter has no griddepcontrol
        with pdl.launches(False):
            assert not pdl._on[0]
        assert pdl._on[0]
        if torch.cuda.is_available():
            want = torch.cuda.get_device_capability() >= pdl.MIN_CAPABILITY
            assert pdl.launch_args(torch.device("cuda")).get("launch_pdl", False) == want
    assert not pdl._on[0]


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moerun.kernels.triton import decode_ops as dk
fn = dk._rms_norm_kernel
params = list(fn.arg_names)
consts = {"BLOCK": 2048, "PERM": False, "X24": False, "PDL": sys.argv[1] == "1"}
sig = {p: "constexpr" if p in consts else "fp32" if p == "eps" else "i32" if p == "N" else "*fp32" for p in params}
src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(p),): v for p, v in consts.items()})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


@pytest.mark.parametrize("on", [False, True])
def test_wait_before_the_first_access(on: bool) -> None:
    """`_rms_norm_kernel` (every PDL kernel starts with `pdl.begin`) compiled for sm_90 in a process without the
    interpreter: with PDL its PTX lets the next kernel launch and waits before its first global load or store;
    without, neither instruction is there."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _COMPILE, "1" if on else "0"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ptx = r.stdout
    first = re.search(r"\b(ld|st)\.global", ptx)
    assert first is not None
    if on:
        trig, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
        assert 0 <= trig < wait < first.start()
    else:
        assert "griddepcontrol" not in ptx
