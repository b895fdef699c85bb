"""Tiny random Hugging Face causal LMs, one per architecture moerun supports, for reference tests.

`TINY[key](seed)` builds a float32, eval-mode transformers model with random weights. Every weight row
length (in-features) is a multiple of 256, so every matrix can be stored as Q4_K / Q8_0 blocks.

Shapes (all keys): hidden 256, 4 query heads x head_dim 64, 2 KV heads (GQA), dense FFN 512, expert
FFN 256 (qwen3moe) or 512 (olmoe, mixtral), vocab 512, 2 layers, context 512, no biases, untied output.
Exceptions, each mirroring the real model family:

- gemma3: 7 layers (5 sliding-window layers then 1 global, as Gemma 3 does, so layer 5 is global),
  head_dim 256 with query_pre_attn_scalar 256 (Gemma 3's values; transformers' GGUF loader cannot set
  query_pre_attn_scalar, so any other value would be unverifiable), tied embeddings.
- olmoe: rms eps 1e-5, because llama.cpp's converter writes 1e-5 for every OLMoE file whatever the
  config says (OlmoeModel.set_gguf_parameters); with 1e-6 file and model would disagree.

Norm weights are randomised (1 + 0.2 N(0,1); for Gemma 3, whose RMSNorm multiplies by (1 + w),
0.2 N(0,1)) and matrices are N(0, 0.08^2), so logits are far from flat.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HIDDEN = 256
N_HEAD = 4
HEAD_DIM = 64
N_HEAD_KV = 2
FFN = 512
MOE_FFN = 256
VOCAB = 512
N_LAYER = 2
N_CTX = 512
RMS_EPS = 1e-6
WEIGHT_STD = 0.08
NORM_STD = 0.2

# shared by every config; bos/eos are the two special tokens of moerun.gguf.vocab.add_bpe_vocab
COMMON: dict[str, Any] = dict(
    hidden_size=HIDDEN,
    num_attention_heads=N_HEAD,
    num_key_value_heads=N_HEAD_KV,
    head_dim=HEAD_DIM,
    intermediate_size=FFN,
    vocab_size=VOCAB,
    num_hidden_layers=N_LAYER,
    max_position_embeddings=N_CTX,
    rms_norm_eps=RMS_EPS,
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=VOCAB - 2,
    eos_token_id=VOCAB - 1,
    pad_token_id=None,
)


def _randomise(model: PreTrainedModel, seed: int, *, norm_offset: float) -> None:
    """Overwrite every parameter in place: 1-D (norms) ~ norm_offset + NORM_STD*N, others WEIGHT_STD*N."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1:
                p.copy_(norm_offset + NORM_STD * noise)
            else:
                p.copy_(WEIGHT_STD * noise)


def _build(
    cls: type[PreTrainedModel], config: PretrainedConfig, seed: int, *, norm_offset: float = 1.0
) -> PreTrainedModel:
    """Instantiate `cls(config)` in float32 with seeded random weights, in eval mode."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    _randomise(model, seed, norm_offset=norm_offset)
    return model.eval()


def olmoe(seed: int) -> PreTrainedModel:
    """OLMoE: 8 experts, top-2, no renormalisation of the top-k weights, full-width q/k norms."""
    # no head_dim key: OlmoeConfig has none (head_dim = hidden / heads), and with one in the config the
    # converter would write attention.key_length, which real OLMoE files lack
    # no GQA: llama.cpp's olmoe graph sizes attn_k_norm as n_embd (real OLMoE has 16 q and 16 kv heads)
    common = {k: v for k, v in COMMON.items() if k != "head_dim"}
    cfg = OlmoeConfig(
        **{**common, "rms_norm_eps": 1e-5, "num_key_value_heads": N_HEAD},
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        clip_qkv=None,
    )
    return _build(OlmoeForCausalLM, cfg, seed)


def qwen3moe(seed: int) -> PreTrainedModel:
    """Qwen3-MoE: 8 experts, top-2, renormalised top-k weights, every layer sparse."""
    cfg = Qwen3MoeConfig(
        **COMMON,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=MOE_FFN,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return _build(Qwen3MoeForCausalLM, cfg, seed)


def llama(seed: int) -> PreTrainedModel:
    """Llama with GQA, default RoPE."""
    return _build(LlamaForCausalLM, LlamaConfig(**COMMON), seed)


# original context 64: wavelengths of the 32 RoPE frequencies (6.3 .. 4.7e4) fall on both sides of
# and between 64/high_freq_factor = 16 and 64/low_freq_factor = 64, so all three llama3 regimes occur.
LLAMA3_ORIG_CTX = 64
LLAMA3_ROPE: dict[str, Any] = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=LLAMA3_ORIG_CTX,
)


def llama_rope_freqs(seed: int) -> PreTrainedModel:
    """Llama with llama3 RoPE scaling (stored in GGUF as the `rope_freqs` tensor).

    `original_max_position_embeddings` is also set at the top level of the config: llama.cpp's
    converter reads it from there (`hparams.get("original_max_position_embeddings", 8192)`), not from
    the rope-scaling dict that transformers reads, so both places must agree.
    """
    cfg = LlamaConfig(
        **COMMON, rope_scaling=dict(LLAMA3_ROPE), original_max_position_embeddings=LLAMA3_ORIG_CTX
    )
    return _build(LlamaForCausalLM, cfg, seed)


def mixtral(seed: int) -> PreTrainedModel:
    """Mixtral: 4 experts of width 512, top-2, GQA."""
    cfg = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    return _build(MixtralForCausalLM, cfg, seed)


def qwen3(seed: int) -> PreTrainedModel:
    """Dense Qwen3 (per-head q/k norms), GQA."""
    return _build(Qwen3ForCausalLM, Qwen3Config(**COMMON), seed)


GEMMA3_HEAD_DIM = 256
GEMMA3_LAYERS = 7
GEMMA3_LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]


def gemma3(seed: int) -> PreTrainedModel:
    """Gemma 3 text model: 5 local (window 8, theta 1e4) : 1 global (theta 1e6) layers, tied embeddings."""
    cfg = Gemma3TextConfig(
        **{
            **COMMON,
            "head_dim": GEMMA3_HEAD_DIM,
            "num_hidden_layers": GEMMA3_LAYERS,
            "tie_word_embeddings": True,
        },
        query_pre_attn_scalar=GEMMA3_HEAD_DIM,
        sliding_window=8,
        layer_types=list(GEMMA3_LAYER_TYPES),
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return _build(Gemma3ForCausalLM, cfg, seed, norm_offset=0.0)


TINY: dict[str, Callable[[int], PreTrainedModel]] = {
    "olmoe": olmoe,
    "qwen3moe": qwen3moe,
    "llama": llama,
    "llama_rope_freqs": llama_rope_freqs,
    "mixtral": mixtral,
    "qwen3": qwen3,
    "gemma3": gemma3,
}
