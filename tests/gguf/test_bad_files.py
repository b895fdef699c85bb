"""GGUFFile on broken files: every case raises GGUFFormatError naming the file (and key/tensor),
fast, without allocating much, and without touching the file.

A missing path, a directory and an empty file also raise GGUFFormatError (documented choice:
one exception type for "this path is not a readable GGUF file").

Offsets of the fields to corrupt are found by parsing the valid file with gguf's stock
GGUFReader, never hard-coded.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from moerun.errors import GGUFFormatError, MoerunError
from moerun.gguf.reader import GGUFFile

TIME_LIMIT_S = 2.0
MEMORY_LIMIT = 64 * 2**20
Q8_NAME = "blk.0.ffn_gate_exps.weight"  # 3-D Q8_0, the last tensor


def write_valid(path: Path) -> Path:
    """A small valid GGUF: scalar, string and array KVs; F32 / F16 / 3-D Q8_0 tensors."""
    w = gguf.GGUFWriter(path, "testarch")
    w.add_custom_alignment(32)
    w.add_uint32("test.a", 7)
    w.add_uint32("test.b", 8)
    w.add_string("test.str", "hello")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "▁hi", "x"])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 32), dtype=np.float32))
    w.add_tensor("blk.0.attn_k.weight", np.ones((4, 32), dtype=np.float16))
    q8 = gguf.quants.quantize(np.ones((2, 3, 64), dtype=np.float32), GGMLQuantizationType.Q8_0)
    w.add_tensor(Q8_NAME, q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside the valid file, found by gguf's own parser."""

    data: bytes
    kv: dict[str, int]  # key -> offset of the key's length
    ti: dict[str, int]  # tensor name -> offset of the name's length
    n_dims: dict[str, int]
    data_offset: int
    data_end: int  # end of the last tensor's data; the writer pads the file beyond it
    tensor_count: int
    kv_count: int

    def kv_type(self, key: str) -> int:
        return self.kv[key] + 8 + len(key.encode())

    def kv_value(self, key: str) -> int:
        return self.kv_type(key) + 4

    def ti_n_dims(self, name: str) -> int:
        return self.ti[name] + 8 + len(name.encode())

    def ti_dims(self, name: str) -> int:
        return self.ti_n_dims(name) + 4

    def ti_type(self, name: str) -> int:
        return self.ti_dims(name) + 8 * self.n_dims[name]

    def ti_offset(self, name: str) -> int:
        return self.ti_type(name) + 4


def parse_layout(path: Path) -> Layout:
    r = gguf.GGUFReader(path)
    kv = {name: f.offset for name, f in r.fields.items() if not name.startswith("GGUF.")}
    ti = {t.name: t.field.offset for t in r.tensors}
    n_dims = {t.name: len(t.shape) for t in r.tensors}
    data_end = max(t.data_offset + t.n_bytes for t in r.tensors)
    counts = (len(r.tensors), len(kv))
    return Layout(path.read_bytes(), kv, ti, n_dims, r.data_offset, data_end, *counts)


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Layout:
    return parse_layout(write_valid(tmp_path_factory.mktemp("valid") / "valid.gguf"))


def patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    """`data` with `struct.pack(fmt, value)` written at `offset`."""
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (rather than hang) if the block runs longer than `seconds`."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def open_checked(path: Path) -> tuple[GGUFFile | None, BaseException | None]:
    """Open `path` under the time and memory limits; the file must stay untouched."""
    before = path.read_bytes() if path.is_file() else None
    mtime = path.stat().st_mtime_ns if before is not None else None
    result: GGUFFile | None = None
    error: BaseException | None = None
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with deadline(TIME_LIMIT_S * 2):
            result = GGUFFile(path)
    except TimeoutError:
        raise
    except Exception as e:
        error = e
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < TIME_LIMIT_S, f"{path.name}: took {elapsed:.2f} s"
    assert peak < MEMORY_LIMIT, f"{path.name}: peak allocation {peak / 2**20:.1f} MiB"
    if before is not None:
        assert path.read_bytes() == before, "the file was modified"
        assert path.stat().st_mtime_ns == mtime, "the file's mtime changed"
    return result, error


