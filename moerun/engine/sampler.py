"""Token sampling on the device: no host sync, static shapes, replayable inside a CUDA graph.

    sampler = Sampler(n_vocab, device)
    sampler.set(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=42))
    sampler.start(prompt_ids)              # the repetition-penalty window starts with the prompt
    sampler.sample(logits, out_id)         # logits [V] f32 -> out_id [1] int64, all on the device

The chain is llama.cpp's default order: penalties (repeat / frequency / presence over the last
`repeat_last_n` tokens) -> top-k -> top-p -> min-p -> temperature -> draw. Top-p and min-p see the
probabilities before temperature, as in llama.cpp; temperature <= 0 or top-k = 1 is greedy (the first
maximum of the penalised logits, exactly `argmax`).

Everything a request can change lives in small device tensors (`_f`, `_i`), so changing the temperature
or the seed is a host-to-device copy, not a new CUDA graph. Only the *structure* (how many candidates
top-k keeps, whether penalties run, the history ring's size) is fixed per graph: `graph_key()` says
when the caller must capture again.

Randomness has no host RNG state: the draw is Gumbel-max, argmax(logit / T + g), with
g = -log(-log(u)) and u a counter-based hash (murmur3's finaliser) of (seed, step counter, candidate
rank). The step counter is a device tensor that each `sample` increments, so a fixed seed reproduces
the same tokens eagerly, in a graph, on the CPU or the GPU (given the same logits).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, fields

import torch

from moerun.errors import MoerunError

__all__ = ["SamplingParams", "Sampler"]

_M32 = 0xFFFFFFFF
_MIN_CAND = 64          # top-k keeps at least this many candidates (rounded up to a power of two)
_MIN_RING = 64          # smallest repetition-history ring


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token (llama.cpp's defaults and flag meanings).

    temperature <= 0: greedy. top_k <= 0: all tokens. top_p >= 1: off. min_p <= 0: off.
    repeat_penalty 1.0 / frequency_penalty 0 / presence_penalty 0: off; they look at the last
    `repeat_last_n` tokens (0: off, -1: the whole context). seed None: a fresh random seed.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.temperature), "temperature must be a finite number"),
            (math.isfinite(self.top_p) and self.top_p >= 0, "top_p must be >= 0"),
            (math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (math.isfinite(self.repeat_penalty) and self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty must be a finite number"),
            (math.isfinite(self.presence_penalty), "presence_penalty must be a finite number"),
            (self.seed is None or self.seed >= 0, "seed must be >= 0 (or None for a random seed)"),
        ]
        for ok, message in checks:
            if not ok:
                raise MoerunError(f"invalid sampling parameter: {message}")

    @classmethod
    def greedy(cls) -> SamplingParams:
        """Always the most likely token."""
        return cls(temperature=0.0)

    @property
    def penalties(self) -> bool:
        """True when any repetition penalty changes the logits."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def is_greedy(self) -> bool:
        """True when the choice is plain argmax of the raw logits (no sampler needed)."""
        return (self.temperature <= 0 or self.top_k == 1) and not self.penalties

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _pow2_at_least(n: int, floor: int) -> int:
    """The smallest power of two >= n, and at least `floor`."""
    return max(floor, 1 << max(n - 1, 0).bit_length())


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow (16-bit halves)."""
    hi = ((x >> 16) * c) & 0xFFFF
    return ((hi << 16) + (x & 0xFFFF) * c) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser (a bijection with full avalanche) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise, a pure function of (seed, counter, lane).

    seed: [2] int64 (low, high 32 bits); counter: [N, 1] or [1] int64; lanes: [C] int64 (premixed
    lane constants, see `Sampler`). Returns [N, C] (or [C]) float32. u = (h >> 9 + 0.5) / 2^23 lies in
    [2^-24, 1 - 2^-24], exactly representable, so -log(-log(u)) is always finite.
    """
    key = _fmix32(_fmix32(seed[0] ^ 0x9E3779B9) ^ seed[1])          # [1]
    step = _fmix32((key + _mul32(counter & _M32, 0x27D4EB2F)) & _M32)  # [N, 1]
    h = _fmix32(step ^ lanes)                                          # [N, C]
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


