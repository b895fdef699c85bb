"""Gemma 3 (text): the default model moerun ships (Gemma 3 270M).

Differences from the plain block, all as llama.cpp implements them:
- embeddings multiplied by sqrt(n_embd);
- RMSNorm after attention and after the MLP too ("post norms"); GGUF stores every norm as 1 + w,
  so the weights are used as they are;
- per-head QK-norm; GELU(tanh) gated MLP;
- 5 sliding-window layers per global layer (window `{arch}.attention.sliding_window`), local layers
  use rope base 10000, global ones `{arch}.rope.freq_base` (and linear rope scaling if the file has it);
- query scale 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), except the 27B model which uses
  1/sqrt(n_embd / n_head).
"""

from __future__ import annotations

import math
from typing import Any

from moerun.models.config import ModelConfig
from moerun.models.spec import ArchSpec

SWA_PATTERN = 6  # every 6th layer is global (llama.cpp: hparams.set_swa_pattern(6))
N_LAYER_27B = 62


def _configure(cfg: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    pattern = raw["swa_pattern"] or SWA_PATTERN
    swa = tuple(cfg.sliding_window > 0 and (i + 1) % pattern != 0 for i in range(cfg.n_layer))
    scale = cfg.attn_scale
    if raw["attn_scale"] is None and cfg.n_layer == N_LAYER_27B:
        scale = 1.0 / math.sqrt(cfg.n_embd / cfg.n_head)
    return cfg.with_(swa_layers=swa, embed_scale=math.sqrt(cfg.n_embd), attn_scale=scale)


SPEC = ArchSpec(
    name="gemma3",
    rope_style="neox",
    qk_norm="head",
    post_norms=True,
    act="gelu_tanh",
    rope_base_swa=10000.0,
    configure=_configure,
)
