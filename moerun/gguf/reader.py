"""Robust, memory-mapped GGUF reading.

`GGUFFile(path)` first walks the whole header with a small bounds-checked parser over a
read-only mmap (`_HeaderWalker`), so that a truncated file, a wrong magic, absurd counts or
lengths, unknown type ids, or tensor data outside the file fail fast with one
`GGUFFormatError` naming the file and the key or tensor at fault. Only then is the file
handed to gguf's `GGUFReader` (mode 'r', memory-mapped; nothing is copied), whose tensor
views become `TensorEntry.data`.

Metadata values come from the walker (it has parsed them anyway): ints, floats, bools,
strings (UTF-8), and lists of those (nested lists for nested arrays).
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import stat
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import GGUFReader, ReaderField

from moerun.errors import GGUFFormatError, MissingKey, MissingTensor, MoerunError

__all__ = ["GGUFFile", "TensorEntry"]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_NAME_LEN = 1 << 20  # bytes; metadata keys and tensor names
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 62
MAX_ARRAY_DEPTH = 8
MAX_ARRAY_LEN = 1 << 24  # elements; real vocabularies / merge lists are <= ~1M
MAX_COUNT = 1 << 20  # tensors, and metadata KVs; real models have a few thousand at most
MAX_ALIGNMENT = 1 << 30
ALIGNMENT_KEY = "general.alignment"

# Fixed-size value types: GGUF value type -> struct/numpy format (little-endian).
_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_STRUCTS: dict[int, struct.Struct] = {t: struct.Struct(f) for t, f in _SCALAR_FORMATS.items()}
_SCALAR_DTYPES: dict[int, np.dtype] = {t: np.dtype(f) for t, f in _SCALAR_FORMATS.items()}

# Fewest bytes one value of each type can occupy (string: u64 length; array: u32 type + u64 length).
_MIN_VALUE_SIZE: dict[int, int] = {
    **{t: s.size for t, s in _SCALAR_STRUCTS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
_MIN_KV_SIZE = 8 + 1 + 4 + 1  # key length, >= 1 key byte, value type, >= 1 value byte
_MIN_TENSOR_INFO_SIZE = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, one dim, type, offset

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file.

    `shape` is in torch order (GGUF `ne` reversed); `data` is the read-only memory-mapped view
    GGUFReader gives (typed for F32/F16/..., raw uint8 bytes for quantized types), not a copy.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray = field(repr=False)

    @property
    def type_name(self) -> str:
        """The GGML type's name, e.g. 'Q8_0'."""
        return GGMLQuantizationType(self.ggml_type).name


@dataclass(frozen=True)
class _TensorInfo:
    """A tensor-info record as the walker validated it (ne in GGUF order)."""

    name: str
    ne: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class _Header:
    """Everything the walker learned from the header."""

    version: int
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]
    alignment: int
    data_offset: int
    string_starts: dict[int, array.array]