class Sampler:
    """Chooses the next token from logits [V] on the device; see the module docstring.

    Buffers (all on `device`): `_f` [6] f32 = (1/T, top_p, log(min_p), repeat, frequency, presence);
    `_i` [3] int64 = (top_k, repeat_last_n, greedy flag); `seed` [2]; `counter` [1]; `ring` [R] int64
    (recent tokens, -1 = empty) with `n_pushed` [1] (tokens written so far) and `_prev` [1] (the ring
    entry the last push overwrote, for `unpush`).
    """

    def __init__(self, n_vocab: int, device: str | torch.device, *, n_ctx: int | None = None) -> None:
        self.n_vocab = n_vocab
        self.device = torch.device(device)
        self.n_ctx = n_ctx
        i64 = dict(device=self.device, dtype=torch.long)
        self._f = torch.zeros(6, device=self.device, dtype=torch.float32)
        self._i = torch.zeros(3, **i64)
        self.seed = torch.zeros(2, **i64)
        self.counter = torch.zeros(1, **i64)
        self.n_pushed = torch.zeros(1, **i64)
        self.params: SamplingParams | None = None
        self.seed_value = 0
        self.n_cand = 0
        self.penalties = False
        self._alloc_ring(_MIN_RING)
        self._lanes: torch.Tensor | None = None
        self.set(SamplingParams())

    # -- parameters (host side, outside any graph) -------------------------------------------------

    def _alloc_ring(self, size: int) -> None:
        self.ring = torch.full((size,), -1, device=self.device, dtype=torch.long)   # [R]
        self.slots = torch.arange(size, device=self.device, dtype=torch.long)       # [R]
        self.counts = torch.zeros(self.n_vocab, device=self.device, dtype=torch.float32)  # [V] scratch
        self._prev = torch.full((1,), -1, device=self.device, dtype=torch.long)  # what the last push overwrote

    def _window(self, p: SamplingParams) -> int:
        if p.repeat_last_n == -1:
            return self.n_ctx or 4096
        return p.repeat_last_n

    def set(self, params: SamplingParams) -> None:
        """Use `params` from now on; restarts the step counter and empties the history ring."""
        V = self.n_vocab
        window = self._window(params)
        self.params = params
        self.penalties = params.penalties
        if params.top_k <= 0 or params.top_k >= V:
            self.n_cand = V
        else:
            self.n_cand = min(V, _pow2_at_least(params.top_k, _MIN_CAND))
        ring = _pow2_at_least(window, _MIN_RING)
        if ring != self.ring.shape[0]:
            self._alloc_ring(ring)
        if self._lanes is None or self._lanes.shape[0] != self.n_cand:
            lanes = torch.arange(self.n_cand, dtype=torch.long)
            self._lanes = _fmix32(_mul32(lanes, 0x9E3779B1) ^ 0x7F4A7C15).to(self.device)  # [C]
            self._rank = torch.arange(self.n_cand, device=self.device, dtype=torch.long)     # [C]
        self.seed_value = params.seed if params.seed is not None else secrets.randbits(32)
        s = self.seed_value
        inv_t = 1.0 / params.temperature if params.temperature > 0 else 1.0
        log_min_p = math.log(params.min_p) if params.min_p > 0 else -math.inf
        greedy = params.temperature <= 0 or params.top_k == 1
        top_k = params.top_k if 0 < params.top_k < self.n_cand else self.n_cand
        self._f.copy_(torch.tensor([inv_t, params.top_p, log_min_p, params.repeat_penalty,
                                    params.frequency_penalty, params.presence_penalty], dtype=torch.float32))
        self._i.copy_(torch.tensor([top_k, window, int(greedy)], dtype=torch.long))
        self.seed.copy_(torch.tensor([s & _M32, (s >> 32) & _M32], dtype=torch.long))
        self.counter.zero_()
        self.start(())

    def start(self, tokens: list[int] | tuple[int, ...] | torch.Tensor) -> None:
        """Empty the history ring, then fill it with the last tokens of `tokens` (the prompt)."""
        R = self.ring.shape[0]
        t = torch.as_tensor(tokens, dtype=torch.long).flatten()[-R:]
        self.ring.fill_(-1)
        if t.numel():
            self.ring[: t.numel()].copy_(t)
        self.n_pushed.fill_(t.numel())

    def graph_key(self) -> tuple[int, int, bool]:
        """What a captured graph depends on: (candidates, ring size, penalties on)."""
        return (self.n_cand, self.ring.shape[0], self.penalties)

    def save_state(self) -> tuple[torch.Tensor, ...]:
        """Copies of the mutable state (counter, ring, n_pushed): warm-up steps before a capture restore it."""
        return self.counter.clone(), self.ring.clone(), self.n_pushed.clone()

    def load_state(self, state: tuple[torch.Tensor, ...]) -> None:
        self.counter.copy_(state[0])
        self.ring.copy_(state[1])
        self.n_pushed.copy_(state[2])

    # -- the device ops (no host sync; same op sequence every call) --------------------------------

    def _penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> penalised copy [V] (llama.cpp's penalties sampler: each distinct recent token
        once for repeat/presence, times its count for frequency)."""
        R = self.ring.shape[0]
        age = torch.remainder(self.n_pushed - 1 - self.slots, R)                     # [R]
        valid = (age < self._i[1]) & (self.ring >= 0)                                # [R]
        self.counts.zero_().index_add_(0, self.ring.clamp(min=0), valid.to(torch.float32))
        seen = self.counts > 0                                                       # [V]
        rep = self._f[3]
        pen = torch.where(logits > 0, logits / rep, logits * rep)
        out = torch.where(seen, pen, logits)
        return out - self.counts * self._f[4] - seen.to(torch.float32) * self._f[5]

    def _candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """logits [V] -> (values [C] descending, token ids [C], keep mask [C]) after top-k/top-p/min-p."""
        if self.n_cand == self.n_vocab:
            vals, ids = torch.sort(logits, descending=True, stable=True)
        else:
            vals, ids = torch.topk(logits, self.n_cand, sorted=True)
        keep = self._rank < self._i[0]                                               # top-k
        probs = torch.softmax(torch.where(keep, vals, -torch.inf), dim=0)            # [C]
        before = torch.cumsum(probs, dim=0) - probs
        top_p = self._f[1]
        keep = keep & ((before < top_p) | (top_p >= 1.0))                            # top-p
        keep = keep & (vals >= vals[0] + self._f[2])                                 # min-p
        keep = keep | (self._rank == 0)                                              # min_keep = 1
        return vals, ids, keep

    def _draw(self, logits: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        """Penalised, filtered logits [V] and counters [N, 1] -> chosen ids [N] int64."""
        greedy_id = logits.argmax().view(1)                                          # first maximum
        vals, ids, keep = self._candidates(logits)
        noise = gumbel_noise(self.seed, counter, self._lanes)                        # [N, C]
        score = torch.where(keep, vals * self._f[0] + noise, -torch.inf)
        sampled = ids[score.argmax(dim=-1)]                                          # [N]
        return torch.where(self._i[2] != 0, greedy_id, sampled)

    def sample(self, logits: torch.Tensor, out_id: torch.Tensor) -> torch.Tensor:
        """logits [V] f32 -> out_id [1] int64 (written in place); advances the step counter and pushes
        the chosen token into the history ring. Device ops only: capturable in a CUDA graph."""
        if self.penalties:
            logits = self._penalise(logits)
        out_id.copy_(self._draw(logits, self.counter.view(1, 1)))
        slot = torch.remainder(self.n_pushed, self.ring.shape[0])                   # [1]
        self._prev.copy_(self.ring.index_select(0, slot))
        self.ring.index_copy_(0, slot, out_id)
        self.n_pushed.add_(1)
        self.counter.add_(1)
        return out_id

    def unpush(self) -> None:
        """Undo the last `sample`'s state changes (counter, history ring): the step it ran in was queued
        ahead and then discarded (`FastDecoder.stream`). Device ops, after that step on the stream."""
        self.n_pushed.sub_(1)
        self.counter.sub_(1)
        self.ring.index_copy_(0, torch.remainder(self.n_pushed, self.ring.shape[0]), self._prev)

    def sample_many(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """`n` independent draws [n] int64 from the same logits [V] (the counters `sample` would use next,
        without touching the history ring): for checking distributions in one batched call."""
        if self.penalties:
            logits = self._penalise(logits)
        counters = self.counter + torch.arange(n, device=self.device, dtype=torch.long).view(n, 1)
        out = self._draw(logits, counters)
        self.counter.add_(n)
        return out
