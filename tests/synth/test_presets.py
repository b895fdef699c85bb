"""Synthetic-model presets at real size: tensor tables, llama.cpp's type mix, file sizes, real headers.

No tensor data is written here: the real-size files are the real header followed by a sparse hole.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as T
from support import llamacpp

from moerun.gguf.reader import GGUFFile
from moerun.models.config import read_config
from moerun.models.registry import arch_spec
from moerun.synth import PRESETS, expected_size, get_preset, plan_file, tensor_plan
from moerun.synth.presets import UnknownPreset
from moerun.synth.quant_mix import ModelInfo, UnsupportedFileType, fallback, plan_types, use_more_bits

GIB = 2**30
REAL = [name for name in PRESETS if not name.startswith("tiny-")]
TINY = [name for name in PRESETS if name.startswith("tiny-")]

# The real architectures, written out independently of moerun's tables: per preset the global tensors
# and one block's tensors with their GGUF ne (row width first), and the tensor count.
OLMOE_BLOCK = {
    "attn_norm": [2048], "attn_q": [2048, 2048], "attn_k": [2048, 2048], "attn_v": [2048, 2048],
    "attn_output": [2048, 2048], "attn_q_norm": [2048], "attn_k_norm": [2048], "ffn_norm": [2048],
    "ffn_gate_inp": [2048, 64], "ffn_gate_exps": [2048, 1024, 64], "ffn_up_exps": [2048, 1024, 64],
    "ffn_down_exps": [1024, 2048, 64],
}
QWEN3MOE_BLOCK = {
    "attn_norm": [2048], "attn_q": [2048, 4096], "attn_k": [2048, 512], "attn_v": [2048, 512],
    "attn_output": [4096, 2048], "attn_q_norm": [128], "attn_k_norm": [128], "ffn_norm": [2048],
    "ffn_gate_inp": [2048, 128], "ffn_gate_exps": [2048, 768, 128], "ffn_up_exps": [2048, 768, 128],
    "ffn_down_exps": [768, 2048, 128],
}
MIXTRAL_BLOCK = {
    "attn_norm": [4096], "attn_q": [4096, 4096], "attn_k": [4096, 1024], "attn_v": [4096, 1024],
    "attn_output": [4096, 4096], "ffn_norm": [4096], "ffn_gate_inp": [4096, 8],
    "ffn_gate_exps": [4096, 14336, 8], "ffn_up_exps": [4096, 14336, 8], "ffn_down_exps": [14336, 4096, 8],
}
QWEN3_8B_BLOCK = {
    "attn_norm": [4096], "attn_q": [4096, 4096], "attn_k": [4096, 1024], "attn_v": [4096, 1024],
    "attn_output": [4096, 4096], "attn_q_norm": [128], "attn_k_norm": [128], "ffn_norm": [4096],
    "ffn_gate": [4096, 12288], "ffn_up": [4096, 12288], "ffn_down": [12288, 4096],
}
LLAMA32_1B_BLOCK = {
    "attn_norm": [2048], "attn_q": [2048, 2048], "attn_k": [2048, 512], "attn_v": [2048, 512],
    "attn_output": [2048, 2048], "ffn_norm": [2048], "ffn_gate": [2048, 8192], "ffn_up": [2048, 8192],
    "ffn_down": [8192, 2048],
}
SMOLLM2_BLOCK = {
    "attn_norm": [2048], "attn_q": [2048, 2048], "attn_k": [2048, 2048], "attn_v": [2048, 2048],
    "attn_output": [2048, 2048], "ffn_norm": [2048], "ffn_gate": [2048, 8192], "ffn_up": [2048, 8192],
    "ffn_down": [8192, 2048],
}
# preset -> (arch, n_layer, globals {name: ne}, block {name: ne})
ARCHITECTURES: dict[str, tuple[str, int, dict[str, list[int]], dict[str, list[int]]]] = {
    "olmoe-1b-7b": ("olmoe", 16, {"token_embd": [2048, 50304], "output_norm": [2048], "output": [2048, 50304]},
                    OLMOE_BLOCK),
    "qwen3-30b-a3b": ("qwen3moe", 48, {"token_embd": [2048, 151936], "output_norm": [2048],
                                       "output": [2048, 151936]}, QWEN3MOE_BLOCK),
    "mixtral-8x7b": ("llama", 32, {"token_embd": [4096, 32000], "output_norm": [4096], "output": [4096, 32000]},
                     MIXTRAL_BLOCK),
    "qwen3-8b": ("qwen3", 36, {"token_embd": [4096, 151936], "output_norm": [4096], "output": [4096, 151936]},
                 QWEN3_8B_BLOCK),
    "llama-3.2-1b": ("llama", 16, {"token_embd": [2048, 128256], "output_norm": [2048], "rope_freqs": [32]},
                     LLAMA32_1B_BLOCK),
    "smollm2-1.7b": ("llama", 24, {"token_embd": [2048, 49152], "output_norm": [2048]}, SMOLLM2_BLOCK),
}
# metadata llama.cpp reads, per preset (keys without the "{arch}." prefix)
METADATA: dict[str, dict[str, object]] = {
    "olmoe-1b-7b": {"context_length": 4096, "embedding_length": 2048, "block_count": 16, "feed_forward_length": 1024,
                    "attention.head_count": 16, "attention.head_count_kv": 16, "expert_count": 64,
                    "expert_used_count": 8, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0},
    "qwen3-30b-a3b": {"context_length": 40960, "embedding_length": 2048, "block_count": 48,
                      "attention.head_count": 32, "attention.head_count_kv": 4, "attention.key_length": 128,
                      "attention.value_length": 128, "expert_count": 128, "expert_used_count": 8,
                      "expert_feed_forward_length": 768, "rope.freq_base": 1e6,
                      "attention.layer_norm_rms_epsilon": 1e-6},
    "mixtral-8x7b": {"context_length": 32768, "embedding_length": 4096, "block_count": 32,
                     "feed_forward_length": 14336, "attention.head_count": 32, "attention.head_count_kv": 8,
                     "expert_count": 8, "expert_used_count": 2, "vocab_size": 32000, "rope.dimension_count": 128,
                     "rope.freq_base": 1e6},
    "qwen3-8b": {"context_length": 40960, "embedding_length": 4096, "block_count": 36, "feed_forward_length": 12288,
                 "attention.head_count": 32, "attention.head_count_kv": 8, "attention.key_length": 128},
    "llama-3.2-1b": {"context_length": 131072, "embedding_length": 2048, "block_count": 16,
                     "feed_forward_length": 8192, "attention.head_count": 32, "attention.head_count_kv": 8,
                     "attention.key_length": 64, "rope.freq_base": 500000.0, "vocab_size": 128256,
                     "rope.dimension_count": 64},
    "smollm2-1.7b": {"context_length": 8192, "embedding_length": 2048, "block_count": 24,
                     "feed_forward_length": 8192, "attention.head_count": 32, "attention.head_count_kv": 32,
                     "rope.freq_base": 130000.0},
}

# llama.cpp's use_more_bits layers for the real depths
MORE_BITS = {16: {0, 1, 4, 7, 10, 13, 14, 15}, 32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}}


def _ne(plan) -> dict[str, list[int]]:
    return {t.spec.name: list(reversed(t.spec.shape)) for t in plan.tensors}


def _types(plan) -> dict[str, T]:
    return {t.spec.name: t.ggml_type for t in plan.tensors}


@pytest.mark.parametrize("name", REAL)
def test_real_tensor_table_matches_architecture(name: str) -> None:
    arch, n_layer, globals_, block = ARCHITECTURES[name]
    plan = plan_file(name, "q4_k_m")
    assert plan.preset.arch == arch
    expected = {f"{k}.weight": v for k, v in globals_.items()}
    for bid in range(n_layer):
        expected |= {f"blk.{bid}.{k}.weight": v for k, v in block.items()}
    assert _ne(plan) == expected
    assert len(plan.tensors) == len(globals_) + n_layer * len(block)


@pytest.mark.parametrize("name", TINY)
def test_tiny_presets_keep_architecture_and_features(name: str) -> None:
    tiny, real = PRESETS[name], PRESETS[name.removeprefix("tiny-")]
    for attr in ("arch", "tied_embeddings", "head_dim_in_config", "tokenizer_pre", "write_expert_ff",
                 "write_vocab_size", "is_moe"):
        assert getattr(tiny, attr) == getattr(real, attr), attr
    assert (tiny.rope_freqs is None) == (real.rope_freqs is None)
    assert (tiny.n_head_kv == tiny.n_head) == (real.n_head_kv == real.n_head)  # GQA or not
    assert (tiny.n_expert == 8) == (real.n_expert == 8)  # llama.cpp's 8-expert type rules
    for width in (tiny.n_embd, tiny.n_head * tiny.head_dim, tiny.n_ff, tiny.n_ff_exp or 256):
        assert width % 256 == 0
    assert _kinds(tiny) == _kinds(real)


def _kinds(p) -> set[str]:
    """Tensor names with the block index dropped."""
    return {t.name.split(".", 2)[-1] if t.layer >= 0 else t.name for t in tensor_plan(p)}


@pytest.mark.parametrize(("ftype", "gib"), [("q4_k_m", 3.92), ("q8_0", 6.85), ("f16", 12.89)])
def test_olmoe_file_sizes_match_llamacpp(ftype: str, gib: float) -> None:
    size = expected_size("olmoe-1b-7b", ftype) / GIB
    assert abs(size - gib) / gib < 0.005, size


def test_qwen3_30b_q4_k_m_size_matches_llamacpp() -> None:
    assert abs(expected_size("qwen3-30b-a3b", "q4_k_m") / GIB - 17.28) / 17.28 < 0.005


def test_olmoe_q4_k_m_type_mix() -> None:
    types = _types(plan_file("olmoe-1b-7b", "q4_k_m"))
    assert types["output.weight"] == T.Q6_K and types["token_embd.weight"] == T.Q4_K
    for bid in range(16):
        more = T.Q6_K if bid in MORE_BITS[16] else T.Q4_K
        assert types[f"blk.{bid}.attn_v.weight"] == more
        assert types[f"blk.{bid}.ffn_down_exps.weight"] == more
        for k in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{bid}.{k}.weight"] == T.Q4_K
        for k in ("ffn_gate_inp", "attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm"):
            assert types[f"blk.{bid}.{k}.weight"] == T.F32


def test_mixtral_eight_expert_rules() -> None:
    for ftype, attn_out in (("q4_k_m", T.Q5_K), ("q5_k_m", T.Q5_K), ("q4_0", T.Q4_0), ("q6_k", T.Q6_K)):
        types = _types(plan_file("mixtral-8x7b", ftype))
        for bid in range(32):
            assert types[f"blk.{bid}.attn_v.weight"] == T.Q8_0
            assert types[f"blk.{bid}.attn_k.weight"] == T.Q8_0
            assert types[f"blk.{bid}.ffn_gate_inp.weight"] == T.F32
            if ftype == "q4_k_m":
                assert types[f"blk.{bid}.attn_output.weight"] == attn_out
                down = T.Q6_K if bid in MORE_BITS[32] else T.Q4_K
                assert types[f"blk.{bid}.ffn_down_exps.weight"] == down
        assert types["output.weight"] == T.Q6_K


@pytest.mark.parametrize(("ftype", "matrix", "output"), [
    ("f16", T.F16, T.F16), ("bf16", T.BF16, T.BF16), ("q8_0", T.Q8_0, T.Q8_0), ("q4_0", T.Q4_0, T.Q6_K),
    ("q6_k", T.Q6_K, T.Q6_K),
])
def test_uniform_file_types(ftype: str, matrix: T, output: T) -> None:
    plan = plan_file("qwen3-8b", ftype)
    for t in plan.tensors:
        want = T.F32 if len(t.spec.shape) == 1 else output if t.spec.name == "output.weight" else matrix
        assert t.ggml_type == want, t.spec.name


@pytest.mark.parametrize("ftype", ["q4_k_m", "q4_0", "q8_0"])
def test_tied_embeddings_quantized_like_output(ftype: str) -> None:
    types = _types(plan_file("llama-3.2-1b", ftype))
    assert "output.weight" not in types
    assert types["token_embd.weight"] == (T.Q8_0 if ftype == "q8_0" else T.Q6_K)
    assert types["rope_freqs.weight"] == T.F32


def test_dense_counters_follow_block_order() -> None:
    """Dense ffn_down uses the running counter; in llama.cpp's order it equals the block index."""
    types = _types(plan_file("qwen3-8b", "q4_k_m"))
    more = {i for i in range(36) if use_more_bits(i, 36)}
    assert {i for i in range(36) if types[f"blk.{i}.ffn_down.weight"] == T.Q6_K} == more
    assert {i for i in range(36) if types[f"blk.{i}.attn_v.weight"] == T.Q6_K} == more


