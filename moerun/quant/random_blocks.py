"""Random but valid GGML blocks, for synthetic weights (gguf-py cannot quantize to K-quants) and tests.

Quantized payload bits are uniform random bytes (every pattern is valid); only the fp16 scale
fields, and the 6-bit / int8 sub-scales of K-quants, are chosen so values stay near `scale`:
|x| <= ~scale and std ~ scale / 3 to scale / 2. Fully vectorized: no Python loop per block.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType

from moerun.quant.registry import quant_type

T = GGMLQuantizationType

# fp16 bit patterns at the edges of the format: +-0, +-max, min normal, min/max subnormal, 1.0
_EXTREME_F16 = np.array(
    [0x0000, 0x8000, 0x7BFF, 0xFBFF, 0x0400, 0x8400, 0x0001, 0x8001, 0x03FF, 0x3C00], dtype=np.uint16
)


def _bytes(n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random uint8 `[n]`, writable (drawn as uint64: several times faster than rng.bytes)."""
    words = rng.integers(0, 2**64 - 1, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float `[n]` -> fp16 little-endian bytes `[n, 2]`."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _extreme_f16(n: int, rng: np.random.Generator) -> np.ndarray:
    """fp16 bytes `[n, 2]`: half edge values, half uniformly random finite patterns (no inf/NaN)."""
    finite = rng.integers(0, 0x7C00, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
    edge = _EXTREME_F16[rng.integers(0, len(_EXTREME_F16), n)]
    bits = np.where(rng.random(n) < 0.5, edge, finite).astype("<u2")
    return bits.view(np.uint8).reshape(n, 2)


def _pack_k4_scales(out: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> None:
    """Pack 6-bit scales and mins `[n, 8]` into the 12 scale bytes `out` `[n, 12]` of Q4_K/Q5_K."""
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)


def _set_k4(out: np.ndarray, u: np.ndarray, scale: float, q_mid: float) -> None:
    """Fill d, dmin and packed scales of Q4_K/Q5_K so x = d*sc*(q - ~q_mid) spans about +-scale.

    Fast path: d from the field's random bytes (see _random_f16_field) and dmin = d * 2^round(log2 q_mid)
    by adding to the exponent bits: byte operations only, no float conversions."""
    shift = round(np.log2(q_mid))
    if _random_f16_field(out[:, 0:2], scale / (63 * q_mid), max_exp=30 - shift):
        out[:, 2] = out[:, 0]
        out[:, 3] = out[:, 1] + (shift << 2)  # same mantissa, exponent + shift
    else:
        d = (scale * u / (63 * q_mid)).astype(np.float16)  # [n]
        out[:, 0:2] = _f16_bytes(d)
        out[:, 2:4] = _f16_bytes(d.astype(np.float32) * q_mid)  # dmin = d * q_mid centres the values
    r = out[:, 4:12]  # [n, 8] random bytes, reused as the source of sub-scales
    sc = r | 0x20  # 6-bit scale in [32, 63] (bits 6-7 dropped by the packing)
    mn = sc ^ (r >> 6)  # min within 3 of the scale
    _pack_k4_scales(out[:, 4:16], sc & 0x3F, mn & 0x3F)


def random_blocks(
    ggml_type: int | GGMLQuantizationType,
    n_blocks: int,
    rng: np.random.Generator,
    *,
    scale: float = 1.0,
    extreme: bool = False,
) -> np.ndarray:
    """Random valid blocks, uint8 `[n_blocks, type_size]`, of any type moerun supports.

    extreme=True draws the fp16 scale fields from edge values (+-0, +-65504, smallest normal and
    subnormal) and random finite patterns, and leaves sub-scales as random bytes: for tests.
    For F32/F16/BF16 a "block" is one value, uniform with std `scale` (random finite bit patterns
    if extreme).
    """
    qt = quant_type(ggml_type)
    if qt.block_size == 1:
        return _random_floats(qt.ggml, n_blocks, rng, scale, extreme)
    out = np.empty((n_blocks, qt.type_size), dtype=np.uint8)  # [n_blocks, type_size]
    chunk = max(1, _CHUNK_BYTES // qt.type_size)  # cache-sized pieces, filled in parallel threads
    starts = range(0, n_blocks, chunk)
    if len(starts) <= 1:
        _fill(qt.ggml, out, rng, scale, extreme)
        return out
    rngs = rng.spawn(len(starts))  # one child stream per chunk: the result does not depend on threading

    def fill(i: int) -> None:
        _fill(qt.ggml, out[starts[i] : starts[i] + chunk], rngs[i], scale, extreme)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(len(starts))))
    return out


_CHUNK_BYTES = 1 << 20


def _fill(
    g: GGMLQuantizationType, out: np.ndarray, rng: np.random.Generator, scale: float, extreme: bool
) -> None:
    """Fill blocks `out` `[n, type_size]` in place: random payload, then the scale fields."""
    n = out.shape[0]
    out.reshape(-1)[:] = _bytes(out.size, rng)
    if extreme:
        for off in _F16_FIELDS[g]:
            out[:, off : off + 2] = _extreme_f16(n, rng)
        return
    u = rng.uniform(0.5, 1.0, n)  # [n] per-block spread of magnitudes
    if g in _SIMPLE_D:  # d in [t/2, t) straight from random bytes when possible: no float conversions
        if not _random_f16_field(out[:, 0:2], scale / _SIMPLE_D[g]):
            out[:, 0:2] = _f16_bytes(scale * u / _SIMPLE_D[g])
        return
    if g == T.Q4_K:
        _set_k4(out, u, scale, 7.5)
    elif g == T.Q5_K:
        _set_k4(out, u, scale, 15.5)
    elif g == T.Q6_K:
        r = out[:, 192:208]  # [n, 16] random bytes, reused for the int8 sub-scales
        mag = ((r & 0x3F) | 0x40).view(np.int8)  # |scale| in [64, 127]
        out[:, 192:208] = np.where(r >= 0x80, -mag, mag).view(np.uint8)
        if not _random_f16_field(out[:, 208:210], scale / (127 * 32)):
            out[:, 208:210] = _f16_bytes(scale * u / (127 * 32))


# d = scale / this for the one-scale block types (max |q| of the type)
_SIMPLE_D = {T.Q8_0: 127, T.Q4_0: 8, T.Q5_0: 16}


def _random_f16_field(field: np.ndarray, target: float, max_exp: int = 30) -> bool:
    """Turn the random bytes of an fp16 field `[n, 2]` into positive values in [target/2, target):
    the exponent of target/2 with the field's own random mantissa bits. Returns False (field
    untouched) when target/2 is not a normal fp16 number with exponent <= max_exp."""
    exp = int(np.floor(np.log2(target / 2))) + 15 if target > 0 else 0
    if not 1 <= exp <= max_exp:
        return False
    field[:, 1] = (field[:, 1] & 0x03) | (exp << 2)  # sign 0, exponent exp, mantissa random
    return True


# byte offsets of the fp16 fields in each block type
_F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q5_0: (0,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
}


def _random_floats(
    g: GGMLQuantizationType, n: int, rng: np.random.Generator, scale: float, extreme: bool
) -> np.ndarray:
    """F32/F16/BF16 values as bytes `[n, 4 or 2]`."""
    if g == T.F16:
        if extreme:
            return _extreme_f16(n, rng)
        return _f16_bytes(_uniform(n, rng, scale))
    if extreme:  # finite fp32 / bf16 patterns: exponent never all ones
        bits = rng.integers(0, 0x7F80_0000, n, dtype=np.uint32) | (
            rng.integers(0, 2, n, dtype=np.uint32) << 31
        )
    else:
        bits = _uniform(n, rng, scale).view(np.uint32)
    if g == T.F32:
        return bits.astype("<u4").view(np.uint8).reshape(n, 4)
    return (bits >> 16).astype("<u2").view(np.uint8).reshape(n, 2)  # BF16: top half (truncation)


def _uniform(n: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """float32 `[n]` uniform with mean 0 and std `scale` (5x faster to draw than a normal)."""
    x = rng.random(n, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(scale * 12**0.5)
    return x
