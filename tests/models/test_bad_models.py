"""Model-level bad input: each case raises a MoerunError naming the file and the tensor or key,
and leaves the file untouched. (Format-level corruption is in tests/gguf/test_bad_files.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from support.device import ENGINE_KW
from support.gguf_edit import rewrite
from support.hf_to_gguf import write_gguf
from support.tiny_models import TINY

from moerun.engine.engine import Engine
from moerun.errors import (
    ContextOverflow,
    MissingKey,
    MissingTensor,
    MoerunError,
    ShapeMismatch,
    UnsupportedArchitecture,
    UnsupportedQuantType,
)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "llama.gguf"
    write_gguf(TINY["llama"](0), path)
    return path


def _expect(path: Path, error: type[MoerunError], *needles: str) -> str:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(error) as info:
        Engine(path, **ENGINE_KW)
    msg = str(info.value)
    assert path.name in msg
    for needle in needles:
        assert needle in msg, msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "the file was modified"
    return msg


def test_missing_tensor(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", drop_tensors=("blk.1.ffn_down.weight",))
    _expect(bad, MissingTensor, "blk.1.ffn_down.weight")


def test_shape_disagrees_with_metadata(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", set_keys={"llama.feed_forward_length": (640, V.UINT32)})
    _expect(bad, ShapeMismatch, "blk.0.ffn_gate.weight", "640")


def test_tensor_with_wrong_shape(good: Path, tmp_path: Path) -> None:
    wrong = np.zeros((128, 256), dtype=np.float32)  # attn_q should be [256, 256]
    bad = rewrite(good, tmp_path / "bad.gguf", replace_tensors={"blk.0.attn_q.weight": (wrong, Q.F32)})
    _expect(bad, ShapeMismatch, "blk.0.attn_q.weight", "[128, 256]")


def test_unsupported_architecture(good: Path, tmp_path: Path) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", arch="rwkv7")
    _expect(bad, UnsupportedArchitecture, "rwkv7", "general.architecture")


def test_unsupported_quant_type(good: Path, tmp_path: Path) -> None:
    # attn_v is [128, 256]: one 256-wide Q3_K block per row
    blocks = np.zeros((128, gguf.GGML_QUANT_SIZES[Q.Q3_K][1]), dtype=np.uint8)
    bad = rewrite(good, tmp_path / "bad.gguf", replace_tensors={"blk.0.attn_v.weight": (blocks, Q.Q3_K)})
    _expect(bad, UnsupportedQuantType, "blk.0.attn_v.weight", "Q3_K")


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count"])
def test_missing_required_key(good: Path, tmp_path: Path, key: str) -> None:
    bad = rewrite(good, tmp_path / "bad.gguf", drop_keys=(key,))
    _expect(bad, MissingKey, key)


@pytest.mark.parametrize(("key", "value", "vtype"), [
    ("llama.block_count", 1 << 30, V.UINT32),
    ("llama.embedding_length", 0, V.UINT32),
    ("llama.attention.head_count_kv", 3, V.UINT32),
    ("llama.expert_used_count", 9, V.UINT32),
    ("llama.rope.freq_base", "fast", V.STRING),
])
def test_absurd_metadata(good: Path, tmp_path: Path, key: str, value: object, vtype: V) -> None:
    keys = {key: (value, vtype)}
    if key == "llama.expert_used_count":
        keys["llama.expert_count"] = (4, V.UINT32)
    bad = rewrite(good, tmp_path / "bad.gguf", set_keys=keys)
    _expect(bad, MoerunError, key.split(".")[-1])


def test_context_overflow_is_an_error(good: Path) -> None:
    eng = Engine(good, **ENGINE_KW, n_ctx=16)
    eng.forward(list(range(10)))
    with pytest.raises(ContextOverflow, match="context size is 16"):
        eng.forward(list(range(7)))
    assert eng.n_past == 10  # nothing was written
    eng.forward(list(range(6)))  # exactly fills the cache
    with pytest.raises(ContextOverflow):
        eng.forward([1])
    with pytest.warns(UserWarning, match="trained"):  # above the training context: allowed, as in llama.cpp
        assert Engine(good, **ENGINE_KW, n_ctx=600).n_ctx == 600
    with pytest.raises(ContextOverflow, match="larger than moerun allows"):
        Engine(good, **ENGINE_KW, n_ctx=1 << 30)


def test_bad_tokens_and_positions(good: Path) -> None:
    eng = Engine(good, **ENGINE_KW)
    with pytest.raises(MoerunError, match="outside the vocabulary"):
        eng.forward([1, 512])
    with pytest.raises(MoerunError, match="at least one token"):
        eng.forward([])
    with pytest.raises(MoerunError, match="outside the cached range"):
        eng.forward([1], pos=3)