def assert_bad(path: Path, *needles: str) -> str:
    """Opening `path` raises GGUFFormatError naming the file and every needle."""
    result, error = open_checked(path)
    assert result is None, f"{path.name} loaded, expected GGUFFormatError"
    assert isinstance(error, GGUFFormatError), f"{type(error).__name__}: {error}"
    assert isinstance(error, MoerunError)
    msg = str(error)
    assert msg.startswith(str(path)), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_valid_file_loads(layout: Layout, tmp_path: Path) -> None:
    f, error = open_checked(write(tmp_path, layout.data, "ok.gguf"))
    assert error is None and f is not None
    assert f.tensor(Q8_NAME).shape == (2, 3, 64)
    assert f.metadata["test.nested"] == [[1, 2], [3]]


# Each case: (id, function of the layout giving corrupt bytes, substrings the message must hold).
Case = tuple[str, Callable[[Layout], bytes], tuple[str, ...]]
U64_MAX = 2**64 - 1
CASES: list[Case] = [
    ("magic", lambda L: b"GGML" + L.data[4:], ("magic",)),
    ("magic_zero", lambda L: bytes(4) + L.data[4:], ("magic",)),
    ("version_1", lambda L: patched(L.data, 4, "<I", 1), ("version 1",)),
    ("version_4", lambda L: patched(L.data, 4, "<I", 4), ("version 4",)),
    ("version_max", lambda L: patched(L.data, 4, "<I", 2**32 - 1), ("version",)),
    ("big_endian", lambda L: patched(L.data, 4, ">I", 3), ("big-endian",)),
    ("tensor_count_2^60", lambda L: patched(L.data, 8, "<Q", 2**60), ("tensor count",)),
    ("tensor_count_max", lambda L: patched(L.data, 8, "<Q", U64_MAX), ("tensor count",)),
    ("tensor_count_+1", lambda L: patched(L.data, 8, "<Q", L.tensor_count + 1), ()),
    ("kv_count_2^60", lambda L: patched(L.data, 16, "<Q", 2**60), ("KV count",)),
    ("kv_count_max", lambda L: patched(L.data, 16, "<Q", U64_MAX), ("KV count",)),
    ("kv_count_+1", lambda L: patched(L.data, 16, "<Q", L.kv_count + 1), ()),
    ("key_len_huge", lambda L: patched(L.data, L.kv["test.str"], "<Q", 2**63), ("key of metadata entry",)),
    ("key_len_2MiB", lambda L: patched(L.data, L.kv["test.str"], "<Q", 2**21), ("absurd length",)),
    ("key_len_+1", lambda L: patched(L.data, L.kv["test.str"], "<Q", len("test.str") + 1), ()),
    ("key_utf8", lambda L: patched(L.data, L.kv["test.str"] + 8, "<B", 0xFF), ("UTF-8",)),
    (
        "key_duplicate",
        lambda L: patched(L.data, L.kv_type("test.b") - 1, "<B", ord("a")),
        ("'test.a'", "twice"),
    ),
    ("string_len_huge", lambda L: patched(L.data, L.kv_value("test.str"), "<Q", 2**62), ("'test.str'",)),
    ("string_len_max", lambda L: patched(L.data, L.kv_value("test.str"), "<Q", U64_MAX), ("'test.str'",)),
    (
        "value_type_13",
        lambda L: patched(L.data, L.kv_type("test.a"), "<I", 13),
        ("'test.a'", "unknown value type"),
    ),
    (
        "value_type_max",
        lambda L: patched(L.data, L.kv_type("test.a"), "<I", 2**32 - 1),
        ("'test.a'", "unknown"),
    ),
    (
        "array_elem_type",
        lambda L: patched(L.data, L.kv_value("tokenizer.ggml.scores"), "<I", 77),
        ("'tokenizer.ggml.scores'", "unknown array element type 77"),
    ),
    (
        "array_len_huge",
        lambda L: patched(L.data, L.kv_value("tokenizer.ggml.tokens") + 4, "<Q", 2**61),
        ("'tokenizer.ggml.tokens'", "array length"),
    ),
    (
        "array_len_max_f32",
        lambda L: patched(L.data, L.kv_value("tokenizer.ggml.scores") + 4, "<Q", U64_MAX),
        ("'tokenizer.ggml.scores'",),
    ),
    (
        "array_string_len_huge",
        lambda L: patched(L.data, L.kv_value("tokenizer.ggml.tokens") + 12, "<Q", 2**40),
        ("'tokenizer.ggml.tokens'[0]",),
    ),
    (
        "nested_array_len_huge",
        lambda L: patched(L.data, L.kv_value("test.nested") + 16, "<Q", 2**50),
        ("'test.nested'",),
    ),
    (
        "alignment_zero",
        lambda L: patched(L.data, L.kv_value("general.alignment"), "<I", 0),
        ("general.alignment",),
    ),
    (
        "alignment_3",
        lambda L: patched(L.data, L.kv_value("general.alignment"), "<I", 3),
        ("general.alignment",),
    ),
    (
        "alignment_type",
        lambda L: patched(L.data, L.kv_type("general.alignment"), "<I", GGUFValueType.INT32),
        ("general.alignment", "UINT32"),
    ),
    ("tensor_name_len_huge", lambda L: patched(L.data, L.ti[Q8_NAME], "<Q", 2**62), ("name of tensor #2",)),
    (
        "tensor_duplicate",
        lambda L: patched(L.data, L.ti_n_dims("blk.0.attn_k.weight") - 8, "<B", ord("q")),
        ("'blk.0.attn_q.weight'", "twice"),
    ),
    ("n_dims_0", lambda L: patched(L.data, L.ti_n_dims(Q8_NAME), "<I", 0), (f"'{Q8_NAME}'", "n_dims 0")),
    ("n_dims_5", lambda L: patched(L.data, L.ti_n_dims(Q8_NAME), "<I", 5), (f"'{Q8_NAME}'", "n_dims")),
    (
        "n_dims_max",
        lambda L: patched(L.data, L.ti_n_dims(Q8_NAME), "<I", 2**32 - 1),
        (f"'{Q8_NAME}'", "n_dims"),
    ),
    (
        "dim_zero",
        lambda L: patched(L.data, L.ti_dims(Q8_NAME) + 8, "<Q", 0),
        (f"'{Q8_NAME}'", "zero dimension"),
    ),
    (
        "dim_max",
        lambda L: patched(L.data, L.ti_dims(Q8_NAME), "<Q", U64_MAX),
        (f"'{Q8_NAME}'", "absurd dims"),
    ),
    (
        "dims_product_overflow",
        lambda L: patched(
            patched(L.data, L.ti_dims(Q8_NAME) + 8, "<Q", 2**31), L.ti_dims(Q8_NAME) + 16, "<Q", 2**31
        ),
        (f"'{Q8_NAME}'", "overflow"),
    ),
    (
        "row_not_blocks",
        lambda L: patched(L.data, L.ti_dims(Q8_NAME), "<Q", 33),
        (f"'{Q8_NAME}'", "block size"),
    ),
    (
        "dims_past_end",
        lambda L: patched(L.data, L.ti_dims(Q8_NAME) + 16, "<Q", 1000),
        (f"'{Q8_NAME}'", "past the end"),
    ),
    (
        "ggml_type_9999",
        lambda L: patched(L.data, L.ti_type(Q8_NAME), "<I", 9999),
        (f"'{Q8_NAME}'", "GGML type id 9999"),
    ),
    (
        "ggml_type_4",
        lambda L: patched(L.data, L.ti_type(Q8_NAME), "<I", 4),
        (f"'{Q8_NAME}'", "GGML type id 4"),
    ),
    (
        "offset_past_end",
        lambda L: patched(L.data, L.ti_offset(Q8_NAME), "<Q", 2**40),
        (f"'{Q8_NAME}'", "past the end"),
    ),
    (
        "offset_max_aligned",
        lambda L: patched(L.data, L.ti_offset(Q8_NAME), "<Q", 2**64 - 32),
        (f"'{Q8_NAME}'", "past the end"),
    ),
    (
        "offset_misaligned",
        lambda L: patched(
            L.data, L.ti_offset(Q8_NAME), "<Q", struct.unpack_from("<Q", L.data, L.ti_offset(Q8_NAME))[0] + 1
        ),
        (f"'{Q8_NAME}'", "not a multiple of 32"),
    ),
    (
        "array_len_over_limit",
        lambda L: patched(L.data, L.kv_value("tokenizer.ggml.scores") + 4, "<Q", 2**24 + 1),
        ("'tokenizer.ggml.scores'", "absurd (limit"),
    ),
    ("tensor_count_over_limit", lambda L: patched(L.data, 8, "<Q", 2**20 + 1), ("tensor count", "absurd")),
    ("tensor_name_empty", lambda L: patched(L.data, L.ti[Q8_NAME], "<Q", 0), ("tensor #2", "empty name")),
    ("key_empty", lambda L: patched(L.data, L.kv["test.str"], "<Q", 0), ("metadata entry #", "empty key")),
    ("tiny_file", lambda L: L.data[:3], ("truncated",)),
    ("header_only", lambda L: L.data[:24], ("truncated",)),
    ("all_zero", lambda L: bytes(len(L.data)), ("magic",)),
]


