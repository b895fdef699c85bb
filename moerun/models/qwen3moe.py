"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3 attention; softmax router, top-k weights renormalised."""

from moerun.models.spec import ArchSpec

SPEC = ArchSpec(name="qwen3moe", rope_style="neox", qk_norm="head", expert_weights_norm=True)
