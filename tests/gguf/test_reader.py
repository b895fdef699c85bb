"""GGUFFile on valid files written with gguf.GGUFWriter."""

from __future__ import annotations

import mmap
import os
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quantize

from moerun.errors import GGUFFormatError, MissingKey, MissingTensor, MoerunError
from moerun.gguf.reader import GGUFFile, TensorEntry

SCALARS: dict[str, tuple[GGUFValueType, object]] = {
    "test.u8": (GGUFValueType.UINT8, 200),
    "test.i8": (GGUFValueType.INT8, -100),
    "test.u16": (GGUFValueType.UINT16, 60000),
    "test.i16": (GGUFValueType.INT16, -30000),
    "test.u32": (GGUFValueType.UINT32, 4_000_000_000),
    "test.i32": (GGUFValueType.INT32, -2_000_000_000),
    "test.f32": (GGUFValueType.FLOAT32, 0.5),
    "test.bool_true": (GGUFValueType.BOOL, True),
    "test.bool_false": (GGUFValueType.BOOL, False),
    "test.str": (GGUFValueType.STRING, "héllo wörld ✓"),
    "test.empty_str": (GGUFValueType.STRING, ""),
    "test.u64": (GGUFValueType.UINT64, 2**63 + 5),
    "test.i64": (GGUFValueType.INT64, -(2**62)),
    "test.f64": (GGUFValueType.FLOAT64, 1e-300),
}
ARRAYS: dict[str, tuple[GGUFValueType, list]] = {
    "test.arr_i32": (GGUFValueType.INT32, [1, -2, 3]),
    "test.arr_u8": (GGUFValueType.UINT8, [0, 255]),
    "test.arr_f32": (GGUFValueType.FLOAT32, [0.25, -1.5, 3.0]),
    "test.arr_f64": (GGUFValueType.FLOAT64, [1e100]),
    "test.arr_bool": (GGUFValueType.BOOL, [True, False, True]),
    "test.arr_str": (GGUFValueType.STRING, ["a", "", "ünïcode", "<|im_start|>"]),
}
NESTED = [[1, 2], [3, 4, 5]]

F32 = np.arange(6 * 8, dtype=np.float32).reshape(6, 8) / 7  # [6, 8]
F16 = np.linspace(-1, 1, 16).astype(np.float16)  # [16]
Q8_FLOAT = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)  # [E, F, D]
Q8 = quantize(Q8_FLOAT, GGMLQuantizationType.Q8_0)  # [2, 3, 68] bytes


def write_valid(path: Path, *, arch: str | None = "testarch", alignment: int | None = None) -> Path:
    """A small valid GGUF with every value type and F32 / F16 / 3-D Q8_0 tensors."""
    w = gguf.GGUFWriter(path, arch or "unused")
    if arch is None:
        del w.kv_data[0]["general.architecture"]
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, value) in SCALARS.items():
        w.add_key_value(key, value, vtype)
    for key, (etype, values) in ARRAYS.items():
        w.add_key_value(key, values, GGUFValueType.ARRAY, sub_type=etype)
    w.add_array("test.nested", NESTED)
    w.add_tensor("f32.weight", F32)
    w.add_tensor("f16.weight", F16)
    w.add_tensor("blk.0.ffn_gate_exps.weight", Q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def valid(tmp_path: Path) -> Path:
    return write_valid(tmp_path / "valid.gguf")


def reaches_mmap(arr: np.ndarray) -> bool:
    """True if `arr` is a view whose base chain ends in a memory map."""
    base = arr
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap):
            return True
        base = base.base
    return isinstance(base, mmap.mmap)


def test_metadata_every_value_type(valid: Path) -> None:
    with GGUFFile(valid) as f:
        assert f.architecture == "testarch"
        assert f.version == 3
        for key, (_, value) in SCALARS.items():
            assert f.metadata[key] == value, key
            assert type(f.metadata[key]) is type(value), key
        for key, (_, values) in ARRAYS.items():
            assert f.metadata[key] == values, key
        assert f.metadata["test.nested"] == NESTED
        assert f.get("test.nope", 7) == 7


