"""The split attention (moerun/kernels/triton/attention.py) vs the plain-torch reference on fresh random inputs:
every split-loop variant (`AttnVariant`: tiles, ahead, tensor cores), the RoPE prologue with this
step's row stored and read back, the fused combine, the quantized and permuted outputs, the split policy.

Runs on CUDA when available, else on the CPU under Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported). Every output and scratch buffer is poisoned with NaN first; the seed is printed (shown on failure).
"""

from __future__ import annotations

import os
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.kernel_checks import DEV, check_x24, close, nan, poisoned_x24, randn  # noqa: E402

from moerun.kernels import reference as ref  # noqa: E402
from moerun.kernels.torch_ops import permute_k4  # noqa: E402
from moerun.kernels.triton import attention as ak  # noqa: E402
from moerun.kernels.triton import decode_ops as ops  # noqa: E402


def _modes(names: str, rows: list[tuple]) -> list[Any]:
    """pytest.params of an attention test's modes: rows of (cache dtype, switch, ...), each id the dtype and the
    names (from `names`, comma-separated after the dtype's) of the switches on."""
    keys = names.split(",")[1:]
    return [pytest.param(*row, id="-".join([str(row[0]).replace("torch.", "")]
                                            + [k for k, on in zip(keys, row[1:], strict=True) if on])) for row in rows]


# (cache dtype, ahead, dot): DOT runs on f16 caches only (`attention.dot_ok`)
ATTN_MODES = [(dt, ahead, False) for dt in (torch.float32, torch.float16, torch.bfloat16) for ahead in (False, True)] \
    + [(torch.float16, False, True), (torch.float16, True, True)]


@pytest.mark.parametrize("cache_dtype,ahead,dot", _modes("cache_dtype,ahead,dot", ATTN_MODES))
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("kv_len", [1, 17, 70])
@pytest.mark.parametrize("h,hkv,d,dv,n_splits", [(3, 1, 16, 16, 4), (3, 3, 32, 32, 7), (4, 2, 32, 16, 1),
                                                   (8, 1, 16, 16, 3)])
def test_attention_decode(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, n_splits: int, kv_len: int,
                          window: int, cache_dtype: torch.dtype, ahead: bool, dot: bool) -> None:
    """Against the reference, the cache outside the window poisoned with NaN (never read); with `ahead` each next
    tile's loads before the tile before's arithmetic (masked past the chunk: a split of 70 positions in one program
    walks 5 tiles of 16, the last partial, the masked one after it); with `dot` q.k and p.v on the tensor cores."""
    n_ctx, scale = 96, d ** -0.5
    q = randn(gen, h, d, scale=2.0)
    k_cache = randn(gen, n_ctx, hkv, d).to(cache_dtype)
    v_cache = randn(gen, n_ctx, hkv, dv).to(cache_dtype)
    want = ref.attention(q[None], k_cache[:kv_len], v_cache[:kv_len], torch.tensor([kv_len - 1], device=DEV),
                         scale, window)[0]  # [H, Dv]
    start = max(0, kv_len - window) if window else 0
    k_cache[:start], k_cache[kv_len:] = float("nan"), float("nan")  # never read
    v_cache[:start], v_cache[kv_len:] = float("nan"), float("nan")
    scratch = tuple(t.fill_(float("nan")) for t in ak.attention_scratch(h, dv, n_splits, DEV))
    out = nan(h, dv)
    kv_len_t = torch.tensor([kv_len], device=DEV, dtype=torch.int64)
    # min_split 16: one live split per 16 positions (kv_len 70 over 7 splits: 5 live, 2 idle; the NaN scratch of the
    # idle ones is never read)
    ak.attention_decode(q, k_cache, v_cache, kv_len_t, scale, window, out, scratch, block_n=16, min_split=16,
                         ahead=ahead, dot=dot)
    close(out, want)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,rope_style", [("full", "neox"), ("head", "norm"), ("none", "neox")])
