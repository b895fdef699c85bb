"""Compute and KV-cache dtype choices: names accepted, results close to float32, bad names refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.hf_to_gguf import write_gguf
from support.tiny_models import TINY

from moerun.engine.engine import Engine
from moerun.errors import MoerunError


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dtypes") / "llama.gguf"
    write_gguf(TINY["llama"](0), path)
    return path


@pytest.mark.parametrize(("kv", "expected", "tol"), [
    ("float16", torch.float16, 5e-3), ("f16", torch.float16, 5e-3), ("bf16", torch.bfloat16, 3e-2),
    (torch.float32, torch.float32, 0.0),
])
def test_kv_cache_dtypes(llama_file: Path, kv, expected: torch.dtype, tol: float) -> None:
    tokens = list(range(1, 25))
    ref = Engine(llama_file, device="cpu", kv_dtype="float32").forward(tokens)
    eng = Engine(llama_file, device="cpu", kv_dtype=kv)
    assert eng.kv_dtype == expected and eng.cache.k[0].dtype == expected
    got = eng.forward(tokens)
    assert float((got - ref).abs().max() / ref.abs().max()) <= tol


@pytest.mark.parametrize(("kw", "needle"), [
    ({"kv_dtype": "int8"}, "KV cache dtype"), ({"dtype": "float16"}, "compute dtype"), ({"dtype": "fp8"}, "compute"),
])
def test_bad_dtype_names(llama_file: Path, kw: dict, needle: str) -> None:
    with pytest.raises(MoerunError, match=needle):
        Engine(llama_file, device="cpu", **kw)
