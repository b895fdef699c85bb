"""moerun: fast batch-1 inference of GGUF models, in readable Python.

    import moerun
    model = moerun.load()                  # the built-in Gemma 3 270M Q4_K_M, or moerun.load("model.gguf")
    print(model.generate("Water boils at", max_tokens=24, temperature=0))

The names below are imported on first use, so `import moerun` (and the CLI's `--help`) stays fast.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatSession", "GenerationStats", "Model", "SamplingParams", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from moerun import api

        return getattr(api, name)
    raise AttributeError(f"module 'moerun' has no attribute {name!r}")
