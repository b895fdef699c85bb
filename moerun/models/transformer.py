"""The shared decoder: embed -> N x (attention block, FFN block) -> norm -> output matrix.

Every supported architecture runs through this one forward; its ArchSpec switches the optional
pieces (QK-norm, post-norms, activation, MoE). This is the plain-torch reference path.
"""

from __future__ import annotations

import torch

from moerun.engine.kv_cache import KVCache
from moerun.kernels import reference as ref
from moerun.models.config import ModelConfig
from moerun.models.dequant_cache import DequantCache
from moerun.models.spec import ArchSpec
from moerun.models.weights import ModelWeights, Param


class Transformer:
    """A model ready to run: spec + config + weights, computing in `dequant.dtype`."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, weights: ModelWeights, dequant: DequantCache) -> None:
        self.spec, self.cfg, self.w, self.dq = spec, cfg, weights, dequant

    def forward(self, tokens: torch.Tensor, pos0: int, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens: [T] int64 at positions pos0..pos0+T-1 -> logits [T, V] (or [1, V]) float32.

        Writes the tokens' keys and values into `cache` and attends over positions 0..pos0+T-1.
        """
        cfg, g = self.cfg, self.w.globals
        pos = torch.arange(pos0, pos0 + tokens.shape[0], device=tokens.device)  # [T]
        rope = self._rope_tables(pos)
        x = self.dq.rows(g["token_embd"], tokens).float()  # [T, N] residual stream, float32
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        for i, layer in enumerate(self.w.layers):
            x = self._block(i, layer, x, pos, pos0, cache, rope)
        if last_only:
            x = x[-1:]
        x = ref.rms_norm(x, g["output_norm"], cfg.rms_eps)
        logits = ref.linear(x, self.dq.matrix(g.get("output", g["token_embd"])))  # [T, V]
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def _rope_tables(self, pos: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for global (False) and sliding-window (True) layers: each [T, rope_dim/2]."""
        cfg, factors = self.cfg, self.w.globals.get("rope_freqs")
        return {
            False: ref.rope_angles(pos, cfg.rope_dim, cfg.rope_base, cfg.rope_scale, factors),
            True: ref.rope_angles(pos, cfg.rope_dim, cfg.rope_base_swa, 1.0, factors),
        }

    def _block(self, i: int, L: dict[str, Param], x: torch.Tensor, pos: torch.Tensor, pos0: int,
               cache: KVCache, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        cfg, post = self.cfg, self.spec.post_norms
        h = self._attention(i, L, ref.rms_norm(x, L["attn_norm"], cfg.rms_eps), pos, pos0, cache, rope)
        if post:
            h = ref.rms_norm(h, L["post_attention_norm"], cfg.rms_eps)
        x = x + h
        m = ref.rms_norm(x, L["ffn_norm"], cfg.rms_eps)
        m = self._moe(L, m) if cfg.is_moe else self._mlp(L, m)
        if post:
            m = ref.rms_norm(m, L["post_ffw_norm"], cfg.rms_eps)
        return x + m

    def _attention(self, i: int, L: dict[str, Param], x: torch.Tensor, pos: torch.Tensor, pos0: int,
                   cache: KVCache, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        cfg, spec, mat = self.cfg, self.spec, self.dq.matrix
        T = x.shape[0]
        q = ref.linear(x, mat(L["attn_q"]))  # [T, H*D]
        k = ref.linear(x, mat(L["attn_k"]))  # [T, Hkv*D]
        v = ref.linear(x, mat(L["attn_v"]))  # [T, Hkv*Dv]
        if spec.qk_norm == "full":
            q = ref.rms_norm(q, L["attn_q_norm"], cfg.rms_eps)
            k = ref.rms_norm(k, L["attn_k_norm"], cfg.rms_eps)
        q = q.view(T, cfg.n_head, cfg.head_dim)
        k = k.view(T, cfg.n_head_kv, cfg.head_dim)
        v = v.view(T, cfg.n_head_kv, cfg.head_dim_v)
        if spec.qk_norm == "head":
            q = ref.rms_norm(q, L["attn_q_norm"], cfg.rms_eps)
            k = ref.rms_norm(k, L["attn_k_norm"], cfg.rms_eps)
        swa = cfg.swa_layers[i]
        cos, sin = rope[swa]
        q = ref.apply_rope(q, cos, sin, spec.rope_style)
        k = ref.apply_rope(k, cos, sin, spec.rope_style)
        cache.write(i, pos0, k, v)
        k_all, v_all = cache.read(i, pos0 + T)  # [S, Hkv, D], [S, Hkv, Dv]
        o = ref.attention(q, k_all, v_all, pos, cfg.attn_scale, cfg.sliding_window if swa else 0)
        return ref.linear(o.reshape(T, cfg.n_head * cfg.head_dim_v), mat(L["attn_output"]))  # [T, N]

    def _mlp(self, L: dict[str, Param], x: torch.Tensor) -> torch.Tensor:
        mat = self.dq.matrix
        return ref.gated_mlp(x, mat(L["ffn_gate"]), mat(L["ffn_up"]), mat(L["ffn_down"]), self.spec.act)

    def _moe(self, L: dict[str, Param], x: torch.Tensor) -> torch.Tensor:
        """Routed experts, one dequantized expert at a time. x: [T, N] -> [T, N]."""
        cfg = self.cfg
        router = L["ffn_gate_inp"]  # [E, N] float32
        assert isinstance(router, torch.Tensor)
        weights, ids = ref.route(x @ router.T, cfg.n_expert_used, cfg.expert_weights_norm)  # [T, K]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in ids.unique().tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            y = ref.gated_mlp(x[tok], self.dq.expert(L["ffn_gate_exps"], e), self.dq.expert(L["ffn_up_exps"], e),
                              self.dq.expert(L["ffn_down_exps"], e), self.spec.act)  # [t, N]
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out
