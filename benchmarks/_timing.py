"""CUDA timing helpers shared by the micro-benchmarks.

The benchmarks run as scripts (`python benchmarks/bench_x.py`), which puts this folder on sys.path, so they import
this module as `_timing`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def event_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """Milliseconds between two CUDA events recorded around `calls` back-to-back calls of fn (device synchronized)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def capture_graph(fns: list[Callable[[], object]], warmup: list[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `fns` called in order, replayed once; `warmup` runs first on a side stream (compiles)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in warmup:  # compile + warm up outside the graph
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return g