@pytest.mark.parametrize("h,hkv,d,dv,rope_dim,n_splits,kv_len,window", [
    (3, 1, 16, 16, 8, 4, 1, 0), (3, 3, 32, 32, 32, 7, 17, 0), (4, 2, 32, 16, 24, 3, 70, 8),
    (8, 1, 16, 16, 16, 1, 40, 0)])
def test_attention_decode_rope(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, rope_dim: int,
                               n_splits: int, kv_len: int, window: int, qk_norm: str, rope_style: str,
                               cache_dtype: torch.dtype) -> None:
    """attention_decode(rope=...) from the raw projections = qk_norm_rope_store at kv_len - 1, then attention_decode:
    the same cache rows (bit for bit, the rest untouched) and the same output."""
    n_ctx, eps, scale = 96, 1e-6, d ** -0.5
    q, k, v = randn(gen, h * d, scale=2.0), randn(gen, hkv * d), randn(gen, hkv * dv)
    width = {"none": (d, d), "head": (d, d), "full": (h * d, hkv * d)}[qk_norm]
    qw, kw = randn(gen, width[0]), randn(gen, width[1])
    table = ops.rope_table(n_ctx, rope_dim, 1000.0, 1.0, None, device=DEV)
    k_cache = randn(gen, n_ctx, hkv, d).to(cache_dtype)
    v_cache = randn(gen, n_ctx, hkv, dv).to(cache_dtype)
    k_cache[kv_len - 1], v_cache[kv_len - 1] = float("nan"), float("nan")  # the row this step writes
    kv_len_t = torch.tensor([kv_len], device=DEV, dtype=torch.int64)
    k2, v2, q_rot, want = k_cache.clone(), v_cache.clone(), nan(h, d), nan(h, dv)
    ops.qk_norm_rope_store(q, k, v, qw, kw, table, kv_len_t - 1, k2, v2, q_rot, eps, qk_norm, rope_style)
    ak.attention_decode(q_rot, k2, v2, kv_len_t, scale, window, want, ak.attention_scratch(h, dv, n_splits, DEV),
                         block_n=16, min_split=16)
    scratch = tuple(t.fill_(float("nan")) for t in ak.attention_scratch(h, dv, n_splits, DEV))
    out = nan(h, dv)
    rope = ak.RopeStore(k, v, qw, kw, table, eps, qk_norm, rope_style)
    ak.attention_decode(q.view(h, d), k_cache, v_cache, kv_len_t, scale, window, out, scratch, block_n=16, rope=rope,
                         min_split=16)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    close(out, want)


