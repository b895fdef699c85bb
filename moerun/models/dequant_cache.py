"""Dequantized views of quantized weights for the reference path, within a memory budget.

The reference path multiplies by dequantized matrices. Small models keep them dequantized after the
first use (fast); past `budget_bytes` each use dequantizes again, so peak memory stays near
file size + budget + one matrix, however large the model.
"""

from __future__ import annotations

import math

import torch

from moerun.quant.qtensor import QTensor

EXPERT_STACK_CACHE_BYTES = 64 << 20


class DequantCache:
    """Returns weights in the compute dtype, caching whole tensors while they fit the budget."""

    def __init__(self, dtype: torch.dtype, budget_bytes: int) -> None:
        self.dtype = dtype
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._cache: dict[int, torch.Tensor] = {}

    def _cached(self, w: QTensor) -> torch.Tensor | None:
        key = id(w)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        size = math.prod(w.shape) * torch.finfo(self.dtype).bits // 8
        if self.used_bytes + size > self.budget_bytes:
            return None
        t = w.dequantize(self.dtype)
        self._cache[key] = t
        self.used_bytes += size
        return t

    def matrix(self, w: QTensor | torch.Tensor) -> torch.Tensor:
        """The whole tensor dequantized: [*w.shape] in the compute dtype."""
        if isinstance(w, torch.Tensor):
            return w.to(self.dtype)
        t = self._cached(w)
        return t if t is not None else w.dequantize(self.dtype)

    def expert(self, w: QTensor, e: int) -> torch.Tensor:
        """One expert's matrix of a stacked [E, rows, cols] tensor: [rows, cols].

        The whole stack is cached only when small (a token uses a few of many experts, so dequantizing
        all of a large stack to serve one would waste time and memory)."""
        small = math.prod(w.shape) * torch.finfo(self.dtype).bits // 8 <= EXPERT_STACK_CACHE_BYTES
        t = self._cached(w) if small else self._cache.get(id(w))
        return t[e] if t is not None else w[e].dequantize(self.dtype)

    def rows(self, w: QTensor, ids: torch.Tensor) -> torch.Tensor:
        """Selected rows of a matrix (embedding lookup): ids [T] -> [T, cols]."""
        t = self._cache.get(id(w))
        return t[ids] if t is not None else w[ids].dequantize(self.dtype)
