"""llama.cpp (through llama-cpp-python, CPU build) as a test oracle: the logits of every position.

The oracle runs in float32 where it can: F32 KV cache (not llama.cpp's default f16), flash attention
off, one thread by default. llama.cpp's log is captured while the model loads and runs, so a load
failure raises an error that carries llama.cpp's own reason instead of "Failed to load model".
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

GGML_TYPE_F32 = 0
_LOG_LEVELS = {0: "NONE", 1: "DEBUG", 2: "INFO", 3: "WARN", 4: "ERROR"}  # enum ggml_log_level; 5 = CONT


class LlamaCppError(RuntimeError):
    """llama.cpp failed to load or evaluate a model; the message ends with llama.cpp's log."""


def available() -> bool:
    """True when llama-cpp-python is installed (a broken install then fails loudly, not skipped)."""
    return importlib.util.find_spec("llama_cpp") is not None


@contextmanager
def _captured_log() -> Iterator[list[str]]:
    """Route llama.cpp's log into a list of lines ("LEVEL: text") for the duration of the block."""
    import llama_cpp
    from llama_cpp import _logger

    lines: list[str] = []
    last_level = [2]

    def on_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        msg = text.decode("utf-8", errors="replace")
        if level == 5 and lines:  # GGML_LOG_LEVEL_CONT: continues the previous line
            lines[-1] += msg.rstrip("\n")
            return
        last_level[0] = level if level != 5 else last_level[0]
        lines.append(f"{_LOG_LEVELS.get(last_level[0], last_level[0])}: {msg.rstrip(chr(10))}")

    callback = llama_cpp.llama_log_callback(on_log)  # keep a reference while llama.cpp may call it
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _log_excerpt(lines: list[str], tail: int = 25) -> str:
    """Errors and warnings from the log, then its last `tail` lines."""
    important = [line for line in lines if line.startswith(("ERROR", "WARN"))]
    return "\n".join(
        ["--- llama.cpp errors/warnings ---", *important, "--- llama.cpp log tail ---", *lines[-tail:]]
    )


def llamacpp_logits(path: str, tokens: list[int], n_ctx: int = 256, n_threads: int = 1) -> np.ndarray:
    """Evaluate `tokens` as one batch from position 0 in llama.cpp (CPU) and return all logits.

    Returns a float32 array [T, n_vocab], row t being the logits after tokens[: t + 1].
    Raises LlamaCppError (with llama.cpp's log) when the model does not load or decode fails.
    """
    import llama_cpp

    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("tokens must not be empty")
    if len(tokens) > n_ctx:
        raise ValueError(f"{len(tokens)} tokens do not fit in n_ctx={n_ctx}")
    with _captured_log() as log:
        llm = None
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                n_gpu_layers=0,
                logits_all=True,
                flash_attn=False,
                type_k=GGML_TYPE_F32,
                type_v=GGML_TYPE_F32,
                use_mmap=False,
                seed=0,
                verbose=False,
            )
            n_vocab = llm.n_vocab()
            if max(tokens) >= n_vocab or min(tokens) < 0:
                raise ValueError(f"token ids must lie in [0, {n_vocab}), got {min(tokens)}..{max(tokens)}")
            llm.eval(tokens)
            return np.array(llm.scores[: len(tokens), :n_vocab], dtype=np.float32, copy=True)  # [T, V]
        except (ValueError, RuntimeError) as exc:
            raise LlamaCppError(f"llama.cpp failed on {path}: {exc}\n{_log_excerpt(log)}") from exc
        finally:
            if llm is not None:
                llm.close()