def test_tensors_shapes_and_data(valid: Path) -> None:
    with GGUFFile(valid) as f:
        assert list(f.tensors) == ["f32.weight", "f16.weight", "blk.0.ffn_gate_exps.weight"]
        a = f.tensor("f32.weight")
        assert isinstance(a, TensorEntry)
        assert (a.ggml_type, a.shape, a.n_bytes) == (GGMLQuantizationType.F32, (6, 8), F32.nbytes)
        np.testing.assert_array_equal(a.data, F32)
        b = f.tensor("f16.weight")
        assert (b.ggml_type, b.shape, b.n_bytes) == (GGMLQuantizationType.F16, (16,), F16.nbytes)
        np.testing.assert_array_equal(b.data, F16)
        q = f.tensor("blk.0.ffn_gate_exps.weight")
        assert q.ggml_type == GGMLQuantizationType.Q8_0 and q.type_name == "Q8_0"
        assert q.shape == (2, 3, 64)  # torch order: ne = [64, 3, 2]
        assert q.n_bytes == Q8.nbytes == 2 * 3 * 2 * 34
        np.testing.assert_array_equal(np.asarray(q.data).reshape(Q8.shape), Q8)
        deq = dequantize(np.asarray(q.data), GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(deq, dequantize(Q8, GGMLQuantizationType.Q8_0))


def test_tensor_data_is_readonly_mmap_view(valid: Path) -> None:
    with GGUFFile(valid) as f:
        assert f.reader is not None and f.reader.data.mode == "r"
        for entry in f.tensors.values():
            assert not entry.data.flags.owndata
            assert not entry.data.flags.writeable
            assert reaches_mmap(entry.data), entry.name
            assert np.shares_memory(entry.data, f.reader.data)


def test_custom_alignment(tmp_path: Path) -> None:
    with GGUFFile(write_valid(tmp_path / "a64.gguf", alignment=64)) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        np.testing.assert_array_equal(f.tensor("f32.weight").data, F32)


def test_require(valid: Path) -> None:
    f = GGUFFile(valid)
    assert f.require("test.u32", int) == 4_000_000_000
    assert f.require("test.str", str) == "héllo wörld ✓"
    assert f.require("test.arr_str", list)[2] == "ünïcode"
    assert f.require("test.u8", float) == 200.0 and isinstance(f.require("test.u8", float), float)
    assert f.require("test.f32", (int, float)) == 0.5
    assert f.require("test.bool_true", bool) is True
    with pytest.raises(MissingKey, match=r"valid\.gguf: metadata key 'test\.nope' is missing"):
        f.require("test.nope")
    with pytest.raises(MissingKey, match=r"'test\.str' has type str, expected int"):
        f.require("test.str", int)
    with pytest.raises(MissingKey, match=r"'test\.bool_true' has type bool, expected int"):
        f.require("test.bool_true", int)


def test_missing_tensor_message(valid: Path) -> None:
    f = GGUFFile(valid)
    with pytest.raises(MissingTensor) as e:
        f.tensor("output.weight")
    msg = str(e.value)
    assert msg.startswith(str(valid)) and "'output.weight' is missing" in msg
    assert "3 tensors" in msg and "f32.weight" in msg
    assert isinstance(e.value, MoerunError)


def test_missing_architecture(tmp_path: Path) -> None:
    f = GGUFFile(write_valid(tmp_path / "noarch.gguf", arch=None))
    with pytest.raises(MissingKey, match="general.architecture"):
        _ = f.architecture


def test_close_and_context_manager(valid: Path) -> None:
    with GGUFFile(valid) as f:
        data = f.tensor("f32.weight").data
    assert f.tensors == {} and f.reader is None
    np.testing.assert_array_equal(data, F32)  # views taken before close stay valid
    with pytest.raises(MissingTensor):
        f.tensor("f32.weight")


def test_read_only_permissions(valid: Path) -> None:
    os.chmod(valid, 0o444)
    before = valid.read_bytes()
    with GGUFFile(valid) as f:
        np.testing.assert_array_equal(f.tensor("f16.weight").data, F16)
    assert valid.read_bytes() == before


def test_accepts_str_path(valid: Path) -> None:
    assert GGUFFile(str(valid)).path == valid


def test_big_sparse_file_opens_without_reading_data(tmp_path: Path) -> None:
    """A 17 GiB (sparse) file opens fast and without copying its data into RAM."""
    path = tmp_path / "big.gguf"
    n_expert, n_ff, n_embd = 128, 2048, 16384  # 128 * 2048 * 16384 * 34/32 bytes = 4.25 GiB each
    w = gguf.GGUFWriter(path, "bigarch")
    shape = (n_expert, n_ff, n_embd // 32 * 34)  # byte shape
    nbytes = n_expert * n_ff * (n_embd // 32 * 34)
    for i in range(4):
        w.add_tensor_info(
            f"blk.{i}.ffn_up_exps.weight", shape, np.dtype(np.uint8), nbytes, GGMLQuantizationType.Q8_0
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    header = path.stat().st_size
    data_start = -(-header // 32) * 32
    os.truncate(path, data_start + 4 * nbytes)  # sparse: nothing is written
    assert path.stat().st_size > 17 * 10**9

    tracemalloc.start()
    t0 = time.perf_counter()
    with GGUFFile(path) as f:
        q = f.tensor("blk.3.ffn_up_exps.weight")
        assert q.shape == (n_expert, n_ff, n_embd) and q.n_bytes == nbytes
        assert int(q.data[-1, -1, -1]) == 0  # touches one page only
    elapsed = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 2.0
    assert peak < 64 * 2**20


def gguf_str(b: bytes) -> bytes:
    """A GGUF string: u64 length + bytes."""
    return struct.pack("<Q", len(b)) + b


def kv_array(key: str, etype: GGUFValueType, n: int, payload: bytes) -> bytes:
    """One metadata KV holding an array of `n` elements of type `etype`."""
    return gguf_str(key.encode()) + struct.pack("<IIQ", GGUFValueType.ARRAY, etype, n) + payload


def write_raw(path: Path, kvs: list[bytes]) -> None:
    """A tensor-less GGUF v3 with the given KV records, written byte by byte."""
    arch = gguf_str(b"general.architecture") + struct.pack("<I", GGUFValueType.STRING) + gguf_str(b"llama")
    kvs = [arch, *kvs]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))


def write_vocab(path: Path, n: int) -> None:
    """A GGUF whose header holds an n-token vocabulary (tokens, scores, types)."""
    tokens = b"".join(gguf_str(f"▁tok{i}".encode()) for i in range(n))
    write_raw(
        path,
        [
            kv_array("tokenizer.ggml.tokens", GGUFValueType.STRING, n, tokens),
            kv_array("tokenizer.ggml.scores", GGUFValueType.FLOAT32, n, np.arange(n, dtype="<f4").tobytes()),
            kv_array("tokenizer.ggml.token_type", GGUFValueType.INT32, n, np.ones(n, dtype="<i4").tobytes()),
        ],
    )


def test_empty_arrays(tmp_path: Path) -> None:
    path = tmp_path / "empty_arrays.gguf"
    write_raw(
        path,
        [
            kv_array("test.no_strings", GGUFValueType.STRING, 0, b""),
            kv_array("test.no_ints", GGUFValueType.INT32, 0, b""),
            kv_array("test.no_lists", GGUFValueType.ARRAY, 0, b""),
        ],
    )
    f = GGUFFile(path)
    assert f.metadata["test.no_strings"] == f.metadata["test.no_ints"] == f.metadata["test.no_lists"] == []
    assert f.reader is not None and f.reader.fields["test.no_strings"].contents() == []


def test_fields_and_tensors_agree_with_stock_gguf(valid: Path, tmp_path: Path) -> None:
    """moerun's fast GGUFReader subclass exposes the same fields and tensors as stock gguf."""
    vocab = tmp_path / "vocab.gguf"
    write_vocab(vocab, 1000)
    for path in (valid, vocab):
        f, stock = GGUFFile(path), gguf.GGUFReader(path)
        assert f.reader is not None
        assert list(f.reader.fields) == list(stock.fields)
        for key, field in stock.fields.items():
            ours = f.reader.fields[key]
            assert ours.types == field.types and ours.offset == field.offset, key
            assert ours.contents() == field.contents(), key
            if field.types[-1] == GGUFValueType.STRING and field.types[0] == GGUFValueType.ARRAY:
                assert ours.contents(3) == field.contents(3), key
                assert ours.contents(slice(1, 3)) == field.contents(slice(1, 3)), key
                assert len(ours.parts) == len(field.parts), key
                for i in (0, 3, 4, 5, -1, -2):
                    assert bytes(ours.parts[i]) == bytes(field.parts[i]), (key, i)
            if key != "test.nested":
                assert f.metadata.get(key, field.contents()) == field.contents(), key
        for t in stock.tensors:
            ours_t = f.tensor(t.name)
            assert ours_t.n_bytes == t.n_bytes and ours_t.data.shape == t.data.shape
            np.testing.assert_array_equal(ours_t.data, t.data)


def test_large_vocab_opens_quickly(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    n = 262_144
    write_vocab(path, n)
    t0 = time.perf_counter()
    f = GGUFFile(path)
    elapsed = time.perf_counter() - t0
    tokens = f.require("tokenizer.ggml.tokens", list)
    assert len(tokens) == n and tokens[0] == "▁tok0" and tokens[-1] == f"▁tok{n - 1}"
    assert f.metadata["tokenizer.ggml.scores"][10] == 10.0
    assert f.metadata["tokenizer.ggml.token_type"][:2] == [1, 1]
    assert f.reader is not None
    field = f.reader.fields["tokenizer.ggml.tokens"]
    assert field.contents(slice(0, 2)) == ["▁tok0", "▁tok1"]  # gguf's own view still works
    assert f.reader.fields["tokenizer.ggml.scores"].contents()[:2] == [0.0, 1.0]
    assert elapsed < 2.0, f"opening a {n}-token vocab took {elapsed:.2f} s"


def test_errors_are_one_type(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(GGUFFormatError) as e:
        GGUFFile(path)
    assert isinstance(e.value, MoerunError) and str(e.value).startswith(str(path))
