"""Write a (tiny) Hugging Face causal LM to GGUF the way llama.cpp's convert_hf_to_gguf.py does.

`write_gguf(model, path, qtype=...)` follows the converter's conventions (TextModel and the per-arch
classes LlamaModel, Qwen2Model/Qwen3Model, Qwen2MoeModel/Qwen3MoeModel, OlmoeModel, Gemma3Model):

- metadata through GGUFWriter's add_* methods, keys as the converter writes them (head_dim -> key/value
  length whenever the config has one; OLMoE always gets rms eps 1e-5; Llama also rope dimension count
  and vocab size; Qwen3-MoE expert FFN width; Gemma 3 sliding window and the local rope base);
- tensor names from gguf's own tables (`get_tensor_name_map`, `TENSOR_NAMES`);
- Llama-arch (also Mixtral) Q/K rows permuted by `LlamaModel.permute`; Gemma 3 norms stored as 1 + w;
- experts stacked as 3-D `ffn_{gate,up,down}_exps` ([n_expert, out, in] in numpy order);
- llama3 RoPE scaling stored as the `rope_freqs` tensor, computed exactly as the converter does;
- 1-D tensors and the router (`ffn_gate_inp`) in F32; other matrices in `qtype`.

For qtype != "f32" the values actually stored (F16-rounded, Q8_0 round-tripped, or random Q4_K blocks)
are copied back into the HF model in place, so the model stays the exact float32 reference for the file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from transformers import PreTrainedModel

from moerun.gguf.vocab import add_bpe_vocab
from moerun.quant.random_blocks import random_blocks

__all__ = ["write_gguf"]

T = gguf.GGMLQuantizationType
MT = gguf.MODEL_TENSOR
A = gguf.MODEL_ARCH

# HF class -> llama.cpp architecture (Mixtral is stored as arch llama with expert tensors)
ARCH: dict[str, gguf.MODEL_ARCH] = {
    "OlmoeForCausalLM": A.OLMOE,
    "Qwen3MoeForCausalLM": A.QWEN3MOE,
    "LlamaForCausalLM": A.LLAMA,
    "MixtralForCausalLM": A.LLAMA,
    "Qwen3ForCausalLM": A.QWEN3,
    "Gemma3ForCausalLM": A.GEMMA3,
}
PERMUTE_QK: frozenset[gguf.MODEL_ARCH] = frozenset({A.LLAMA})  # LlamaModel.undo_permute
NORM_SHIFT: dict[gguf.MODEL_ARCH, float] = {A.GEMMA3: 1.0}  # Gemma3Model.norm_shift, on "*norm.weight"
FIXED_RMS_EPS: dict[gguf.MODEL_ARCH, float] = {A.OLMOE: 1e-5}  # OlmoeModel.set_gguf_parameters
ALWAYS_F32: frozenset[gguf.MODEL_TENSOR] = frozenset({MT.FFN_GATE_INP})  # besides every 1-D tensor

QTYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (T.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (T.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_k": (T.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
}

# fused transformers-5 expert parameters -> the GGUF expert tensors they hold
EXPERT_PARAMS: dict[str, tuple[gguf.MODEL_TENSOR, ...]] = {
    "gate_up_proj": (MT.FFN_GATE_EXP, MT.FFN_UP_EXP),  # [E, 2*ff, hidden]: gate rows, then up rows
    "down_proj": (MT.FFN_DOWN_EXP,),  # [E, hidden, ff]
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: HF's rotate-half row order -> llama.cpp's interleaved RoPE pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(hparams: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor | None:
    """The converter's `rope_freqs` tensor (LlamaModel.generate_extra_tensors), or None if not llama3.

    Note: like the converter, the original context length is read from the top level of the config
    (default 8192), not from the rope-scaling dict.
    """
    if rope.get("rope_type", "").lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    if (dim := hparams.get("head_dim")) is None:
        dim = hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = hparams.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _rope_params(hparams: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 `rope_parameters` (possibly per layer type), as the converter's `rope_parameters`."""
    return hparams.get("rope_parameters") or {"rope_theta": hparams.get("rope_theta", 10000.0)}