@pytest.mark.parametrize("mutate, needles", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_corrupt_header(
    layout: Layout, tmp_path: Path, mutate: Callable[[Layout], bytes], needles: tuple[str, ...]
) -> None:
    assert_bad(write(tmp_path, mutate(layout)), *needles)


def test_truncated_everywhere(layout: Layout, tmp_path: Path) -> None:
    """Every cut through the header, and cuts inside the tensor data, fail cleanly."""
    size = layout.data_end
    cuts = set(range(1, layout.data_offset + 40)) | {
        size - 1,
        size - 2,
        size - 34,
        (layout.data_offset + size) // 2,
    }
    cuts |= set(range(layout.data_offset, size, 97))
    for cut in sorted(c for c in cuts if 0 < c < size):
        msg = assert_bad(write(tmp_path, layout.data[:cut], f"cut{cut}.gguf"))
        if cut > layout.ti[Q8_NAME] + 8 + len(Q8_NAME):  # after the last tensor's name
            assert "tensor" in msg, msg


def test_empty_file(tmp_path: Path) -> None:
    assert_bad(write(tmp_path, b"", "empty.gguf"), "empty")


def test_directory(tmp_path: Path) -> None:
    path = tmp_path / "dir.gguf"
    path.mkdir()
    assert_bad(path, "directory")


def test_fifo(tmp_path: Path) -> None:
    """A named pipe is rejected without blocking in open()."""
    path = tmp_path / "pipe.gguf"
    os.mkfifo(path)
    assert_bad(path, "not a regular file")


def test_missing_path(tmp_path: Path) -> None:
    """A missing path raises GGUFFormatError too (not FileNotFoundError)."""
    assert_bad(tmp_path / "nope.gguf", "no such file")


def test_random_single_byte_corruptions(layout: Layout, tmp_path: Path) -> None:
    """200 random one-byte corruptions: each loads or raises a MoerunError, nothing else."""
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    data = layout.data
    for i in range(200):
        pos = rng.randrange(layout.data_offset) if rng.random() < 0.75 else rng.randrange(len(data))
        value = (data[pos] + rng.randrange(1, 256)) % 256
        corrupt = bytearray(data)
        corrupt[pos] = value
        path = write(tmp_path, bytes(corrupt), f"fuzz{i}.gguf")
        where = f"seed={seed} case={i} byte {pos} := {value:#04x}"
        try:
            f, error = open_checked(path)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from e
        if error is not None:
            assert isinstance(error, MoerunError), f"{where}: {type(error).__name__}: {error}"
            assert str(error).startswith(str(path)), f"{where}: {error}"
            continue
        assert f is not None
        for entry in f.tensors.values():  # the data is readable and the right size
            assert np.asarray(entry.data).nbytes == entry.n_bytes, where
            float(np.asarray(entry.data).view(np.uint8).sum())
        path.unlink()