class _HeaderWalker:
    """Bounds-checked parser of a GGUF header over a read-only buffer.

    Every read checks the remaining bytes first, and every count is checked against what the
    remaining bytes could possibly hold before a loop runs, so no input can make it hang or
    allocate much more than the file's own header.
    """

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0
        self.value_types: dict[str, int] = {}  # metadata key -> declared GGUF value type
        self.string_starts: dict[int, array.array] = {}  # string array offset -> each string's offset

    # -- primitives ---------------------------------------------------------------------

    def fail(self, what: str) -> GGUFFormatError:
        """Build the error for a problem at `what` (a key, tensor, or header field)."""
        return GGUFFormatError(f"{self.path}: {what}")

    def remaining(self) -> int:
        """Bytes left after the cursor."""
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        """Raise unless `n` more bytes exist after the cursor."""
        if n > self.remaining():
            raise self.fail(
                f"truncated file: {what} at byte {self.pos} needs {n} bytes, "
                f"but only {self.remaining()} remain (file size {self.size})"
            )

    def unpack(self, st: struct.Struct, what: str) -> Any:
        """Read one fixed-size value and advance."""
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def raw_string(self, what: str, max_len: int | None = None) -> bytes:
        """Read a GGUF string (u64 length + bytes) and advance."""
        n = self.unpack(_U64, f"length of {what}")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} has absurd length {n} (limit {max_len})")
        self.need(n, what)
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def text(self, what: str, max_len: int | None = None) -> str:
        """Read a GGUF string and decode it as UTF-8."""
        data = self.raw_string(what, max_len)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def count(self, what: str, min_item_size: int) -> int:
        """Read a u64 array length and check that the remaining bytes could hold that many items."""
        n = self.unpack(_U64, what)
        self.check_count(what, n, n * min_item_size, self.remaining(), MAX_ARRAY_LEN)
        return n

    def check_count(self, what: str, n: int, min_bytes: int, budget: int, limit: int) -> None:
        """Raise if `n` exceeds `limit`, or `budget` bytes cannot hold the `min_bytes` it needs."""
        if n > limit:
            raise self.fail(f"{what} {n} is absurd (limit {limit})")
        if min_bytes > budget:
            raise self.fail(
                f"{what} {n} needs at least {min_bytes} bytes, but only {budget} remain "
                "(the count is absurd or the file is truncated)"
            )

    # -- values -------------------------------------------------------------------------

    def value_type(self, what: str, label: str = "value type") -> int:
        """Read a u32 value type id and check it is known."""
        vtype = self.unpack(_U32, f"{label} of {what}")
        if vtype not in _MIN_VALUE_SIZE:
            raise self.fail(f"{what} has unknown {label} {vtype}")
        return vtype

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Read one value of type `vtype` and return it as a Python object."""
        if vtype in _SCALAR_STRUCTS:
            return self.unpack(_SCALAR_STRUCTS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.text(what)
        return self.array(what, depth)

    def array(self, what: str, depth: int) -> list[Any]:
        """Read an array value (element type, length, elements)."""
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        start = self.pos
        etype = self.value_type(what, "array element type")
        n = self.count(f"{what}: array length", _MIN_VALUE_SIZE[etype])
        if etype in _SCALAR_DTYPES:
            dtype = _SCALAR_DTYPES[etype]
            values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
            self.pos += n * dtype.itemsize
            return values
        if etype == GGUFValueType.STRING:
            return self.string_array(n, what, start)
        return [self.array(f"{what}[{i}]", depth + 1) for i in range(n)]

    def string_array(self, n: int, what: str, start: int) -> list[str]:
        """Read `n` strings quickly (a 262k-token vocabulary takes ~0.1 s).

        Records where each string starts in `string_starts[start]` for `_FastReader`.
        """
        buf, size, unpack = self.buf, self.size, _U64.unpack_from
        pos = self.pos
        out: list[str] = []
        starts = self.string_starts[start] = array.array("Q")
        append, mark = out.append, starts.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, f"length of {what}[{i}]")
            (slen,) = unpack(buf, pos)
            end = pos + 8 + slen
            if end > size:
                self.pos = pos + 8
                self.need(slen, f"{what}[{i}]")
            try:
                append(buf[pos + 8 : end].decode("utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}] is not valid UTF-8 ({e.reason})") from None
            mark(pos)
            pos = end
        self.pos = pos
        return out

    # -- sections -----------------------------------------------------------------------

    def preamble(self) -> tuple[int, int, int]:
        """Read magic, version, tensor count and KV count."""
        self.need(4, "magic")
        magic = self.buf[0:4]
        if magic != GGUF_MAGIC:
            raise self.fail(f"not a GGUF file: magic is {magic!r}, expected {GGUF_MAGIC!r}")
        self.pos = 4
        version = self.unpack(_U32, "version")
        if version & 0xFFFF == 0 and version != 0:
            raise self.fail("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise self.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.need(16, "tensor count and metadata count")
        tensor_count = self.unpack(_U64, "tensor count")
        kv_count = self.unpack(_U64, "metadata KV count")
        budget = self.remaining()
        kv_bytes = kv_count * _MIN_KV_SIZE
        ti_bytes = tensor_count * _MIN_TENSOR_INFO_SIZE
        self.check_count("metadata KV count", kv_count, kv_bytes, budget, MAX_COUNT)
        self.check_count("tensor count", tensor_count, ti_bytes + kv_bytes, budget, MAX_COUNT)
        return version, tensor_count, kv_count

    def metadata(self, kv_count: int) -> dict[str, Any]:
        """Read `kv_count` key/value pairs."""
        out: dict[str, Any] = {}
        prev = "(none)"
        for i in range(kv_count):
            key = self.text(f"key of metadata entry #{i} (after key '{prev}')", MAX_NAME_LEN)
            if not key:
                raise self.fail(f"metadata entry #{i} (after key '{prev}') has an empty key")
            if key in out:
                raise self.fail(f"metadata key '{key}' appears twice")
            what = f"metadata key '{key}'"
            vtype = self.value_types[key] = self.value_type(what)
            out[key] = self.value(vtype, what)
            prev = key
        return out

    def tensor_info(self, i: int, prev: str) -> _TensorInfo:
        """Read and check one tensor-info record (not its data range: that needs the offset)."""
        name = self.text(f"name of tensor #{i} (after tensor '{prev}')", MAX_NAME_LEN)
        if not name:
            raise self.fail(f"tensor #{i} (after tensor '{prev}') has an empty name")
        what = f"tensor '{name}'"
        n_dims = self.unpack(_U32, f"n_dims of {what}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"{what} has absurd n_dims {n_dims} (must be 1..{MAX_DIMS})")
        self.need(8 * n_dims, f"dims of {what}")
        ne = tuple(self.unpack(_U64, f"dims of {what}") for _ in range(n_dims))
        raw_type = self.unpack(_U32, f"GGML type of {what}")
        offset = self.unpack(_U64, f"data offset of {what}")
        n_bytes = self.tensor_bytes(what, ne, raw_type)
        return _TensorInfo(name, ne, raw_type, offset, n_bytes)

    def tensor_bytes(self, what: str, ne: tuple[int, ...], raw_type: int) -> int:
        """Check dims and type; return the tensor's data size in bytes."""
        if any(d <= 0 for d in ne):
            raise self.fail(f"{what} has a zero dimension: ne={list(ne)}")
        n_elements = 1
        for d in ne:
            n_elements *= d
            if n_elements >= MAX_ELEMENTS:
                raise self.fail(f"{what} has absurd dims ne={list(ne)} (element count overflows)")
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self.fail(f"{what} has unknown GGML type id {raw_type}") from None
        if ne[0] % block_size:
            raise self.fail(
                f"{what} ({qtype.name}) has row length {ne[0]}, not a multiple of the block size {block_size}"
            )
        return n_elements // block_size * type_size

    def tensor_infos(self, tensor_count: int) -> list[_TensorInfo]:
        """Read `tensor_count` tensor-info records."""
        infos: list[_TensorInfo] = []
        names: set[str] = set()
        prev = "(none)"
        for i in range(tensor_count):
            info = self.tensor_info(i, prev)
            if info.name in names:
                raise self.fail(f"tensor '{info.name}' appears twice")
            names.add(info.name)
            infos.append(info)
            prev = info.name
        return infos

    def alignment(self, metadata: dict[str, Any]) -> int:
        """`general.alignment` (a u32 power of two), or the default 32."""
        if ALIGNMENT_KEY not in metadata:
            return GGUF_DEFAULT_ALIGNMENT
        value = metadata[ALIGNMENT_KEY]
        if self.value_types[ALIGNMENT_KEY] != GGUFValueType.UINT32:
            raise self.fail(f"metadata key '{ALIGNMENT_KEY}' must be a UINT32")
        if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
            raise self.fail(f"metadata key '{ALIGNMENT_KEY}' is {value}, not a sane power of two")
        return value

    def check_data_ranges(self, infos: list[_TensorInfo], data_offset: int, alignment: int) -> None:
        """Each tensor's data must be aligned and lie inside the file."""
        for info in infos:
            what = f"tensor '{info.name}'"
            if info.offset % alignment:
                raise self.fail(f"{what} data offset {info.offset} is not a multiple of {alignment}")
            start = data_offset + info.offset
            end = start + info.n_bytes
            if end > self.size:
                raise self.fail(
                    f"{what} data [{start}, {end}) runs past the end of the file "
                    f"({self.size} bytes; the file is truncated or the offset is corrupt)"
                )

    def walk(self) -> _Header:
        """Parse and validate the whole header."""
        version, tensor_count, kv_count = self.preamble()
        metadata = self.metadata(kv_count)
        infos = self.tensor_infos(tensor_count)
        alignment = self.alignment(metadata)
        data_offset = -(-self.pos // alignment) * alignment
        self.check_data_ranges(infos, data_offset, alignment)
        return _Header(version, metadata, infos, alignment, data_offset, self.string_starts)


class _LazyStringParts(Sequence[np.ndarray]):
    """The `parts` of a gguf ReaderField holding an array of strings, built on demand.

    Same layout as stock gguf, [elem_type, length, (str_len, str_bytes) * n], but each part is
    sliced from the memmap only when indexed, so a 262k-token vocabulary costs nothing here.
    """

    def __init__(self, raw: np.ndarray, head: list[np.ndarray], starts: array.array) -> None:
        self.raw = raw
        self.head = head
        self.starts = starts

    def __len__(self) -> int:
        return len(self.head) + 2 * len(self.starts)

    def data_indices(self) -> range:
        """Indices of the string-bytes parts (ReaderField.data)."""
        return range(len(self.head) + 1, len(self), 2)

    def with_head(self, head: list[np.ndarray]) -> _LazyStringParts:
        """The same strings behind `head` + this object's head parts."""
        return _LazyStringParts(self.raw, head + self.head, self.starts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]  # normalises negatives, raises IndexError
        if index < len(self.head):
            return self.head[index]
        k, is_data = divmod(index - len(self.head), 2)
        pos = self.starts[k]
        if not is_data:
            return self.raw[pos : pos + 8].view(np.uint64)
        n = int(self.raw[pos : pos + 8].view(np.uint64)[0])
        return self.raw[pos + 8 : pos + 8 + n]


class _FastReader(GGUFReader):
    """GGUFReader with fast paths for big arrays (its stock parser needs ~9 s for a 262k vocab).

    Reads go through a plain ndarray view of the memmap (cheaper slicing than np.memmap);
    numeric arrays become one vectorized part instead of one part per element; string arrays
    get lazily built parts from the string offsets the header walk recorded. Only used on
    files `_HeaderWalker` has already validated, and only for little-endian files.
    """

    def __init__(self, path: Path, string_starts: dict[int, array.array]) -> None:
        self._string_starts = string_starts
        super().__init__(path, mode="r")

    def _get(
        self,
        offset: int,
        dtype: Any,
        count: int = 1,
        override_order: None | Literal["I", "S", "<"] = None,
    ) -> np.ndarray:
        raw = self.__dict__.get("_raw")
        if raw is None:
            raw = self._raw = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        arr = raw[offset : offset + dt.itemsize * int(count)].view(dt)
        order = self.byte_order if override_order is None else override_order
        if order == "I" or (order == "<" and sys.byteorder == "little"):
            return arr
        return arr.view(dt.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, Any, Any, list]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        etype = int(itype[0])
        alen = self._get(orig_offs + 4, np.uint64)
        types = [GGUFValueType.ARRAY, GGUFValueType(etype)]
        if etype in self.gguf_scalar_to_np:
            values = self._get(orig_offs + 12, self.gguf_scalar_to_np[GGUFValueType(etype)], alen[0])
            return 12 + int(values.nbytes), [itype, alen, values], [2], types
        starts = self._string_starts.get(orig_offs)
        if etype == GGUFValueType.STRING and starts is not None:
            if not starts:
                return 12, [itype, alen], [], types
            last = starts[-1]
            end = last + 8 + int(self._get(last, np.uint64)[0])
            parts = _LazyStringParts(self._raw, [itype, alen], starts)
            return end - orig_offs, parts, parts.data_indices(), types
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        """Stock `_build_fields`, except that lazy string parts stay lazy."""
        for _ in range(count):
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            vtype = self._get(offs, np.uint32)
            offs += int(vtype.nbytes)
            head = [klen, kdata, vtype]
            size, parts, idxs, types = self._get_field_parts(offs, int(vtype[0]))
            if isinstance(parts, _LazyStringParts):
                parts = parts.with_head(head)
                idxs = parts.data_indices()
            else:
                parts = head + parts
                idxs = [i + len(head) for i in idxs]
            name = kdata.tobytes().decode("utf-8")
            self._push_field(ReaderField(orig_offs, name, parts, idxs, types), skip_sum=True)
            offs += size
        return offs


def _open_readonly(path: Path) -> tuple[mmap.mmap, int]:
    """Map `path` read-only; GGUFFormatError if it is missing, not a regular file, or empty."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise GGUFFormatError(f"{path}: no such file") from None
    except OSError as e:
        raise GGUFFormatError(f"{path}: cannot stat: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise GGUFFormatError(f"{path}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO could block open() forever
        raise GGUFFormatError(f"{path}: is not a regular file")
    if st.st_size == 0:
        raise GGUFFormatError(f"{path}: file is empty, not a GGUF file")
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), os.fstat(f.fileno()).st_size
    except (OSError, ValueError) as e:
        raise GGUFFormatError(f"{path}: cannot open and map: {e}") from None


def _walk_file(path: Path) -> _Header:
    """Open `path` read-only, map it, and validate its header."""
    buf, size = _open_readonly(path)
    try:
        return _HeaderWalker(buf, size, path).walk()
    except MoerunError:
        raise
    except Exception as e:  # a walker bug, not a user error; still one exception type
        raise GGUFFormatError(f"{path}: malformed header ({type(e).__name__}: {e})") from e
    finally:
        with contextlib.suppress(BufferError):
            buf.close()


def _open_reader(path: Path, header: _Header) -> GGUFReader:
    """Construct the GGUFReader (mode 'r'); any failure becomes GGUFFormatError."""
    try:
        reader = _FastReader(path, header.string_starts)
    except MoerunError:
        raise
    except Exception as e:  # the walker should have caught it; be safe
        raise GGUFFormatError(f"{path}: gguf could not read the file: {type(e).__name__}: {e}") from None
    if reader.data_offset != header.data_offset or len(reader.tensors) != len(header.tensors):
        raise GGUFFormatError(f"{path}: gguf's reader disagrees with moerun's header walk")
    return reader


def _entry(t: Any) -> TensorEntry:
    """A TensorEntry from a gguf ReaderTensor."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return TensorEntry(t.name, int(t.tensor_type), shape, int(t.n_bytes), t.data)


def _type_names(kind: type | tuple[type, ...]) -> str:
    """'int' or 'int | float' for messages."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " | ".join(k.__name__ for k in kinds)


def _matches(value: Any, kind: type | tuple[type, ...]) -> bool:
    """isinstance, except a bool is not an int, and an int is accepted where a float is wanted."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds and object not in kinds:
        return False
    if isinstance(value, int) and float in kinds:
        return True
    return isinstance(value, kinds)


class GGUFFile:
    """A validated, memory-mapped GGUF file.

    Raises GGUFFormatError (a MoerunError) naming the file, and the key or tensor at fault,
    for anything that is not a well-formed GGUF v2/v3 little-endian file, including a
    missing path, a directory, or an empty file. Never writes to the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        header = _walk_file(self.path)
        self.version: int = header.version
        self.alignment: int = header.alignment
        self.data_offset: int = header.data_offset
        self.metadata: dict[str, Any] = header.metadata
        self.reader: GGUFReader | None = _open_reader(self.path, header)
        self.tensors: dict[str, TensorEntry] = {t.name: _entry(t) for t in self.reader.tensors}

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"

    @property
    def architecture(self) -> str:
        """`general.architecture`; MissingKey if absent."""
        return self.require("general.architecture", str)

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default`."""
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        """The metadata value of `key`; MissingKey if absent or not of type `kind`.

        A bool never counts as an int; an int is accepted (and returned as float) where
        `float` is asked for.
        """
        if key not in self.metadata:
            raise MissingKey(f"{self.path}: metadata key '{key}' is missing")
        value = self.metadata[key]
        if not _matches(value, kind):
            raise MissingKey(
                f"{self.path}: metadata key '{key}' has type {type(value).__name__}, "
                f"expected {_type_names(kind)}"
            )
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, int) and not isinstance(value, bool) and float in kinds and int not in kinds:
            return float(value)
        return value

    def tensor(self, name: str) -> TensorEntry:
        """The tensor called `name`; MissingTensor if absent."""
        entry = self.tensors.get(name)
        if entry is None:
            examples = ", ".join(list(self.tensors)[:3]) or "none"
            raise MissingTensor(
                f"{self.path}: tensor '{name}' is missing "
                f"(the file has {len(self.tensors)} tensors, e.g. {examples})"
            )
        return entry

    def close(self) -> None:
        """Drop this object's references to the mapping.

        The file is unmapped once no `TensorEntry.data` view is still referenced elsewhere.
        """
        self.tensors = {}
        self.reader = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
