"""Decode-step ops backed by the fused Triton kernels (kernels/triton/), same interface as TorchOps.

Holds the little state the kernels need (RoPE tables, attention and argmax scratch), allocated on
first use — which is the warm-up before a CUDA graph is captured, never inside the graph.
A weight type without a fused kernel falls back to TorchOps (visible in `paths`).
"""

from __future__ import annotations

import torch

from moerun.kernels.torch_ops import TorchOps
from moerun.kernels.triton import decode_ops as dk
from moerun.kernels.triton import embed as ek
from moerun.kernels.triton import qmatvec as qk
from moerun.kernels.triton import tcmatvec as tc
from moerun.kernels.triton import wmatvec as wk


class TritonOps:
    """Fused Triton kernels for every decode-step op.

    words: products of the types in wmatvec.WORD_TYPES (K % 256 == 0) run on the word kernels, which read
    permuted activations (see TorchOps); False keeps every type on qmatvec's byte kernels.
    tc: Q4_K, Q6_K and Q8_0 products run on tcmatvec's tensor-core kernels instead: x prepared by its producer
    (RMSNorm, attention) in the layouts its readers asked for on the first step, or else by one more launch; h
    handed from gate/up to down prepared (an experiment: benchmarks/NOTES.md 7e)."""

    name = "triton"

    def __init__(self, words: bool = True, tc: bool = False) -> None:
        self.words = words
        self.tc = tc
        self._tc_x: dict[tuple, tc.TcX] = {}  # prepared x per (K, format, device); h per ("h", n_sel, F, device)
        # preparations written by the producers of x (rms_norm, attention), per (data_ptr, numel, layout); the
        # layouts each producer's output is read in, learned from the products that had to prepare it themselves
        self._tc_made: dict[tuple, tc.TcX] = {}
        self._tc_want: dict[tuple, list[int]] = {}
        self._rope: dict[tuple, torch.Tensor] = {}
        self._attn_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._argmax_scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def has_kernel(qtype: int) -> bool:
        return qtype in qk.SUPPORTED

    def kernel_name(self, qtype: int) -> str:
        """The decode path of a weight type, for the bench's path column."""
        if self.tc and qtype in tc.FORMATS:
            return "triton-words+tc"
        if self.words and qtype in wk.WORD_TYPES:
            kinds = [kd + (f">={wk.MIN_ROWS[(kd, qtype)]}" if (kd, qtype) in wk.MIN_ROWS else "")
                     for kd, table in wk.KERNELS.items() if qtype in table]
            if kinds == list(wk.KERNELS):  # every product, any size
                return "triton-words"
            return f"triton+words({','.join(kinds)})"  # e.g. Q6_K: words for some products, bytes for the rest
        return "triton" if qtype in qk.SUPPORTED else "torch-dequant (no fused kernel)"

    def perm(self, qtype: int, k: int, kind: str | None = None) -> bool:
        """Whether products of this type over K inputs (of `kind`: "mv", "gate_up", "down"; None: any) run on
        the word kernels (permuted activations)."""
        return self.words and wk.supports(qtype, k, kind)

    def h_layout(self, qtype_gate: int, qtype_up: int, qtype_down: int, f: int) -> bool | str:
        """As TorchOps', or "tcN": gate/up writes h prepared (in the down type's TcX layout N) for a tensor-core
        down product."""
        if self.tc and qtype_gate == qtype_up and qtype_gate in tc.FORMATS and tc.supports_tc(qtype_down, f):
            return f"tc{tc.FORMATS[qtype_down]}"
        return self.perm(qtype_down, f, "down")

    def _prepared(self, x: torch.Tensor, fmt: int = 4) -> tc.TcX:
        """x prepared for the tensor-core kernels in layout `fmt`: what x's producer (rms_norm, attention) wrote
        with it, else one more launch into a buffer per size (allocated on first use: the warm-up), and the
        producer learns to write that layout from its next call on (the decode step's first, eager, step).
        In the decode step only those producers write the buffers they prepare (xn, attn), so a preparation
        they made is current whenever a product reads it."""
        made = self._tc_made.get((x.data_ptr(), x.numel(), fmt))
        if made is not None:
            return made
        want = self._tc_want.setdefault((x.data_ptr(), x.numel()), [])
        if fmt not in want:
            want.append(fmt)
        key = (x.shape[-1], fmt, x.device)
        if key not in self._tc_x:
            self._tc_x[key] = tc.empty_x(x.shape[-1], x.device)
        return tc.prepare_x(x, self._tc_x[key], fmt)

    def _tc_outputs(self, out: torch.Tensor, default: list[int]) -> list[tuple[int, tc.TcX]]:
        """The (layout, buffer) pairs a producer writing `out` prepares: the layouts its readers asked for (at most
        two; `default` before any asked), registered so that the readers find them."""
        # the defaults join the list on the first call, so a layout once written stays written (never stale)
        fmts = self._tc_want.setdefault((out.data_ptr(), out.numel()), list(default))[:2]
        outs = []
        for f in fmts:
            key = (out.data_ptr(), out.numel(), f)
            if key not in self._tc_made:
                self._tc_made[key] = tc.empty_x(out.numel(), out.device)
            outs.append((f, self._tc_made[key]))
        return outs

    def _h_tc(self, n_sel: int, f: int, device: torch.device) -> tc.TcX:
        key = ("h", n_sel, f, device)
        if key not in self._tc_x:
            self._tc_x[key] = tc.empty_x(f, device, n_sel)
        return self._tc_x[key]

    def qmatvec(self, w: torch.Tensor, qtype: int, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None = None, x_perm: torch.Tensor | None = None) -> torch.Tensor:
        if qtype not in qk.SUPPORTED:
            return TorchOps.qmatvec(w, qtype, x, out, residual)
        if self.tc and tc.supports_tc(qtype, x.shape[-1]):
            return tc.qmatvec_tc(w, self._prepared(x, tc.FORMATS[qtype]), out, residual, qtype=qtype)
        if x_perm is not None and self.words and wk.supports(qtype, x.shape[-1], "mv", w.shape[0]):
            return wk.KERNELS["mv"][qtype](w, x_perm, out, residual)
        return qk.qmatvec(w, qtype, x, out, residual)

    def moe_gate_up(self, w_gate: torch.Tensor, w_up: torch.Tensor, qtype_gate: int, qtype_up: int,
                    x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, act: str = "silu",
                    x_perm: torch.Tensor | None = None, perm_out: bool | str = False) -> torch.Tensor:
        """perm_out: `h_layout`'s answer ("tcN": h goes to this object's prepared buffer for `moe_down`)."""
        tc_ok = self.tc and qtype_gate == qtype_up and tc.supports_tc(qtype_gate, x.shape[-1])
        h_tc = isinstance(perm_out, str) and perm_out.startswith("tc")
        if h_tc or (tc_ok and not perm_out):
            if not tc_ok:
                raise ValueError("h prepared for tensor cores needs gate and up matrices of one type with a "
                                 "tensor-core kernel")
            dst = self._h_tc(ids.shape[0], out.shape[-1], out.device) if h_tc else out
            tc.moe_gate_up_tc(w_gate, w_up, self._prepared(x, tc.FORMATS[qtype_gate]), ids, dst, act,
                              qtype=qtype_gate, out_fmt=int(perm_out[2:]) if h_tc else 4)
            return out
        if qtype_gate not in qk.SUPPORTED or qtype_up not in qk.SUPPORTED:
            return TorchOps.moe_gate_up(w_gate, w_up, qtype_gate, qtype_up, x, ids, out, act, perm_out=perm_out)
        k = x.shape[-1]
        if x_perm is not None and qtype_gate == qtype_up and self.perm(qtype_gate, k, "gate_up"):
            return wk.KERNELS["gate_up"][qtype_gate](w_gate, w_up, x_perm, ids, out, act, perm_out=perm_out)
        return qk.moe_gate_up(w_gate, w_up, qtype_gate, qtype_up, x, ids, out, act=act, perm_out=perm_out)

    def moe_down(self, w_down: torch.Tensor, qtype: int, h: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, residual: torch.Tensor, out: torch.Tensor,
                 h_perm: bool | str = False) -> torch.Tensor:
        if isinstance(h_perm, str) and h_perm.startswith("tc"):  # h is in the buffer `moe_gate_up` prepared
            if f"tc{tc.FORMATS.get(qtype)}" != h_perm:
                raise ValueError(f"h prepared as {h_perm!r} given to a down product of type {qtype}")
            return tc.moe_down_tc(w_down, self._h_tc(ids.shape[0], h.shape[-1], h.device), ids, weights, residual,
                                  out, qtype=qtype)
        if h_perm:
            if not self.perm(qtype, h.shape[-1], "down"):
                raise ValueError(f"permuted h given to a down product of type {qtype} without a word kernel")
            return wk.KERNELS["down"][qtype](w_down, h, ids, weights, residual, out)
        if qtype not in qk.SUPPORTED:
            return TorchOps.moe_down(w_down, qtype, h, ids, weights, residual, out)
        return qk.moe_down(w_down, qtype, h, ids, weights, residual, out)

    @staticmethod
    def embed(w: torch.Tensor, qtype: int, ids: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if qtype not in qk.SUPPORTED:
            return TorchOps.embed(w, qtype, ids, out, scale)
        return ek.embed(w, qtype, ids, out, scale)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 out_perm: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[-1]
        if not (self.tc and x.dim() == 1 and n >= 256 and n & (n - 1) == 0):
            return dk.rms_norm(x, w, eps, out, out_perm)
        # prepared as it is written, for the tensor-core products that follow (Q4_K's layout until others ask)
        return dk.rms_norm(x, w, eps, out, out_perm, out_tc=self._tc_outputs(out, [4]))

    @staticmethod
    def router(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return dk.router_logits(x, w, out)

    @staticmethod
    def route_topk(logits: torch.Tensor, k: int, renormalise: bool, weights_out: torch.Tensor,
                   ids_out: torch.Tensor) -> None:
        dk.route_topk(logits, k, renormalise, weights_out, ids_out)

    def qk_norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor | None,
                           k_norm_w: torch.Tensor | None, pos_t: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, q_out: torch.Tensor, *, eps: float, qk_norm: str,
                           rope_style: str, rope_dim: int, base: float, scale: float,
                           freq_factors: torch.Tensor | None) -> None:
        key = (k_cache.shape[0], rope_dim, base, scale, freq_factors is not None, k_cache.device)
        table = self._rope.get(key)
        if table is None:
            table = self._rope[key] = dk.rope_table(k_cache.shape[0], rope_dim, base, scale, freq_factors,
                                                    device=k_cache.device)
        dk.qk_norm_rope_store(q, k, v, q_norm_w, k_norm_w, table, pos_t, k_cache, v_cache, q_out, eps,
                              qk_norm=qk_norm, rope_style=rope_style)

    def attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         kv_len_t: torch.Tensor, scale: float, window: int, out: torch.Tensor,
                         out_perm: torch.Tensor | None = None) -> None:
        H, Dv = out.shape
        key = (k_cache.shape[0], H, Dv, q.device)
        scratch = self._attn_scratch.get(key)
        if scratch is None:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
            splits = dk.attention_splits(k_cache.shape[0], H, sms)
            scratch = self._attn_scratch[key] = dk.attention_scratch(H, Dv, splits, q.device)
        tc_ok = self.tc and (H * Dv) % 256 == 0 and Dv >= 32 and Dv & (Dv - 1) == 0
        dk.attention_decode(q, k_cache, v_cache, kv_len_t, scale, window, out, scratch, out_perm=out_perm,
                            out_tc=self._tc_outputs(out, []) if tc_ok else None)

    def argmax(self, logits: torch.Tensor, out_id: torch.Tensor) -> None:
        key = (logits.shape[-1], logits.device)
        scratch = self._argmax_scratch.get(key)
        if scratch is None:
            scratch = self._argmax_scratch[key] = dk.argmax_scratch(logits.shape[-1], logits.device)
        dk.argmax(logits, out_id, scratch)
