"""OLMoE (OLMoE-1B-7B): 64 experts, top-8.

Router: softmax over all experts, then top-k, weights NOT renormalised. q and k are RMS-normalised
over their full width (all heads together), before the split into heads.
"""

from moerun.models.spec import ArchSpec

SPEC = ArchSpec(name="olmoe", rope_style="neox", qk_norm="full", expert_weights_norm=False)
