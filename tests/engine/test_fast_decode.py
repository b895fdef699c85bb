"""The fused decode step (engine/fast_decode.py) against the reference forward, teacher-forced.

On the CPU it runs with the torch twins of the kernels (and the Triton kernels under the
interpreter in tests/kernels); on CUDA with the Triton kernels, eagerly and as a CUDA graph.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from support.device import TEST_DEVICE
from support.tiny_files import rel_err, tiny_gguf, tiny_tokens
from support.tiny_models import TINY

from moerun.engine.engine import Engine
from moerun.errors import ContextOverflow
from moerun.kernels.ops import FEATURES
from moerun.kernels.torch_ops import TorchOps


class PermutingTorchOps(TorchOps):
    """The torch twins, asking for permuted activations wherever TritonOps' word kernels could (K % 256 == 0,
    any type): runs the step's permuted wiring (rms_norm copies, x_perm, h written and read permuted) on the CPU."""

    @staticmethod
    def perm(qtype: int, k: int, kind: str | None = None) -> bool:
        return k % 256 == 0

N_STEPS = 64 if TEST_DEVICE == "cuda" else 24  # issue 4: 64 teacher-forced steps (the CPU: fewer, for time)
OPS = ["torch"] + (["triton", "triton-bytes", *(f"triton+{f}" for f in FEATURES)] if TEST_DEVICE == "cuda" else [])
GRAPH = [False] + ([True] if TEST_DEVICE == "cuda" else [])
ALL_FEATURES = ["triton+" + "+".join(FEATURES)] if FEATURES else []  # every unmeasured ops feature at once


@pytest.fixture(scope="module", params=[(a, q) for a in TINY for q in ("f32", "q4_k")], ids=lambda p: "-".join(p))
def model_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    arch, qtype = request.param
    model, path, seed = tiny_gguf(arch, qtype, tmp_path_factory.mktemp(f"{arch}-{qtype}"))
    return path, tiny_tokens(model, seed, N_STEPS)


@pytest.mark.parametrize("graph", GRAPH, ids=lambda g: "graph" if g else "eager")
@pytest.mark.parametrize("ops", OPS)
def test_fast_steps_match_reference(model_file, ops: str, graph: bool) -> None:
    path, tokens = model_file
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    ref = Engine(path, fast=False, **kw).forward(tokens)  # [T, V]
    eng = Engine(path, fast=True, ops=ops, graph=graph, **kw)
    for i, tok in enumerate(tokens):
        next_id = eng.decode(tok)
        assert eng.n_past == i + 1
        err = rel_err(eng.fast.logits, ref[i])
        assert err < 1e-4, f"step {i}: relative logit error {err:.2e}"
        assert next_id == int(eng.fast.logits.argmax())
        top2 = ref[i].topk(2).values
        if top2[0] - top2[1] > 1e-2:  # a clear winner: the reference's greedy token
            assert next_id == int(ref[i].argmax()), f"step {i}: greedy {next_id}, reference {int(ref[i].argmax())}"


@pytest.mark.parametrize("graph", GRAPH, ids=lambda g: "graph" if g else "eager")
@pytest.mark.parametrize("ops", OPS)
def test_chained_steps_match_reference(model_file, ops: str, graph: bool) -> None:
    """Each step fed the token it chose: its inputs come from the step before on the device (no host writes);
    a token the caller changes, or a rewound position, is written from the host again."""
    path, tokens = model_file
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    ref_tokens = Engine(path, fast=False, **kw).generate_greedy(tokens[:3], 8)
    eng = Engine(path, fast=True, ops=ops, graph=graph, **kw)
    assert list(eng.generate(tokens[:3], 8)) == ref_tokens
    eng.reset()
    eng.prefill(tokens[:3])
    first = eng.decode(tokens[3])  # not the token the last step chose
    eng.n_past = 3  # rewind: the same position and token again
    assert eng.decode(tokens[3]) == first
    full = Engine(path, fast=False, **kw).forward(tokens[:4])
    assert rel_err(eng.fast.logits, full[3]) < 1e-4