def test_use_more_bits() -> None:
    for n, layers in MORE_BITS.items():
        assert {i for i in range(n) if use_more_bits(i, n)} == layers


def test_fallback_for_row_widths_blocks_do_not_divide() -> None:
    assert fallback("x", 2880, T.Q4_K) == T.Q5_0
    assert fallback("x", 2880, T.Q5_K) == T.Q5_1
    assert fallback("x", 2880, T.Q6_K) == T.Q8_0
    assert fallback("x", 100, T.Q6_K) == T.F16
    assert fallback("x", 4096, T.Q4_K) == T.Q4_K
    types = plan_types([("output.weight", (10, 2880)), ("blk.0.attn_q.weight", (2880, 2880))], "q4_k_m",
                       ModelInfo(n_layer=1, n_expert=0))
    assert types == [T.Q8_0, T.Q5_0]  # output: ncols % 256 -> Q8_0 before the fallback


def test_unknown_names_are_clear_errors() -> None:
    with pytest.raises(UnknownPreset, match="unknown preset 'nope'; choose one of: olmoe-1b-7b"):
        get_preset("nope")
    with pytest.raises(UnsupportedFileType, match="unknown file type 'q3_k_m'"):
        plan_file("tiny-olmoe-1b-7b", "q3_k_m")