def _step_inputs(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, n_ctx: int,
                 cache_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One step's raw q [H*D] / k [Hkv*D] / v [Hkv*Dv] projections, full-width QK-norm weights, a RoPE table over
    all D and random [n_ctx, Hkv, D|Dv] caches of cache_dtype."""
    q = randn(gen, h * d, scale=2.0)
    k, v = randn(gen, hkv * d), randn(gen, hkv * dv)
    qw, kw = randn(gen, h * d), randn(gen, hkv * d)
    table = ops.rope_table(n_ctx, d, 1000.0, 1.0, None, device=DEV)
    k_cache = randn(gen, n_ctx, hkv, d).to(cache_dtype)
    v_cache = randn(gen, n_ctx, hkv, dv).to(cache_dtype)
    return q, k, v, qw, kw, table, k_cache, v_cache


ROW_MODES = "cache_dtype,fused,early,ahead,dot"


@pytest.mark.parametrize(ROW_MODES, _modes(ROW_MODES, [
    (dt, *mode, False) for dt in (torch.float16, torch.bfloat16, torch.float32)
    for mode in ((True, True, False), (False, True, False), (True, False, False), (True, False, True),
                 (False, True, True))]
    + [(torch.float16, True, False, False, True), (torch.float16, False, True, True, True)]))
@pytest.mark.parametrize("h,hkv,d,dv,n_splits,kv_len,window", [
    (3, 1, 16, 16, 4, 1, 0), (3, 3, 32, 32, 7, 17, 0), (4, 2, 32, 16, 3, 70, 8), (8, 1, 16, 16, 1, 40, 0),
    (2, 2, 64, 64, 5, 33, 0), (2, 1, 32, 32, 2, 80, 0)])
def test_attention_decode_row_in_registers(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, n_splits: int,
                                           kv_len: int, window: int, fused: bool, early: bool, ahead: bool,
                                           dot: bool, cache_dtype: torch.dtype) -> None:
    """The split programs load their first K / V tile before this step's row is stored: where that tile holds
    position len-1 its row comes from registers (cast to the cache's dtype), where a later tile holds it the loop
    reads it back after a barrier (kv_len 40 in one split: its third tile; 80 in two of 48: the second's second tile;
    33 in three live splits of 16: a first tile). The cache's row is poisoned with NaN until the launch stores it;
    against qk_norm_rope_store then attention_decode: the same cache rows bit for bit, the same output and quantized
    output (f16 / bf16 / f32 caches, GQA, a window, one and several live splits (min_split 16), tiles of 16
    positions, the fused reduce and the reduce launch); also with the first tile loaded after the prologue and its
    barrier instead (`early` False, `attention.ATTN_LONG`), and with each next tile's loads ahead of the tile
    before's arithmetic (`ahead`: the second tile's loads come after the store's barrier; kv_len 40 / 80), and with
    q.k and p.v on the tensor cores (`dot`, f16: the row from registers kept in f16)."""
    n_ctx, eps, scale = 96, 1e-6, d ** -0.5
    q, k, v, qw, kw, table, k_cache, v_cache = _step_inputs(gen, h, hkv, d, dv, n_ctx, cache_dtype)
    k_cache[kv_len - 1], v_cache[kv_len - 1] = float("nan"), float("nan")  # the row this step writes
    kv_len_t = torch.tensor([kv_len], device=DEV, dtype=torch.int64)
    x24 = dv % 32 == 0
    k2, v2, q_rot, want = k_cache.clone(), v_cache.clone(), nan(h, d), nan(h, dv)
    ops.qk_norm_rope_store(q, k, v, qw, kw, table, kv_len_t - 1, k2, v2, q_rot, eps, "full", "neox")
    ak.attention_decode(q_rot, k2, v2, kv_len_t, scale, window, want, ak.attention_scratch(h, dv, n_splits, DEV),
                         block_n=16, min_split=16)
    scratch = tuple(t.fill_(float("nan")) for t in ak.attention_scratch(h, dv, n_splits, DEV))
    out, out24 = nan(h, dv), (poisoned_x24(h * dv) if x24 else None)
    ak.attention_decode(q.view(h, d), k_cache, v_cache, kv_len_t, scale, window, out, scratch, block_n=16,
                         min_split=16, out_x24=out24,
                         counters=torch.zeros(h, dtype=torch.int32, device=DEV) if fused else None,
                         rope=ak.RopeStore(k, v, qw, kw, table, eps, "full", "neox"), early=early, ahead=ahead,
                         dot=dot)
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
    close(out, want)
    if x24:
        check_x24(out24, out.reshape(-1))


def _attention_into(gen: torch.Generator, **outputs) -> torch.Tensor:
    """One small attention_decode (4 heads of 64, 2 KV heads, 9 cached positions, 2 splits) writing its extra
    `outputs` (out_perm / out_x24) too; returns out [4, 64]."""
    h, hkv, d, n_ctx, kv_len = 4, 2, 64, 32, 9
    q = randn(gen, h, d)
    k_cache, v_cache = randn(gen, n_ctx, hkv, d), randn(gen, n_ctx, hkv, d)
    scratch = ak.attention_scratch(h, d, 2, DEV)
    out = nan(h, d)
    kv_len_t = torch.tensor([kv_len], device=DEV, dtype=torch.int64)
    ak.attention_decode(q, k_cache, v_cache, kv_len_t, d ** -0.5, 0, out, scratch, block_n=16, **outputs)
    return out


def test_attention_decode_perm_out(gen: torch.Generator) -> None:
    """The reduce step also writes the output flattened in the word kernels' order (for attn_output)."""
    out_p = nan(4 * 64)
    out = _attention_into(gen, out_perm=out_p)
    assert torch.equal(out_p.cpu(), permute_k4(out.reshape(-1).cpu()))


def test_attention_decode_x24_out(gen: torch.Generator) -> None:
    """The reduce step also writes the output flattened and quantized (imatvec.X24, for attn_output)."""
    x24 = poisoned_x24(4 * 64)
    out = _attention_into(gen, out_x24=x24)
    check_x24(x24, out.reshape(-1))


@pytest.mark.parametrize("min_split", [16, 128])
@pytest.mark.parametrize("h,hkv,d,dv,n_splits,kv_len", [(3, 1, 16, 16, 4, 17), (4, 2, 64, 64, 3, 40),
                                                          (8, 1, 32, 32, 1, 5), (2, 2, 16, 16, 5, 9)])
def test_attention_decode_fused_reduce(gen: torch.Generator, h: int, hkv: int, d: int, dv: int, n_splits: int,
                                       kv_len: int, min_split: int) -> None:
    """counters: the split launch combines the splits itself (the last of each head's live programs to finish):
    the reduce launch's outputs bit for bit (out, and out_x24 where Dv % 32 == 0); twice, so the counters' reset
    shows (min_split 16: kv_len 40 over 3 live splits, 9 over 1 live of 5; 128: one live split, the rest idle)."""
    n_ctx = 96
    q = randn(gen, h, d)
    k_cache, v_cache = randn(gen, n_ctx, hkv, d), randn(gen, n_ctx, hkv, dv)
    kv_len_t = torch.tensor([kv_len], device=DEV, dtype=torch.int64)
    want, got = nan(h, dv), nan(h, dv)
    x24 = dv % 32 == 0
    want24, got24 = (poisoned_x24(h * dv), poisoned_x24(h * dv)) if x24 else (None, None)
    ak.attention_decode(q, k_cache, v_cache, kv_len_t, d ** -0.5, 0, want, ak.attention_scratch(h, dv, n_splits, DEV),
                         block_n=16, out_x24=want24, min_split=min_split)
    cnt = torch.zeros(h, dtype=torch.int32, device=DEV)
    for _ in range(2):
        scratch = tuple(t.fill_(float("nan")) for t in ak.attention_scratch(h, dv, n_splits, DEV))
        got.fill_(float("nan"))
        ak.attention_decode(q, k_cache, v_cache, kv_len_t, d ** -0.5, 0, got, scratch, block_n=16, out_x24=got24,
                             counters=cnt, min_split=min_split)
        assert torch.equal(got, want)
        if x24 and DEV.type == "cpu":
            assert all(torch.equal(a, b) for a, b in zip(got24, want24, strict=True))
        elif x24:  # a head's only split quantizes in the split kernel: its division and sums may round differently
            check_x24(got24, got.reshape(-1))
        assert int(cnt.abs().sum()) == 0
    with pytest.raises(ValueError, match="counters must be int32 zeros"):
        ak.attention_decode(q, k_cache, v_cache, kv_len_t, d ** -0.5, 0, got, scratch, block_n=16,
                             counters=cnt[:h - 1])


def test_attention_splits_policy() -> None:
    assert ak.attention_splits(4096, 16, 132) == 25  # 400 programs of 192 positions: 3 per SM (160 registers)
    assert ak.attention_splits(4096, 16, 132, programs_per_sm=4) == 33  # 528 programs of 128 positions
    assert ak.attention_splits(96, 16, 132, block_n=64) == 2  # never more splits than tiles
    assert ak.attention_splits(1, 64, 132) == 1
    assert ak.attention_splits(131072, 32, 132) == 13
