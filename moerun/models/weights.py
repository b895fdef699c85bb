"""GGUF tensors -> model parameters, through tables of gguf's own tensor names.

Matrices stay quantized (`QTensor`, a view of the memory-mapped file on the CPU); 1-D tensors
(norms, rope factors) are small and are dequantized once to float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import MODEL_TENSOR as T
from gguf import TENSOR_NAMES  # noqa: N811

from moerun.errors import ShapeMismatch
from moerun.gguf.reader import GGUFFile
from moerun.models.config import ModelConfig
from moerun.models.spec import ArchSpec
from moerun.quant.qtensor import QTensor

Shape = Callable[[ModelConfig], tuple[int, ...]]

# parameter -> (gguf tensor, expected torch-order shape). Per-layer names are formatted with bid.
GLOBAL: dict[str, tuple[T, Shape]] = {
    "token_embd": (T.TOKEN_EMBD, lambda c: (c.n_vocab, c.n_embd)),
    "output_norm": (T.OUTPUT_NORM, lambda c: (c.n_embd,)),
    "output": (T.OUTPUT, lambda c: (c.n_vocab, c.n_embd)),
    "rope_freqs": (T.ROPE_FREQS, lambda c: (c.rope_dim // 2,)),
}
ATTENTION: dict[str, tuple[T, Shape]] = {
    "attn_norm": (T.ATTN_NORM, lambda c: (c.n_embd,)),
    "attn_q": (T.ATTN_Q, lambda c: (c.n_head * c.head_dim, c.n_embd)),
    "attn_k": (T.ATTN_K, lambda c: (c.n_head_kv * c.head_dim, c.n_embd)),
    "attn_v": (T.ATTN_V, lambda c: (c.n_head_kv * c.head_dim_v, c.n_embd)),
    "attn_output": (T.ATTN_OUT, lambda c: (c.n_embd, c.n_head * c.head_dim_v)),
    "ffn_norm": (T.FFN_NORM, lambda c: (c.n_embd,)),
}
QK_NORM: dict[str, dict[str, tuple[T, Shape]]] = {
    "none": {},
    "head": {
        "attn_q_norm": (T.ATTN_Q_NORM, lambda c: (c.head_dim,)),
        "attn_k_norm": (T.ATTN_K_NORM, lambda c: (c.head_dim,)),
    },
    "full": {
        "attn_q_norm": (T.ATTN_Q_NORM, lambda c: (c.n_head * c.head_dim,)),
        "attn_k_norm": (T.ATTN_K_NORM, lambda c: (c.n_head_kv * c.head_dim,)),
    },
}
POST_NORMS: dict[str, tuple[T, Shape]] = {
    "post_attention_norm": (T.ATTN_POST_NORM, lambda c: (c.n_embd,)),
    "post_ffw_norm": (T.FFN_POST_NORM, lambda c: (c.n_embd,)),
}
DENSE_FFN: dict[str, tuple[T, Shape]] = {
    "ffn_gate": (T.FFN_GATE, lambda c: (c.n_ff, c.n_embd)),
    "ffn_up": (T.FFN_UP, lambda c: (c.n_ff, c.n_embd)),
    "ffn_down": (T.FFN_DOWN, lambda c: (c.n_embd, c.n_ff)),
}
MOE_FFN: dict[str, tuple[T, Shape]] = {
    "ffn_gate_inp": (T.FFN_GATE_INP, lambda c: (c.n_expert, c.n_embd)),
    "ffn_gate_exps": (T.FFN_GATE_EXP, lambda c: (c.n_expert, c.n_ff_exp, c.n_embd)),
    "ffn_up_exps": (T.FFN_UP_EXP, lambda c: (c.n_expert, c.n_ff_exp, c.n_embd)),
    "ffn_down_exps": (T.FFN_DOWN_EXP, lambda c: (c.n_expert, c.n_embd, c.n_ff_exp)),
}
OPTIONAL_GLOBAL = {"output", "rope_freqs"}  # output falls back to token_embd (tied embeddings)
SMALL = {"ffn_gate_inp"}  # matrices small enough to keep dequantized in float32

Param = torch.Tensor | QTensor


@dataclass
class ModelWeights:
    """All parameters of a model: globals by name, and one dict per layer."""

    globals: dict[str, Param]
    layers: list[dict[str, Param]]


def layer_table(spec: ArchSpec, cfg: ModelConfig) -> dict[str, tuple[T, Shape]]:
    """The per-layer parameters this architecture (and this config: dense or MoE) needs."""
    table = dict(ATTENTION) | QK_NORM[spec.qk_norm]
    if spec.post_norms:
        table |= POST_NORMS
    return table | (MOE_FFN if cfg.is_moe else DENSE_FFN)


def _load(f: GGUFFile, param: str, name: str, shape: tuple[int, ...]) -> Param:
    entry = f.tensor(name)
    if tuple(entry.shape) != shape:
        raise ShapeMismatch(
            f"{f.path}: tensor '{name}' has shape {list(entry.shape)}, but the metadata implies {list(shape)}"
        )
    q = QTensor.from_numpy(name, str(f.path), entry.ggml_type, entry.shape, entry.data)
    return q.dequantize() if len(shape) == 1 or param in SMALL else q


def load_weights(f: GGUFFile, spec: ArchSpec, cfg: ModelConfig) -> ModelWeights:
    """Read every parameter of `cfg` from `f`, checking each shape against the metadata."""
    g: dict[str, Param] = {}
    for param, (tensor, shape) in GLOBAL.items():
        name = TENSOR_NAMES[tensor] + ".weight"
        if param in OPTIONAL_GLOBAL and name not in f.tensors:
            continue
        g[param] = _load(f, param, name, shape(cfg))
    layers = []
    table = layer_table(spec, cfg)
    for bid in range(cfg.n_layer):
        layers.append({
            param: _load(f, param, TENSOR_NAMES[tensor].format(bid=bid) + ".weight", shape(cfg))
            for param, (tensor, shape) in table.items()
        })
    return ModelWeights(g, layers)
