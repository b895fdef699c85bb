"""The device sampler (engine/sampler.py): reproducibility, greedy equivalences, distributions against
targets computed independently in numpy, repetition penalties, no host sync, CUDA-graph replay."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.device import TEST_DEVICE

from moerun.engine.sampler import Sampler, SamplingParams
from moerun.errors import MoerunError

DEV = TEST_DEVICE
N_DRAWS = 20_000
# A fixed logit vector with distinct values (no ties), V = 12.
LOGITS = np.array([2.0, 1.1, 3.2, -0.5, 0.3, 2.9, -2.0, 1.7, 0.0, 2.4, -1.2, 0.9], dtype=np.float32)


def _logits(x: np.ndarray = LOGITS) -> torch.Tensor:
    return torch.tensor(x, device=DEV)


def _sampler(params: SamplingParams, n_vocab: int = len(LOGITS)) -> Sampler:
    s = Sampler(n_vocab, DEV)
    s.set(params)
    return s


def _seq(s: Sampler, logits: torch.Tensor, n: int) -> list[int]:
    out = torch.zeros(1, dtype=torch.long, device=DEV)
    return [int(s.sample(logits, out)) for _ in range(n)]


# -- targets in numpy, following llama.cpp's chain (penalties -> top-k -> top-p -> min-p -> temperature) --

def target(logits: np.ndarray, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> np.ndarray:
    l = logits.astype(np.float64)
    order = np.argsort(-l, kind="stable")
    keep = np.zeros(len(l), dtype=bool)
    k = len(l) if top_k <= 0 else min(top_k, len(l))
    cand = order[:k]
    p = np.exp(l[cand] - l[cand].max())
    p /= p.sum()
    if top_p < 1.0:
        cum = np.cumsum(p)
        last = int(np.searchsorted(cum, top_p))  # first index where cum >= top_p
        cand, p = cand[: last + 1], p[: last + 1]
    if min_p > 0:
        ok = p >= min_p * p.max()
        cand = cand[ok]
    keep[cand] = True
    q = np.where(keep, np.exp((l - l.max()) / temperature), 0.0)
    return q / q.sum()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is the 1e-4 upper tail."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def check_distribution(draws: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(draws, minlength=len(p))
    assert counts[p == 0].sum() == 0, f"drew excluded tokens: {np.nonzero(counts * (p == 0))[0].tolist()}"
    support = p > 0
    expected = p[support] * len(draws)
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    assert chi2 < chi2_critical(df), f"chi2 {chi2:.1f} (df {df}); counts {counts.tolist()}, expected {expected}"


CASES = {
    "temperature-1": dict(temperature=1.0),
    "temperature-0.6": dict(temperature=0.6),
    "temperature-2": dict(temperature=2.0),
    "top-k-5": dict(temperature=1.0, top_k=5),
    "top-p-0.8": dict(temperature=1.0, top_p=0.8),
    "top-p-0.5-temp-1.7": dict(temperature=1.7, top_p=0.5),
    "min-p-0.2": dict(temperature=1.0, min_p=0.2),
    "chain": dict(temperature=0.8, top_k=8, top_p=0.95, min_p=0.05),
}


@pytest.mark.parametrize("case", CASES)
def test_distribution_matches_target(case: str) -> None:
    kw = CASES[case]
    full = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kw
    s = _sampler(SamplingParams(**full, seed=1234))
    draws = s.sample_many(_logits(), N_DRAWS).cpu().numpy()
    check_distribution(draws, target(LOGITS, **full))


def test_distribution_large_vocab_topk_path() -> None:
    """V larger than the candidate buffer: the top-k (torch.topk) path, not the full sort."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, 5000).astype(np.float32)
    params = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)
    s = _sampler(SamplingParams(**params, seed=7), n_vocab=len(logits))
    assert s.n_cand < len(logits)
    draws = s.sample_many(_logits(logits), N_DRAWS).cpu().numpy()
    check_distribution(draws, target(logits, **params))


def test_sample_many_equals_sequential_samples() -> None:
    p = SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, seed=99)
    batch = _sampler(p).sample_many(_logits(), 200).cpu().tolist()
    assert _seq(_sampler(p), _logits(), 200) == batch


def test_fixed_seed_reproduces_and_seeds_differ() -> None:
    rng = np.random.default_rng(1)
    logits = _logits(rng.normal(0, 1.5, 1000).astype(np.float32))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = _seq(_sampler(p, 1000), logits, 64)
    b = _seq(_sampler(p, 1000), logits, 64)
    c = _seq(_sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43), 1000), logits, 64)
    assert a == b
    assert a != c
    s = _sampler(p, 1000)
    first = _seq(s, logits, 16)
    s.set(p)  # set() restarts the counter
    assert _seq(s, logits, 16) == first


@pytest.mark.parametrize("params", [dict(top_k=1, temperature=0.8), dict(temperature=0.0), dict(temperature=-1.0),
                                    dict(top_k=1, temperature=5.0, top_p=0.1, min_p=0.5)])
def test_greedy_settings_equal_argmax(params: dict) -> None:
    rng = np.random.default_rng(2)
    s = _sampler(SamplingParams(**params, seed=3), 300)
    out = torch.zeros(1, dtype=torch.long, device=DEV)
    for _ in range(50):
        x = rng.normal(0, 3, 300).astype(np.float32)
        x[rng.integers(300)] = x.max()  # a tie for the maximum: argmax takes the first
        logits = _logits(x)
        assert int(s.sample(logits, out)) == int(logits.argmax())
    assert SamplingParams(**params).is_greedy


