"""Synthetic full-size GGUF models with random weights: `moerun synth`, and the bench's model cache.

    from moerun.synth import synthesize, cached_synth, expected_size, PRESETS
    synthesize("olmoe-1b-7b", "q4_k_m", "olmoe.gguf", seed=0)   # 3.92 GiB, like llama.cpp's quantizer
"""

from __future__ import annotations

from moerun.synth.presets import PRESETS, Preset, get_preset, tensor_plan
from moerun.synth.quant_mix import FILE_TYPES, plan_types
from moerun.synth.writer import cached_synth, expected_size, plan_file, synthesize

__all__ = [
    "FILE_TYPES",
    "PRESETS",
    "Preset",
    "cached_synth",
    "expected_size",
    "get_preset",
    "plan_file",
    "plan_types",
    "synthesize",
    "tensor_plan",
]
