"""Named model shapes for synthetic GGUF files: the real hyper-parameters of public models, and tiny twins.

Each real preset copies the model's Hugging Face `config.json` (the values llama.cpp's converter reads);
each `tiny-*` preset keeps the architecture and its features (MoE routing, GQA or not, QK-norm, tied
embeddings, llama3 rope factors, the 8-expert quantization special case) at a size that builds in
milliseconds. Every tiny row width (n_embd, n_head*head_dim, n_ff, n_ff_exp) is a multiple of 256 so
every K-quant applies without llama.cpp's fallback types.

`tensor_plan(preset)` lists every tensor of the model (GGUF name, numpy-order shape, kind) from the
same tables moerun's loader uses (moerun.models.weights), in the order llama.cpp's quantizer writes
them (`weight_name_comparer` in src/llama-model-loader.h: globals first, then by block, then by name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from gguf import MODEL_TENSOR, TENSOR_NAMES

from moerun.errors import MoerunError
from moerun.models.config import ModelConfig
from moerun.models.registry import ARCHS
from moerun.models.weights import GLOBAL, layer_table


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1-style RoPE scaling (`rope_scaling.rope_type == "llama3"`), stored as `rope_freqs`."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class Preset:
    """The shape of one model, in the terms of its Hugging Face config.

    head_dim: per-head width; `head_dim_in_config` says whether the HF config states it (the converter
    then writes {arch}.attention.key_length / value_length). n_ff is the dense FFN width (for Qwen3-MoE
    the unused dense width the config still carries), n_ff_exp the width of one expert.
    """

    name: str
    arch: str  # general.architecture
    source: str  # the model whose config this is
    n_vocab: int
    n_ctx: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_base: float
    rms_eps: float
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    tied_embeddings: bool = False
    rope_freqs: Llama3Rope | None = None
    head_dim_in_config: bool = False
    tokenizer_pre: str = "default"
    write_expert_ff: bool = False  # converter writes {arch}.expert_feed_forward_length (Qwen3-MoE)
    write_vocab_size: bool = False  # converter writes {arch}.vocab_size and rope.dimension_count (llama)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    def config(self) -> ModelConfig:
        """The ModelConfig moerun will read back from the file (shape-relevant fields)."""
        return ModelConfig(
            arch=self.arch,
            n_vocab=self.n_vocab,
            n_ctx_train=self.n_ctx,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_ff=self.n_ff,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim=self.head_dim,
            head_dim_v=self.head_dim,
            rms_eps=self.rms_eps,
            rope_base=self.rope_base,
            rope_base_swa=self.rope_base,
            rope_dim=self.head_dim,
            rope_scale=1.0,
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_exp=self.n_ff_exp or self.n_ff,
        )


class TensorSpec(NamedTuple):
    """One tensor of a plan: GGUF name, numpy-order shape ([rows, cols], cols = GGUF ne[0]), kind."""

    name: str
    shape: tuple[int, ...]
    kind: MODEL_TENSOR
    layer: int  # -1 for global tensors

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Row width (GGUF ne[0]): the dimension quantization blocks run along."""
        return self.shape[-1]


def tensor_plan(p: Preset) -> list[TensorSpec]:
    """Every tensor of `p`, named and shaped by moerun.models.weights' tables, in llama.cpp's order."""
    cfg = p.config()
    spec = ARCHS[p.arch]
    out: list[TensorSpec] = []
    for param, (kind, shape) in GLOBAL.items():
        if (param == "output" and p.tied_embeddings) or (param == "rope_freqs" and p.rope_freqs is None):
            continue
        out.append(TensorSpec(TENSOR_NAMES[kind] + ".weight", shape(cfg), kind, -1))
    table = layer_table(spec, cfg)
    for bid in range(p.n_layer):
        for kind, shape in table.values():
            out.append(TensorSpec(TENSOR_NAMES[kind].format(bid=bid) + ".weight", shape(cfg), kind, bid))
    out.sort(key=lambda t: (t.layer, t.name))  # llama-model-loader.h weight_name_comparer
    return out


def n_params(p: Preset) -> int:
    """Total number of weights of the model."""
    return sum(t.n_elements for t in tensor_plan(p))


# ---------------------------------------------------------------------------------------------------
# The real models. Sources: each model's config.json on the Hugging Face hub.

