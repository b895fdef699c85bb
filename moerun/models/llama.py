"""Llama 3 / SmolLM2 (and Mixtral, which llama.cpp stores as arch `llama` with `ffn_*_exps`).

llama.cpp's converter permutes the Q and K rows of this arch so that RoPE rotates adjacent pairs
("norm" style); `rope_freqs` (Llama 3.1 long-context factors) is applied when present.
Mixtral's top-k routing weights are renormalised.
"""

from moerun.models.spec import ArchSpec

SPEC = ArchSpec(name="llama", rope_style="norm", expert_weights_norm=True)
