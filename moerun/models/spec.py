"""ArchSpec: what one architecture changes in the shared transformer block, as data.

Every supported model is the same pre-norm decoder (embed -> N x [attention, FFN] -> norm -> output);
an ArchSpec says which optional pieces it uses. Architecture files (models/<arch>.py) each define one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from moerun.models.config import ModelConfig

RopeStyle = Literal["norm", "neox"]  # llama.cpp names: adjacent pairs vs. split halves
QKNorm = Literal["none", "head", "full"]  # RMSNorm per head of head_dim, or over the whole q / k width
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class ArchSpec:
    """The per-architecture choices of the shared decoder block."""

    name: str                       # general.architecture value
    rope_style: RopeStyle
    qk_norm: QKNorm = "none"
    post_norms: bool = False        # RMSNorm on the attention and FFN outputs before the residual add
    act: Activation = "silu"        # gated MLP activation: act(gate) * up
    expert_weights_norm: bool = False  # default when the file has no {arch}.expert_weights_norm key
    rope_base_swa: float | None = None  # rope base of sliding-window layers when the file has no key
    # Architecture-specific derived fields (SWA layout, embedding scale, ...): (cfg, raw keys) -> cfg
    configure: Callable[[ModelConfig, dict[str, Any]], ModelConfig] | None = None

    def finish_config(self, cfg: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
        """Fill the fields every architecture derives the same way, then apply `configure`."""
        cfg = cfg.with_(
            attn_scale=raw["attn_scale"] or 1.0 / math.sqrt(cfg.head_dim),
            swa_layers=(False,) * cfg.n_layer,
        )
        return self.configure(cfg, raw) if self.configure else cfg
