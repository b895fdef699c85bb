"""Qwen3 (dense): GQA, per-head RMSNorm on q and k, split-half RoPE."""

from moerun.models.spec import ArchSpec

SPEC = ArchSpec(name="qwen3", rope_style="neox", qk_norm="head")
