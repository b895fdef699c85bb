"""Which GGML type llama.cpp's quantizer gives each tensor, for the file types `moerun synth` writes.

A port of `llama_tensor_get_type` (and its helpers) from llama.cpp's src/llama-quant.cpp
(ggml-org/llama.cpp, 2026 source), restricted to the file types F16, BF16, Q8_0, Q4_0, Q4_K_M, Q5_K_M
and Q6_K, and to the tensors of the architectures moerun supports. Names in comments are llama.cpp's.

What the rules amount to for these file types:

- tensors that are not quantized at all (`tensor_allows_quantization`): 1-D tensors (norms,
  rope_freqs), `*_norm.weight`, and the MoE router `ffn_gate_inp.weight`: they keep the type the
  converter wrote (F32);
- F16 / BF16 files (`ggml_is_quantized(default_type)` is false): every other tensor F16 / BF16;
- `output.weight` (and `token_embd.weight` when the embeddings are tied, i.e. there is no output.weight):
  Q6_K, unless the file type is Q8_0 (stays Q8_0) or the row width is not a multiple of the default
  type's block size (Q8_0);
- attention V (`category_is_attn_v`): Q6_K for Q4_K_M / Q5_K_M in the layers `use_more_bits` picks;
  Q8_0 whenever the model has exactly 8 experts (Mixtral);
- attention K: Q8_0 when the model has exactly 8 experts;
- FFN down (dense or `_exps`): Q6_K for Q4_K_M / Q5_K_M in the layers `use_more_bits` picks;
- attention output: Q5_K for Q4_K_M when the model has exactly 8 experts;
- then `tensor_type_fallback` for row widths the chosen type's block does not divide.

Counters: llama.cpp counts attention-V and FFN-down tensors as it meets them (i_attention_wv,
i_ffn_down) in weight_name_comparer order (by block, then name), and for MoE models reads the layer from
the tensor name instead; for the models here both give the block index. `plan_types` walks the tensors
in that order with the same counters, so the port stays faithful for any tensor list.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from moerun.errors import MoerunError

T = GGMLQuantizationType


class UnsupportedFileType(MoerunError, ValueError):
    """A file type name `moerun synth` does not write."""


# file type name -> (llama_ftype, default tensor type: llama_ftype_get_default_type)
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f16": (LlamaFileType.MOSTLY_F16, T.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, T.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, T.Q4_0),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    "q5_k_m": (LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
}

FT = LlamaFileType
_MORE_BITS_FTYPES = frozenset({FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M})  # attn_v / ffn_down -> Q6_K

# tensor_type_fallback: a type whose block does not divide the row width -> its replacement
FALLBACK: dict[GGMLQuantizationType, GGMLQuantizationType] = {
    T.Q4_K: T.Q5_0,
    T.Q5_K: T.Q5_1,
    T.Q6_K: T.Q8_0,
}


class Category(enum.Enum):
    """tensor_category (llama-quant.cpp), for the tensor names moerun's architectures use."""

    TOKEN_EMBD = enum.auto()
    ATTENTION_Q = enum.auto()
    ATTENTION_V = enum.auto()
    ATTENTION_K = enum.auto()
    ATTENTION_OUTPUT = enum.auto()
    FFN_UP = enum.auto()
    FFN_GATE = enum.auto()
    FFN_DOWN = enum.auto()
    OUTPUT = enum.auto()
    OTHER = enum.auto()


# tensor_get_category: first match wins, in this order ("ffn_up" before "ffn_gate" before "ffn_down");
# exact names first, then substrings
_EXACT: dict[str, Category] = {"output.weight": Category.OUTPUT, "token_embd.weight": Category.TOKEN_EMBD}
_SUBSTRINGS: tuple[tuple[str, Category], ...] = (
    ("attn_v.weight", Category.ATTENTION_V),
    ("attn_k.weight", Category.ATTENTION_K),
    ("attn_q.weight", Category.ATTENTION_Q),
    ("attn_output.weight", Category.ATTENTION_OUTPUT),
    ("ffn_up", Category.FFN_UP),
    ("ffn_gate", Category.FFN_GATE),
    ("ffn_down", Category.FFN_DOWN),
)


def category(name: str) -> Category:
    """tensor_get_category(name)."""
    if name in _EXACT:
        return _EXACT[name]
    return next((cat for sub, cat in _SUBSTRINGS if sub in name), Category.OTHER)


