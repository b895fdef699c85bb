"""ModelConfig: the frozen hyper-parameters of a model, read from a GGUF file's `{arch}.*` keys.

Which key feeds which field is one table (`_KEYS`); what differs between architectures (rope style,
norm placement, activation, ...) lives in each architecture's `ArchSpec` (models/<arch>.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from moerun.errors import MissingKey

if TYPE_CHECKING:
    from moerun.gguf.reader import GGUFFile
    from moerun.models.spec import ArchSpec

_REQUIRED = object()

# field -> (GGUF key template, python kind, default; _REQUIRED = the key must be present)
_KEYS: dict[str, tuple[str, type, Any]] = {
    "n_ctx_train": ("{arch}.context_length", int, _REQUIRED),
    "n_embd": ("{arch}.embedding_length", int, _REQUIRED),
    "n_layer": ("{arch}.block_count", int, _REQUIRED),
    "n_ff": ("{arch}.feed_forward_length", int, 0),
    "n_head": ("{arch}.attention.head_count", int, _REQUIRED),
    "n_head_kv": ("{arch}.attention.head_count_kv", int, None),
    "head_dim": ("{arch}.attention.key_length", int, None),
    "head_dim_v": ("{arch}.attention.value_length", int, None),
    "rms_eps": ("{arch}.attention.layer_norm_rms_epsilon", float, _REQUIRED),
    "rope_base": ("{arch}.rope.freq_base", float, 10000.0),
    "rope_base_swa": ("{arch}.rope.freq_base_swa", float, None),
    "rope_dim": ("{arch}.rope.dimension_count", int, None),
    "rope_scaling_type": ("{arch}.rope.scaling.type", str, "none"),
    "rope_scaling_factor": ("{arch}.rope.scaling.factor", float, 1.0),
    "n_expert": ("{arch}.expert_count", int, 0),
    "n_expert_used": ("{arch}.expert_used_count", int, 0),
    "n_ff_exp": ("{arch}.expert_feed_forward_length", int, None),
    "expert_weights_norm": ("{arch}.expert_weights_norm", bool, None),
    "sliding_window": ("{arch}.attention.sliding_window", int, 0),
    "swa_pattern": ("{arch}.attention.sliding_window_pattern", int, None),
    "attn_scale": ("{arch}.attention.scale", float, None),
    "final_logit_softcap": ("{arch}.final_logit_softcapping", float, None),
    "n_vocab": ("{arch}.vocab_size", int, None),
}

# Sanity bounds: a value outside these is a corrupt or hostile header, not a model.
_MAX = {"n_embd": 1 << 17, "n_layer": 4096, "n_head": 4096, "n_head_kv": 4096, "head_dim": 4096,
        "head_dim_v": 4096, "n_ff": 1 << 20, "n_ff_exp": 1 << 20, "n_expert": 4096, "n_ctx_train": 1 << 24,
        "n_vocab": 1 << 24}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one model. Sizes in elements; `n_vocab` from the embedding matrix."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_dim: int
    rope_scale: float                 # positions are divided by this (linear scaling); 1.0 = none
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = False  # renormalise the top-k routing weights to sum to 1
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()  # per layer: True = sliding-window attention
    attn_scale: float = 1.0
    embed_scale: float = 1.0
    final_logit_softcap: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def with_(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)


def read_config(f: GGUFFile, spec: ArchSpec, n_vocab: int) -> ModelConfig:
    """Build the ModelConfig of `f` (whose architecture is `spec.name`); raises MissingKey on bad keys."""
    raw: dict[str, Any] = {}
    for name, (template, kind, default) in _KEYS.items():
        key = template.format(arch=spec.name)
        value = f.get(key, None)
        if value is None:
            if default is _REQUIRED:
                raise MissingKey(f"{f.path}: metadata key '{key}' is missing (needed for {spec.name})")
            raw[name] = default
            continue
        if kind is int and isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # per-layer arrays with one value (some converters write them)
        if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise MissingKey(f"{f.path}: metadata key '{key}' is {type(value).__name__}, expected {kind.__name__}")
        if kind is int and (value != int(value) or value < 0 or value > _MAX.get(name, 1 << 40)):
            raise MissingKey(f"{f.path}: metadata key '{key}' has an absurd value {value!r}")
        if kind is float and not math.isfinite(value):
            raise MissingKey(f"{f.path}: metadata key '{key}' is not finite ({value!r})")
        raw[name] = kind(value)

    for name in ("n_embd", "n_layer", "n_head"):
        if raw[name] <= 0:
            raise MissingKey(f"{f.path}: metadata key '{_KEYS[name][0].format(arch=spec.name)}' must be > 0")
    n_head_kv = raw["n_head_kv"] or raw["n_head"]
    if raw["n_head"] % n_head_kv:
        raise MissingKey(f"{f.path}: head_count {raw['n_head']} is not a multiple of head_count_kv {n_head_kv}")
    head_dim = raw["head_dim"] or raw["n_embd"] // raw["n_head"]
    rope_scale = raw["rope_scaling_factor"] if raw["rope_scaling_type"] == "linear" else 1.0
    if rope_scale <= 0:
        raise MissingKey(f"{f.path}: metadata key '{spec.name}.rope.scaling.factor' must be > 0")
    cfg = ModelConfig(
        arch=spec.name,
        n_vocab=n_vocab,
        n_ctx_train=raw["n_ctx_train"],
        n_embd=raw["n_embd"],
        n_layer=raw["n_layer"],
        n_ff=raw["n_ff"],
        n_head=raw["n_head"],
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=raw["head_dim_v"] or head_dim,
        rms_eps=raw["rms_eps"],
        rope_base=raw["rope_base"],
        rope_base_swa=raw["rope_base_swa"] or spec.rope_base_swa or raw["rope_base"],
        rope_dim=raw["rope_dim"] or head_dim,
        rope_scale=rope_scale,
        n_expert=raw["n_expert"],
        n_expert_used=raw["n_expert_used"],
        n_ff_exp=raw["n_ff_exp"] or raw["n_ff"],
        expert_weights_norm=(spec.expert_weights_norm if raw["expert_weights_norm"] is None
                             else raw["expert_weights_norm"]),
        sliding_window=raw["sliding_window"],
        final_logit_softcap=raw["final_logit_softcap"],
    )
    if cfg.n_expert and not 0 < cfg.n_expert_used <= cfg.n_expert:
        raise MissingKey(f"{f.path}: '{spec.name}.expert_used_count' = {cfg.n_expert_used} must be in "
                         f"1..expert_count ({cfg.n_expert})")
    return spec.finish_config(cfg, raw)
