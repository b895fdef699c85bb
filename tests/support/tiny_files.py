"""Fresh random tiny models (support/tiny_models.py) written to GGUF, and the error measure the engine
tests compare logits with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from support.hf_to_gguf import write_gguf
from support.tiny_models import TINY


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest |ref|."""
    got, ref = got.float().cpu(), ref.float().cpu()
    return float((got - ref).abs().max() / ref.abs().max())


def tiny_gguf(arch: str, qtype: str, directory: Path) -> tuple[PreTrainedModel, Path, int]:
    """A fresh random TINY[arch] model (random seed, printed in failures by the callers) written to
    directory/model.gguf with matrices in `qtype` -> (HF model, path, seed)."""
    seed = int(np.random.default_rng().integers(1 << 31))
    model = TINY[arch](seed)
    path = directory / "model.gguf"
    write_gguf(model, path, qtype=qtype, seed=seed)
    return model, path, seed


def tiny_tokens(model: PreTrainedModel, seed: int, n: int) -> list[int]:
    """n token ids from `seed`, below the vocabulary's last two ids (kept for special tokens)."""
    return np.random.default_rng(seed).integers(0, model.config.vocab_size - 2, n).tolist()
