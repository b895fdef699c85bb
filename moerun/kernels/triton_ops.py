"""Decode-step ops backed by the fused Triton kernels (kernels/triton/), same interface as TorchOps.

Holds the little state the kernels need (RoPE tables, attention and argmax scratch), allocated on
first use — which is the warm-up before a CUDA graph is captured, never inside the graph.
A weight type without a fused kernel falls back to TorchOps (visible in `paths`).
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from contextlib import AbstractContextManager
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moerun.kernels.gpu import sm_count
from moerun.kernels.torch_ops import Route, TorchOps
from moerun.kernels.triton import attention as ak
from moerun.kernels.triton import decode_ops as dk
from moerun.kernels.triton import embed as ek
from moerun.kernels.triton import imatvec as ik
from moerun.kernels.triton import qmatvec as qk
from moerun.kernels.triton import wmatvec as wk
from moerun.kernels.triton.pdl import launches as pdl_launches

REPACK_RESERVE = 1 << 30  # GPU bytes a repacked copy must leave free (prefill workspaces, graphs)


class TritonOps:
    """Fused Triton kernels for every decode-step op.

    words: products of the types in wmatvec.WORD_TYPES (K % 256 == 0) run on the word kernels, which read
    permuted activations (see TorchOps); False keeps every type on qmatvec's byte kernels.
    pad: the word-kernel products in wmatvec.PAD (Q6_K's) read a load-time copy of their matrices in the layout
    their kernel decodes fastest (`repack`: Q6_K one byte per value, `bytes_q6k`); False: the file's rows.
    ints: the products in int_kinds (default imatvec.INT_KINDS: Q4_K's, Q6_K's and Q8_0's) run on the
    integer-dot kernels, which read x quantized to 24 bits per value (`ints`; the producing RMSNorm, attention or,
    for down, the integer gate/up writes it); Q6_K's and Q8_0's through a load-time copy (`repack`).
    attn_fused: the attention's reduce done by the last program of each head in the split launch.
    qkv_fused: `qmatvecs` runs a layer's two q/k/v runs of different types (integer kernels) as one launch.
    down_ahead: the down kernels (integer, and the byte kernel's F32 / F16 / BF16) issue this many experts' loads
    before their arithmetic (`experts_ahead` of `imatvec.moe_down_i` and `qmatvec.moe_down`; 1: one at a time).
    pdl: the step's kernels are launched with programmatic dependent launch (`kernels/triton/pdl.py`; sm_90+):
    each lets the next one launch, then waits for the one before, so launches overlap the kernel before them
    (the integer matvecs load their first K-step's weights before that wait, the RMSNorm and norm + router
    kernels their weights).
    down_route: the integer down kernel ranks the experts itself from the router's logits and loads its first
    experts' words before that wait (its gate/up lets it launch only after its own wait; `imatvec.moe_down_i` route;
    where the gate/up did not rank them itself, or one expert at a time, the down reads the ids as before).
    byte_down_route: `down_route` for the byte-decoding kernels (F16 / BF16 / F32 down after a byte gate/up that
    ranked the experts itself: that gate/up launched `late`, the down ranking them again from the logits).
    attn_short, attn_long: the split attention's variants (`attention.AttnVariant`: KV positions per tile, warps,
    programs per SM its split policy aims at, first tile with the RoPE prologue's loads, next tiles' loads ahead of the
    tile before's arithmetic, q.k and p.v on the tensor cores for f16 caches) for the
    phases of the context's length (`attention_phases`; the fast step captures a graph per phase): short from length 1
    (`attention.ATTN_SHORT`: the early tile, 160 registers per thread at OLMoE's shape, 3 programs per SM), long
    (default `attention.ATTN_LONG`: the first tile after the prologue, 128 registers, 4 programs per SM; H100 Q4_K_M
    tg128 @ d4096 +6.6%, F16 +2.4%, NOTES.md 8n; None: no such phase) from `attention.attention_long_from`
    (attn_long_from: that length instead, for tests and tuning); attn_long_f16: the long phase's variant where the
    caches are f16 (default `attention.ATTN_LONG_F16`, the tensor-core tile: H200 Q4_K_M tg128 @ d2048 +3.0%,
    NOTES.md 9i; None: attn_long's). In both the KV length (and with several live splits per
    head the first tile) is read before the PDL wait (`attention._attn_split_kernel`; NOTES.md 8o, 8r).
    attn_min_split: the fewest KV positions a live split takes (`attention.ATTN_MIN_SPLIT`; `_live_splits`).
    float_tiles: launch tiles (rows per program, blocks per K-step, warps) for the F32 / F16 / BF16 byte kernels'
    products by kind ("mv", "out": a matvec of at least `qmatvec.LARGE_MV_ROWS` rows, "gate_up", "down") instead of
    `qmatvec.tile_for`'s (`ops.parse_tile`: for timing a sweep's tile in the whole step).
    argmax_fused: greedy sampling's argmax in one launch, the last chunk program reducing (`decode_ops.argmax` counter;
    H100 Q4_K_M tg128 +0.6%, @ d4096 +0.4%, NOTES.md 9a); False: a chunk launch and a reduce launch.

    Every gate/up launch that can (at most `decode_ops.ROUTE_MAX_E` experts; not the torch fallback) ranks the
    router's logits itself, the byte-decoding one (F16 / BF16 / F32 files) too; the byte-decoding matvec of F32 /
    F16 / BF16 loads its first K-step's weights before the PDL wait (NOTES.md 8i)."""

    name = "triton"

    def __init__(self, words: bool = True, pad: bool = True, ints: bool = True,
                 int_kinds: dict[int, tuple[str, ...]] | None = None, attn_fused: bool = True,
                 qkv_fused: bool = True, down_ahead: int = qk.EXPERTS_AHEAD,
                 pdl: bool = True, down_route: bool = True, byte_down_route: bool = True,
                 attn_short: ak.AttnVariant = ak.ATTN_SHORT, attn_long: ak.AttnVariant | None = ak.ATTN_LONG,
                 attn_long_f16: ak.AttnVariant | None = ak.ATTN_LONG_F16, attn_long_from: int | None = None,
                 attn_min_split: int = ak.ATTN_MIN_SPLIT,
                 float_tiles: dict[str, tuple[int, int, int]] | None = None, argmax_fused: bool = True) -> None:
        self.words, self.pad, self.use_ints = words, pad, ints
        self.int_kinds = ik.INT_KINDS if int_kinds is None else int_kinds
        self.attn_fused = attn_fused
        self.qkv_fused = qkv_fused
        self.down_ahead = down_ahead
        self.pdl = pdl
        self.down_route, self.byte_down_route = down_route, byte_down_route
        self._late_route: Route | None = None  # the route of a byte gate/up just launched `late` (for its down)
        self.attn_short = ak.AttnVariant(*attn_short)
        self.attn_long = None if attn_long is None else ak.AttnVariant(*attn_long)
        self.attn_long_f16 = None if attn_long_f16 is None else ak.AttnVariant(*attn_long_f16)
        self.attn_long_from = attn_long_from
        self.attn_min_split = attn_min_split
        self.float_tiles = {k: qk.Tile(*t) for k, t in (float_tiles or {}).items()}
        self.argmax_fused = argmax_fused
        self.attn_phase = 0  # which of `attention_phases` the step being launched is in (the fast step sets it)
        self._repack_warned = False
        self._rope: dict[tuple, torch.Tensor] = {}
        self._attn_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._argmax_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counter_scratch: dict[tuple, torch.Tensor] = {}

    def step_context(self) -> AbstractContextManager[None]:
        """Entered around each decode step's launches: PDL for the kernels that take it, where `pdl`."""
        return pdl_launches(self.pdl)

    @staticmethod
    def has_kernel(qtype: int) -> bool:
        return qtype in qk.SUPPORTED

    def kernel_name(self, qtype: int) -> str:
        """The decode path of a weight type, for the bench's path column."""
        ints = [kd for kd in wk.KERNELS if self.ints(qtype, 256, kd)]
        if self.words and qtype in wk.WORD_TYPES:
            kinds = [kd + (f">={wk.MIN_ROWS[(kd, qtype)]}" if (kd, qtype) in wk.MIN_ROWS else "")
                     + (" repacked" if self.pad and (kd, qtype) in wk.PAD else "")
                     for kd, table in wk.KERNELS.items() if qtype in table and kd not in ints]
            if ints:
                return f"triton-int({','.join(ints)})" + (f"+words({','.join(kinds)})" if kinds else "")
            if kinds == list(wk.KERNELS):  # every product, any size, the file's rows
                return "triton-words"
            return f"triton+words({','.join(kinds)})"  # e.g. Q6_K: words for some products, bytes for the rest
        return "triton" if qtype in qk.SUPPORTED else "torch-dequant (no fused kernel)"

    def perm(self, qtype: int, k: int, kind: str | None = None) -> bool:
        """Whether products of this type over K inputs (of `kind`: "mv", "gate_up", "down"; None: any) run on
        the word kernels (permuted activations)."""
        return self.words and wk.supports(qtype, k, kind)

    def ints(self, qtype: int, k: int, kind: str) -> bool:
        """Whether products of this type over K inputs (of `kind`) run on the integer-dot kernels (x24 input)."""
        return self.use_ints and ik.supports(qtype, k, kind, self.int_kinds)

    def ints_take(self, qtype: int, kind: str, w: torch.Tensor, k: int) -> bool:
        """Whether product `kind` of matrix w (as `repack` returned it) over K inputs runs on the integer kernels."""
        return self.ints(qtype, k, kind) and ik.takes(qtype, w, k)

    def repack(self, qtype: int, kind: str, w: torch.Tensor, ints: bool = True) -> torch.Tensor:
        """The rows this ops' product `kind` reads for a matrix (raw uint8 [..., M, row_bytes]): the integer
        kernels' copy where they take the product (Q6_K: signed bytes), else wmatvec.PAD's copy where a word kernel
        takes it and PAD says that is faster (Q6_K: 1.37x the bytes; the file's rows stay for prefill and the
        reference path), else w itself. ints=False: the caller will not pass x quantized to this product (e.g. a
        down whose gate/up is not on the integer kernels), so never the integer layout (the word kernels would
        misread it)."""
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        k = w.shape[-1] // size * block
        if ints and self.ints(qtype, k, kind):
            copy = ik.COPIES.get(qtype)  # the integer kernels' layout (Q4_K: its own rows)
        elif self.words and self.pad and wk.supports(qtype, k, kind, w.shape[-2]):
            copy = wk.PAD.get((kind, qtype))
        else:
            copy = None
        if copy is None:
            return w
        if w.is_cuda and torch.cuda.mem_get_info(w.device)[0] < 1.5 * w.nbytes + REPACK_RESERVE:
            if not self._repack_warned:
                warnings.warn(f"not enough free GPU memory for a repacked copy of {tuple(w.shape)} "
                              f"{GGMLQuantizationType(qtype).name} weights: it, and any later matrix that does not fit,"
                              " runs on the file's rows (slower; NOTES.md 7m)", stacklevel=2)
                self._repack_warned = True
            return w
        return copy(w)

    def qmatvec(self, w: torch.Tensor, qtype: int, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None = None, x_perm: torch.Tensor | None = None,
                x24: ik.X24 | None = None) -> torch.Tensor:
        if x24 is not None and self.ints_take(qtype, "mv", w, x.shape[-1]):
            return ik.qmatvec_i(w, x24, out, residual, qtype=qtype)
        if qtype not in qk.SUPPORTED:
            return TorchOps.qmatvec(w, qtype, x, out, residual)
        if x_perm is not None and self.words and wk.supports(qtype, x.shape[-1], "mv", w.shape[0]):
            return wk.KERNELS["mv"][qtype](w, x_perm, out, residual)
        kind = "out" if w.shape[0] >= qk.LARGE_MV_ROWS else "mv"
        return qk.qmatvec(w, qtype, x, out, residual, tile=self._float_tile(kind, qtype))

    def qmatvecs(self, prods: list[tuple[torch.Tensor, int, torch.Tensor]], x: torch.Tensor,
                 x_perm: torch.Tensor | None = None, x24: ik.X24 | None = None) -> None:
        """`qmatvec` of each (w, qtype, out); with qkv_fused two integer-kernel products of different layouts (a
        Q4_K q/k run and a Q6_K v) in one launch (`imatvec.qmatvec_i2`)."""
        k = x.shape[-1]
        if (self.qkv_fused and x24 is not None and len(prods) == 2 and prods[0][1] != prods[1][1]
                and all(self.ints_take(qt, "mv", w, k) for w, qt, _ in prods)):
            (w, qt, out), (w2, qt2, out2) = prods
            ik.qmatvec_i2(w, qt, out, w2, qt2, out2, x24)
            return
        for w, qt, out in prods:
            self.qmatvec(w, qt, x, out, x_perm=x_perm, x24=x24)

    def moe_gate_up(self, w_gate: torch.Tensor, w_up: torch.Tensor, qtype_gate: int, qtype_up: int,
                    x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, act: str = "silu",
                    x_perm: torch.Tensor | None = None, perm_out: bool = False,
                    route: Route | None = None, x24: ik.X24 | None = None,
                    h_x24: ik.X24 | None = None) -> torch.Tensor:
        """As TorchOps.moe_gate_up; with `route` the word and integer kernels choose the experts inside the same
        launch, the other paths launch route_topk first. h_x24: out also quantized (for an integer-dot down; the
        integer gate/up only, so x24 must be given)."""
        k = x.shape[-1]
        self._late_route = None
        if route is not None and route.logits.shape[-1] > dk.ROUTE_MAX_E:  # too many experts to rank in gate/up
            self.route_topk(route.logits, ids.shape[0], route.renormalise, route.weights_out, ids)
            route = None
        if (x24 is not None and qtype_gate == qtype_up and self.ints_take(qtype_gate, "gate_up", w_gate, k)
                and self.ints_take(qtype_up, "gate_up", w_up, k)):
            cnt = None if h_x24 is None else self._counters(ids.shape[0] * out.shape[-1] // 32, out.device)
            return ik.moe_gate_up_i(w_gate, w_up, x24, ids, out, act, perm_out=perm_out, route=route, h_out=h_x24,
                                    counters=cnt, qtype=qtype_gate, late=self._routed_down(route, h_x24, ids))
        if h_x24 is not None:
            raise ValueError("h_x24 (h quantized for an integer-dot down) needs the integer gate/up kernel")
        if x_perm is not None and qtype_gate == qtype_up and self.perm(qtype_gate, k, "gate_up"):
            return wk.KERNELS["gate_up"][qtype_gate](w_gate, w_up, x_perm, ids, out, act, perm_out=perm_out,
                                                     route=route)
        if qtype_gate not in qk.SUPPORTED or qtype_up not in qk.SUPPORTED:  # the torch fallback
            if route is not None:
                self.route_topk(route.logits, ids.shape[0], route.renormalise, route.weights_out, ids)
            return TorchOps.moe_gate_up(w_gate, w_up, qtype_gate, qtype_up, x, ids, out, act, perm_out=perm_out)
        late = route is not None and self.byte_down_route and qtype_gate in qk.FLOATS  # a float down follows
        self._late_route = route if late else None
        return qk.moe_gate_up(w_gate, w_up, qtype_gate, qtype_up, x, ids, out, act=act, perm_out=perm_out,
                              route=route, late=late,
                              tile=self._float_tile("gate_up", qtype_gate))

    def moe_down(self, w_down: torch.Tensor, qtype: int, h: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, residual: torch.Tensor, out: torch.Tensor,
                 h_perm: bool = False, h_x24: ik.X24 | None = None, route: Route | None = None) -> torch.Tensor:
        """As TorchOps.moe_down; `route` (the gate/up's) lets the integer down rank the experts itself (down_route)."""
        if h_x24 is not None and self.ints_take(qtype, "down", w_down, h.shape[-1]):
            return ik.moe_down_i(w_down, h_x24, ids, weights, residual, out, qtype=qtype,
                                 experts_ahead=self.down_ahead,
                                 route=route if self._routed_down(route, h_x24, ids) else None)
        if h_perm:
            if not self.perm(qtype, h.shape[-1], "down"):
                raise ValueError(f"permuted h given to a down product of type {qtype} without a word kernel")
            return wk.KERNELS["down"][qtype](w_down, h, ids, weights, residual, out)
        if qtype not in qk.SUPPORTED:
            return TorchOps.moe_down(w_down, qtype, h, ids, weights, residual, out)
        routed = (route is not None and route is self._late_route and qtype in qk.FLOATS
                  and qk.experts_group(ids.shape[0], self.down_ahead) > 1)
        self._late_route = None
        return qk.moe_down(w_down, qtype, h, ids, weights, residual, out, experts_ahead=self.down_ahead,
                           route=route if routed else None, tile=self._float_tile("down", qtype))

    def _float_tile(self, kind: str, qtype: int) -> qk.Tile | None:
        """The `float_tiles` tile of product `kind` where qtype is F32 / F16 / BF16, else None (the default)."""
        return self.float_tiles.get(kind) if qtype in qk.FLOATS else None

    def _routed_down(self, route: Route | None, h_x24: ik.X24 | None, ids: torch.Tensor) -> bool:
        """Whether the integer gate/up (routing itself, writing h_x24) and down of a layer run as `down_route`
        pairs: the gate/up `late`, the down ranking from route.logits. Decided from what both calls see."""
        return (self.down_route and route is not None and h_x24 is not None
                and route.logits.shape[-1] <= dk.ROUTE_MAX_E and qk.experts_group(ids.shape[0], self.down_ahead) > 1)

    def _counters(self, n: int, device: torch.device, owner: str = "") -> torch.Tensor:
        """int32 zeros [n] for the kernels' arrival counters (left zero by them), allocated once per size (kernels
        asking for the same size share them) and owner (a kernel that names itself gets its own)."""
        c = self._counter_scratch.get((n, device, owner))
        if c is None:
            c = self._counter_scratch[(n, device, owner)] = torch.zeros(n, dtype=torch.int32, device=device)
        return c

    @staticmethod
    def embed(w: torch.Tensor, qtype: int, ids: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if qtype not in qk.SUPPORTED:
            return TorchOps.embed(w, qtype, ids, out, scale)
        return ek.embed(w, qtype, ids, out, scale)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 out_perm: torch.Tensor | None = None, out_x24: ik.X24 | None = None) -> torch.Tensor:
        return dk.rms_norm(x, w, eps, out, out_perm, out_x24)

    @staticmethod
    def router(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return dk.router_logits(x, w, out)

    def norm_router(self, x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_router: torch.Tensor, out: torch.Tensor,
                    xn: torch.Tensor, xn_perm: torch.Tensor | None = None,
                    xn_x24: ik.X24 | None = None) -> torch.Tensor:
        if x.shape[-1] > 16384:
            TorchOps.norm_router(x, norm_w, eps, w_router, out, xn, xn_perm)
            if xn_x24 is not None:
                ik.quantize_x24(xn, xn_x24)
            return out
        return dk.norm_router(x, norm_w, eps, w_router, out, xn, xn_perm, xn_x24)

    @staticmethod
    def route_topk(logits: torch.Tensor, k: int, renormalise: bool, weights_out: torch.Tensor,
                   ids_out: torch.Tensor) -> None:
        dk.route_topk(logits, k, renormalise, weights_out, ids_out)

    def _rope_table(self, k_cache: torch.Tensor, rope_dim: int, base: float, scale: float,
                    freq_factors: torch.Tensor | None) -> torch.Tensor:
        key = (k_cache.shape[0], rope_dim, base, scale, freq_factors is not None, k_cache.device)
        table = self._rope.get(key)
        if table is None:
            table = self._rope[key] = dk.rope_table(k_cache.shape[0], rope_dim, base, scale, freq_factors,
                                                    device=k_cache.device)
        return table

    def _phase_table(self, n_ctx: int, n_head: int, device: torch.device) -> list[tuple[int, ak.AttnVariant]]:
        """[(KV length it starts from, variant)] of each attention phase: the short one from 1, the long one
        (where there is one) after it."""
        table = [(1, self.attn_short)]
        if self.attn_long is not None:
            # where the default long variant would start, whichever long variant runs there
            start = self.attn_long_from or ak.attention_long_from(n_ctx, n_head, sm_count(device), self.attn_short,
                                                                  ak.ATTN_LONG, self.attn_min_split)
            if start is not None and start > 1:
                table.append((start, self.attn_long))
        return table

    def attention_phases(self, n_ctx: int, n_head: int, device: torch.device) -> tuple[int, ...]:
        """The KV lengths each attention phase starts from (`_phase_table`): (1,) or (1, long)."""
        return tuple(start for start, _ in self._phase_table(n_ctx, n_head, device))

    def _attn_variant(self, k_cache: torch.Tensor, out: torch.Tensor, window: int) -> ak.AttnVariant:
        """This step's attention variant: its phase's, or for a sliding window too short to reach that phase the
        phase of the window's length."""
        table = self._phase_table(k_cache.shape[0], out.shape[0], out.device)
        p = min(self.attn_phase, len(table) - 1)
        if window > 0:
            p = min(p, bisect_right([start for start, _ in table], window) - 1)
        if p > 0 and self.attn_long_f16 is not None and k_cache.dtype == torch.float16:
            return self.attn_long_f16  # the long phase on f16 caches
        return table[p][1]

    def _attention_scratch(self, k_cache: torch.Tensor, out: torch.Tensor, block_n: int,
                           pps: int) -> tuple[torch.Tensor, ...]:
        H, Dv = out.shape
        key = (k_cache.shape[0], H, Dv, out.device, block_n, pps)
        scratch = self._attn_scratch.get(key)
        if scratch is None:
            splits = ak.attention_splits(k_cache.shape[0], H, sm_count(out.device), block_n,
                                         pps)  # one wave of split programs
            scratch = self._attn_scratch[key] = ak.attention_scratch(H, Dv, splits, out.device)
        return scratch

    def _attn_launch(self, k_cache: torch.Tensor, out: torch.Tensor, window: int) -> dict[str, Any]:
        """`ak.attention_decode`'s scratch, counters and tile arguments for this step's variant (`_attn_variant`)."""
        v = self._attn_variant(k_cache, out, window)
        return dict(scratch=self._attention_scratch(k_cache, out, v.block_n, v.programs_per_sm),
                    counters=self._attn_counters(out), block_n=v.block_n, num_warps=v.warps, early=v.early,
                    ahead=v.ahead, dot=v.dot, min_split=self.attn_min_split)

    def _attn_counters(self, out: torch.Tensor) -> torch.Tensor | None:
        return self._counters(out.shape[0], out.device) if self.attn_fused else None

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor | None,
                           k_norm_w: torch.Tensor | None, pos_t: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, q_out: torch.Tensor, *, eps: float, qk_norm: str,
                           rope_style: str, rope_dim: int, base: float, scale: float,
                           freq_factors: torch.Tensor | None) -> None:
        table = self._rope_table(k_cache, rope_dim, base, scale, freq_factors)
        dk.qk_norm_rope_store(q, k, v, q_norm_w, k_norm_w, table, pos_t, k_cache, v_cache, q_out, eps,
                              qk_norm=qk_norm, rope_style=rope_style)

    def attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         kv_len_t: torch.Tensor, scale: float, window: int, out: torch.Tensor,
                         out_perm: torch.Tensor | None = None, out_x24: ik.X24 | None = None) -> None:
        ak.attention_decode(q, k_cache, v_cache, kv_len_t, scale, window, out, out_perm=out_perm, out_x24=out_x24,
                            **self._attn_launch(k_cache, out, window))

    def rope_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor | None,
                       k_norm_w: torch.Tensor | None, pos_t: torch.Tensor, kv_len_t: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, q_rot: torch.Tensor, out: torch.Tensor, *,
                       eps: float, qk_norm: str, rope_style: str, rope_dim: int, base: float, scale: float,
                       freq_factors: torch.Tensor | None, attn_scale: float, window: int,
                       out_perm: torch.Tensor | None = None, out_x24: ik.X24 | None = None) -> None:
        """As TorchOps.rope_attention in one launch pair (split + reduce): the split programs norm and rotate
        q themselves and store this step's k and v (q_rot is not written; pos_t is kv_len_t - 1)."""
        table = self._rope_table(k_cache, rope_dim, base, scale, freq_factors)
        rope = ak.RopeStore(k, v, q_norm_w, k_norm_w, table, eps, qk_norm, rope_style)
        ak.attention_decode(q.view(q_rot.shape), k_cache, v_cache, kv_len_t, attn_scale, window, out,
                            out_perm=out_perm, rope=rope, out_x24=out_x24, **self._attn_launch(k_cache, out, window))

    def argmax(self, logits: torch.Tensor, out_id: torch.Tensor,
               chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        key = (logits.shape[-1], logits.device)
        scratch = self._argmax_scratch.get(key)
        if scratch is None:
            scratch = self._argmax_scratch[key] = dk.argmax_scratch(logits.shape[-1], logits.device)
        counter = self._counters(1, logits.device, "argmax") if self.argmax_fused else None
        dk.argmax(logits, out_id, scratch, chain=chain, counter=counter)

    advance = staticmethod(TorchOps.advance)
