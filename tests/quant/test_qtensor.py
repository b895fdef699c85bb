"""QTensor: zero-copy wrapping of GGUF bytes, leading-dim indexing, errors a user can act on."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moerun.errors import MoerunError, ShapeMismatch, UnsupportedQuantType
from moerun.quant import QUANT_TYPES, QTensor, dequantize, quant_type, random_blocks


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = int(os.environ.get("MOERUN_SEED", int.from_bytes(os.urandom(8), "little")))
    print(f"{request.node.name}: MOERUN_SEED={seed}")
    return np.random.default_rng(seed)


def make(g: T, shape: tuple[int, ...], rng: np.random.Generator) -> QTensor:
    """A QTensor of random valid blocks of logical shape `shape`."""
    qt = QUANT_TYPES[g]
    n_blocks = int(np.prod(shape)) // qt.block_size
    data = random_blocks(g, n_blocks, rng).reshape(*shape[:-1], -1)
    return QTensor.from_numpy("blk.0.ffn_down_exps.weight", "model.gguf", g, shape, data)


def memmap_tensor(tmp_path: Path, g: T, shape: tuple[int, ...], rng: np.random.Generator):
    qt = QUANT_TYPES[g]
    blocks = random_blocks(g, int(np.prod(shape)) // qt.block_size, rng)
    path = tmp_path / "t.bin"
    path.write_bytes(b"\0" * 32 + blocks.tobytes())  # a 32-byte header, as tensor data sits at an offset
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=32, shape=(blocks.size,))
    return mm, blocks


@pytest.mark.parametrize("g", [T.Q4_K, T.Q8_0, T.F32, T.F16], ids=lambda g: g.name)
def test_from_memmap_is_zero_copy(tmp_path: Path, g: T, rng: np.random.Generator) -> None:
    shape = (3, 4, 512)
    mm, blocks = memmap_tensor(tmp_path, g, shape, rng)
    data = mm.view(np.float32 if g == T.F32 else np.uint8)  # GGUFReader hands F32 data as float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-array warning must be suppressed
        q = QTensor.from_numpy("blk.0.ffn_up_exps.weight", "m.gguf", g, shape, data)
    assert q.raw.data_ptr() == mm.ctypes.data
    assert np.shares_memory(q.raw.numpy(), mm)
    assert q.raw.dtype == torch.uint8 and q.raw.shape == (3, 4, QUANT_TYPES[g].row_bytes(512))
    assert q.shape == shape and q.ndim == 3 and q.nbytes == blocks.size and q.device.type == "cpu"
    want = dequantize(torch.from_numpy(blocks.reshape(12, -1)), g, (12, 512)).reshape(shape)
    out = q.dequantize()
    assert torch.equal(out, want)
    assert not np.shares_memory(out.numpy(), mm)  # dequantized values are fresh, writable memory
    out.add_(1.0)


def test_dequantize_dtype(rng: np.random.Generator) -> None:
    q = make(T.Q6_K, (2, 256), rng)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize().to(torch.bfloat16))


@pytest.mark.parametrize("g", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_0, T.BF16], ids=lambda g: g.name)
def test_leading_dim_indexing(g: T, rng: np.random.Generator) -> None:
    q = make(g, (5, 3, 512), rng)
    full = q.dequantize()  # [5, 3, 512]
    ids = torch.tensor([4, 0, 0, 2], dtype=torch.long)
    cases = [
        (2, (3, 512)),
        (slice(1, 4), (3, 3, 512)),
        (ids, (4, 3, 512)),
        ((1, 2), (512,)),
        ((ids, 1), (4, 512)),
    ]
    for idx, shape in cases:
        sub = q[idx]
        assert isinstance(sub, QTensor) and sub.shape == shape and sub.qtype is q.qtype
        assert torch.equal(sub.dequantize(), full[idx])
    assert q[1].raw.data_ptr() == q.raw[1].data_ptr()  # int index is a view, no copy


def test_embedding_row_lookup(rng: np.random.Generator) -> None:
    q = make(T.Q4_K, (11, 256), rng)
    ids = torch.tensor([10, 3, 3, 0])
    assert torch.equal(q[ids].dequantize(), q.dequantize()[ids])


def test_index_rejects_row_dim(rng: np.random.Generator) -> None:
    q = make(T.Q8_0, (4, 64), rng)
    for idx in [(0, 1), ..., (None,)]:
        with pytest.raises(IndexError, match="leading dims"):
            q[idx]
    with pytest.raises(IndexError):
        q[0][0]  # a single row has no leading dim left


def test_to_device_keeps_metadata(rng: np.random.Generator) -> None:
    q = make(T.Q5_K, (2, 256), rng)
    r = q.to("cpu")
    assert (r.name, r.file, r.shape, r.qtype) == (q.name, q.file, q.shape, q.qtype)
    assert "Q5_K" in repr(r)


def test_byte_count_mismatch_names_tensor() -> None:
    data = np.zeros(144 * 3, dtype=np.uint8)
    with pytest.raises(ShapeMismatch, match=r"bad\.gguf.*blk\.7\.attn_q\.weight"):
        QTensor.from_numpy("blk.7.attn_q.weight", "bad.gguf", T.Q4_K, (2, 512), data)
    with pytest.raises(ShapeMismatch, match=r"blk\.7\.attn_q\.weight.*whole number"):
        QTensor.from_numpy("blk.7.attn_q.weight", "bad.gguf", T.Q4_K, (1, 300), data)


@pytest.mark.parametrize(
    "ggml_type,type_name", [(T.Q3_K, "Q3_K"), (T.Q2_K, "Q2_K"), (T.IQ2_XXS, "IQ2_XXS"), (999, "999")]
)
def test_unsupported_types(ggml_type: int, type_name: str) -> None:
    with pytest.raises(UnsupportedQuantType) as err:
        quant_type(ggml_type, tensor="blk.3.ffn_down_exps.weight", file="m.gguf")
    msg = str(err.value)
    assert "blk.3.ffn_down_exps.weight" in msg and type_name in msg and "m.gguf" in msg and "Q4_K" in msg
    assert isinstance(err.value, MoerunError)
    with pytest.raises(UnsupportedQuantType, match="blk.3.ffn_down_exps.weight"):
        QTensor.from_numpy(
            "blk.3.ffn_down_exps.weight", "m.gguf", ggml_type, (1, 256), np.zeros(110, np.uint8)
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_qtensor(rng: np.random.Generator) -> None:
    q = make(T.Q4_K, (4, 2, 512), rng)
    g = q.to("cuda")
    assert g.device.type == "cuda"
    ids = torch.tensor([3, 1], device="cuda")
    assert torch.equal(g[ids].dequantize().cpu(), q.dequantize()[[3, 1]])
    assert torch.equal(g.dequantize(torch.bfloat16).cpu(), q.dequantize(torch.bfloat16))
