"""The synthetic BPE vocabulary (moerun.gguf.vocab) and the llama.cpp oracle (tests/support/llamacpp)."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from support import llamacpp

from moerun.gguf.vocab import SPECIAL_TOKENS, add_bpe_vocab, build_bpe_vocab, bytes_to_unicode

needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")

# Tiny llama: E=64, 4 query heads and 2 KV heads of 16, FFN 128, one block.
E, N_HEAD, N_KV, FF, N_CTX = 64, 4, 2, 128, 256
HEAD_DIM = E // N_HEAD
RMS_EPS, ROPE_BASE = 1e-5, 10000.0


def _write_llama(path: Path, n_vocab: int, tensors: dict[str, np.ndarray], seed: int = 0) -> None:
    """A one-block llama GGUF: the tiny model's metadata, a BPE vocabulary and `tensors` (by GGUF name)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(E)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_bpe_vocab(writer, n_vocab, seed=seed)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_llama(path: Path, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a one-block llama GGUF with random F32 weights; returns the weights by GGUF name.

    A PyTorch Linear weight of shape [out, in] is written as the numpy array [out, in] (GGUF
    lists dimensions reversed: ne = [in, out]).
    """
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)

    weights = {
        "token_embd.weight": rng.standard_normal((n_vocab, E)).astype(np.float32),  # [V, E]
        "blk.0.attn_norm.weight": norm(),
        "blk.0.attn_q.weight": mat(N_HEAD * HEAD_DIM, E),
        "blk.0.attn_k.weight": mat(N_KV * HEAD_DIM, E),
        "blk.0.attn_v.weight": mat(N_KV * HEAD_DIM, E),
        "blk.0.attn_output.weight": mat(E, N_HEAD * HEAD_DIM),
        "blk.0.ffn_norm.weight": norm(),
        "blk.0.ffn_gate.weight": mat(FF, E),
        "blk.0.ffn_up.weight": mat(FF, E),
        "blk.0.ffn_down.weight": mat(E, FF),
        "output_norm.weight": norm(),
        "output.weight": mat(n_vocab, E),  # [V, E]
    }
    _write_llama(path, n_vocab, weights, seed)
    return weights


def reference_logits(weights: dict[str, np.ndarray], tokens: list[int]) -> torch.Tensor:
    """The tiny llama's forward pass in float64 torch, with llama.cpp's conventions. Returns [T, V].

    llama.cpp applies "normal" RoPE to llama: rotations of adjacent pairs (2i, 2i+1) of each head, on
    the q/k weights exactly as stored.
    """
    w = {k: torch.from_numpy(v).double() for k, v in weights.items()}
    T = len(tokens)

    def rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * g

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, H, D]
        inv = ROPE_BASE ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)  # [D/2]
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # [T, D/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)

    x = w["token_embd.weight"][tokens]  # [T, E]
    h = rms(x, w["blk.0.attn_norm.weight"])
    q = rope((h @ w["blk.0.attn_q.weight"].T).view(T, N_HEAD, HEAD_DIM))
    k = rope((h @ w["blk.0.attn_k.weight"].T).view(T, N_KV, HEAD_DIM))
    v = (h @ w["blk.0.attn_v.weight"].T).view(T, N_KV, HEAD_DIM)
    k = k.repeat_interleave(N_HEAD // N_KV, dim=1)  # [T, H, D]: query head h reads KV head h // 2
    v = v.repeat_interleave(N_HEAD // N_KV, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / HEAD_DIM**0.5  # [H, T, T]
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, E)
    x = x + attn @ w["blk.0.attn_output.weight"].T
    h = rms(x, w["blk.0.ffn_norm.weight"])
    gate = torch.nn.functional.silu(h @ w["blk.0.ffn_gate.weight"].T)
    x = x + (gate * (h @ w["blk.0.ffn_up.weight"].T)) @ w["blk.0.ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T  # [T, V]


def read_vocab(path: Path) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types) of a GGUF file, read back with gguf's reader."""
    fields = gguf.GGUFReader(str(path)).fields

    def strings(key: str) -> list[str]:
        field = fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    types = fields["tokenizer.ggml.token_type"]
    return (
        strings("tokenizer.ggml.tokens"),
        strings("tokenizer.ggml.merges"),
        [int(types.parts[i][0]) for i in types.data],
    )


