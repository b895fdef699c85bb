"""Fast prompt processing: every token of a chunk at once through batched kernels.

Per layer: the projections are quantized GEMMs (weights decoded tile by tile inside the kernel,
kernels/triton/qgemm.py; Q, K and V stacked into one), or from 128 tokens on cuBLAS products of bf16 copies
of the weights (`dense`), the routed experts a grouped GEMM per matrix over the token-expert assignments
grouped by expert on the device (moe_align.py, no host sync), and attention torch's
scaled_dot_product_attention (flash / memory-efficient kernels) over the KV cache, which the chunk's keys and
values are written into first. Residual add + RMSNorm (which also sums each token's expert outputs),
QK-norm + RoPE + KV store, the router's logits (split-K partial sums) and its softmax/top-k (which adds
them) are one Triton launch each (kernels/triton/prefill_ops.py): ~15 launches per layer.

Long prompts run in chunks of `chunk` tokens (each continues the cache like a multi-turn prompt), so
intermediate buffers stay bounded whatever the prompt length.

CUDA graphs: a prompt is launch-bound on the host below a few thousand tokens (those launches take
tens of microseconds each from Python). A prompt chunk at position 0 (the first chunk of every
conversation; what `moerun bench`'s ppN times) whose logits are wanted only for its last token is
therefore replayed as a CUDA graph: its length is padded up to a multiple of GRAPH_STEP (padding tokens
come after the real ones, so causal attention keeps them out of every real token's result; their cache
rows lie past the filled positions and are overwritten by the next tokens), one graph per padded length
up to `graph_max` tokens (at most graph_max / GRAPH_STEP graphs, each holding its intermediate buffers),
captured the second time a length is seen (the first time runs eagerly). Later chunks (positions > 0) run eagerly.

Numerics: `exact` multiplies in float32 (tensor cores in "ieee" mode: the reference's precision);
otherwise matrix inputs are rounded to bf16 with float32 accumulation, as the reference's bf16 mode.
The residual stream, norms, softmax and routing are float32 in both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moerun.engine.kv_cache import KVCache
from moerun.kernels import reference as ref
from moerun.kernels.gpu import sm_count
from moerun.kernels.triton import prefill_ops as po
from moerun.kernels.triton import qgemm as qg
from moerun.kernels.triton.decode_ops import rope_table
from moerun.models.config import ModelConfig
from moerun.models.spec import ArchSpec
from moerun.models.weights import ModelWeights
from moerun.quant.qtensor import QTensor
from moerun.quant.registry import dequantize

DEFAULT_CHUNK = 2048
ROUTERS = ("bmm", "torch")  # FastPrefill(router=...)
GRAPH_STEP = 128  # prompt lengths are padded to a multiple of this for graph replay
DEFAULT_GRAPH_MAX = 1024  # longest padded chunk replayed as a graph (longer ones amortise their launches)
DENSE_MODES = ("dequant", "cached", "fused")  # FastPrefill's `dense` choices (besides "auto")
DENSE_CACHE_SHARE = 0.25  # dense="auto" keeps bf16 attention matrices if they take at most this of free memory
DEQUANT_MIN_ROWS = 128  # dense products of fewer tokens decode in the GEMM (a bf16 copy of W costs more)

# Tiles per kind of product ("dense": projections, "gate_up" / "down": the grouped expert GEMMs), from
# benchmarks/bench_qgemm.py and bench_prefill.py on the H200 (benchmarks/NOTES.md section 6), with the
# types whose raw weights each loads one step ahead (8 = Q8_0, 12 = Q4_K, 14 = Q6_K; 6f). Float expert
# weights (F16/BF16/F32: no decode, bandwidth-bound) prefer narrower token blocks.
TILES: dict[str, qg.GemmTile] = {
    "dense": qg.GemmTile(64, 32, 4, 3, frozenset({8, 12, 14})),
    "gate_up": qg.GemmTile(128, 128, 8, 3, frozenset({8, 12, 14})),
    "down": qg.GemmTile(128, 128, 8, 3, frozenset({8, 14})),
}
FLOAT_EXPERT_TILE = qg.GemmTile(64, 128, 4, 3)
FLOAT_TYPES = frozenset({0, 1, 30})
# Quantized expert tiles per type for chunks with few token-expert rows per expert (T * n_used / n_expert up to
# the first number; TILES above that): a 128-token block of a 64-row expert is half padding, and for Q8_0
# smaller token blocks with the decoded weights as the MMA's register operand (swap) do less work; Q4_K is
# slower so (NOTES.md 6j).
MOE_TILES_BY_ROWS: dict[int, list[tuple[int, qg.GemmTile, qg.GemmTile]]] = {
    8: [(96, qg.GemmTile(64, 64, 4, 3, frozenset({8}), swap=True),
         qg.GemmTile(64, 64, 4, 3, frozenset({8}), swap=True))],
}
if qg._INTERPRET:  # Triton's CPU interpreter (tests): few, wide programs run fastest in numpy
    TILES.update(dense=qg.GemmTile(64, 256, 4, 1), gate_up=qg.GemmTile(64, 128, 4, 1),
                 down=qg.GemmTile(64, 128, 4, 1))
    FLOAT_EXPERT_TILE = qg.GemmTile(64, 128, 4, 1)
    MOE_TILES_BY_ROWS = {q: [(r, gu._replace(num_stages=1), dn._replace(num_stages=1)) for r, gu, dn in entries]
                         for q, entries in MOE_TILES_BY_ROWS.items()}


def _raw(w: Any) -> tuple[torch.Tensor, int]:
    assert isinstance(w, QTensor), "matrices stay quantized"
    return w.raw, int(w.qtype.ggml)


class FastPrefill:
    """Batched forward of prompt chunks for one model and one KV cache."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, weights: ModelWeights, cache: KVCache, *,
                 exact: bool, chunk: int = DEFAULT_CHUNK, experts: str = "fused", dense: str = "auto",
                 graph_max: int = DEFAULT_GRAPH_MAX, router: str = "bmm") -> None:
        """experts: "fused" decodes expert weights inside the grouped GEMM; "dequant" first dequantizes
        each layer's expert stacks to bf16 (float32 when exact) with the torch dequantizers, then runs
        the same GEMM on those (the alternative benchmarks/bench_prefill.py measures).
        dense: "dequant" (1.1-1.2x pp512 over "fused" on the H200, benchmarks/NOTES.md 6h) writes each projection's
        weights to one reused bf16 buffer and multiplies with torch (cuBLAS) when the chunk has >=
        DEQUANT_MIN_ROWS tokens (bf16 mode; the float32 mode always decodes in the GEMM); "fused" decodes the
        weights inside the GEMM, once per token block; "cached" is "dequant" with each projection's bf16 copy
        kept after its first use (no copy per chunk, at the cost of the attention matrices in bf16 on the GPU;
        +1-3% pp512, 6j); "auto" (default) is "cached" when that copy takes at most DENSE_CACHE_SHARE of the
        device's free memory, else "dequant".
        graph_max: longest (padded) first chunk replayed as a CUDA graph; 0 = never (CUDA only).
        router: how the router's float32 logits are computed: "bmm" (default) as split-K partial sums from one
        batched cuBLAS matmul over column slices (enough tiles for every SM; `router_parts_mm`), which the top-k
        kernel adds in order, or "torch" as one matmul (16 tiles at 512 tokens: 0.243 vs 0.178 ms per OLMoE
        prompt on the H200, NOTES.md 6l)."""
        self.spec, self.cfg, self.w, self.cache = spec, cfg, weights, cache
        self.exact = exact
        if experts not in ("fused", "dequant"):
            raise ValueError(f"experts must be 'fused' or 'dequant', got {experts!r}")
        self.experts = experts
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
        self.router = router
        if dense not in DENSE_MODES + ("auto",):
            raise ValueError(f"dense must be auto or one of {', '.join(DENSE_MODES)}, got {dense!r}")
        self._qkv = [self._stack_qkv(L) for L in weights.layers]
        self.dense = self._auto_dense(cache.k[0].device) if dense == "auto" else dense
        self.tile_overrides: set[str] = set()  # kinds whose TILES entry a benchmark set explicitly
        self.chunk = chunk
        self.act_dtype = torch.float32 if exact else torch.bfloat16  # dtype of matrix inputs
        self.graph_max = graph_max if cache.k[0].device.type == "cuda" else 0
        self._graphs: dict[int, _ChunkGraph] = {}  # padded length -> captured first-chunk forward
        self._seen: set[int] = set()  # padded lengths run once (captured the next time)
        self._wbuf: torch.Tensor | None = None  # dense="dequant": bf16 weights of the current projection
        self._wcache: dict[tuple[int, int, int], torch.Tensor] = {}  # dense="cached": (raw ptr, M, K) -> bf16 [M, K]
        dev, factors = cache.k[0].device, weights.globals.get("rope_freqs")
        self._rope = {False: rope_table(cache.n_ctx, cfg.rope_dim, cfg.rope_base, cfg.rope_scale, factors, dev)}
        if any(cfg.swa_layers):
            self._rope[True] = rope_table(cache.n_ctx, cfg.rope_dim, cfg.rope_base_swa, 1.0, factors, dev)

    # --- products -------------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, w: Any) -> torch.Tensor:
        """x [T, K] (act dtype) @ W^T -> [T, M] float32."""
        raw, qtype = _raw(w)
        return self._linear_raw(x, raw.reshape(-1, raw.shape[-1]), qtype)

    def _linear_raw(self, x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
        T, M = x.shape[0], raw.shape[0]
        K = x.shape[1]
        bf16_copy = self.dense != "fused" and not self.exact and T >= DEQUANT_MIN_ROWS
        if bf16_copy and self._wbuf is None:  # allocated by the first (eager) chunk using it, not in a capture
            self._wbuf = self._dense_buffer(x.device)
        if bf16_copy and M * K <= self._wbuf.numel():
            key = (raw.data_ptr(), M, K)
            wb = self._wcache.get(key) if self.dense == "cached" else None  # the copy an earlier chunk made
            if wb is None:
                keep = self.dense == "cached" and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
                dst = torch.empty(M, K, dtype=torch.bfloat16, device=x.device) if keep else self._wbuf[: M * K]
                wb = qg.dequantize_bf16(raw, qtype, dst.view(M, K))  # [M, K] bf16
                if keep:
                    self._wcache[key] = wb
            return _mm_f32(x.to(torch.bfloat16), wb)
        out = torch.empty(T, M, device=x.device, dtype=torch.float32)
        return qg.qgemm(x, raw, qtype, out, exact=self.exact, tile=TILES["dense"])

    def _dense_sizes(self) -> list[int]:
        """Weights per attention matrix a prompt multiplies (stacked q/k/v, else q, k and v; the output)."""
        sizes = []
        for i, L in enumerate(self.w.layers):
            names = ("attn_output",) if self._qkv[i] is not None else ("attn_q", "attn_k", "attn_v", "attn_output")
            mats = [L[k] for k in names if isinstance(L.get(k), QTensor)]
            sizes += [m.shape[0] * m.shape[1] for m in mats if len(m.shape) == 2]
            if self._qkv[i] is not None:
                sizes.append(self._qkv[i][0].shape[0] * self.cfg.n_embd)
        return sizes

    def _auto_dense(self, device: torch.device) -> str:
        """dense="auto": "cached" when the bf16 copies of all attention matrices fit in DENSE_CACHE_SHARE of the
        device's free memory (always on the CPU), else "dequant"."""
        if device.type != "cuda":
            return "cached"
        need = 2 * sum(self._dense_sizes())
        return "cached" if need <= DENSE_CACHE_SHARE * torch.cuda.mem_get_info(device)[0] else "dequant"

    def _dense_buffer(self, device: torch.device) -> torch.Tensor:
        """The bf16 buffer dense="dequant" writes each projection into: the largest attention matrix
        (stacked q/k/v or one of q, k, v, output), reused by every layer in turn; the output matrix
        (vocabulary rows) is larger and decodes in the GEMM."""
        return torch.empty(max(self._dense_sizes(), default=0), dtype=torch.bfloat16, device=device)

    @staticmethod
    def _stack_qkv(L: dict[str, Any]) -> tuple[torch.Tensor, int] | None:
        """Q, K and V rows stacked into one matrix [(H + 2 Hkv) D, row_bytes] when they share a type (one
        GEMM instead of three; costs a copy of these three matrices, a few % of an MoE model)."""
        ws = [L[k] for k in ("attn_q", "attn_k", "attn_v")]
        if not all(isinstance(w, QTensor) for w in ws) or len({int(w.qtype.ggml) for w in ws}) != 1:
            return None
        return torch.cat([w.raw.reshape(-1, w.raw.shape[-1]) for w in ws]), int(ws[0].qtype.ggml)

    def _ffn(self, L: dict[str, Any], x: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        """Routed experts (or the dense MLP as one expert) of x [T, N] float32 (normalised; xa: the same in
        the act dtype) -> each token's weighted expert outputs [T, K, N] float32 (their sum is the block
        output). The router reads the float32 x."""
        cfg = self.cfg
        T = x.shape[0]
        if cfg.is_moe:
            wr = L["ffn_gate_inp"]  # [E, N] float32
            if self.router == "bmm":
                logits = router_parts_mm(x, wr)  # [S, T, E] float32 partial sums, added in order by the top-k
            else:
                logits = x @ wr.T  # [T, E] float32
            K = cfg.n_expert_used
            route_w = torch.empty(T, K, device=x.device, dtype=torch.float32)
            ids = torch.empty(T, K, device=x.device, dtype=torch.int32)
            po.route_topk_rows(logits, K, cfg.expert_weights_norm, route_w, ids)
            gate, up, down = L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]
            n_expert = cfg.n_expert
        else:
            ids = torch.zeros(T, 1, dtype=torch.int32, device=x.device)
            route_w = torch.ones(T, 1, dtype=torch.float32, device=x.device)
            gate, up, down = L["ffn_gate"], L["ffn_up"], L["ffn_down"]
            n_expert = 1
        (wg, qgt), (wu, qut), (wd, qdt) = _raw(gate), _raw(up), _raw(down)
        if wg.dim() == 2:  # dense: [1, rows, row_bytes]
            wg, wu, wd = wg[None], wu[None], wd[None]
        if self.experts == "dequant":
            (wg, qgt), (wu, qut), (wd, qdt) = (self._dequant(w) for w in (gate, up, down))
        t_gu, t_dn = self._moe_tiles(T * ids.shape[1] / n_expert, qgt, qdt)
        assert t_gu.block_m == t_dn.block_m, "gate/up and down share the routing's BLOCK_M"
        routing = qg.moe_align(ids, n_expert, t_gu.block_m)
        h = torch.empty(routing.rows.shape[0], wg.shape[1], device=x.device, dtype=self.act_dtype)  # [P, F]
        qg.moe_gate_up(xa, wg, wu, qgt, qut, routing, h, self.spec.act, exact=self.exact, tile=t_gu)
        y = torch.empty(ids.numel(), wd.shape[1], device=x.device, dtype=torch.float32)  # [T*K, N]
        qg.moe_down(h, wd, qdt, routing, route_w.view(-1), y, exact=self.exact, tile=t_dn)
        return y.view(T, ids.shape[1], -1)  # [T, K, N]: the next add_rms_norm sums the K parts

    def _moe_tiles(self, rows: float, qgt: int, qdt: int) -> tuple[qg.GemmTile, qg.GemmTile]:
        """(gate/up, down) tiles for experts of these types with `rows` token-expert pairs per expert on
        average: a benchmark's explicit TILES, else FLOAT_EXPERT_TILE for float weights, else the first
        MOE_TILES_BY_ROWS entry of their (common) type that covers `rows`, else TILES."""
        if self.tile_overrides & {"gate_up", "down"}:
            return TILES["gate_up"], TILES["down"]
        if qgt in FLOAT_TYPES and qdt in FLOAT_TYPES:
            return FLOAT_EXPERT_TILE, FLOAT_EXPERT_TILE
        for max_rows, t_gu, t_dn in MOE_TILES_BY_ROWS.get(qgt, []) if qgt == qdt else []:
            if rows <= max_rows:
                return t_gu, t_dn
        return TILES["gate_up"], TILES["down"]

    def _dequant(self, w: QTensor) -> tuple[torch.Tensor, int]:
        """A whole (expert) matrix dequantized, as typed rows the GEMM reads: ([E, M, K] bytes view, type)."""
        dt, qtype = (torch.float32, 0) if self.exact else (torch.bfloat16, 30)
        t = w.dequantize(dt)
        t = t if t.dim() == 3 else t[None]
        return t.view(torch.uint8), qtype

    # --- attention ------------------------------------------------------------------------------

    def _attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, pos0: int, window: int
                ) -> torch.Tensor:
        """q [T, H, D] (rotated) at positions pos0.., cache rows [S, Hkv, D] -> [T, H, Dv] (q's dtype or f32)."""
        T, H, _ = q.shape
        S, Hkv = k_all.shape[0], k_all.shape[1]
        dt = torch.float32 if self.exact or k_all.dtype == torch.float32 else k_all.dtype
        qh = q.transpose(0, 1).to(dt)[None]  # [1, H, T, D]
        kh = k_all.transpose(0, 1).to(dt)
        vh = v_all.transpose(0, 1).to(dt)
        if Hkv != H:
            kh = kh.repeat_interleave(H // Hkv, dim=0)
            vh = vh.repeat_interleave(H // Hkv, dim=0)
        kh, vh = kh[None], vh[None]  # [1, H, S, D]
        if window:
            qp = torch.arange(pos0, pos0 + T, device=q.device)[:, None]
            kp = torch.arange(S, device=q.device)[None, :]
            mask = (kp <= qp) & (qp - kp < window)  # [T, S] True = attend
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.cfg.attn_scale)
        elif pos0 == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.cfg.attn_scale)
        else:
            from torch.nn.attention.bias import causal_lower_right

            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(T, S),
                                               scale=self.cfg.attn_scale)
        return o[0].transpose(0, 1)  # [T, H, Dv]

    def _attention(self, i: int, L: dict[str, Any], xa: torch.Tensor, pos0: int) -> torch.Tensor:
        """xa [T, N] normalised, in the act dtype, at positions pos0.. -> attention block output [T, N] f32."""
        cfg, spec = self.cfg, self.spec
        T = xa.shape[0]
        qkv = self._qkv[i]
        if qkv is not None:  # one GEMM over the stacked rows; q, k, v are column slices of it
            q, k, v = self._linear_raw(xa, *qkv).split(
                [cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_head_kv * cfg.head_dim_v], dim=1)
        else:
            q = self._linear(xa, L["attn_q"])  # [T, H*D]
            k = self._linear(xa, L["attn_k"])  # [T, Hkv*D]
            v = self._linear(xa, L["attn_v"])  # [T, Hkv*Dv]
        swa = cfg.swa_layers[i]
        kc, vc = self.cache.k[i], self.cache.v[i]
        q_dt = torch.float32 if self.exact or kc.dtype == torch.float32 else kc.dtype
        q_rot = torch.empty(T, cfg.n_head, cfg.head_dim, device=xa.device, dtype=q_dt)
        po.qk_norm_rope_rows(q, k, v, L.get("attn_q_norm"), L.get("attn_k_norm"), self._rope[swa], pos0, kc, vc,
                             q_rot, eps=cfg.rms_eps, qk_norm=spec.qk_norm, rope_style=spec.rope_style)
        k_all, v_all = self.cache.read(i, pos0 + T)
        o = self._attend(q_rot, k_all, v_all, pos0, cfg.sliding_window if swa else 0)  # [T, H, Dv]
        return self._linear(o.reshape(T, -1), L["attn_output"])  # [T, N]; f16 o is cast to bf16 in the GEMM

    # --- forward --------------------------------------------------------------------------------

    def _chunk(self, tokens: torch.Tensor, pos0: int, last_only: bool, last: torch.Tensor | None = None
               ) -> torch.Tensor:
        """tokens [T] at positions pos0.. -> logits [T, V], or [1, V] of the last token with last_only (of
        row `last` [1] int64 when given: a padded chunk's last real token)."""
        cfg, spec, g = self.cfg, self.spec, self.w.globals
        T = tokens.shape[0]
        embd = g["token_embd"]
        x = dequantize(embd.raw.index_select(0, tokens), int(embd.qtype.ggml), (T, cfg.n_embd))  # [T, N] f32
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        xn = torch.empty_like(x)  # normalised input of the next block, float32 (router, final norm)
        xa = xn if self.exact else torch.empty_like(x, dtype=self.act_dtype)  # the same, GEMM input dtype
        lowp = None if self.exact else xa
        h = None  # output of the previous block, added to x by the next norm
        for i, L in enumerate(self.w.layers):
            po.add_rms_norm(x, L["attn_norm"], cfg.rms_eps, xn, h, out2=lowp)
            h = self._attention(i, L, xa, pos0)
            if spec.post_norms:
                h = ref.rms_norm(h, L["post_attention_norm"], cfg.rms_eps)
            po.add_rms_norm(x, L["ffn_norm"], cfg.rms_eps, xn, h, out2=lowp)
            h = self._ffn(L, xn, xa)  # [T, K, N]
            if spec.post_norms:
                h = ref.rms_norm(h.sum(1), L["post_ffw_norm"], cfg.rms_eps)
        if last_only:
            rows = (lambda t: t[-1:]) if last is None else (lambda t: t.index_select(0, last))
            x, h, xn = rows(x), rows(h), rows(xn)
            xa = xn if self.exact else rows(xa)  # exact: one buffer for both
        po.add_rms_norm(x, g["output_norm"], cfg.rms_eps, xn, h, out2=None if self.exact else xa)
        logits = self._linear(xa, g.get("output", g["token_embd"]))  # [T, V]
        if cfg.final_logit_softcap:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
        return logits

    def forward(self, tokens: torch.Tensor, pos0: int, last_only: bool = False) -> torch.Tensor:
        """tokens [T] int64 (device) at positions pos0.. -> logits [T, V] (or [1, V]) float32; fills the
        cache. Runs in chunks of `chunk` tokens; with last_only each chunk computes only its last row's
        logits and the final chunk's are returned."""
        outs = []
        for s in range(0, tokens.shape[0], self.chunk):
            part = tokens[s:s + self.chunk]
            graph = self._graph(part.shape[0]) if last_only and pos0 + s == 0 else None
            outs.append(graph.run(part) if graph is not None else self._chunk(part, pos0 + s, last_only))
        return outs[-1] if last_only else torch.cat(outs)

    # --- CUDA graphs of first chunks ------------------------------------------------------------

    def _graph(self, T: int) -> _ChunkGraph | None:
        """The graph a T-token first chunk replays: captured now if its padded length was seen before;
        None (run eagerly) the first time, or when the padded length exceeds graph_max or the cache."""
        padded = -(-T // GRAPH_STEP) * GRAPH_STEP
        if padded > min(self.graph_max, self.cache.n_ctx):
            return None
        if padded not in self._graphs and padded in self._seen:
            self._graphs[padded] = _ChunkGraph(self, padded)
        self._seen.add(padded)
        return self._graphs.get(padded)

    def drop_graphs(self) -> None:
        """Forget every captured graph (e.g. after changing kernel options): capture afresh from now on."""
        self._graphs, self._seen = {}, set()

    def padded_forward(self, tokens: torch.Tensor, padded: int) -> torch.Tensor:
        """What a graph replays, run eagerly: tokens [T] padded with token 0 to `padded` rows at position
        0 -> logits [1, V] of the last real token (tests check it equals the unpadded forward)."""
        buf = torch.empty(padded, dtype=torch.long, device=tokens.device)
        last = torch.empty(1, dtype=torch.long, device=tokens.device)
        _fill_padded(buf, last, tokens)
        return self._chunk(buf, 0, True, last)


ROUTER_BT, ROUTER_MIN_SPAN = 32, 256  # token rows per tile of the router's product; fewest columns per slice


def router_split(t: int, n: int, device: torch.device) -> int:
    """Column slices of the router's split-K product (`router_parts_mm`) for T tokens over N: enough 32-token
    tiles x slices for every SM (at 512 tokens one product is 16 tiles, NOTES.md 6j), each slice >=
    ROUTER_MIN_SPAN columns."""
    row_blocks = -(-t // ROUTER_BT)
    return max(1, min(-(-sm_count(device) // row_blocks), n // ROUTER_MIN_SPAN))


def router_parts_mm(x: torch.Tensor, w: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """The router's logits x @ w^T as S partial sums over column slices of N, from one batched matmul (at 512
    tokens a single [T, N] x [N, E] float32 product is 16 cuBLAS tiles for 132 SMs: NOTES.md 6j).

    x: [T, N] f32, w: [E, N] f32 -> [S, T, E] f32, S = split (default `router_split`), reduced to a divisor of
    N."""
    if x.stride(1) != 1:
        x = x.contiguous()
    t, n = x.shape
    e = w.shape[0]
    s = split or router_split(t, n, x.device)
    while n % s:
        s -= 1
    xs = x.as_strided((s, t, n // s), (n // s, x.stride(0), 1))  # [S, T, N/S] slice s of every row
    ws = w.reshape(e, s, n // s).permute(1, 2, 0)  # [S, N/S, E]
    return torch.bmm(xs, ws)


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [M, K]^T -> [T, M] float32 from bf16 operands (float32 accumulation and output)."""
    if x.is_cuda:
        return torch.mm(x, w.T, out_dtype=torch.float32)
    return x.float() @ w.float().T  # CPU: bf16 products are exact in float32


def _fill_padded(buf: torch.Tensor, last: torch.Tensor, tokens: torch.Tensor) -> None:
    """A padded first chunk's inputs: buf [padded] = tokens [T] then token 0; last [1] = T - 1."""
    T = tokens.shape[0]
    buf[:T].copy_(tokens)
    buf[T:].zero_()
    last.fill_(T - 1)


class _ChunkGraph:
    """One captured first-chunk forward at a padded length: static token and last-row inputs, logits out."""

    def __init__(self, owner: FastPrefill, padded: int) -> None:
        """Warm up and capture (the warm-up fills cache rows 0..padded-1 with padding: the first replay,
        which follows at once, overwrites them)."""
        dev = owner.cache.k[0].device
        self.tokens = torch.zeros(padded, dtype=torch.long, device=dev)  # [padded] token ids, 0 = padding
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # [1] row of the last real token
        self.graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up at this shape (Triton kernels compiled and loaded)
            owner._chunk(self.tokens, 0, True, self.last)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(self.graph):  # its own memory pool (sharing one failed: NOTES.md 6e)
            self.logits = owner._chunk(self.tokens, 0, True, self.last)  # [1, V]

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] (T <= padded) at position 0 -> logits [1, V] float32 (a copy: graphs share memory)."""
        _fill_padded(self.tokens, self.last, tokens)
        self.graph.replay()
        return self.logits.clone()
