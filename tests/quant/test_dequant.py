"""Bit-exactness of moerun's torch dequantizers against gguf-py's numpy reference."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moerun.quant import QUANT_TYPES, dequantize, quant_type, random_blocks

TYPES = list(QUANT_TYPES)
QUANTIZED = [g for g in TYPES if QUANT_TYPES[g].block_size > 1]

# byte offsets of fp16 fields that random raw bytes must not turn into inf/NaN
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q5_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A freshly seeded generator; the seed is printed so a failure can be replayed (MOERUN_SEED=...)."""
    seed = int(os.environ.get("MOERUN_SEED", int.from_bytes(os.urandom(8), "little")))
    print(f"{request.node.name}: MOERUN_SEED={seed}")
    return np.random.default_rng(seed)


def reference(blocks: np.ndarray, g: T) -> np.ndarray:
    """gguf-py's dequantization of uint8 rows `[rows, row_bytes]` -> float32 `[rows, cols]`."""
    if g in (T.F32, T.F16):  # gguf.quants.dequantize takes these in their own dtype
        return gguf.quants.dequantize(blocks.view(np.float32 if g == T.F32 else np.float16), g)
    return gguf.quants.dequantize(blocks, g)


def assert_bit_exact(got: torch.Tensor, want: np.ndarray) -> None:
    got_np = got.cpu().numpy()
    assert got_np.dtype == np.float32 and want.dtype == np.float32
    assert got_np.shape == want.shape
    bad = got_np.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), (
        f"{bad.sum()} mismatches, first at {np.argwhere(bad)[0]}: {got_np[bad][:4]} vs {want[bad][:4]}"
    )


def check(blocks: np.ndarray, g: T, rows: int) -> None:
    """Dequantize `blocks` `[n, type_size]` laid out as `rows` rows with both engines and compare."""
    qt = QUANT_TYPES[g]
    n = blocks.shape[0]
    assert n % rows == 0
    raw = np.ascontiguousarray(blocks).reshape(rows, -1)  # [rows, row_bytes]
    cols = n // rows * qt.block_size
    got = dequantize(torch.from_numpy(raw), g, (rows, cols))
    assert_bit_exact(got, reference(raw, g))


@pytest.mark.parametrize("g", TYPES, ids=lambda g: g.name)
@pytest.mark.parametrize("extreme", [False, True], ids=["moderate", "extreme"])
@pytest.mark.parametrize("n_blocks,rows", [(1, 1), (7, 1), (33, 3), (255, 5)])
def test_random_blocks_bit_exact(
    g: T, extreme: bool, n_blocks: int, rows: int, rng: np.random.Generator
) -> None:
    check(random_blocks(g, n_blocks, rng, extreme=extreme), g, rows)


@pytest.mark.parametrize("g", QUANTIZED, ids=lambda g: g.name)
def test_random_bytes_bit_exact(g: T, rng: np.random.Generator) -> None:
    """Fully random bytes (every payload pattern is valid) with finite fp16 scales."""
    n = 129
    blocks = rng.integers(0, 256, (n, QUANT_TYPES[g].type_size), dtype=np.uint8)
    for off in F16_FIELDS[g]:
        bits = rng.integers(0, 0x7C00, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
        blocks[:, off : off + 2] = bits.astype("<u2").view(np.uint8).reshape(n, 2)
    check(blocks, g, 3)


@pytest.mark.parametrize("g", [T.F32, T.F16, T.BF16], ids=lambda g: g.name)
def test_float_random_bits_bit_exact(g: T, rng: np.random.Generator) -> None:
    """Every bit pattern of the float types, NaN and inf included, converts exactly."""
    ts = QUANT_TYPES[g].type_size
    blocks = rng.integers(0, 256, (3 * 1001, ts), dtype=np.uint8)
    special = {
        2: [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF, 0x8000, 0x0001],
        4: [0x7F800000, 0x7FC00001, 0x80000000],
    }
    for i, bits in enumerate(special[ts]):
        blocks[i] = np.array([bits], dtype=f"<u{ts}").view(np.uint8)
    check(blocks, g, 3)


@pytest.mark.parametrize("g", QUANTIZED, ids=lambda g: g.name)
def test_random_blocks_magnitude(g: T, rng: np.random.Generator) -> None:
    """Moderate random blocks give values within about +-scale, with a sensible spread."""
    blocks = random_blocks(g, 64, rng, scale=0.02)
    assert blocks.dtype == np.uint8 and blocks.shape == (64, QUANT_TYPES[g].type_size)
    x = gguf.quants.dequantize(blocks, g)
    assert np.isfinite(x).all()
    assert np.abs(x).max() <= 0.02 * 1.1
    assert 0.02 / 5 < x.std() < 0.02


def test_registry_matches_gguf_sizes() -> None:
    for g, qt in QUANT_TYPES.items():
        assert (qt.block_size, qt.type_size) == gguf.GGML_QUANT_SIZES[g]
        assert qt.name == g.name and qt.ggml == g
        assert quant_type(int(g)) is qt


def test_multi_dim_shape_and_dtype(rng: np.random.Generator) -> None:
    """A 3-D [E, rows, cols] tensor dequantizes to that shape, row-major over the leading dims."""
    blocks = random_blocks(T.Q4_K, 2 * 3 * 2, rng)
    raw = torch.from_numpy(blocks.reshape(2, 3, 2 * 144))
    out = dequantize(raw, T.Q4_K, (2, 3, 512))
    assert out.shape == (2, 3, 512) and out.dtype == torch.float32
    assert_bit_exact(out.reshape(6, 512), reference(blocks.reshape(6, 288), T.Q4_K))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("g", TYPES, ids=lambda g: g.name)
def test_cuda_bit_exact(g: T, rng: np.random.Generator) -> None:
    blocks = np.concatenate([random_blocks(g, 96, rng), random_blocks(g, 96, rng, extreme=True)])
    raw = torch.from_numpy(blocks.reshape(4, -1)).to("cuda")
    cols = 48 * QUANT_TYPES[g].block_size
    got = dequantize(raw, g, (4, cols))
    assert got.device.type == "cuda"
    assert_bit_exact(got, reference(blocks.reshape(4, -1), g))


@pytest.mark.parametrize("g", [T.Q4_K, T.Q8_0], ids=lambda g: g.name)
def test_random_blocks_deterministic_across_chunks(g: T) -> None:
    """Large requests are filled by threads in chunks; the same seed still gives the same bytes."""
    n = 3 * (1 << 20) // QUANT_TYPES[g].type_size + 5  # several chunks and a ragged tail
    a = random_blocks(g, n, np.random.default_rng(7))
    b = random_blocks(g, n, np.random.default_rng(7))
    assert np.array_equal(a, b) and a.shape == (n, QUANT_TYPES[g].type_size)
    assert not np.array_equal(a[:100], a[-100:])  # chunks draw from different streams
    x = gguf.quants.dequantize(a[-4096:], g)
    assert np.isfinite(x).all() and np.abs(x).max() <= 1.1