@pytest.mark.parametrize("n_vocab", [260, 1000, 65_536 + 258, 70_000])
def test_vocab_is_consistent(n_vocab: int) -> None:
    tokens, types, merges = build_bpe_vocab(n_vocab, seed=1)
    assert len(tokens) == len(types) == n_vocab
    assert len(set(tokens)) == n_vocab, "token strings must be unique"
    byte_chars = bytes_to_unicode()
    assert tokens[:256] == [byte_chars[b] for b in range(256)]
    assert tokens[-len(SPECIAL_TOKENS) :] == list(SPECIAL_TOKENS)
    assert types[-1] == gguf.TokenType.CONTROL and types[0] == gguf.TokenType.NORMAL
    assert len(merges) == n_vocab - 256 - len(SPECIAL_TOKENS)
    index = {t: i for i, t in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        a, b = merge.split(" ")
        assert index[a] < 256 + rank and index[b] < 256 + rank  # parts exist before the merge
        assert index[a + b] == 256 + rank


def test_vocab_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="n_vocab"):
        build_bpe_vocab(100)


def test_vocab_152k_builds_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    add_bpe_vocab(writer, 152_000)
    elapsed = time.perf_counter() - start
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert elapsed < 2.0
    tokens, _, merges = build_bpe_vocab(152_000)
    assert len(set(tokens)) == 152_000 and len(merges) == 152_000 - 258
    assert (tmp_path / "vocab.gguf").stat().st_size > 152_000 * 2


def test_vocab_loads_in_tokenizers(tmp_path: Path) -> None:
    """A GGUF gpt2 vocabulary converts to a `tokenizers` BPE + ByteLevel tokenizer that round-trips text."""
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_bpe_vocab(writer, 5000)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tokens, merges, types = read_vocab(path)

    model = tokenizers.models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]
    )
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.CONTROL])
    assert tok.get_vocab_size() == 5000

    text = "Hello world, the quick brown fox 123 — ünïcödé <|eos|>"
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode())  # some merges apply
    assert ids[-1] == tokens.index("<|eos|>")
    assert tok.decode(ids, skip_special_tokens=False) == text


@needs_llamacpp
@pytest.mark.parametrize("n_vocab", [300, 70_000])
def test_tiny_llama_loads_in_llamacpp(tmp_path: Path, n_vocab: int) -> None:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama(path, n_vocab)
    tokens = [1, 5, 200, n_vocab - 3, 7, n_vocab - 1]
    logits = llamacpp.llamacpp_logits(str(path), tokens)
    assert logits.shape == (len(tokens), n_vocab) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1


@needs_llamacpp
def test_llamacpp_load_failure_carries_its_log(tmp_path: Path) -> None:
    """A file missing most tensors fails with llama.cpp's reason attached."""
    bad = tmp_path / "missing-tensor.gguf"
    _write_llama(bad, 300, {"token_embd.weight": np.zeros((300, E), np.float32)})
    with pytest.raises(llamacpp.LlamaCppError, match="error loading model"):
        llamacpp.llamacpp_logits(str(bad), [1, 2])


@needs_llamacpp
def test_llamacpp_matches_torch_reference(tmp_path: Path) -> None:
    """llama.cpp's F32 logits match a float64 torch forward pass of the same tiny llama."""
    path = tmp_path / "tiny-llama.gguf"
    weights = write_tiny_llama(path, 512, seed=3)
    tokens = np.random.default_rng(4).integers(0, 510, size=40).tolist()
    got = torch.from_numpy(llamacpp.llamacpp_logits(str(path), tokens)).double()
    want = reference_logits(weights, tokens)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, f"max relative logit error {rel:.3g}"
