"""moerun's tokenizer against llama.cpp's own tokenizer test vectors.

The vocabulary-only GGUF files `models/ggml-vocab-*.gguf` and their `.inp` / `.out` cases come from the
llama-cpp-python source package on PyPI (fetched once into a cache by `support.llamacpp_sdist`; a failed
download fails these tests). Every case of every vocabulary whose pre-tokenizer moerun claims must give
llama.cpp's ids (`add_special=False`, `parse_special=False`, as llama.cpp's test-tokenizer-0 runs them).
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import pytest
from support import llamacpp_sdist

from moerun.errors import MoerunError
from moerun.gguf.reader import GGUFFile
from moerun.gguf.vocab import add_bpe_vocab
from moerun.tokenizer import PRE_TOKENIZERS, StreamDecoder, Tokenizer, UnsupportedTokenizer

# Vocabularies with test cases in llama-cpp-python 0.3.36, by what moerun does with them.
SUPPORTED = (
    "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3",
    "qwen2", "qwen35", "refact", "starcoder",
)  # fmt: skip
UNSUPPORTED = {"bert-bge": "'bert'", "gemma-4": "'gemma4'"}  # vocab -> the value the error must name
REQUIRED_PRE = ("default", "gpt-2", "llama-bpe", "qwen2", "olmo", "smollm")


@functools.cache
def files() -> llamacpp_sdist.LlamaCppFiles:
    return llamacpp_sdist.files()


@functools.cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(files().models / f"ggml-vocab-{name}.gguf")


def test_sdist_has_the_expected_vocabularies() -> None:
    names = {p.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for p in files().vocabs()}
    assert names == set(SUPPORTED) | set(UNSUPPORTED)


@pytest.mark.parametrize("name", SUPPORTED)
def test_every_case_matches_llamacpp(name: str) -> None:
    tok = tokenizer(name)
    cases = llamacpp_sdist.read_cases(files().models / f"ggml-vocab-{name}.gguf")
    assert len(cases) >= 46
    wrong = [
        (text, want, got)
        for text, want in cases
        if (got := tok.encode(text, add_special=False, parse_special=False)) != want
    ]
    assert not wrong, f"{len(wrong)}/{len(cases)} cases differ, first: {wrong[0]!r}"
    # Decoding gives the text back (these cases have no unknown characters).
    for text, want in cases:
        assert tok.decode(want) == text


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_vocabulary_is_a_clear_error(name: str) -> None:
    path = files().models / f"ggml-vocab-{name}.gguf"
    with pytest.raises(UnsupportedTokenizer, match=UNSUPPORTED[name]) as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)
    assert isinstance(e.value, MoerunError)


def test_every_vocab_file_reads_and_builds_or_refuses() -> None:
    """Also the files without test cases (aquila, baichuan, gpt-neox, nomic-bert-moe)."""
    for path in sorted(files().models.glob("ggml-vocab-*.gguf")):
        f = GGUFFile(path)  # vocabulary-only files, no tensors
        assert f.tensors == {}
        try:
            tok = Tokenizer.from_gguf(f)
        except UnsupportedTokenizer:
            assert f.get("tokenizer.ggml.model") not in ("gpt2", "llama")
            continue
        assert tok.decode(tok.encode("Hello world 123", add_special=False)) == "Hello world 123"


def _vocab_only_file(path: Path, *, pre: str, model: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    add_bpe_vocab(writer, 600, pre=pre)
    if model != "gpt2":
        writer.add_key_value("tokenizer.ggml.model", model, gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    path = _vocab_only_file(tmp_path / "mystery.gguf", pre="mystery-bpe")
    with pytest.raises(UnsupportedTokenizer, match=r"tokenizer\.ggml\.pre = 'mystery-bpe'") as e:
        Tokenizer.from_gguf(path)
    assert str(path) in str(e.value)


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedTokenizer, match=r"tokenizer\.ggml\.model = 'rwkv'"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("pre", REQUIRED_PRE)
def test_required_pre_tokenizers_are_claimed(tmp_path: Path, pre: str) -> None:
    assert pre in PRE_TOKENIZERS
    tok = Tokenizer.from_gguf(_vocab_only_file(tmp_path / f"{pre}.gguf", pre=pre))
    text = "Hello, y'all!  3333 apples\n\tcafé 🦙"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|eos|>", add_special=False, parse_special=True) == [tok.eos_id]


def test_add_special_adds_bos_where_the_file_asks() -> None:
    spm = tokenizer("llama-spm")  # SentencePiece: BOS by default
    assert spm.encode("Hello")[0] == spm.bos_id == 1
    assert spm.encode("Hello", add_special=False)[0] != spm.bos_id
    assert spm.encode("") == [1] and spm.encode("", add_special=False) == []
    llama3 = tokenizer("llama-bpe")  # llama3 pre-tokenizer: BOS by default
    assert llama3.encode("Hello")[0] == 128000
    gpt2 = tokenizer("gpt-2")
    assert gpt2.encode("Hello") == gpt2.encode("Hello", add_special=False)


def test_parse_special_controls_control_tokens() -> None:
    tok = tokenizer("qwen2")
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text, add_special=False, parse_special=True)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    plain = tok.encode(text, add_special=False)
    assert tok.token_to_id("<|im_start|>") not in plain and len(plain) > len(ids)
    # Control tokens are hidden when decoding unless asked for.
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, special=True) == text
    assert tok.decode(plain) == text


def test_end_of_generation_ids() -> None:
    qwen = tokenizer("qwen2")
    assert {qwen.token_to_id("<|im_end|>"), qwen.token_to_id("<|endoftext|>")} <= qwen.eog_ids
    llama3 = tokenizer("llama-bpe")
    assert {128001, 128009} <= llama3.eog_ids  # <|end_of_text|>, <|eot_id|>
    phi3 = tokenizer("phi-3")
    assert phi3.token_to_id("<|end|>") in phi3.eog_ids and phi3.eos_id in phi3.eog_ids


@pytest.mark.parametrize("name", ["qwen2", "llama-spm", "gpt-2"])
def test_stream_decoder_never_splits_a_character(name: str) -> None:
    tok = tokenizer(name)
    text = "Hi 👨‍👩‍👧‍👦 and 🏳️‍🌈, 日本語 ✅ façade 🦙!"
    ids = tok.encode(text, add_special=False)
    stream = StreamDecoder(tok)
    chunks = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(chunks) == text == tok.decode(ids)
    assert all("\ufffd" not in c for c in chunks)
    assert any(c == "" for c in chunks[:-1]), "an emoji should span several byte tokens"