def _chain(eng: Engine, tok: int, n: int) -> list[int]:
    """n greedy-or-sampled steps one `decode` at a time, the host waiting for each token."""
    out = []
    for _ in range(n):
        tok = eng.decode(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("graph", GRAPH, ids=lambda g: "graph" if g else "eager")
@pytest.mark.parametrize("ops", OPS)
def test_stream_equals_decode(model_file, ops: str, graph: bool, sampled: bool) -> None:
    """decode_stream (step i + 1 queued before the host reads token i) gives decode's tokens and n_past; closed
    early, its queued step is discarded (sampler state included): carrying on gives the uninterrupted run."""
    from moerun.engine.sampler import SamplingParams

    path, tokens = model_file
    eng = Engine(path, fast=True, ops=ops, graph=graph, device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    prompt, n = tokens[:3], 10
    params = SamplingParams(temperature=1.5, repeat_penalty=1.2, seed=7) if sampled else None

    def restart() -> None:
        eng.set_sampling(params)
        if eng.sampler is not None:
            eng.sampler.start(prompt)
        eng.prefill(prompt, pos=0)

    restart()
    want = _chain(eng, tokens[3], n)
    restart()
    got = []
    for i, t in enumerate(eng.decode_stream(tokens[3], n)):
        got.append(t)
        assert eng.n_past == 4 + i
    assert got == want
    restart()
    it = eng.decode_stream(tokens[3], n)
    part = [next(it) for _ in range(4)]
    it.close()  # step 5 was queued: discarded
    assert eng.n_past == 7
    assert part + list(eng.decode_stream(part[-1], n - 4)) == want
    assert list(eng.decode_stream(want[-1], 0)) == []
    with pytest.raises(ContextOverflow):
        next(eng.decode_stream(want[-1], eng.n_ctx))


def test_generate_same_tokens_fast_and_reference(model_file) -> None:
    path, tokens = model_file
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    ref = Engine(path, fast=False, **kw).generate_greedy(tokens[:5], 12)
    fast = Engine(path, fast=True, ops="torch", **kw).generate_greedy(tokens[:5], 12)
    assert fast == ref


def test_permuted_wiring_matches_reference(model_file) -> None:
    path, tokens = model_file
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    ref = Engine(path, fast=False, **kw).forward(tokens[:6])
    eng = Engine(path, fast=True, ops="torch", graph=False, **kw)
    eng.fast.ops = PermutingTorchOps()
    for i, tok in enumerate(tokens[:6]):
        eng.decode(tok)
        err = rel_err(eng.fast.logits, ref[i])
        assert err < 1e-4, f"step {i}: relative logit error {err:.2e}"


def test_make_ops_names() -> None:
    from moerun.errors import MoerunError
    from moerun.kernels.ops import make_ops, parse_ops
    from moerun.kernels.triton import imatvec as ik

    assert make_ops("torch").name == "torch"
    assert make_ops("triton").words and not make_ops("triton-bytes").words
    assert make_ops("triton").kernel_name(12) == "triton-int(mv,gate_up,down)"
    assert make_ops("triton-words").kernel_name(12) == "triton-words"
    assert make_ops("triton").ints(12, 2048, "gate_up") and not make_ops("triton-words").ints(12, 2048, "gate_up")
    assert make_ops("triton").ints(12, 2048, "down") and make_ops("triton").ints(14, 2048, "mv")
    assert make_ops("triton").ints(14, 2048, "gate_up") and make_ops("triton").ints(8, 2048, "mv")
    assert not make_ops("triton").ints(13, 2048, "mv")  # Q5_K
    assert make_ops("triton-words").kernel_name(8) == "triton-words"
    assert make_ops("triton").kernel_name(8) == "triton-int(mv,gate_up,down)"
    assert make_ops("triton").kernel_name(14) == "triton-int(mv,gate_up,down)"
    assert make_ops("triton-words").kernel_name(14) == "triton+words(mv repacked,gate_up repacked,down repacked)"
    assert make_ops("triton-unpadded").kernel_name(14) == "triton-words"
    w = torch.zeros(16384, 8 * 210, dtype=torch.uint8)  # a Q6_K output-sized matrix, K = 2048
    assert make_ops("triton").repack(14, "mv", w).shape == (16384, 8 * 288)
    assert make_ops("triton").repack(14, "mv", w[:2048]).shape == (2048, 8 * 288)
    assert make_ops("triton").repack(14, "down", w[None, :2048]).shape == (1, 2048, 8 * 288)
    for name, qtype, kind, m in [("triton-unpadded", 14, "mv", w), ("triton-bytes", 14, "mv", w),
                                 ("triton", 8, "mv", w)]:
        assert make_ops(name).repack(qtype, kind, m) is m, (name, qtype, kind, m.shape)
    assert make_ops("torch").repack(14, "mv", w) is w
    assert make_ops("triton-bytes").kernel_name(12) == "triton"
    assert make_ops("triton").kernel_name(10).startswith("torch-dequant")
    with pytest.raises(MoerunError, match="unknown decode ops"):
        make_ops("cuda-magic")
    # features after '+': a base alone parses, an unknown feature is named with the list
    assert parse_ops("triton") == ("triton", ()) and parse_ops("triton-bytes") == ("triton-bytes", ())
    with pytest.raises(MoerunError, match=r"unknown decode ops feature 'fast' in 'triton\+fast'; features: "):
        make_ops("triton+fast")
    for gone in ("pair", "nfused", "down4", "mvahead", "dnorm", "down2", "attnearly", "pdl", "pdlpre",
                 "wpre", "attnpipe", "kpipe", "dpipe", "attnlate", "attnlong", "attnpre", "attnl2", "attnmid",
                 "attnmidlate", "preshort", "prelong", "normmv", "split64", "rounds", "kvhead", "gupersist",
                 "gupre", "attnlongpre", "attnlongk", "argmax1", "kvl2", "kvl2all", "ahead32", "ahead64", "pipe32",
                 "pipe32s4", "pipe32p6", "pipe64", "dot32a"):
        # measured and deleted, or the default
        with pytest.raises(MoerunError, match=f"unknown decode ops feature '{gone}'"):
            parse_ops(f"triton+{gone}")
    with pytest.raises(MoerunError, match="the base 'cuda' is not one of triton, .*; features after '\\+': "):
        parse_ops("cuda+fast")
    # the measured-faster variants are the default (NOTES.md 7v)
    t = make_ops("triton")
    assert t.qkv_fused and t.attn_fused and t.int_kinds == ik.INT_KINDS and 8 in ik.INT_KINDS
    assert t.down_ahead == make_ops("triton-bytes").down_ahead == 2  # NOTES.md 7y (down4, mvahead, dnorm: deleted)
    # programmatic dependent launch in every base (NOTES.md 8a; test_pdl.py), the attention's splits sized for its
    # registers (3 programs per SM)
    from moerun.kernels.gpu import sm_count
    from moerun.kernels.triton import attention as ak

    assert t.pdl and make_ops("triton-bytes").pdl and not make_ops("triton-nopdl").pdl
    k, o = torch.empty(4096, 16, 128), torch.empty(16, 128)
    block_n, _, pps, *_ = t._attn_variant(k, o, 0)
    assert t._attention_scratch(k, o, block_n, pps)[0].shape[1] == ak.attention_splits(
        4096, 16, sm_count(o.device), programs_per_sm=3)


def test_attention_phases() -> None:
    """Where the long-context attention variant starts: once the short variant's splits (3 programs per SM) are all
    live, whether the long one has more (ATTN_LONG, 4 per SM) or as many (ATTN_LONG_F16); never in a context too
    short for that, nor for a sliding window too short to reach it; which long variant runs, by cache dtype."""
    from moerun.kernels.gpu import sm_count
    from moerun.kernels.ops import make_ops
    from moerun.kernels.triton import attention as ak
    from moerun.kernels.triton_ops import TritonOps

    short = ak.ATTN_SHORT
    assert short == (ak.ATTN_BLOCK_N, 4, ak.ATTN_PROGRAMS_PER_SM, True, False, False)
    # OLMoE (16 heads) on 132 SMs: 25 splits of 64 positions cover 1,600; 33 with the long variant
    assert ak.ATTN_MIN_SPLIT == 64  # NOTES.md 8t
    assert ak.attention_long_from(4224, 16, 132, short, ak.ATTN_LONG) == 1601
    assert ak.attention_long_from(4224, 16, 132, short, ak.ATTN_LONG, min_split=128) == 3201  # NOTES.md 8n
    assert ak.attention_long_from(1600, 16, 132, short, ak.ATTN_LONG) is None  # never reached
    assert ak.attention_long_from(4224, 16, 132, short, short) is None  # the same variant: no second phase
    # ATTN_LONG_F16 (dot32a until NOTES.md 9i) has as many splits as short: its phase starts where ATTN_LONG's would
    assert ak.attention_long_from(4224, 16, 132, short, ak.ATTN_LONG_F16) == 1601
    assert ak.attention_long_from(1 << 20, 4, 132, short, ak.ATTN_LONG) == 99 * 64 + 1
    assert make_ops("triton").attention_phases(1 << 16, 2, torch.device("cpu")) == (1, 385)  # NOTES 8n, 8r, 8t
    assert TritonOps(attn_min_split=128).attention_phases(1 << 16, 2, torch.device("cpu")) == (1, 769)
    # a long variant of fewer splits starts where the default long variant would
    fewer = TritonOps(attn_long=(64, 4, 2, False, True, False))
    assert fewer.attention_phases(1 << 16, 2, torch.device("cpu")) == (1, 385)
    # a feature's long variant reaches the launch (`dot64`: the tensor-core tile) in the long phase only
    feat = make_ops("triton+dot64")
    k16, o = torch.empty(1024, 1, 64, dtype=torch.float16), torch.empty(2, 64)
    assert feat._attn_launch(k16, o, 0)["dot"] is False
    feat.attn_phase = 1
    launch = feat._attn_launch(k16, o, 0)
    assert (launch["dot"], launch["ahead"], launch["block_n"]) == (True, False, 64)
    # the default long phase: ATTN_LONG_F16 on f16 caches, ATTN_LONG on the others and with `plain64`
    for ops_name, cache, want in (("triton", torch.float16, ak.ATTN_LONG_F16), ("triton", torch.float32, ak.ATTN_LONG),
                                  ("triton", torch.bfloat16, ak.ATTN_LONG),
                                  ("triton+plain64", torch.float16, ak.ATTN_LONG)):
        t = make_ops(ops_name)
        t.attn_phase = 1
        assert t._attn_variant(torch.empty(1024, 1, 64, dtype=cache), o, 0) == want, (ops_name, cache)
        launch = t._attn_launch(torch.empty(1024, 1, 64, dtype=cache), o, 0)
        assert (launch["block_n"], launch["ahead"], launch["dot"]) == (want.block_n, want.ahead, want.dot)
        assert launch["scratch"][0].shape[1] == ak.attention_splits(1024, 2, sm_count(o.device), want.block_n,
                                                                     want.programs_per_sm)
        t.attn_phase = 0
        assert t._attn_variant(torch.empty(1024, 1, 64, dtype=cache), o, 0) == short
    t = TritonOps(attn_long=None)
    assert t.attention_phases(1 << 16, 2, torch.device("cpu")) == (1,)
    t = TritonOps()  # the CPU counts as 4 SMs: 2 heads take 6 splits, 8 with the long variant
    assert t.attention_phases(1024, 2, torch.device("cpu")) == (1, 385)
    assert t.attention_phases(384, 2, torch.device("cpu")) == (1,)
    k, o = torch.empty(1024, 1, 64), torch.empty(2, 64)
    assert t._attn_variant(k, o, 0) == short
    t.attn_phase = 1
    assert [t._attn_variant(k, o, w) for w in (0, 384, 385)] == [ak.ATTN_LONG, short, ak.ATTN_LONG]
    t.attn_long_from = 5
    assert t.attention_phases(1024, 2, torch.device("cpu")) == (1, 5)
    t.attn_long_from = 1  # no short phase left: one phase
    assert t.attention_phases(1024, 2, torch.device("cpu")) == (1,)


class PhasedTorchOps(TorchOps):
    """The torch twins with a second attention phase from KV length 4, recording the phase of each attention."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @staticmethod
    def attention_phases(n_ctx: int, n_head: int, device: torch.device) -> tuple[int, ...]:
        return (1, 4)

    def rope_attention(self, *args, **kw) -> None:
        self.seen.append(self.attn_phase)
        super().rope_attention(*args, **kw)


def test_steps_in_attention_phases(model_file) -> None:
    """The fast step tells the ops each step's attention phase from its position, in `decode` and in `stream`."""
    path, tokens = model_file
    eng = Engine(path, fast=True, ops="torch", graph=False, device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    n_layer = eng.cfg.n_layer
    for run in ("decode", "stream"):
        ops = eng.fast.ops = PhasedTorchOps()
        if run == "decode":
            for pos, tok in enumerate(tokens[:6]):
                eng.fast.decode(tok, pos)
        else:
            list(eng.fast.stream(tokens[0], 0, 6))
        assert ops.seen == [p for p in (0, 0, 0, 1, 1, 1) for _ in range(n_layer)], run


def test_ops_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """The '+' mechanism with an empty FEATURES table (its messages say so) and with a stand-in feature of the
    integer kernels (parsed, deduplicated, refused on a base without them)."""
    from moerun.errors import MoerunError
    from moerun.kernels import ops

    monkeypatch.setattr(ops, "FEATURES", {})
    monkeypatch.setattr(ops, "INT_FEATURES", ())
    with pytest.raises(MoerunError, match=r"; features: none at present$"):
        ops.parse_ops("triton+pair")
    with pytest.raises(MoerunError, match=r"\(or 'torch'\); features after '\+': none at present$"):
        ops.parse_ops("tritonx")
    monkeypatch.setattr(ops, "FEATURES", {"x": "a stand-in", "y": "another"})
    monkeypatch.setattr(ops, "INT_FEATURES", ("x",))
    assert ops.parse_ops("triton+x+y+x") == ("triton", ("x", "y"))
    assert ops.parse_ops("triton-words+y") == ("triton-words", ("y",))
    with pytest.raises(MoerunError, match=r"feature 'z' in 'triton\+z'; features: x: a stand-in; y: another$"):
        ops.parse_ops("triton+z")
    with pytest.raises(MoerunError, match="needs the integer-dot kernels"):
        ops.parse_ops("triton-words+x")


def test_tile_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """"KIND@BMxNBxWARPS" features: parsed (bad ones named), and each tile reaches the byte kernel of its kind for
    float weights only (the others keep `tile_for`'s)."""
    from moerun.errors import MoerunError
    from moerun.kernels import ops
    from moerun.kernels.triton import qmatvec as qk

    assert ops.parse_ops("triton-bytes+gate_up@1x2048x2+out@4x256x1+gate_up@1x2048x2") == (
        "triton-bytes", ("gate_up@1x2048x2", "out@4x256x1"))
    for bad in ("gate@1x2x4", "down@1x2", "down@1x3x4", "mv@0x2x4", "out@1x2x32", "mv@axbxc"):
        with pytest.raises(MoerunError, match=f"bad tile feature '{bad}'"):
            ops.parse_ops(f"triton+{bad}")
    t = ops.make_ops("triton+gate_up@1x2048x2+down@4x512x8+out@4x256x1+mv@1x1024x2+down@2x256x4")
    assert t.float_tiles == {"gate_up": qk.Tile(1, 2048, 2), "down": qk.Tile(2, 256, 4), "out": qk.Tile(4, 256, 1),
                             "mv": qk.Tile(1, 1024, 2)}
    seen: list[tuple[str, qk.Tile | None]] = []
    for fn in ("qmatvec", "moe_gate_up", "moe_down"):
        monkeypatch.setattr(qk, fn, lambda *a, tile=None, _fn=fn, **k: seen.append((_fn, tile)))
    f16, q8 = 1, 8
    w = torch.zeros(qk.LARGE_MV_ROWS, 4)
    t.qmatvec(w, f16, torch.zeros(2), None)
    t.qmatvec(w[:8], f16, torch.zeros(2), None)
    t.qmatvec(w[:8], q8, torch.zeros(2), None)
    ids = torch.zeros(2, dtype=torch.int32)
    t.moe_gate_up(w, w, f16, f16, torch.zeros(2), ids, None)
    t.moe_down(w, f16, w, ids, None, None, None)
    t.moe_down(w, q8, w, ids, None, None, None)
    assert seen == [("qmatvec", qk.Tile(4, 256, 1)), ("qmatvec", qk.Tile(1, 1024, 2)), ("qmatvec", None),
                    ("moe_gate_up", qk.Tile(1, 2048, 2)), ("moe_down", qk.Tile(2, 256, 4)), ("moe_down", None)]


def test_qkv_fused_without_a_second_copy(model_file) -> None:
    """q/k/v of one type are multiplied as one matrix whose rows the layer's QTensors view (no extra memory)."""
    path, _ = model_file
    eng = Engine(path, device=TEST_DEVICE, dtype="float32", fast=True, ops="torch", graph=False)
    for i, L in enumerate(eng.weights.layers):
        runs = eng.fast.layers[i]["qkv_runs"]
        assert runs[0][1] == 0 and runs[-1][2] == eng.fast.qkv.numel()
        for m, a, b in runs:
            assert m.raw.shape[0] == b - a
        q, k, v = L["attn_q"], L["attn_k"], L["attn_v"]
        if q.qtype.ggml == k.qtype.ggml == v.qtype.ggml:  # one run: every raw is a view of it
            assert len(runs) == 1
            base = runs[0][0].raw.untyped_storage().data_ptr()
            assert all(t.raw.untyped_storage().data_ptr() == base for t in (q, k, v))


@pytest.mark.skipif(TEST_DEVICE != "cpu" or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors under Triton's interpreter only (on CUDA the tests above run the Triton step)")
@pytest.mark.parametrize(("ops", "ftype", "kv"),
                         [("triton", "q4_k_m", "float32"), ("triton", "f16", "float32"), ("triton", "f16", "float16"),
                          *((f, "f16", "float16") for f in ALL_FEATURES)])
def test_triton_step_in_the_interpreter(ops: str, ftype: str, kv: str, tmp_path: Path) -> None:
    """The Triton ops' step on the CPU under Triton's interpreter (about a minute a step): two steps of synth's tiny
    OLMoE Q4_K_M mix against the reference, so CI runs the fused kernels' wiring (RMSNorm in the router launch,
    top-k in the gate/up launch, QK-norm + RoPE + KV store in the attention launch, the integer-dot kernels with x
    quantized by its producers, the attention's reduce in its split launch, a layer's Q4_K q/k and Q6_K v in one
    launch) end to end, the second step in the long attention phase; the F16 file's byte-decoding kernels (top-k in
    their gate/up launch too) in ~15 s, three steps, also with an f16 KV cache (the CUDA default: the long phase's
    tensor-core tile, `attention.ATTN_LONG_F16`), and on it the features not yet measured, all at once."""
    from moerun.synth import synthesize

    path = tmp_path / f"tiny-olmoe-{ftype}.gguf"
    synthesize("tiny-olmoe-1b-7b", ftype, path, progress=False)
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype=kv)
    tokens = [5, 17] if ftype == "q4_k_m" else [5, 17, 3]
    ref = Engine(path, fast=False, **kw).forward(tokens)
    eng = Engine(path, fast=True, ops=ops, graph=False, **kw)
    eng.fast.ops.attn_long_from = 2  # from step 1 in the long phase (NOTES.md 8n)
    for i, tok in enumerate(tokens):
        eng.decode(tok)
        err = rel_err(eng.fast.logits, ref[i])
        assert err < 1e-4, f"{ops} step {i}: relative logit error {err:.2e}"


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="CUDA only (the interpreter takes minutes a step)")
@pytest.mark.parametrize("ops", ["triton"] + [f"triton+{f}" for f in FEATURES] + ALL_FEATURES)
@pytest.mark.parametrize("ftype", ["q4_k_m", "q8_0", "f16"])
def test_features_in_the_step(ops: str, ftype: str, tmp_path: Path) -> None:
    """The default ops, each ops feature not yet measured and all together, in graph-replayed steps of synth's tiny
    OLMoE (whose products all take the integer kernels for Q4_K_M and Q8_0, the byte kernels for F16: every down
    kernel with its experts ahead) against the reference; steps 0-4 replay the short attention phase's graph, steps
    5-7 the long-context phase's."""
    from moerun.synth import synthesize

    path = tmp_path / f"tiny-olmoe-{ftype}.gguf"
    synthesize("tiny-olmoe-1b-7b", ftype, path, progress=False)
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    tokens = [5, 17, 3, 250, 9, 41, 77, 1]
    ref = Engine(path, fast=False, **kw).forward(tokens)
    eng = Engine(path, fast=True, ops=ops, graph=True, **kw)
    eng.fast.ops.attn_long_from = 6  # NOTES.md 8n
    for i, tok in enumerate(tokens):
        eng.decode(tok)
        err = rel_err(eng.fast.logits, ref[i])
        assert err < 1e-4, f"{ops} {ftype} step {i}: relative logit error {err:.2e}"
    assert len(eng.fast.graphs) == 2


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="the Triton ops run on CUDA here (the interpreter takes ~10 min)")
@pytest.mark.parametrize("ops", ["triton", "triton-unpadded"])
def test_q6k_repacked_in_the_step(ops: str, tmp_path: Path) -> None:
    """A Q4_K_M mix (synth's tiny OLMoE: Q6_K output, attn_v and down in layer 1) through the fast step, the
    Q6_K products on the word kernels over a repacked copy, one byte per value (triton), or the file's rows
    (triton-unpadded): reference logits."""
    from moerun.synth import synthesize

    path = tmp_path / "tiny-olmoe-q4_k_m.gguf"
    synthesize("tiny-olmoe-1b-7b", "q4_k_m", path, progress=False)
    kw = dict(device=TEST_DEVICE, dtype="float32", kv_dtype="float32")
    tokens = [5, 17, 99, 3, 250, 8, 41, 7]
    ref = Engine(path, fast=False, **kw).forward(tokens)
    eng = Engine(path, fast=True, ops=ops, graph=False, **kw)
    size = 288 if ops == "triton" else 210
    assert eng.fast.out_mat.qtype == 14 and eng.fast.out_mat.raw.shape[-1] % size == 0
    downs = [L["ffn_down_exps"] for L in eng.fast.layers if L["ffn_down_exps"].qtype == 14]
    assert downs and all(m.raw.shape[-1] % size == 0 for m in downs)
    for i, tok in enumerate(tokens):
        eng.decode(tok)
        err = rel_err(eng.fast.logits, ref[i])
        assert err < 1e-4, f"step {i}: relative logit error {err:.2e}"


def test_repack_falls_back_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without room for a repacked copy (faked: a CUDA tensor with 0 bytes free) repack warns once and keeps the
    file's rows; with room it copies."""
    from moerun.kernels.ops import make_ops

    ops = make_ops("triton")
    w = torch.zeros(2048, 8 * 210, dtype=torch.uint8)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 1 << 34))
    w3 = w[None]
    with pytest.warns(UserWarning, match="not enough free GPU memory for a repacked copy"):
        assert ops.repack(14, "down", w3) is w3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        assert ops.repack(14, "mv", w) is w
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 34, 1 << 34))
    assert ops.repack(14, "mv", w).shape == (2048, 8 * 288)


