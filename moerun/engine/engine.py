"""Engine: load a GGUF model, keep its KV cache, run prompt and decode steps.

    eng = Engine("model.gguf")                 # device auto (CUDA if present), float32
    logits = eng.forward([1, 2, 3])            # [3, V] logits of a prompt, cache now holds 3 tokens
    logits = eng.forward([4])                  # [1, V] one decode step at position 3
    eng.reset()                                # empty the cache
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from moerun.engine.device import KV_DTYPES, pick_device, pick_dtype
from moerun.engine.fast_decode import FastDecoder
from moerun.engine.fast_prefill import DEFAULT_CHUNK, DEFAULT_GRAPH_MAX, FastPrefill
from moerun.engine.kv_cache import KVCache
from moerun.engine.sampler import Sampler, SamplingParams
from moerun.errors import ContextOverflow, MoerunError, ShapeMismatch
from moerun.gguf.reader import GGUFFile
from moerun.kernels.gpu import warn_if_untuned
from moerun.kernels.ops import make_ops
from moerun.models.config import ModelConfig, read_config
from moerun.models.dequant_cache import DequantCache
from moerun.models.registry import arch_spec
from moerun.models.transformer import Transformer
from moerun.models.weights import ModelWeights, load_weights

DEFAULT_N_CTX = 4096
MAX_N_CTX = 1 << 24
DEFAULT_DEQUANT_BUDGET = 4 << 30  # bytes of weights kept dequantized by the reference path


class Engine:
    """One model, one sequence: a KV cache of `n_ctx` positions and the number of positions filled."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        n_ctx: int | None = None,
        dequant_budget_bytes: int = DEFAULT_DEQUANT_BUDGET,
        progress: bool | None = None,
        kv_dtype: str | torch.dtype | None = None,
        fast: bool | None = None,
        ops: str | None = None,
        graph: bool = True,
        prefill: str | None = None,
        prefill_dtype: str | torch.dtype | None = None,
        prefill_chunk: int = DEFAULT_CHUNK,
    ) -> None:
        """Load `path`. device: "cuda"/"cpu"/None (auto). dtype: compute dtype (float32 or bf16; default
        float32, except that fast prefill on CUDA then multiplies in bf16, see prefill_dtype).
        kv_dtype: KV cache dtype (default float16 on CUDA, else the compute dtype). fast: use the fused
        decode step (default: on CUDA). ops: "triton" or "torch" kernels for it (default: triton on
        CUDA). graph: replay the fast decode step, and repeated first-prompt lengths of fast prefill (padded
        to a multiple of 128 tokens, up to 1024), as CUDA graphs (CUDA only; False = eager, for debugging).
        prefill: "fast" (batched Triton GEMMs, default on CUDA) or "reference" (the plain-torch
        forward, default elsewhere) for prompts. prefill_dtype: matrix inputs of fast prefill,
        bfloat16 (tensor cores) or float32 (exact); default: `dtype` when given, else bfloat16 on CUDA.
        prefill_chunk: tokens per fast-prefill pass (longer prompts run in chunks)."""
        self.file = GGUFFile(path)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype or torch.float32)
        self.spec = arch_spec(self.file.architecture, file=str(self.file.path))
        self.cfg: ModelConfig = read_config(self.file, self.spec, self._n_vocab())
        weights = load_weights(self.file, self.spec, self.cfg)
        if self.device.type != "cpu":
            weights = _to_device(weights, self.device, progress)
        self.weights = weights
        self.model = Transformer(self.spec, self.cfg, weights, DequantCache(self.dtype, dequant_budget_bytes))
        self.n_ctx = self._context_size(n_ctx)
        on_cuda = self.device.type == "cuda"
        self.kv_dtype = (pick_dtype(kv_dtype, KV_DTYPES, "KV cache") if kv_dtype
                         else (torch.float16 if on_cuda else self.dtype))
        self.cache = KVCache(self.cfg, self.n_ctx, self.device, self.kv_dtype)
        self.n_past = 0
        self.sampler: Sampler | None = None  # None: greedy (argmax); see set_sampling
        self.fast: FastDecoder | None = None
        self.ops_name: str | None = None  # the fused decode step's kernels (`set_ops`); None without one
        self._graph = graph
        if fast if fast is not None else on_cuda:
            self.set_ops(ops or ("triton" if on_cuda else "torch"))
        self.prefiller: FastPrefill | None = None
        mode = prefill or ("fast" if on_cuda else "reference")
        if mode not in ("fast", "reference"):
            raise MoerunError(f"unknown prefill path {prefill!r}; use 'fast' or 'reference'")
        if prefill_chunk <= 0:
            raise MoerunError(f"prefill_chunk must be positive, got {prefill_chunk}")
        if mode == "fast":
            if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
                raise MoerunError("the fast prefill path needs a CUDA device (or TRITON_INTERPRET=1 for tests)")
            pdt = pick_dtype(prefill_dtype or dtype or (torch.bfloat16 if on_cuda else torch.float32))
            self.prefiller = FastPrefill(self.spec, self.cfg, weights, self.cache, exact=pdt == torch.float32,
                                         chunk=prefill_chunk, graph_max=DEFAULT_GRAPH_MAX if graph else 0)

    def _context_size(self, n_ctx: int | None) -> int:
        train = self.cfg.n_ctx_train
        if n_ctx is None:
            return min(train, DEFAULT_N_CTX) if train > 0 else DEFAULT_N_CTX
        if n_ctx <= 0:
            raise MoerunError(f"{self.file.path}: context size must be positive, got {n_ctx}")
        if n_ctx > MAX_N_CTX:
            raise ContextOverflow(f"{self.file.path}: n_ctx {n_ctx} is larger than moerun allows ({MAX_N_CTX})")
        if 0 < train < n_ctx:
            warnings.warn(f"{self.file.path}: n_ctx {n_ctx} exceeds the context length the model was trained "
                          f"with ({train}, {self.spec.name}.context_length); quality may degrade", stacklevel=3)
        return n_ctx

    def _n_vocab(self) -> int:
        entry = self.file.tensor("token_embd.weight")
        if len(entry.shape) != 2:
            raise ShapeMismatch(f"{self.file.path}: tensor 'token_embd.weight' has shape {list(entry.shape)}, "
                                "expected [n_vocab, n_embd]")
        n_vocab = entry.shape[0]
        declared = self.file.get(f"{self.spec.name}.vocab_size")
        if declared is not None and declared != n_vocab:
            raise ShapeMismatch(f"{self.file.path}: '{self.spec.name}.vocab_size' is {declared} but "
                                f"tensor 'token_embd.weight' has {n_vocab} rows")
        return n_vocab

    def _check(self, T: int, pos: int) -> None:
        if not 0 <= pos <= self.n_past:
            raise MoerunError(f"position {pos} is outside the cached range 0..{self.n_past}")
        if pos + T > self.n_ctx:
            raise ContextOverflow(f"{self.file.path}: {T} tokens at position {pos} need {pos + T} positions "
                                  f"but the context size is {self.n_ctx} (raise n_ctx, up to "
                                  f"{self.cfg.n_ctx_train}, or start a new sequence)")

    def _out_of_vocab(self, token: int) -> MoerunError:
        return MoerunError(f"token id {token} is outside the vocabulary 0..{self.cfg.n_vocab - 1}")

    def set_ops(self, ops: str) -> None:
        """(Re)build the fused decode step with the kernels `ops` ("triton", "torch", a base plus features:
        `kernels.ops.make_ops`) on the loaded weights: the previous step, its graph and its load-time copies are
        dropped first. Lets one process time several ops on one loaded model (`moerun bench --ops A,B`)."""
        kernels = make_ops(ops)
        if self.fast is not None:
            self.fast = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
        if kernels.name != "torch":
            warn_if_untuned(self.device)
        self.fast = FastDecoder(self.spec, self.cfg, self.weights, self.cache, kernels, use_graph=self._graph)
        self.fast.sampler = self.sampler
        self.ops_name = ops
        self.reset()

    def set_sampling(self, params: SamplingParams | None) -> None:
        """Choose tokens with `params` from now on (prefill, decode, generate); None or greedy
        params = argmax, the default. Restarts the sampler's step counter and its penalty history."""
        if params is None or params.is_greedy:
            self.sampler = None
        else:
            if self.sampler is None:
                self.sampler = Sampler(self.cfg.n_vocab, self.device, n_ctx=self.n_ctx)
            self.sampler.set(params)
        if self.fast is not None:
            self.fast.sampler = self.sampler

    def reset(self) -> None:
        """Forget every cached position (the cache tensors are reused)."""
        self.n_past = 0

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int] | torch.Tensor, *, pos: int | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Run `tokens` at positions pos.. (default: after the cached ones) -> logits [T, V] float32.

        `pos` below `n_past` rewinds the cache (positions from `pos` on are overwritten), which is
        how a prompt continues a shared prefix. With `last_only`, returns only the last row [1, V].
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).flatten().to(self.device)  # [T]
        pos = self.n_past if pos is None else pos
        T = ids.shape[0]
        if T == 0:
            raise MoerunError("forward() needs at least one token")
        self._check(T, pos)
        bad = (ids < 0) | (ids >= self.cfg.n_vocab)
        if bool(bad.any()):
            raise self._out_of_vocab(int(ids[bad][0]))
        if self.prefiller is not None:
            logits = self.prefiller.forward(ids, pos, last_only=last_only)
        else:
            logits = self.model.forward(ids, pos, self.cache, last_only=last_only)
        self.n_past = pos + T
        return logits

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int] | torch.Tensor, *, pos: int | None = None) -> int:
        """Run a prompt after the cached positions (or at `pos`, see `forward`) and return the token
        chosen to follow it."""
        return self._choose(self.forward(tokens, pos=pos, last_only=True)[-1])

    @torch.inference_mode()
    def decode(self, token: int) -> int:
        """One generation step: `token` at position n_past -> the next token (chosen on the device;
        only the chosen id reaches the host, which waits for it; `decode_stream` does not wait)."""
        if self.fast is None:
            return self._choose(self.forward([token], last_only=True)[-1])
        self._check(1, self.n_past)
        if not 0 <= token < self.cfg.n_vocab:
            raise self._out_of_vocab(token)
        next_id = self.fast.decode(token, self.n_past)
        self.n_past += 1
        return next_id

    def decode_stream(self, token: int, n: int | None = None) -> Iterator[int]:
        """`n` chained decode steps from `token` at n_past (None: until the context is full) -> each step's
        chosen token, the same tokens `decode` would give one by one; n_past counts the tokens handed out.
        On the fast path step i + 1 is already queued on the device when the host waits for token i
        (`FastDecoder.stream`), so the GPU does not wait on the host; closing the iterator early discards
        that step. Call nothing else on the engine until the iterator is exhausted or closed. `generate`,
        the API's generation loop and `moerun bench`'s tgN run on it."""
        if n is None:
            n = self.n_ctx - self.n_past
        elif n > 0:
            self._check(n, self.n_past)  # ContextOverflow before any step
        if n <= 0:
            return
        if self.fast is None:
            for _ in range(n):
                token = self.decode(token)
                yield token
            return
        if not 0 <= token < self.cfg.n_vocab:
            raise self._out_of_vocab(token)
        start = self.n_past
        steps = self.fast.stream(token, start, n)
        try:
            for k in range(n):
                with torch.inference_mode():
                    tok = next(steps)
                self.n_past = start + k + 1
                yield tok
        finally:
            with torch.inference_mode():
                steps.close()

    def _choose(self, logits: torch.Tensor) -> int:
        """logits: [V] -> the chosen token id (greedy, or the sampler's draw)."""
        if self.sampler is None:
            return int(logits.argmax())
        out = torch.zeros(1, dtype=torch.long, device=logits.device)
        return int(self.sampler.sample(logits.float(), out).item())

    def generate(self, prompt: Sequence[int], n: int, sampling: SamplingParams | None = None) -> Iterator[int]:
        """Yield `n` tokens continuing `prompt` (prefilled from position 0), one decode step each.
        `sampling`: use these params (`set_sampling`); None keeps the current choice (greedy by default)."""
        self.reset()
        if sampling is not None:
            self.set_sampling(sampling)
        if self.sampler is not None:
            self.sampler.start(prompt)
        tok = self.prefill(prompt)
        if n <= 0:
            return
        yield tok
        steps = self.decode_stream(tok, n - 1)
        try:
            yield from steps
        finally:
            steps.close()

    def generate_greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """Greedy continuation of `prompt` as a list of `n` token ids."""
        return list(self.generate(prompt, n))

    def kernel_paths(self) -> dict[str, str]:
        """Which kernels multiply by each weight type in decode: {"Q4_K": "triton", "F32": "torch-dequant", ...}.

        F32 covers 1-D tensors (norms) and the router, which the fast path reads directly."""
        entries = {e.type_name: e.ggml_type for e in self.file.tensors.values()}
        fast = self.fast
        def path(ggml_type: int) -> str:
            if fast is None:
                return "torch-dequant"
            name = getattr(fast.ops, "kernel_name", None)
            return fast.ops.name if name is None else name(ggml_type)
        return {name: path(t) for name, t in sorted(entries.items())}

    def prefill_path(self) -> str:
        """How prompts run: "torch-dequant", or "triton-gemm (bf16 inputs[, attention bf16 kept]|float32[, graphs
        <= N])" where first chunks of up to N tokens replay as CUDA graphs ("attention bf16 kept": FastPrefill's
        dense="cached")."""
        p = self.prefiller
        if p is None:
            return "torch-dequant"
        inputs = "float32" if p.exact else "bf16 inputs" + (", attention bf16 kept" if p.dense == "cached" else "")
        graphs = f", graphs <= {p.graph_max}" if p.graph_max else ""
        return f"triton-gemm ({inputs}{graphs})"

    def close(self) -> None:
        self.file.close()


def _to_device(w: ModelWeights, device: torch.device, progress: bool | None) -> ModelWeights:
    """Copy every parameter to `device`, with a progress bar for large models."""
    items = [(None, k, v) for k, v in w.globals.items()]
    items += [(i, k, v) for i, layer in enumerate(w.layers) for k, v in layer.items()]
    total = sum(v.nbytes for _, _, v in items)
    show = progress if progress is not None else total > (1 << 30)
    g: dict = {}
    layers: list[dict] = [{} for _ in w.layers]
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading to {device}", disable=not show) as bar:
        for i, k, v in items:
            (g if i is None else layers[i])[k] = v.to(device)
            bar.update(v.nbytes)
    return ModelWeights(g, layers)
