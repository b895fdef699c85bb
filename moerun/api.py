"""The Python API, as small as the CLI.

    import moerun

    model = moerun.load()                                    # the built-in Gemma 3 270M (or load("x.gguf"))
    print(model.generate("Water boils at", max_tokens=24, temperature=0))
    for piece in model.generate("Once upon a time", max_tokens=48, seed=1, stream=True):
        print(piece, end="", flush=True)
    print(model.chat([{"role": "user", "content": "Name three colours."}], max_tokens=48))
    chat = model.chat_session(system="Answer in one sentence.")
    print(chat.send("What is the capital of France?"))      # later turns reuse the cached prefix

Sampling keywords are `SamplingParams`' fields (llama.cpp's defaults: temperature=0.8, top_k=40,
top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64, seed=None); temperature=0 is greedy.
Generation stops at an end-of-generation token, a `stop` string (not included in the text), after
`max_tokens` tokens (-1: no limit) or when the context is full; `model.last_stats` tells which.
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from moerun.chat_template import render, template_for
from moerun.engine.engine import Engine
from moerun.engine.sampler import SamplingParams
from moerun.errors import ContextOverflow, MoerunError
from moerun.tokenizer import Tokenizer

__all__ = ["ChatSession", "GenerationStats", "Model", "SamplingParams", "StopBuffer", "load"]

DEFAULT_MAX_TOKENS = 128


def load(path: str | os.PathLike | None = None, **engine_kw: Any) -> Model:
    """Load a GGUF file (None: the built-in default model) -> Model.

    `engine_kw` go to `Engine` (device="cuda"/"cpu", dtype="bf16", n_ctx=..., progress=...)."""
    if path is None:
        from moerun.default_model import default_model_path

        path = default_model_path()
    return Model(path, **engine_kw)


@dataclass
class GenerationStats:
    """What one generation did. Times in seconds; `stop`: 'eog', 'stop' (a stop string), 'length'
    (max_tokens) or 'context' (the context is full)."""

    n_prompt: int = 0      # prompt tokens
    n_reused: int = 0      # of them, taken from the KV cache instead of recomputed
    prompt_s: float = 0.0  # prefill of the n_prompt - n_reused others, and choosing the first token
    n_gen: int = 0         # tokens generated (an end-of-generation token not counted)
    n_decode: int = 0      # decode steps (each feeds one generated token, chooses the next)
    decode_s: float = 0.0
    stop: str = ""

    def summary(self) -> str:
        """One line like llama.cpp's timings: prompt and generation speed."""
        n_eval = self.n_prompt - self.n_reused
        pp = f"{n_eval / self.prompt_s:.1f} t/s" if self.prompt_s > 0 else "n/a"
        tg = f"{self.n_decode / self.decode_s:.1f} t/s" if self.decode_s > 0 else "n/a"
        reused = f", {self.n_reused} reused" if self.n_reused else ""
        return (f"prompt: {n_eval} tokens{reused} in {self.prompt_s * 1e3:.1f} ms ({pp}) | "
                f"generation: {self.n_gen} tokens, {self.n_decode} steps in {self.decode_s * 1e3:.1f} ms ({tg}) | "
                f"stop: {self.stop}")


