"""Embedding lookup for batch-1 decode: dequantize the rows of a quantized matrix picked by device ids (Triton).

One launch, reading only the picked rows' bytes with the prefill GEMM's tile decoders (qgemm.deq_tile, so
every type qgemm reads), where the plain-torch dequantizer of one row costs ~28 small launches per token
(benchmarks/NOTES.md 7). The ids stay on the device: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moerun.kernels.triton.pdl import launch_args, trigger, wait
from moerun.kernels.triton.qgemm import BK, deq_tile
from moerun.kernels.triton.qmatvec import GEOMETRY, SUPPORTED, _typed


@triton.jit
def _embed_kernel(w_ptr, ids_ptr, out_ptr, scale, K, stride_w, stride_out, QTYPE: tl.constexpr, BKC: tl.constexpr,
                  PDL: tl.constexpr = False):
    """Grid (cdiv(K, BKC), n). w: [V, row] bytes (typed for F32/F16/BF16), ids: [n] int, out: [n, K] f32.

    With PDL it waits before it lets the next kernel launch (the decode step's first kernel: a boundary), so no kernel
    of a step starts before the step before has finished: a kernel may read before its own wait what only earlier
    steps write (the attention: the KV length and the cache's earlier rows, `_attn_split_kernel`). In a CUDA
    graph the step's first kernel has nothing to wait for, so this costs nothing there."""
    wait(PDL)
    trigger(PDL)
    kb = tl.program_id(0) * BKC
    i = tl.program_id(1)
    row = tl.load(ids_ptr + i).to(tl.int64)
    two = tl.arange(0, 2)  # the decoders work on row tiles: row 0 is the one wanted, row 1 is masked off
    nm = two < 1
    wr = w_ptr + row * stride_w + two * 0
    w = deq_tile(wr, nm, kb, K, QTYPE, BKC)  # [2, BKC]
    k = kb + tl.arange(0, BKC)
    y = tl.sum(tl.where(nm[:, None], w, 0.0), axis=0) * scale  # row 0
    tl.store(out_ptr + i * stride_out + k, y, mask=k < K)


def embed(w: torch.Tensor, qtype: int, ids: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """out[i, :] = scale * dequantize(W[ids[i]]) for a quantized [V, row_bytes] matrix (uint8, GGUF bytes).

    ids: int [n] on the device; out: float32 [n, K] (rows contiguous). Returns out.
    """
    if qtype not in SUPPORTED:
        raise NotImplementedError(f"no Triton embedding kernel for GGML type {qtype} (supported: {sorted(SUPPORTED)})")
    n, k = out.shape
    bs, ts, view = GEOMETRY[qtype]
    if w.shape[-1] != k // bs * ts or k % bs:
        raise ValueError(f"embedding rows of {w.shape[-1]} bytes do not hold {k} weights of GGML type {qtype}")
    wt = _typed(w, qtype)
    _embed_kernel[(triton.cdiv(k, BK), n)](wt, ids, out, float(scale), k, wt.stride(0), out.stride(0),
                                           QTYPE=qtype, BKC=BK, num_warps=2, **launch_args(out.device))
    return out
