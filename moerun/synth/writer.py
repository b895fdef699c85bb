"""Write full-size GGUF files with random weights, streamed: `synthesize(preset, ftype, path)`.

The header (metadata, vocabulary, tensor table) is built with gguf's own `GGUFWriter` exactly as
llama.cpp's converter + quantizer would lay it out: keys per `_KEYS`, tensors from
`presets.tensor_plan` (names and shapes from moerun.models.weights' tables), types from
`quant_mix.plan_types` (llama.cpp's `llama_tensor_get_type`). Tensor data is then streamed in pieces
of about 1 MiB: each piece is random valid blocks (`moerun.quant.random_blocks`) from its own random
stream `default_rng([seed, tensor index, piece index])`, so the bytes depend only on the seed, not on
threading or chunking; pieces are generated in parallel threads and written by a background thread,
with at most a few chunks in memory whatever the file size.

Values: matrices have std 1/sqrt(row width) (so a forward pass keeps activations O(1) and logits
finite and far from flat), norms are 1 +- 0.1, the router is a matrix like the others (in F32), and
`rope_freqs` holds the real llama3 factors.
"""

from __future__ import annotations

import functools
import io
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.gguf_writer import WriterState
from tqdm.auto import tqdm

from moerun.errors import MoerunError
from moerun.gguf.vocab import add_bpe_vocab
from moerun.quant.random_blocks import random_blocks
from moerun.synth.presets import Llama3Rope, Preset, TensorSpec, get_preset, tensor_plan
from moerun.synth.quant_mix import ModelInfo, file_type, plan_types

T = GGMLQuantizationType
MT = gguf.MODEL_TENSOR

ALIGNMENT = gguf.GGUF_DEFAULT_ALIGNMENT
PIECE_BYTES = 1 << 20  # one random stream per piece of a tensor (about this many bytes)
CHUNK_PIECES = 32  # pieces generated in parallel and handed to the writer thread at once
MAX_PENDING_WRITES = 2  # chunks queued for writing beyond the one being generated
NORM_SPREAD = 0.1  # norm weights are uniform in 1 +- NORM_SPREAD
SPACE_MARGIN = 64 << 20  # bytes left free on the disk beyond the file
SYNTH_VERSION = 1  # bump when the bytes synthesize() writes for a (preset, type, seed) change


class InsufficientSpace(MoerunError):
    """The target disk has too little free space for the file."""


# ---------------------------------------------------------------------------------------------------
# metadata: (GGUFWriter method, value from the preset, written when) in the converter's order
# (TextModel.set_gguf_parameters, then LlamaModel / Qwen3MoeModel additions)

_ALWAYS: Callable[[Preset], bool] = lambda p: True  # noqa: E731

_KEYS: tuple[tuple[str, Callable[[Preset], object], Callable[[Preset], bool]], ...] = (
    ("add_block_count", lambda p: p.n_layer, _ALWAYS),
    ("add_context_length", lambda p: p.n_ctx, _ALWAYS),
    ("add_embedding_length", lambda p: p.n_embd, _ALWAYS),
    ("add_feed_forward_length", lambda p: p.n_ff, _ALWAYS),
    ("add_head_count", lambda p: p.n_head, _ALWAYS),
    ("add_head_count_kv", lambda p: p.n_head_kv, _ALWAYS),
    ("add_rope_freq_base", lambda p: p.rope_base, _ALWAYS),
    ("add_layer_norm_rms_eps", lambda p: p.rms_eps, _ALWAYS),
    ("add_expert_count", lambda p: p.n_expert, lambda p: p.is_moe),
    ("add_expert_used_count", lambda p: p.n_expert_used, lambda p: p.is_moe),
    ("add_key_length", lambda p: p.head_dim, lambda p: p.head_dim_in_config),
    ("add_value_length", lambda p: p.head_dim, lambda p: p.head_dim_in_config),
    ("add_vocab_size", lambda p: p.n_vocab, lambda p: p.write_vocab_size),
    ("add_rope_dimension_count", lambda p: p.head_dim, lambda p: p.write_vocab_size),
    ("add_expert_feed_forward_length", lambda p: p.n_ff_exp, lambda p: p.write_expert_ff),
)