def allows_quantization(name: str, n_dims: int) -> bool:
    """tensor_allows_quantization, for the tensor names of moerun's architectures: 2-D/3-D `*weight`
    tensors except norms and the MoE router."""
    return (
        n_dims >= 2
        and name.endswith("weight")
        and "_norm.weight" not in name
        and "ffn_gate_inp.weight" not in name
    )


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third in between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _block(t: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[t][0]


def fallback(name: str, ncols: int, t: GGMLQuantizationType) -> GGMLQuantizationType:
    """tensor_type_fallback: a type whose block size divides `ncols` (F16 as the last resort)."""
    if ncols % _block(t) == 0:
        return t
    if t not in FALLBACK:
        raise ValueError(f"{name}: no tensor type fallback is defined for type {t.name} (row width {ncols})")
    new = FALLBACK[t]
    return new if ncols % _block(new) == 0 else T.F16


@dataclass(frozen=True)
class ModelInfo:
    """The hyper-parameters llama_tensor_get_type looks at."""

    n_layer: int
    n_expert: int  # 0 for dense models


@dataclass
class _State:
    """quantize_state_impl: the counters and flags of one quantization run."""

    n_attention_wv: int
    n_ffn_down: int
    has_tied_embeddings: bool
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _layer_of(name: str, counter: int, n_expert: int) -> int:
    """layer_info: for MoE models the block index parsed from `blk.%d.`, else the running counter."""
    if n_expert > 1:
        return int(name.split(".")[1])
    return counter


def _get_type_impl(qs: _State, m: ModelInfo, name: str, ncols: int, new: GGMLQuantizationType,
                   ftype: LlamaFileType, cat: Category) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl, the branches reachable for FILE_TYPES (no MXFP4, IQ*, Q2_K..Q3_K,
    Q4_K_S, IQ4_*; no imatrix; not Falcon; no 70B model)."""
    if cat == Category.OUTPUT or (qs.has_tied_embeddings and cat == Category.TOKEN_EMBD):
        if ncols % _block(new) != 0:
            return T.Q8_0
        return new if new == T.Q8_0 else T.Q6_K
    if cat == Category.TOKEN_EMBD:
        return new  # only IQ*/TQ*/Q2_0 file types change it
    if cat == Category.ATTENTION_V:
        if ftype in _MORE_BITS_FTYPES and use_more_bits(qs.i_attention_wv, qs.n_attention_wv):
            new = T.Q6_K
        if m.n_expert == 8:  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
            new = T.Q8_0
        qs.i_attention_wv += 1
        return new
    if cat == Category.ATTENTION_K:
        return T.Q8_0 if m.n_expert == 8 else new
    if cat == Category.FFN_DOWN:
        i_layer = _layer_of(name, qs.i_ffn_down, m.n_expert)
        if ftype in _MORE_BITS_FTYPES and use_more_bits(i_layer, qs.n_ffn_down):
            new = T.Q6_K
        qs.i_ffn_down += 1
        return new
    if cat == Category.ATTENTION_OUTPUT:
        return T.Q5_K if m.n_expert == 8 and ftype == FT.MOSTLY_Q4_K_M else new
    return new  # ATTENTION_Q, FFN_GATE, FFN_UP: only IQ3 file types change them


def plan_types(tensors: Iterable[tuple[str, Sequence[int]]], ftype: str, model: ModelInfo,
               *, source_type: GGMLQuantizationType = T.F32) -> list[GGMLQuantizationType]:
    """The GGML type of each tensor (name, numpy-order shape) in a file of type `ftype`.

    `tensors` must be in the file's (weight_name_comparer) order. Tensors llama.cpp does not quantize
    keep `source_type`, the type the converter writes them in (F32 for norms, rope_freqs, router).
    """
    tensors = list(tensors)
    llama_ftype, default = file_type(ftype)
    cats = [category(name) for name, _ in tensors]
    qs = _State(  # init_quantize_state_counters
        n_attention_wv=sum(c == Category.ATTENTION_V for c in cats),
        n_ffn_down=model.n_layer,
        has_tied_embeddings=Category.OUTPUT not in cats,
    )
    out: list[GGMLQuantizationType] = []
    for (name, shape), cat in zip(tensors, cats, strict=True):
        if not allows_quantization(name, len(shape)):
            out.append(source_type)
            continue
        new = default
        if _block(default) > 1:  # ggml_is_quantized(default_type)
            new = _get_type_impl(qs, model, name, shape[-1], default, llama_ftype, cat)
            new = fallback(name, shape[-1], new)
        out.append(new)
    return out


def file_type(ftype: str) -> tuple[LlamaFileType, GGMLQuantizationType]:
    """(llama_ftype, default tensor type) of a file type name such as 'q4_k_m'."""
    try:
        return FILE_TYPES[ftype.lower()]
    except KeyError:
        raise UnsupportedFileType(f"unknown file type '{ftype}'; choose one of: {', '.join(FILE_TYPES)}") from None
