"""The key/value cache: one [n_ctx, Hkv, D] tensor pair per layer (position-major, or head-major storage seen
through that shape)."""

from __future__ import annotations

import torch

from moerun.models.config import ModelConfig


class KVCache:
    """Keys and values of positions 0..n_ctx-1 for every layer, in the compute dtype."""

    def __init__(self, cfg: ModelConfig, n_ctx: int, device: torch.device, dtype: torch.dtype,
                 head_major: bool = False) -> None:
        """head_major: each layer's k / v stored [Hkv, n_ctx, D] (a head's positions contiguous) and kept as its
        [n_ctx, Hkv, D] view (strided; every kernel takes the strides) instead of stored position-major."""
        self.n_ctx, self.head_major = n_ctx, head_major
        self._cfg, self._device, self._dtype = cfg, device, dtype
        self.k: list[torch.Tensor] = []  # each [n_ctx, Hkv, D]
        self.v: list[torch.Tensor] = []  # each [n_ctx, Hkv, Dv]
        self._allocate()

    def _allocate(self) -> None:
        cfg, n = self._cfg, self.n_ctx

        def zeros(d: int) -> torch.Tensor:
            if self.head_major:
                return torch.zeros(cfg.n_head_kv, n, d, device=self._device, dtype=self._dtype).transpose(0, 1)
            return torch.zeros(n, cfg.n_head_kv, d, device=self._device, dtype=self._dtype)

        self.k, self.v = [], []  # the old tensors go first (a full-size cache may not fit twice)
        self.k = [zeros(cfg.head_dim) for _ in range(cfg.n_layer)]
        self.v = [zeros(cfg.head_dim_v) for _ in range(cfg.n_layer)]

    def set_layout(self, head_major: bool) -> bool:
        """Store head-major or position-major from now on; where that changes the layout the cache is allocated
        afresh (zeros: the caller starts a new sequence). Returns whether it changed."""
        if head_major == self.head_major:
            return False
        self.head_major = head_major
        self._allocate()
        return True

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