_REAL: list[Preset] = [
    Preset(  # allenai/OLMoE-1B-7B-0924
        name="olmoe-1b-7b", arch="olmoe", source="allenai/OLMoE-1B-7B-0924",
        n_vocab=50304, n_ctx=4096, n_embd=2048, n_layer=16, n_head=16, n_head_kv=16, head_dim=128,
        n_ff=1024, n_expert=64, n_expert_used=8, n_ff_exp=1024, rope_base=10000.0, rms_eps=1e-5,
        tokenizer_pre="olmo",
    ),
    Preset(  # Qwen/Qwen3-30B-A3B
        name="qwen3-30b-a3b", arch="qwen3moe", source="Qwen/Qwen3-30B-A3B",
        n_vocab=151936, n_ctx=40960, n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
        n_ff=6144, n_expert=128, n_expert_used=8, n_ff_exp=768, rope_base=1e6, rms_eps=1e-6,
        head_dim_in_config=True, tokenizer_pre="qwen2", write_expert_ff=True,
    ),
    Preset(  # mistralai/Mixtral-8x7B-v0.1 (llama.cpp stores it as arch llama with expert tensors)
        name="mixtral-8x7b", arch="llama", source="mistralai/Mixtral-8x7B-v0.1",
        n_vocab=32000, n_ctx=32768, n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, head_dim=128,
        n_ff=14336, n_expert=8, n_expert_used=2, n_ff_exp=14336, rope_base=1e6, rms_eps=1e-5,
        write_vocab_size=True,
        notes=("the real vocabulary is SentencePiece; the synthetic one is byte-level BPE of the same size",),
    ),
    Preset(  # Qwen/Qwen3-8B
        name="qwen3-8b", arch="qwen3", source="Qwen/Qwen3-8B",
        n_vocab=151936, n_ctx=40960, n_embd=4096, n_layer=36, n_head=32, n_head_kv=8, head_dim=128,
        n_ff=12288, rope_base=1e6, rms_eps=1e-6, head_dim_in_config=True, tokenizer_pre="qwen2",
    ),
    Preset(  # meta-llama/Llama-3.2-1B
        name="llama-3.2-1b", arch="llama", source="meta-llama/Llama-3.2-1B",
        n_vocab=128256, n_ctx=131072, n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, head_dim=64,
        n_ff=8192, rope_base=500000.0, rms_eps=1e-5, tied_embeddings=True, rope_freqs=Llama3Rope(),
        head_dim_in_config=True, tokenizer_pre="llama-bpe", write_vocab_size=True,
    ),
    Preset(  # HuggingFaceTB/SmolLM2-1.7B
        name="smollm2-1.7b", arch="llama", source="HuggingFaceTB/SmolLM2-1.7B",
        n_vocab=49152, n_ctx=8192, n_embd=2048, n_layer=24, n_head=32, n_head_kv=32, head_dim=64,
        n_ff=8192, rope_base=130000.0, rms_eps=1e-5, tied_embeddings=True, tokenizer_pre="smollm",
        write_vocab_size=True,
    ),
]

# Tiny twins: hidden 256, 2 layers (llama.cpp's use_more_bits(i, 2) picks layer 1 and not layer 0),
# vocab 1024, context 512; MoE twins keep their routing (OLMoE: no GQA, as llama.cpp requires; Mixtral:
# exactly 8 experts, which changes llama.cpp's type mix). Qwen3 twins keep GQA and an explicit head_dim.
_TINY: dict[str, dict] = {
    "olmoe-1b-7b": dict(n_head=4, n_head_kv=4, head_dim=64, n_ff=256, n_expert=16, n_expert_used=4,
                        n_ff_exp=256),
    "qwen3-30b-a3b": dict(n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_expert=16, n_expert_used=4,
                          n_ff_exp=256),
    "mixtral-8x7b": dict(n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_expert=8, n_expert_used=2,
                         n_ff_exp=512),
    "qwen3-8b": dict(n_head=4, n_head_kv=2, head_dim=64, n_ff=512),
    "llama-3.2-1b": dict(n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                         rope_freqs=Llama3Rope(original_context=256)),
    "smollm2-1.7b": dict(n_head=4, n_head_kv=4, head_dim=64, n_ff=512),
}
TINY_COMMON = dict(n_vocab=1024, n_ctx=512, n_embd=256, n_layer=2)


def _tiny(p: Preset) -> Preset:
    kw = dict(TINY_COMMON, **_TINY[p.name])
    return Preset(**{**p.__dict__, **kw, "name": "tiny-" + p.name, "source": f"{p.source} (tiny twin)",
                     "notes": ()})


PRESETS: dict[str, Preset] = {p.name: p for p in _REAL} | {f"tiny-{p.name}": _tiny(p) for p in _REAL}


class UnknownPreset(MoerunError, ValueError):
    """A preset name that is not in PRESETS."""


def get_preset(preset: str | Preset) -> Preset:
    """A Preset by name (or the Preset itself); UnknownPreset naming the choices for an unknown name."""
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise UnknownPreset(f"unknown preset '{preset}'; choose one of: {', '.join(PRESETS)}") from None
