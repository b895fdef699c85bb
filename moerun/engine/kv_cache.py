"""The key/value cache: one [n_ctx, Hkv, D] tensor pair per layer."""

from __future__ import annotations

import torch

from moerun.models.config import ModelConfig


class KVCache:
    """Keys and values of positions 0..n_ctx-1 for every layer, in the compute dtype."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, device: torch.device, dtype: torch.dtype) -> None:
        self.n_ctx = n_ctx
        self.k = [torch.zeros(n_ctx, cfg.n_head_kv, cfg.head_dim, device=device, dtype=dtype)
                  for _ in range(cfg.n_layer)]  # each [n_ctx, Hkv, D]
        self.v = [torch.zeros(n_ctx, cfg.n_head_kv, cfg.head_dim_v, device=device, dtype=dtype)
                  for _ in range(cfg.n_layer)]  # each [n_ctx, Hkv, Dv]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k: [T, Hkv, D] and v: [T, Hkv, Dv] at positions pos0..pos0+T-1."""
        end = pos0 + k.shape[0]
        assert end <= self.n_ctx, "callers check the context size first"
        self.k[layer][pos0:end] = k
        self.v[layer][pos0:end] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [end, Hkv, D] and values [end, Hkv, Dv] of positions 0..end-1."""
        return self.k[layer][:end], self.v[layer][:end]