def _add_metadata(w: gguf.GGUFWriter, p: Preset, ftype: str) -> None:
    """general.* and {arch}.* keys as the converter and quantizer write them, then the vocabulary."""
    llama_ftype, _ = file_type(ftype)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{p.name} (synthetic)")
    w.add_description(f"moerun synth: random weights with the shape of {p.source}")  # same length for every ftype
    for method, value, when in _KEYS:
        if when(p):
            getattr(w, method)(value(p))
    w.add_file_type(llama_ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_bpe_vocab(w, p.n_vocab, pre=p.tokenizer_pre)


# ---------------------------------------------------------------------------------------------------
# the plan: every tensor with its type, size and data offset, and the header bytes


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file plan: its spec, GGML type, data bytes and offset in the data section."""

    spec: TensorSpec
    ggml_type: GGMLQuantizationType
    n_bytes: int
    offset: int


@dataclass(frozen=True)
class FilePlan:
    """Everything about a synthetic file except its tensor bytes."""

    preset: Preset
    ftype: str
    tensors: list[PlannedTensor]
    header: bytes  # magic .. tensor infos, zero-padded to the alignment

    @property
    def data_bytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + _pad(last.n_bytes)

    @property
    def size(self) -> int:
        """Exact size of the file in bytes."""
        return len(self.header) + self.data_bytes

    @property
    def n_params(self) -> int:
        return sum(t.spec.n_elements for t in self.tensors)

    def type_counts(self) -> dict[str, int]:
        """{GGML type name: number of tensors}."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.ggml_type.name] = out.get(t.ggml_type.name, 0) + 1
        return out


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _n_bytes(shape: tuple[int, ...], t: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[t]
    return math.prod(shape) // block * type_size


def plan_file(preset: str | Preset, ftype: str) -> FilePlan:
    """The plan of the file `synthesize(preset, ftype, ...)` writes (builds the header in memory;
    cached: a 152k-token vocabulary takes most of a second)."""
    return _plan_file(get_preset(preset), ftype.lower())


@functools.lru_cache(maxsize=16)
def _plan_file(p: Preset, ftype: str) -> FilePlan:
    tensors = _tensors(p, ftype)
    return FilePlan(p, ftype, tensors, _header(p, ftype, tensors))


@functools.lru_cache(maxsize=64)
def _tensors(p: Preset, ftype: str) -> list[PlannedTensor]:
    """Every tensor of the file with its type, size and offset (no header: cheap)."""
    specs = tensor_plan(p)
    types = plan_types([(s.name, s.shape) for s in specs], ftype, ModelInfo(p.n_layer, p.n_expert))
    tensors, offset = [], 0
    for s, t in zip(specs, types, strict=True):
        n = _n_bytes(s.shape, t)
        tensors.append(PlannedTensor(s, t, n, offset))
        offset += _pad(n)
    return tensors


@functools.lru_cache(maxsize=16)
def _header_size(p: Preset) -> int:
    """Header bytes (padded) of any file of `p`: every file type gives the same length (the type fields
    are fixed-width), so one header is built per preset."""
    return len(_header(p, "f16", _tensors(p, "f16")))


def _header(p: Preset, ftype: str, tensors: list[PlannedTensor]) -> bytes:
    """GGUF header bytes (magic, counts, KV data, tensor infos), padded to the alignment."""
    w = gguf.GGUFWriter(None, p.arch)
    _add_metadata(w, p, ftype)
    for t in tensors:
        w.add_tensor_info(t.spec.name, t.spec.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.ggml_type)
    buf = io.BytesIO()
    w.fout, w.state = [buf], WriterState.EMPTY  # GGUFWriter writes to any binary file object
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout = None
    raw = buf.getvalue()
    return raw + bytes(_pad(len(raw)) - len(raw))


def expected_size(preset: str | Preset, ftype: str) -> int:
    """Exact size in bytes of the file `synthesize(preset, ftype, ...)` writes, without writing it."""
    p = get_preset(preset)
    last = _tensors(p, ftype.lower())[-1]
    return _header_size(p) + last.offset + _pad(last.n_bytes)


# ---------------------------------------------------------------------------------------------------
# tensor values


@functools.cache
def _unit_std(t: GGMLQuantizationType) -> float:
    """Std of the values `random_blocks(t, ..., scale=1)` decodes to (measured once per type)."""
    raw = random_blocks(t, 1024 if GGML_QUANT_SIZES[t][0] > 1 else 1 << 16, np.random.default_rng(12345))
    return float(gguf.quants.dequantize(raw, t).std())


def llama3_rope_factors(r: Llama3Rope, head_dim: int, base: float) -> np.ndarray:
    """float32 [head_dim // 2]: the `rope_freqs` tensor llama.cpp's converter writes for llama3 RoPE
    scaling (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = r.original_context / r.low_freq_factor
    high_wavelen = r.original_context / r.high_freq_factor
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(r.factor)
        else:
            smooth = (r.original_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            out.append(1 / ((1 - smooth) / r.factor + smooth))
    return np.array(out, dtype=np.float32)


# 16-bit float formats: (mantissa bits, exponent bias)
_HALF_FORMATS: dict[GGMLQuantizationType, tuple[int, int]] = {T.F16: (10, 15), T.BF16: (7, 127)}
_HALF_STD = 2.415  # std of +-[1, 4) (mantissa uniform, exponent 0 or 1 with equal odds), in units of 2^k


def _random_half(t: GGMLQuantizationType, n: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """uint16 [n]: F16 / BF16 bit patterns of random sign, random mantissa, and one of two exponents:
    |x| in [2^k, 2^(k+2)), with k chosen so the std (2.415 * 2^k) is within a factor sqrt(2) of `std`.
    About 5x faster than rounding random floats, and always finite."""
    mant_bits, bias = _HALF_FORMATS[t]
    k = round(math.log2(std / _HALF_STD))
    r = rng.integers(0, 2**64 - 1, (n + 3) // 4, dtype=np.uint64, endpoint=True).view(np.uint16)[:n]
    out = r & np.uint16(0x8000 | ((1 << mant_bits) - 1))  # sign and mantissa
    exponent = ((r >> np.uint16(mant_bits)) & np.uint16(1)) + np.uint16(k + bias)  # k or k + 1, biased
    out |= exponent << np.uint16(mant_bits)
    return out


def _special_values(p: Preset, t: PlannedTensor, rng: np.random.Generator) -> np.ndarray | None:
    """Values of the tensors that are not random matrices (as F32 bytes), else None."""
    if t.spec.kind == MT.ROPE_FREQS:
        assert p.rope_freqs is not None
        return llama3_rope_factors(p.rope_freqs, p.head_dim, p.rope_base).view(np.uint8)
    if len(t.spec.shape) == 1:  # norms
        x = rng.uniform(1 - NORM_SPREAD, 1 + NORM_SPREAD, t.spec.shape).astype(np.float32)
        return x.view(np.uint8)
    return None


def _pieces(t: PlannedTensor) -> list[tuple[int, int]]:
    """(first block, n blocks) of each ~PIECE_BYTES piece of a tensor."""
    block, type_size = GGML_QUANT_SIZES[t.ggml_type]
    n_blocks = t.spec.n_elements // block
    per = max(1, PIECE_BYTES // type_size)
    return [(b, min(per, n_blocks - b)) for b in range(0, n_blocks, per)]


def _tensor_chunks(p: Preset, index: int, t: PlannedTensor, seed: int,
                   pool: ThreadPoolExecutor) -> Iterator[list[np.ndarray]]:
    """The bytes of tensor `index`, as lists of uint8 arrays (one list per chunk of pieces)."""
    special = _special_values(p, t, np.random.default_rng([seed, index]))
    if special is not None:
        yield [special]
        return
    std = 1.0 / math.sqrt(t.spec.row)

    def piece(i_piece: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([seed, index, i_piece])
        if t.ggml_type in _HALF_FORMATS:
            return _random_half(t.ggml_type, n, rng, std).view(np.uint8)
        return random_blocks(t.ggml_type, n, rng, scale=std / _unit_std(t.ggml_type)).reshape(-1)

    pieces = _pieces(t)
    for start in range(0, len(pieces), CHUNK_PIECES):
        group = range(start, min(start + CHUNK_PIECES, len(pieces)))
        yield list(pool.map(lambda i: piece(i, pieces[i][1]), group))


# ---------------------------------------------------------------------------------------------------
# writing


def check_free_space(path: str | os.PathLike, n_bytes: int) -> None:
    """Raise InsufficientSpace unless the disk holding `path` has room for `n_bytes` (+ a margin);
    an existing file at `path` counts as free space (it will be replaced)."""
    path = Path(path)
    free = shutil.disk_usage(path.parent if path.parent.exists() else Path.cwd()).free
    if path.exists():
        free += path.stat().st_size
    if free < n_bytes + SPACE_MARGIN:
        raise InsufficientSpace(
            f"{path}: not enough disk space: the file needs {n_bytes / 2**30:.2f} GiB, "
            f"{free / 2**30:.2f} GiB are free on {path.parent}"
        )


def synthesize(preset: str | Preset, ftype: str, path: str | os.PathLike, *, seed: int = 0,
               progress: bool = True) -> Path:
    """Write the GGUF file of `preset` with quant mix `ftype` and random weights from `seed` to `path`.

    ftype: f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m or q6_k. The file is the size llama.cpp's quantizer
    would make it (same tensors, types, alignment); same seed -> identical bytes. Memory stays bounded
    (a few chunks of CHUNK_PIECES x PIECE_BYTES). Returns the path.
    """
    plan = plan_file(preset, ftype)
    path = Path(path)
    check_free_space(path, plan.size)
    try:
        _write_file(plan, path, seed, progress)
    except BaseException:
        path.unlink(missing_ok=True)  # no half-written file left behind (interrupt, full disk, ...)
        raise
    if path.stat().st_size != plan.size:
        raise MoerunError(f"{path}: wrote {path.stat().st_size} bytes, planned {plan.size} (bug)")
    return path


def _write_file(plan: FilePlan, path: Path, seed: int, progress: bool) -> None:
    """Stream the header and every tensor of `plan` to `path`."""
    n_threads = min(16, os.cpu_count() or 1)
    bar = tqdm(total=plan.size, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
               desc=f"synth {plan.preset.name} {plan.ftype}")
    with open(path, "wb") as f, bar, ThreadPoolExecutor(n_threads) as pool, ThreadPoolExecutor(1) as io_pool:
        pending: list[Future] = []

        def write(parts: list[np.ndarray], pad: int = 0) -> None:
            while len(pending) > MAX_PENDING_WRITES:
                pending.pop(0).result()
            pending.append(io_pool.submit(_write_parts, f, parts, pad, bar))

        write([np.frombuffer(plan.header, dtype=np.uint8)])
        for index, t in enumerate(plan.tensors):
            for parts in _tensor_chunks(plan.preset, index, t, seed, pool):
                write(parts)
            write([], _pad(t.n_bytes) - t.n_bytes)
        for fut in pending:
            fut.result()


def _write_parts(f: io.BufferedWriter, parts: list[np.ndarray], pad: int, bar: tqdm) -> None:
    """Write arrays then `pad` zero bytes to `f` (runs on the writer thread)."""
    for a in parts:
        f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
        bar.update(a.nbytes)
    if pad:
        f.write(bytes(pad))
        bar.update(pad)


def default_cache_dir() -> Path:
    """Where cached synthetic files live: `$MOERUN_CACHE/synth`, else `~/.cache/moerun/synth`."""
    root = os.environ.get("MOERUN_CACHE")
    return Path(root) / "synth" if root else Path.home() / ".cache" / "moerun" / "synth"


def cached_synth(preset: str | Preset, ftype: str, *, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                 progress: bool = True) -> Path:
    """The synthetic file of (preset, ftype, seed), written once into the cache directory.

    The file is written under a temporary name in the same directory and renamed when complete, so an
    interrupted run leaves no half file; a cached file whose size is not the planned size is rewritten.
    """
    p = get_preset(preset)
    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{p.name}-{ftype.lower()}-seed{seed}-v{SYNTH_VERSION}.gguf"
    if path.exists() and path.stat().st_size == expected_size(p, ftype):
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        synthesize(p, ftype, tmp, seed=seed, progress=progress)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def synth_report(path: Path, plan: FilePlan, seconds: float) -> str:
    """One line about a written file: size, params, types, time, throughput."""
    return (f"{path}: {plan.preset.name} {plan.ftype}, {plan.size / 2**30:.2f} GiB, "
            f"{plan.n_params / 1e9:.2f} B params, {len(plan.tensors)} tensors "
            f"({', '.join(f'{k} {v}' for k, v in sorted(plan.type_counts().items()))}), "
            f"{seconds:.1f} s, {plan.size / max(seconds, 1e-9) / 1e9:.2f} GB/s")