class StopBuffer:
    """Holds back streamed text that could be the start of a stop string; cuts at the first one found.

    `push(text)` returns the text that is safe to show; `stopped` turns True once a stop string
    appeared (the stop string and anything after it are dropped); `flush()` returns what was held back.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[: min(hits)]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Utf8Stream:
    """Token ids -> text, never splitting a UTF-8 character. Unlike `StreamDecoder`, the first piece keeps
    its leading space: a continuation of a prompt is printed right after the prompt."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_to_piece(token_id, special=False))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _params(sampling: SamplingParams | None, kw: dict[str, Any]) -> SamplingParams:
    names = SamplingParams.field_names()
    unknown = sorted(set(kw) - set(names))
    if unknown:
        raise TypeError(f"unknown sampling argument(s) {', '.join(unknown)}; known: {', '.join(names)}")
    if sampling is not None:
        if kw:
            raise TypeError("give either sampling=SamplingParams(...) or sampling keywords, not both")
        return sampling
    return SamplingParams(**kw)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class Model:
    """A loaded model: `engine` (moerun.engine.engine.Engine), `tokenizer`, `template` (the chat template).

    One model holds one KV cache, so one generation runs at a time. `last_stats` describes the last one.
    """

    def __init__(self, path: str | os.PathLike, **engine_kw: Any) -> None:
        self.engine = Engine(path, **engine_kw)
        self.path = self.engine.file.path
        self.tokenizer = Tokenizer.from_gguf(self.engine.file)
        self.template = template_for(self.engine.file)
        self.last_stats = GenerationStats()
        self._cached: list[int] = []  # the tokens whose keys/values fill positions 0..n_past-1

    def __repr__(self) -> str:
        return f"moerun.Model({str(self.path)!r}, device={self.engine.device}, n_ctx={self.engine.n_ctx})"

    # -- text <-> tokens ---------------------------------------------------------------------------

    def encode(self, prompt: str, *, add_bos: bool = True) -> list[int]:
        """Prompt text -> ids as llama-cli tokenizes a prompt (BOS where the file asks for it; special
        tokens written in the text are parsed)."""
        return self.tokenizer.encode(prompt, add_special=add_bos, parse_special=True)

    def chat_tokens(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Messages -> the chat template's prompt -> ids (the template writes BOS itself)."""
        tok = self.tokenizer
        bos = tok.tokens[tok.bos_id] if tok.bos_id is not None else ""
        eos = tok.tokens[tok.eos_id] if tok.eos_id is not None else ""
        text = render(self.template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos,
                      eos_token=eos)
        return tok.encode(text, add_special=False, parse_special=True)

    # -- generation --------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 stop: str | Iterable[str] = (), stream: bool = False, add_bos: bool = True,
                 ignore_eos: bool = False, sampling: SamplingParams | None = None,
                 **sampling_kw: Any) -> str | Iterator[str]:
        """Continue `prompt` (text, or token ids) -> the generated text, or with `stream=True` an
        iterator of text pieces as tokens arrive. Sampling: `SamplingParams` fields as keywords."""
        ids = self.encode(prompt, add_bos=add_bos) if isinstance(prompt, str) else [int(t) for t in prompt]
        it = self.stream_tokens(ids, params=_params(sampling, sampling_kw), max_tokens=max_tokens, stop=stop,
                                reuse=False, ignore_eos=ignore_eos)
        return it if stream else "".join(it)

    def chat(self, messages: list[dict], *, max_tokens: int = -1, stop: str | Iterable[str] = (),
             stream: bool = False, sampling: SamplingParams | None = None,
             **sampling_kw: Any) -> str | Iterator[str]:
        """The assistant's reply to `messages` ([{"role": "user", "content": "..."}, ...]) through the
        model's chat template; with `stream=True` an iterator of pieces. max_tokens -1: until the model
        ends its turn."""
        ids = self.chat_tokens(messages)
        it = self.stream_tokens(ids, params=_params(sampling, sampling_kw), max_tokens=max_tokens, stop=stop,
                                reuse=False)
        return it if stream else "".join(it)

    def chat_session(self, system: str | None = None, **defaults: Any) -> ChatSession:
        """A multi-turn conversation that keeps its history and reuses the KV cache between turns."""
        return ChatSession(self, system=system, **defaults)

    def stream_tokens(self, tokens: Sequence[int], *, params: SamplingParams | None = None,
                      max_tokens: int = DEFAULT_MAX_TOKENS, stop: str | Iterable[str] = (), reuse: bool = False,
                      ignore_eos: bool = False) -> Iterator[str]:
        """The generation loop: prompt ids -> text pieces. `reuse`: keep the cached positions that match
        the start of `tokens` (the longest common prefix) and compute only the rest."""
        tokens = list(tokens)
        eng = self.engine
        if not tokens:
            raise MoerunError("the prompt is empty (no tokens)")
        if len(tokens) >= eng.n_ctx:
            raise ContextOverflow(f"the prompt has {len(tokens)} tokens but the context size is {eng.n_ctx}; "
                                  "raise it (-c / n_ctx) or shorten the prompt")
        stops = [stop] if isinstance(stop, str) else list(stop)
        common = 0
        if reuse and eng.n_past == len(self._cached):
            common = min(_common_prefix(self._cached, tokens), len(tokens) - 1)
        params = params if params is not None else SamplingParams()
        return self._loop(tokens, common, params, max_tokens, stops, ignore_eos)

    def _loop(self, tokens: list[int], common: int, params: SamplingParams, max_tokens: int, stops: list[str],
              ignore_eos: bool) -> Iterator[str]:
        eng, tok = self.engine, self.tokenizer
        stats = self.last_stats = GenerationStats(n_prompt=len(tokens), n_reused=common)
        eng.set_sampling(params)
        if eng.sampler is not None:
            eng.sampler.start(tokens)
        self._cached = []
        t0 = time.perf_counter()
        next_id = eng.prefill(tokens[common:], pos=common)
        stats.prompt_s = time.perf_counter() - t0
        self._cached = fed = list(tokens)
        text, cut = _Utf8Stream(tok), StopBuffer(stops)
        steps: Iterator[int] | None = None  # eng.decode_stream from the first generated token
        try:
            while True:
                if max_tokens >= 0 and stats.n_gen >= max_tokens:
                    stats.stop = "length"
                    break
                if not ignore_eos and next_id in tok.eog_ids:
                    stats.stop = "eog"
                    break
                stats.n_gen += 1
                piece = cut.push(text.feed(next_id))
                if piece:
                    yield piece
                if cut.stopped:
                    stats.stop = "stop"
                    break
                if eng.n_past >= eng.n_ctx:
                    stats.stop = "context"
                    break
                if max_tokens >= 0 and stats.n_gen >= max_tokens:
                    stats.stop = "length"
                    break
                t0 = time.perf_counter()
                if steps is None:  # as many steps as max_tokens and the context allow
                    room = eng.n_ctx - eng.n_past
                    steps = eng.decode_stream(next_id, min(max_tokens - stats.n_gen, room) if max_tokens >= 0
                                              else room)
                fed_id, next_id = next_id, next(steps)
                stats.decode_s += time.perf_counter() - t0
                stats.n_decode += 1
                fed.append(fed_id)
        finally:
            if steps is not None:
                steps.close()  # a step queued ahead and not used is discarded
        if not cut.stopped:
            rest = cut.push(text.flush()) + cut.flush()
            if rest:
                yield rest

    def close(self) -> None:
        self.engine.close()


