"""Embedding rows picked by device ids (kernels/triton/embed.py) vs the torch dequantizer: bit-exact, every
type. CUDA when available, else Triton's interpreter (set before import)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from support.kernel_checks import quant_weights  # noqa: E402

from moerun.kernels.triton.embed import embed  # noqa: E402

TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.Q5_0, T.F16, T.BF16, T.F32]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embed_exact(qtype, device, rng) -> None:
    gen, seed = rng
    v, k = 11, 3 * 256 + (64 if qtype in (T.F16, T.BF16, T.F32, T.Q8_0, T.Q4_0, T.Q5_0) else 0)  # a partial step
    raw, dense = quant_weights(int(qtype), (v,), k, gen, device)
    ids = torch.tensor([7, 0, 7, 10], device=device)
    for scale in (1.0, 45.25):
        out = torch.full((4, k), float("nan"), device=device)
        embed(raw, int(qtype), ids, out, scale)
        want = (dense.float()[ids.cpu()] * scale) if scale != 1.0 else dense.float()[ids.cpu()]
        assert torch.equal(out.cpu(), want), f"{qtype.name} scale {scale} (seed {seed})"


def test_embed_checks_row_size(device) -> None:
    with pytest.raises(ValueError, match="do not hold"):
        embed(torch.zeros(3, 100, dtype=torch.uint8, device=device), int(T.Q4_K), torch.zeros(1, device=device,
              dtype=torch.long), torch.zeros(1, 256, device=device))
    with pytest.raises(NotImplementedError, match="GGML type 10"):
        embed(torch.zeros(3, 84, dtype=torch.uint8, device=device), 10, torch.zeros(1, device=device,
              dtype=torch.long), torch.zeros(1, 256, device=device))
