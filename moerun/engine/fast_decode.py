"""The fast decode step: one token through every layer with fused ops, replayed as one CUDA graph.

Everything stays on the device within a step: the token and position are read from device buffers,
the router's top-k runs on the GPU and the expert kernels read the chosen ids from device memory;
the host only reads the chosen next token. The same step runs eagerly (any device, `TorchOps` or
Triton ops) or captured once and replayed (`use_graph`, CUDA only). Ops whose attention has variants for ranges of
the context's length (`attention_phases`: TritonOps' short and long phases) get one graph per phase, each
replayed for the positions of its phase.

A dense MLP is run as a one-expert MoE (ids = [0], weight 1), so every model uses the same two
fused FFN kernels.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from moerun.engine.kv_cache import KVCache
from moerun.kernels.torch_ops import X24, Route
from moerun.models.config import ModelConfig
from moerun.models.spec import ArchSpec
from moerun.models.weights import ModelWeights
from moerun.quant.qtensor import QTensor


@dataclass
class _Mat:
    """A quantized matrix as the kernels take it: raw rows [..., row_bytes] and the GGML type."""

    raw: torch.Tensor
    qtype: int
    name: str


def _mat(w: Any, experts: bool = False) -> _Mat:
    assert isinstance(w, QTensor), "matrices stay quantized"
    raw = w.raw if experts or w.raw.dim() == 2 else w.raw.reshape(-1, w.raw.shape[-1])
    return _Mat(raw, int(w.qtype.ggml), w.name)


def _fuse_runs(mats: list[QTensor]) -> list[tuple[_Mat, int, int]]:
    """Consecutive matrices of one type and row size (q, k, v) as one matrix each: (matrix, first output
    row, end) per run. A run's rows are copied once into one tensor and the QTensors' `raw` become views
    of it (no second copy stays in memory), so one launch multiplies the run."""
    runs: list[list[QTensor]] = []
    for w in mats:
        if runs and runs[-1][0].qtype.ggml == w.qtype.ggml and runs[-1][0].raw.shape[-1] == w.raw.shape[-1]:
            runs[-1].append(w)
        else:
            runs.append([w])
    out, row = [], 0
    for run in runs:
        raws = [w.raw.reshape(-1, w.raw.shape[-1]) for w in run]
        cat = raws[0] if len(run) == 1 else torch.cat(raws)
        if len(run) > 1:
            a = 0
            for w, r in zip(run, raws, strict=True):
                w.raw = cat[a:a + r.shape[0]].view(w.raw.shape)
                a += r.shape[0]
        out.append((_Mat(cat, int(run[0].qtype.ggml), "+".join(w.name for w in run)), row, row + cat.shape[0]))
        row += cat.shape[0]
    return out


class FastDecoder:
    """Static buffers + the per-token sequence of fused ops for one model and one KV cache."""

    def __init__(self, spec: ArchSpec, cfg: ModelConfig, weights: ModelWeights, cache: KVCache,
                 ops: Any, *, use_graph: bool) -> None:
        self.spec, self.cfg, self.cache, self.ops = spec, cfg, cache, ops
        dev = weights.globals["output_norm"].device
        self.device = dev
        f32 = dict(device=dev, dtype=torch.float32)
        N, H, Hkv, D, Dv = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v
        K = cfg.n_expert_used if cfg.is_moe else 1
        F = cfg.n_ff_exp if cfg.is_moe else cfg.n_ff
        # per-step inputs and outputs (device)
        self.tok = torch.zeros(1, device=dev, dtype=torch.long)
        self.pos = torch.zeros(1, device=dev, dtype=torch.long)
        self.kv_len = torch.ones(1, device=dev, dtype=torch.long)  # pos + 1
        self.next_id = torch.zeros(1, device=dev, dtype=torch.long)
        self.logits = torch.empty(cfg.n_vocab, **f32)
        # activations
        self.x = torch.empty(N, **f32)        # residual stream
        self.xn = torch.empty(N, **f32)       # normalised input of a projection
        self.y = torch.empty(N, **f32)        # block output before a post-norm
        self.tmp = torch.empty(N, **f32)
        self.zero = torch.zeros(N, **f32)
        self.qkv = torch.empty(H * D + Hkv * D + Hkv * Dv, **f32)  # q, k, v, adjacent (fused products)
        self.q, self.k, self.v = self.qkv.split([H * D, Hkv * D, Hkv * Dv])
        self.q_rot = torch.empty(H, D, **f32)
        self.attn = torch.empty(H, Dv, **f32)
        self.attn_p = torch.empty(H * Dv, **f32)  # attn in the word kernels' order, where attn_output reads it
        self.attn24 = X24.empty((H * Dv,), dev)  # attn quantized, where attn_output reads it (ops.ints)
        self.router_logits = torch.empty(max(cfg.n_expert, 1), **f32)
        self.ids = torch.zeros(K, device=dev, dtype=torch.int32)       # chosen experts
        self.route_w = torch.ones(K, **f32)                             # their weights
        self.h = torch.empty(K, F, **f32)
        self.h24 = X24.empty((K, F), dev) if F % 32 == 0 else None  # h quantized, where an integer down reads it
        self.xp = torch.empty(N, **f32)       # xn in the word kernels' order (ops.perm), where one reads it
        self.x24 = X24.empty((N,), dev)  # xn quantized, where an integer-dot kernel reads it (ops.ints)
        self._weights(weights)
        self.sampler: Any = None  # a moerun.engine.sampler.Sampler; None = greedy (ops.argmax)
        self._graph_key: Any = None  # the sampler structure the graph was captured with
        self.graphs: list[torch.cuda.CUDAGraph] | None = None  # one per attention phase (`_phase_starts`)
        self._chained: tuple[int, int] | None = None  # (token, pos) the device inputs already hold
        self.use_graph = use_graph and dev.type == "cuda"
        # `stream`: two host slots for chosen tokens (pinned on CUDA, so the copies are asynchronous) and the
        # events that say when each was written
        self._host = torch.zeros(2, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._ready = [torch.cuda.Event() for _ in range(2)] if dev.type == "cuda" else None

    def _weights(self, w: ModelWeights) -> None:
        g = w.globals
        self.embd = g["token_embd"]
        self.out_norm = g["output_norm"]
        self.out_mat = self._repack("mv", _mat(g.get("output", g["token_embd"])))
        self.rope_freqs = g.get("rope_freqs")
        self.layers = []
        moe = self.cfg.is_moe
        for L in w.layers:
            d: dict[str, Any] = {k: L[k] for k in L if isinstance(L[k], torch.Tensor)}  # norms, router
            for k in ("attn_q", "attn_k", "attn_v"):
                d[k] = _mat(L[k])
            # attn_output reads the attention's quantized output only where its heads split into 32-value groups
            d["attn_output"] = self._repack("mv", _mat(L["attn_output"]), ints=self.cfg.head_dim_v % 32 == 0)
            d["qkv_runs"] = [(self._repack("mv", m), a, b) for m, a, b in _fuse_runs([L["attn_q"], L["attn_k"],
                                                                                       L["attn_v"]])]
            if d["qkv_runs"][-1][2] != self.qkv.numel():
                raise ValueError(f"layer {len(self.layers)}: q/k/v matrices have {d['qkv_runs'][-1][2]} rows, "
                                 f"the model's heads need {self.qkv.numel()}")
            if moe:
                for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                    d[k] = _mat(L[k], experts=True)
            else:  # dense MLP as one expert: [1, rows, row_bytes]
                for src in ("ffn_gate", "ffn_up", "ffn_down"):
                    m = _mat(L[src])
                    d[src + "_exps"] = _Mat(m.raw[None], m.qtype, m.name)
            gate, up = d["ffn_gate_exps"], d["ffn_up_exps"]
            if gate.qtype == up.qtype:  # one gate/up launch reads both: the same layout, or neither copied
                g2, u2 = self._repack("gate_up", gate), self._repack("gate_up", up)
                d["ffn_gate_exps"], d["ffn_up_exps"] = (g2, u2) if (g2 is gate) == (u2 is up) else (gate, up)
            g2, u2, n = d["ffn_gate_exps"], d["ffn_up_exps"], self.cfg.n_embd
            # gate/up on the integer kernels (both matrices in their layout) writes h quantized for down; down's
            # matrix goes into the integer layout only then
            d["int_gate_up"] = g2.qtype == u2.qtype and all(self.ops.ints_take(m.qtype, "gate_up", m.raw, n)
                                                            for m in (g2, u2))
            d["ffn_down_exps"] = self._repack("down", d["ffn_down_exps"], ints=d["int_gate_up"])
            d["attn_norm_outs"] = self._norm_outs(*(m for m, _, _ in d["qkv_runs"]))
            self.layers.append(d)
        self.final_norm_outs = self._norm_outs(self.out_mat)  # the final norm's, for the output matrix

    def _repack(self, kind: str, m: _Mat, ints: bool = True) -> _Mat:
        """m in the layout the ops' product `kind` reads (`ops.repack`: a load-time copy, or m itself); ints=False:
        the step will not give this product a quantized x, so not the integer kernels' layout."""
        raw = self.ops.repack(m.qtype, kind, m.raw, ints=ints)
        return m if raw is m.raw else _Mat(raw, m.qtype, m.name)

    # --- the step -------------------------------------------------------------------------------

    def _embed(self) -> None:
        self.ops.embed(self.embd.raw, int(self.embd.qtype.ggml), self.tok, self.x.view(1, -1), self.cfg.embed_scale)

    def _add_block_output(self, post_norm: torch.Tensor) -> None:
        """x += post_norm(y) (architectures with post-norms)."""
        self.ops.rms_norm(self.y, post_norm, self.cfg.rms_eps, self.tmp)
        self.x.add_(self.tmp)

    def _perm(self, kind: str, *mats: _Mat) -> torch.Tensor | None:
        """self.xp if one of these matrices (over the model width, in products of `kind`) reads permuted
        activations, else None."""
        n = self.cfg.n_embd
        return self.xp if any(self.ops.perm(m.qtype, n, kind) and not self.ops.ints(m.qtype, n, kind)
                              for m in mats) else None

    def _x24(self, kind: str, *mats: _Mat) -> X24 | None:
        """self.x24 if one of these matrices (over the model width, in products of `kind`) reads x quantized
        (an integer-dot kernel), else None."""
        return self.x24 if any(self.ops.ints(m.qtype, self.cfg.n_embd, kind) for m in mats) else None

    def _norm_outs(self, *mats: _Mat) -> tuple[torch.Tensor | None, X24 | None]:
        """(out_perm, out_x24) of the RMSNorm into xn that feeds these matrices' products: xn also permuted /
        quantized where they read it so (`_perm`, `_x24`; chosen once, at load)."""
        return self._perm("mv", *mats), self._x24("mv", *mats)

    def _layer(self, i: int, L: dict[str, Any]) -> None:
        cfg, spec, ops = self.cfg, self.spec, self.ops
        swa = cfg.swa_layers[i]
        runs = L["qkv_runs"]
        xp, x24 = L["attn_norm_outs"]
        ops.rms_norm(self.x, L["attn_norm"], cfg.rms_eps, self.xn, out_perm=xp, out_x24=x24)
        # q, k and v: one product per run of matrices of one type (ops may launch two runs together)
        ops.qmatvecs([(m.raw, m.qtype, self.qkv[a:b]) for m, a, b in runs], self.xn, x_perm=xp, x24=x24)
        wo = L["attn_output"]
        a24 = self.attn24 if ops.ints(wo.qtype, self.attn_p.shape[0], "mv") and cfg.head_dim_v % 32 == 0 else None
        ap = self.attn_p if a24 is None and ops.perm(wo.qtype, self.attn_p.shape[0], "mv") else None
        ops.rope_attention(  # QK-norm, RoPE, this step's k/v into the cache, attention over it
            self.q, self.k, self.v, L.get("attn_q_norm"), L.get("attn_k_norm"), self.pos, self.kv_len,
            self.cache.k[i], self.cache.v[i], self.q_rot, self.attn, eps=cfg.rms_eps, qk_norm=spec.qk_norm,
            rope_style=spec.rope_style, rope_dim=cfg.rope_dim,
            base=cfg.rope_base_swa if swa else cfg.rope_base, scale=1.0 if swa else cfg.rope_scale,
            freq_factors=self.rope_freqs, attn_scale=cfg.attn_scale, window=cfg.sliding_window if swa else 0,
            out_perm=ap, out_x24=a24)
        if spec.post_norms:
            ops.qmatvec(wo.raw, wo.qtype, self.attn.view(-1), self.y, x_perm=ap, x24=a24)
            self._add_block_output(L["post_attention_norm"])
        else:
            ops.qmatvec(wo.raw, wo.qtype, self.attn.view(-1), self.x, residual=self.x, x_perm=ap, x24=a24)

        g, u, d = L["ffn_gate_exps"], L["ffn_up_exps"], L["ffn_down_exps"]
        xp = self._perm("gate_up", g, u)
        x24 = self.x24 if L["int_gate_up"] else None
        route = None
        if cfg.is_moe:  # norm + the router's logits; gate/up chooses the experts from them (ids, route_w)
            ops.norm_router(self.x, L["ffn_norm"], cfg.rms_eps, L["ffn_gate_inp"], self.router_logits, self.xn, xp,
                            xn_x24=x24)
            route = Route(self.router_logits, self.route_w, cfg.expert_weights_norm)
        else:
            ops.rms_norm(self.x, L["ffn_norm"], cfg.rms_eps, self.xn, out_perm=xp, out_x24=x24)
        f = self.h.shape[-1]
        # down reads h quantized (written by the integer gate/up), or permuted (a word kernel), or as it is
        h24 = self.h24 if x24 is not None and ops.ints(d.qtype, f, "down") else None
        h_perm = h24 is None and ops.perm(d.qtype, f, "down")
        ops.moe_gate_up(g.raw, u.raw, g.qtype, u.qtype, self.xn, self.ids, self.h, act=spec.act, x_perm=xp,
                        perm_out=h_perm, route=route, x24=x24, h_x24=h24)
        if spec.post_norms:
            ops.moe_down(d.raw, d.qtype, self.h, self.ids, self.route_w, self.zero, self.y, h_perm=h_perm, h_x24=h24,
                         route=route)
            self._add_block_output(L["post_ffw_norm"])
        else:
            ops.moe_down(d.raw, d.qtype, self.h, self.ids, self.route_w, self.x, self.x, h_perm=h_perm, h_x24=h24,
                         route=route)

    def _phase_starts(self) -> tuple[int, ...]:
        """The KV lengths from which each of the ops' attention phases runs (`ops.attention_phases`, host
        arithmetic), ascending from 1."""
        return self.ops.attention_phases(self.cache.n_ctx, self.cfg.n_head, self.device)

    def _phase(self, pos: int) -> int:
        """The attention phase of the step at `pos` (KV length pos + 1)."""
        return bisect_right(self._phase_starts(), pos + 1) - 1

    def _step(self, phase: int = 0) -> None:
        """One token: tok at pos -> logits, next_id; writes the KV cache at pos; then tok = next_id, pos + 1.
        phase: the attention phase (`_phase`) of pos."""
        self.ops.attn_phase = phase
        with self.ops.step_context():  # TritonOps: programmatic dependent launch where its `pdl` says so
            self._step_launches()

    def _step_launches(self) -> None:
        cfg = self.cfg
        self._embed()
        for i, L in enumerate(self.layers):
            self._layer(i, L)
        xp, x24 = self.final_norm_outs
        self.ops.rms_norm(self.x, self.out_norm, cfg.rms_eps, self.xn, out_perm=xp, out_x24=x24)
        self.ops.qmatvec(self.out_mat.raw, self.out_mat.qtype, self.xn, self.logits, x_perm=xp, x24=x24)
        if cfg.final_logit_softcap:
            c = cfg.final_logit_softcap
            self.logits.copy_(torch.tanh(self.logits / c) * c)
        chain = (self.tok, self.pos, self.kv_len)  # the next step's inputs, set on the device
        if self.sampler is None:
            self.ops.argmax(self.logits, self.next_id, chain=chain)
        else:
            self.sampler.sample(self.logits, self.next_id)
            self.ops.advance(self.next_id, *chain)

    def _capture(self, token: int, pos: int) -> None:
        """A graph per attention phase, each warmed up and captured at (token, pos): every phase's kernels give the
        same sums at any length, so the warm-up steps all write pos's cache row alike."""
        state = self.sampler.save_state() if self.sampler is not None else None
        self.graphs = []
        for phase in range(len(self._phase_starts())):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):  # warm up (Triton compiles, allocator settles), both at (token, pos)
                    self._inputs(token, pos)
                    self._step(phase)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()  # its own memory pool: the phases replay in any order
            with torch.cuda.graph(graph):
                self._step(phase)
            self.graphs.append(graph)
        if state is not None:  # the warm-up steps sampled: undo their counter and history updates
            self.sampler.load_state(state)
        self._graph_key = None if self.sampler is None else (id(self.sampler), self.sampler.graph_key())

    def run(self, token: int, pos: int) -> torch.Tensor:
        """Queue one step for `token` at `pos` (no host sync); returns the device next-id buffer [1].
        The input buffers are written from the host only when the last step (`decode`) did not already
        leave them there: a chain of decode steps launches nothing but the graph."""
        if self.use_graph:
            key = None if self.sampler is None else (id(self.sampler), self.sampler.graph_key())
            if self.graphs is None or key != self._graph_key:
                self._capture(token, pos)  # its warm-up steps run this very step (and move the inputs on)
                self._chained = None
        if self._chained != (token, pos):
            self._inputs(token, pos)
        self._chained = None
        self._launch(pos)
        return self.next_id

    def _launch(self, pos: int) -> None:
        """Queue one step on the inputs the device holds (for position `pos`: which phase's graph)."""
        phase = self._phase(pos)
        if self.use_graph:
            self.graphs[phase].replay()
        else:
            self._step(phase)

    def decode(self, token: int, pos: int) -> int:
        """One step for `token` at `pos` -> the chosen next token (the host waits for it)."""
        nid = int(self.run(token, pos).item())
        self._chained = (nid, pos + 1)  # what the step left in tok / pos on the device
        return nid

    def stream(self, token: int, pos: int, n: int) -> Iterator[int]:
        """`n` chained steps from `token` at `pos` -> each step's chosen token, as `decode` would give them.

        Step i + 1 is queued before the host waits for step i's token (its inputs are already on the device:
        each step chains them), so the GPU does not idle while the host reads a token and launches the next
        step. Each token is copied into one of two host slots behind its step; the host reads slot i % 2 only
        after step i's copy, and step i + 2's copy is queued only after that read. Closing the iterator after
        token i discards the queued step i + 1: its cache row (pos + i + 1) is written again by whatever runs
        there next, and the sampler's counter and history step back (`Sampler.unpush`).
        """
        if n <= 0:
            return
        queued = done = 0  # steps queued; tokens handed out
        last = token
        try:
            self.run(token, pos)
            self._copy_token(0)
            queued = 1
            while done < n:
                if queued < n:
                    self._launch(pos + queued)
                    self._copy_token(queued % 2)
                    queued += 1
                last = self._read_token(done % 2)
                done += 1
                yield last
        finally:
            if queued > done and self.sampler is not None:
                self.sampler.unpush()  # the discarded step's draw
            self._chained = (last, pos + done) if queued == done and done else None

    def _copy_token(self, slot: int) -> None:
        """Behind the queued step: its chosen token into host slot `slot` (asynchronous on CUDA)."""
        self._host[slot:slot + 1].copy_(self.next_id, non_blocking=self._ready is not None)
        if self._ready is not None:
            self._ready[slot].record()

    def _read_token(self, slot: int) -> int:
        if self._ready is not None:
            self._ready[slot].synchronize()
        return int(self._host[slot])

    def _inputs(self, token: int, pos: int) -> None:
        self.tok.fill_(token)
        self.pos.fill_(pos)
        self.kv_len.fill_(pos + 1)
