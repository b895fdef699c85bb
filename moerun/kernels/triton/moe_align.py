"""Grouping token-expert assignments by expert for the grouped GEMMs of prefill (Triton, 2 launches).

ids [T, topk] -> the A = T*topk assignments a = t*topk + k listed by expert in ascending a (stable),
each expert's run padded to a multiple of BLOCK_M so every BLOCK_M-row block holds one expert:
    rows [P] int32          assignment at each padded position, -1 for padding
    block_expert [P / BM]   expert of each block, -1 for blocks past the last used one
P = padded_rows(A, E, BM) is a static upper bound, so no size depends on the routing: no host sync.

Two kernels, one program per expert: `_count` counts each expert's assignments; `_place` derives the
expert's padded start from all counts (experts before it), numbers its assignments with a running
prefix sum over the ids and writes them, -1 in its padding, and its blocks' expert id (the last
program marks the unused tail). torch-only twin: `moe_align_torch`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

CHUNK = 1024  # ids scanned per step


class Routing(NamedTuple):
    """Assignments grouped by expert: rows [P] int32, block_expert [P / BM] int32."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    topk: int
    block_m: int


def padded_rows(n_assign: int, n_expert: int, block_m: int) -> int:
    """Static upper bound of the padded assignment count (every expert may need a partial block)."""
    return triton.cdiv(n_assign + n_expert * (block_m - 1), block_m) * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, A, CH: tl.constexpr):
    """Grid (E,): counts[e] = number of ids equal to e among ids[0:A]."""
    e = tl.program_id(0)
    n = tl.zeros([CH], dtype=tl.int32)
    s = 0
    while s < A:  # (while loops: Triton's interpreter cannot range() over a runtime bound)
        i = s + tl.arange(0, CH)
        n += (tl.load(ids_ptr + i, mask=i < A, other=-1) == e).to(tl.int32)
        s += CH
    tl.store(counts_ptr + e, tl.sum(n, axis=0))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, rows_ptr, bexp_ptr, A, E, P, BM: tl.constexpr, EP: tl.constexpr,
                  CH: tl.constexpr):
    """Grid (E,): write expert e's assignments (ascending) at its padded start, -1 in its padding rows and
    its blocks' expert id; the last program also marks the unused tail (rows and blocks) with -1."""
    e = tl.program_id(0)
    j = tl.arange(0, EP)
    cnt = tl.load(counts_ptr + j, mask=j < E, other=0)
    padded = (cnt + BM - 1) // BM * BM
    start = tl.sum(tl.where(j < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(j == e, padded, 0), axis=0)
    n_mine = tl.sum(tl.where(j == e, cnt, 0), axis=0)
    b = start // BM
    while b < (start + mine) // BM:  # (while loops: Triton's interpreter cannot range() over a runtime bound)
        tl.store(bexp_ptr + b, e)
        b += 1
    base = start
    s = 0
    while s < A:
        i = s + tl.arange(0, CH)
        m = tl.load(ids_ptr + i, mask=i < A, other=-1) == e
        mi = m.to(tl.int32)
        rank = tl.cumsum(mi, axis=0) - mi  # exclusive prefix within the chunk
        tl.store(rows_ptr + base + rank, i, mask=m)
        base += tl.sum(mi, axis=0)
        s += CH
    pad = start + n_mine + tl.arange(0, BM)  # fewer than BM padding rows
    tl.store(rows_ptr + pad, tl.full([BM], -1, tl.int32), mask=pad < start + mine)
    if e == E - 1:
        total = tl.sum(padded, axis=0)
        s = total
        while s < P:
            i = s + tl.arange(0, CH)
            tl.store(rows_ptr + i, tl.full([CH], -1, tl.int32), mask=i < P)
            s += CH
        b = total // BM
        while b < P // BM:
            tl.store(bexp_ptr + b, -1)
            b += 1


def moe_align(ids: torch.Tensor, n_expert: int, block_m: int) -> Routing:
    """ids [T, topk] int (device) -> Routing (see module doc). Two launches, no host sync."""
    T, topk = ids.shape
    flat = ids.reshape(-1).to(torch.int32)  # [A]
    A = flat.shape[0]
    P = padded_rows(A, n_expert, block_m)
    counts = torch.empty(n_expert, dtype=torch.int32, device=ids.device)
    rows = torch.empty(P, dtype=torch.int32, device=ids.device)  # every entry written by _place_kernel
    bexp = torch.empty(P // block_m, dtype=torch.int32, device=ids.device)
    _count_kernel[(n_expert,)](flat, counts, A, CH=CHUNK)
    _place_kernel[(n_expert,)](flat, counts, rows, bexp, A, n_expert, P, BM=block_m,
                               EP=triton.next_power_of_2(n_expert), CH=CHUNK)
    return Routing(rows, bexp, topk, block_m)


def moe_align_torch(ids: torch.Tensor, n_expert: int, block_m: int) -> Routing:
    """The same grouping in torch ops (the reference the kernels are tested against)."""
    T, topk = ids.shape
    flat = ids.reshape(-1).long()  # [A]
    A = flat.shape[0]
    dev = ids.device
    counts = torch.zeros(n_expert, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = padded.cumsum(0)  # [E] end of each expert's padded run
    e_sorted, order = torch.sort(flat, stable=True)  # [A] assignments by expert
    cstart = counts.cumsum(0) - counts
    dest = (pend - padded)[e_sorted] + torch.arange(A, device=dev) - cstart[e_sorted]
    P = padded_rows(A, n_expert, block_m)
    rows = torch.full((P,), -1, dtype=torch.int32, device=dev)
    rows[dest] = order.to(torch.int32)
    starts = torch.arange(0, P, block_m, device=dev)
    bexp = torch.searchsorted(pend, starts, right=True)  # expert whose run holds the block
    bexp = torch.where(bexp < n_expert, bexp, -1).to(torch.int32)
    return Routing(rows, bexp, topk, block_m)