class ChatSession:
    """A conversation: `send(text)` adds a user turn, answers it and keeps both in `messages`.

    Each turn renders the whole history through the chat template and reuses the KV cache up to the
    longest common token prefix with what is cached; `model.last_stats.n_reused` says how much.
    `defaults`: generation keywords for every turn (max_tokens, stop, temperature, seed, ...).
    """

    def __init__(self, model: Model, system: str | None = None, **defaults: Any) -> None:
        self.model = model
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.defaults = defaults

    def send(self, text: str, *, stream: bool = False, **kw: Any) -> str | Iterator[str]:
        """Answer the user message `text` -> the reply (or an iterator of pieces with `stream=True`)."""
        opts = {**self.defaults, **kw}
        max_tokens = opts.pop("max_tokens", -1)
        stop = opts.pop("stop", ())
        sampling = opts.pop("sampling", None)
        params = _params(sampling, opts)
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.model.chat_tokens(self.messages)
            it = self.model.stream_tokens(ids, params=params, max_tokens=max_tokens, stop=stop, reuse=True)
        except BaseException:
            self.messages.pop()
            raise
        pieces = self._record(it)
        return pieces if stream else "".join(pieces)

    def _record(self, it: Iterator[str]) -> Iterator[str]:
        """Pass the reply's pieces through (leading whitespace dropped) and add it to the history."""
        parts: list[str] = []
        try:
            for piece in it:
                if not parts or not "".join(parts):
                    piece = piece.lstrip()
                parts.append(piece)
                if piece:
                    yield piece
        finally:
            self.messages.append({"role": "assistant", "content": "".join(parts)})

    @property
    def n_reused(self) -> int:
        """Prompt tokens the last turn took from the KV cache."""
        return self.model.last_stats.n_reused