@pytest.mark.parametrize("name", REAL)
def test_real_size_header_reads_back(name: str, tmp_path: Path) -> None:
    """The real header over a sparse hole: gguf's reader, moerun's reader and config, llama.cpp's
    vocab-only load all accept it and read back the real architecture."""
    plan = plan_file(name, "q4_k_m")
    path = tmp_path / f"{name}.gguf"
    with open(path, "wb") as f:
        f.write(plan.header)
        f.truncate(plan.size)
    assert path.stat().st_size == plan.size
    want = {t.spec.name: (t.spec.shape, t.ggml_type) for t in plan.tensors}
    if name == "olmoe-1b-7b":  # gguf's own reader takes ~10 s on a 152k-token vocabulary: one preset only
        reader = gguf.GGUFReader(path)
        assert {t.name: (tuple(reversed(t.shape.tolist())), t.tensor_type) for t in reader.tensors} == want
    f = GGUFFile(path)
    try:
        assert {n: (e.shape, e.ggml_type) for n, e in f.tensors.items()} == want
        p = PRESETS[name]
        assert f.architecture == p.arch
        for key, value in METADATA[name].items():
            assert f.get(f"{p.arch}.{key}") == pytest.approx(value), key
        assert f.get("general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
        assert f.get("general.quantization_version") == 2
        assert len(f.get("tokenizer.ggml.tokens")) == p.n_vocab
        cfg = read_config(f, arch_spec(p.arch), p.n_vocab)
        assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_expert,
                cfg.n_expert_used, cfg.n_ff_exp) == (p.n_embd, p.n_layer, p.n_head, p.n_head_kv, p.head_dim,
                                                       p.n_expert, p.n_expert_used, p.n_ff_exp or p.n_ff)
    finally:
        f.close()
    if llamacpp.available():
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        try:
            assert llm.n_vocab() == PRESETS[name].n_vocab
        finally:
            llm.close()