def test_repeat_penalty_values() -> None:
    """Each distinct recent token once: positive logits divided, negative multiplied; frequency/presence
    subtract count * f + p; tokens outside the last-n window are untouched."""
    V = 12
    p = SamplingParams(repeat_penalty=1.5, repeat_last_n=4, frequency_penalty=0.25, presence_penalty=0.5, seed=0)
    s = _sampler(p, V)
    history = [0, 3, 2, 2, 3, 9]  # window of 4: [2, 2, 3, 9]; token 0 has left it
    s.start(history)
    got = s._penalise(_logits()).cpu().numpy()
    want = LOGITS.astype(np.float64).copy()
    for tok, count in {2: 2, 3: 1, 9: 1}.items():
        v = want[tok]
        want[tok] = (v / 1.5 if v > 0 else v * 1.5) - count * 0.25 - 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_repeat_penalty_changes_choice_and_ring_follows_samples() -> None:
    """Greedy with a strong penalty: the prompt's top token is avoided, and each chosen token enters the
    history on the device, so the next steps avoid it too."""
    s = _sampler(SamplingParams(temperature=0.0, repeat_penalty=100.0, repeat_last_n=64, seed=0))
    assert not SamplingParams(temperature=0.0, repeat_penalty=100.0).is_greedy
    order = np.argsort(-LOGITS, kind="stable").tolist()  # 2, 5, 9, 0, ...
    s.start([order[0]])
    assert _seq(s, _logits(), 4) == order[1:5]
    s.set(SamplingParams(temperature=0.0, repeat_penalty=1.0, seed=0))
    s.start([order[0]])
    assert _seq(s, _logits(), 3) == [order[0]] * 3


def test_ring_wraps() -> None:
    """More tokens than the ring holds: only the last repeat_last_n count."""
    s = _sampler(SamplingParams(temperature=0.0, repeat_penalty=100.0, repeat_last_n=3, seed=0))
    top = int(np.argmax(LOGITS))
    s.start([top] + [11] * 200)  # the top token is far outside the window
    assert _seq(s, _logits(), 1) == [top]


def test_unpush_restores_state() -> None:
    """A draw taken back (`unpush`, a discarded queued step) leaves the counter and the history ring as they
    were, also where the push overwrote a token still inside the window (window = ring size, ring wrapped),
    so the next draws are those of a sampler that never made it."""
    p = SamplingParams(temperature=1.0, repeat_penalty=1.3, repeat_last_n=64, seed=3)
    s, t = _sampler(p), _sampler(p)
    assert s.ring.shape[0] == 64
    hist = [int(v) for v in np.random.default_rng(0).integers(0, len(LOGITS), 70)]
    s.start(hist)
    t.start(hist)
    _seq(s, _logits(), 5)
    _seq(t, _logits(), 5)
    before = [x.clone() for x in s.save_state()]
    _seq(s, _logits(), 1)
    s.unpush()
    for a, b in zip(s.save_state(), before, strict=True):
        assert torch.equal(a, b)
    assert _seq(s, _logits(), 20) == _seq(t, _logits(), 20)


def test_bad_params_raise() -> None:
    for bad in (dict(top_p=-0.1), dict(min_p=1.5), dict(repeat_penalty=0.0), dict(temperature=float("nan")),
                dict(seed=-2), dict(repeat_last_n=-2)):
        with pytest.raises(MoerunError):
            SamplingParams(**bad)


def test_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample() never reads a device value on the host: every host-read path of a tensor raises."""
    samplers = [
        _sampler(SamplingParams(seed=5)),  # full sort (V < candidate floor)
        _sampler(SamplingParams(seed=5, repeat_penalty=1.3, frequency_penalty=0.1, presence_penalty=0.2)),
        _sampler(SamplingParams(seed=5, top_k=10), n_vocab=1000),  # torch.topk path
    ]
    inputs = [_logits(), _logits(), torch.randn(1000, device=DEV)]
    for s in samplers:
        s.start([1, 2, 3])

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync in the sampler")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "synchronize", boom)
    out = torch.zeros(1, dtype=torch.long, device=DEV)
    for s, x in zip(samplers, inputs, strict=True):
        for _ in range(3):
            s.sample(x, out)
        s.sample_many(x, 4)
    monkeypatch.undo()
    assert 0 <= int(out) < 1000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_eager() -> None:
    """The sampler captured in a CUDA graph: replays draw the same tokens as eager calls, and a new
    temperature / seed written into the device parameters takes effect without a new capture."""
    V = 50_000
    logits = torch.randn(V, device="cuda") * 2
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repeat_penalty=1.2, seed=11)
    eager = Sampler(V, "cuda")
    eager.set(p)
    eager.start([1, 2, 3])
    want = _seq_cuda(eager, logits, 32)

    s = Sampler(V, "cuda")
    s.set(p)
    s.start([1, 2, 3])
    out = torch.zeros(1, dtype=torch.long, device="cuda")
    state = s.save_state()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        s.sample(logits, out)
    torch.cuda.current_stream().wait_stream(side)
    s.load_state(state)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        s.sample(logits, out)
    got = []
    for _ in range(32):
        graph.replay()
        got.append(int(out.item()))
    assert got == want

    p2 = SamplingParams(temperature=0.5, top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.2, seed=12)
    eager.set(p2)
    eager.start([4])
    s.set(p2)
    s.start([4])
    assert s.graph_key() == eager.graph_key()
    want2 = _seq_cuda(eager, logits, 16)
    got2 = []
    for _ in range(16):
        graph.replay()
        got2.append(int(out.item()))
    assert got2 == want2


def _seq_cuda(s: Sampler, logits: torch.Tensor, n: int) -> list[int]:
    out = torch.zeros(1, dtype=torch.long, device=logits.device)
    return [int(s.sample(logits, out)) for _ in range(n)]