@pytest.mark.parametrize("ftype,ops", [("q4_k_m", "triton"), ("q6_k", "triton"), ("q4_k_m", "triton-words")])
def test_q6k_layout_follows_the_input(ftype: str, ops: str, tmp_path: Path) -> None:
    """A Q6_K matrix is copied into the integer kernels' signed bytes only where the step gives its product a
    quantized x: always for the matvecs (output, attn_v: RMSNorm writes it), for down only behind an integer gate/up
    (Q4_K_M's Q4_K gate/up, a Q6_K file's Q6_K gate/up: yes; with `triton-words` never:
    the word kernels' unsigned copy, which they read). Load-time only: no kernel runs."""
    from moerun.kernels.triton import wmatvec as wk
    from moerun.synth import synthesize

    path = tmp_path / f"tiny-olmoe-{ftype}.gguf"
    synthesize("tiny-olmoe-1b-7b", ftype, path, progress=False)
    eng = Engine(path, device="cpu", dtype="float32", kv_dtype="float32", fast=True, ops=ops, graph=False)
    int_down = ops == "triton"
    downs = [(L["ffn_down_exps"], W["ffn_down_exps"]) for L, W in zip(eng.fast.layers, eng.weights.layers,
                                                                      strict=True)]
    downs = [(m, w) for m, w in downs if m.qtype == 14]
    assert downs
    for m, w in downs:
        assert torch.equal(m.raw, wk.bytes_q6k(w.raw, signed=int_down))
    out = eng.weights.globals.get("output", eng.weights.globals["token_embd"])
    if int(out.qtype.ggml) == 14:
        assert torch.equal(eng.fast.out_mat.raw, wk.bytes_q6k(out.raw.reshape(eng.fast.out_mat.raw.shape[0], -1),
                                                              signed=ops != "triton-words"))