def _add_metadata(
    w: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, hp: dict[str, Any], ftype: gguf.LlamaFileType
) -> None:
    """Key/values as TextModel.set_gguf_parameters plus the per-arch additions."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"tiny-{gguf.MODEL_ARCH_NAMES[arch]}")
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    rope = _rope_params(hp)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if (swa := rope.get("sliding_attention")) is not None:
        w.add_rope_freq_base_swa(swa["rope_theta"])
    w.add_layer_norm_rms_eps(FIXED_RMS_EPS.get(arch, hp["rms_norm_eps"]))
    if (n_expert := hp.get("num_local_experts", hp.get("num_experts"))) is not None:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(hp["num_experts_per_tok"])
    if (head_dim := hp.get("head_dim")) is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type(ftype)
    if arch == A.LLAMA:
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if arch == A.QWEN3MOE:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == A.GEMMA3:
        assert hp.get("attn_logit_softcapping") is None and hp.get("final_logit_softcapping") is None
        w.add_sliding_window(hp["sliding_window"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


@functools.cache
def _unit_std(ggml_type: gguf.GGMLQuantizationType) -> float:
    """Std of the values `random_blocks(ggml_type, ..., scale=1)` decodes to (measured once)."""
    raw = random_blocks(ggml_type, 1024, np.random.default_rng(12345), scale=1.0)
    return float(gguf.quants.dequantize(raw, ggml_type).std())


def _encode(
    data: np.ndarray, ggml_type: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(payload to write, float32 values it decodes to) for `data` (float32, GGUF numpy layout)."""
    if ggml_type == T.F32:
        return data, data
    if ggml_type == T.F16:
        half = data.astype(np.float16)
        return half, half.astype(np.float32)
    if ggml_type == T.Q8_0:
        raw = gguf.quants.quantize(data, T.Q8_0)
    else:  # Q4_K: gguf-py cannot quantise to it; random valid blocks with the weight's spread instead
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_blocks = data.size // block
        raw = random_blocks(ggml_type, n_blocks, rng, scale=float(data.std()) / _unit_std(ggml_type))
        raw = raw.reshape(*data.shape[:-1], data.shape[-1] // block * type_size)
    return raw, gguf.quants.dequantize(raw, ggml_type).astype(np.float32)


def _layer_of(hf_name: str) -> int:
    """Block index of `model.layers.{bid}....`."""
    return int(hf_name.split("layers.")[1].split(".")[0])


class Job(NamedTuple):
    """One GGUF tensor to write: its kind and name, float32 data in GGUF (numpy) layout, and how to
    copy the values actually stored back into the HF parameter it came from."""

    kind: gguf.MODEL_TENSOR
    name: str
    data: np.ndarray
    back: Callable[[np.ndarray], None]


def _jobs(model: PreTrainedModel, arch: gguf.MODEL_ARCH, hp: dict[str, Any]) -> list[Job]:
    """Every parameter of `model` as converter-named, converter-transformed GGUF tensors."""
    name_map = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    heads_of = {"q_proj": hp["num_attention_heads"], "k_proj": hp["num_key_value_heads"]}
    shift = NORM_SHIFT.get(arch, 0.0)
    jobs: list[Job] = []
    for hf_name, param in model.named_parameters():  # tied output appears once, as the embedding
        p = param.detach()
        data = p.numpy().astype(np.float32, copy=True)
        module, _, leaf = hf_name.rpartition(".")
        if leaf in EXPERT_PARAMS and module.endswith(".experts"):  # fused transformers-5 experts
            kinds = EXPERT_PARAMS[leaf]
            width = data.shape[1] // len(kinds)
            for i, kind in enumerate(kinds):
                rows = slice(i * width, (i + 1) * width)

                def back_rows(v: np.ndarray, p: torch.Tensor = p, rows: slice = rows) -> None:
                    p[:, rows].copy_(torch.from_numpy(v))

                name = gguf.TENSOR_NAMES[kind].format(bid=_layer_of(hf_name))
                jobs.append(Job(kind, name + ".weight", data[:, rows], back_rows))
            continue
        assert leaf == "weight", hf_name
        found = name_map.get_type_and_name(module)
        assert found is not None, f"no GGUF name for {hf_name}"
        kind, name = found
        if shift and hf_name.endswith("norm.weight"):
            data = data + np.float32(shift)
        n_head = heads_of.get(module.rsplit(".", 1)[-1])
        if arch in PERMUTE_QK and n_head is not None:
            data = permute(data, n_head)

            def back(v: np.ndarray, p: torch.Tensor = p, n_head: int = n_head) -> None:
                p.copy_(torch.from_numpy(unpermute(v, n_head)))
        else:

            def back(v: np.ndarray, p: torch.Tensor = p) -> None:
                p.copy_(torch.from_numpy(v))

        jobs.append(Job(kind, name + ".weight", data, back))
    for job in jobs:
        assert job.kind in gguf.MODEL_TENSORS[arch], (
            f"{job.name} is not a {gguf.MODEL_ARCH_NAMES[arch]} tensor"
        )
    return jobs


def write_gguf(model: PreTrainedModel, path: str | Path, *, qtype: str = "f32", seed: int = 0) -> None:
    """Write `model` to `path` as llama.cpp's converter would, matrices in `qtype`.

    qtype: "f32", "f16", "q8_0" or "q4_k" (random valid Q4_K blocks from `seed`, with each weight's
    spread). Matrices of `model` are overwritten in place with the values the file decodes to.
    """
    cls = type(model).__name__
    if cls not in ARCH:
        raise ValueError(f"unsupported model class {cls}")
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    arch = ARCH[cls]
    ggml_type, ftype = QTYPES[qtype]
    hp = model.config.to_dict()
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _add_metadata(writer, arch, hp, ftype)
    add_bpe_vocab(writer, hp["vocab_size"])

    rope = _rope_params(hp)
    if (factors := llama3_rope_factors(hp, rope.get("full_attention", rope))) is not None:
        writer.add_tensor(gguf.TENSOR_NAMES[MT.ROPE_FREQS] + ".weight", factors.numpy())

    with torch.no_grad():
        for job in _jobs(model, arch, hp):
            keep_f32 = job.data.ndim <= 1 or job.kind in ALWAYS_F32
            tensor_type = T.F32 if keep_f32 else ggml_type
            raw, stored = _encode(job.data, tensor_type, rng)
            writer.add_tensor(job.name, raw, raw_dtype=tensor_type if raw.dtype == np.uint8 else None)
            if not keep_f32:
                job.back(stored)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
