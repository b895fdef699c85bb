"""Decode-step ops in plain torch, with the same signatures as the fused Triton kernels.

The fast decode path (engine/fast_decode.py) is written against this interface; `TorchOps` runs it
anywhere (CPU included) and is the twin every Triton op is tested against inside the full step.
All ops write into caller-provided outputs and read per-step scalars (position, KV length) from
device tensors, so a step built from them can be captured in a CUDA graph.

Shapes: N = model width, H/Hkv = query/KV heads, D/Dv = head dims, E = experts, K = experts used.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch

from moerun.kernels import reference as ref
from moerun.quant.registry import dequantize


def _deq(w: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """Raw rows [..., row_bytes] -> float32 [..., cols]."""
    return dequantize(w, qtype, (*w.shape[:-1], cols))


def permute_k4(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 256 == 0) -> the order the word kernels read activations in (kernels/triton/wmatvec.py):
    inside each block of 256, slot 64 k + a holds element 4 a + k."""
    k = x.shape[-1]
    return x.reshape(*x.shape[:-1], k // 256, 64, 4).transpose(-1, -2).reshape(x.shape)


def unpermute_k4(xp: torch.Tensor) -> torch.Tensor:
    """The inverse of permute_k4."""
    k = xp.shape[-1]
    return xp.reshape(*xp.shape[:-1], k // 256, 4, 64).transpose(-1, -2).reshape(xp.shape)


class X24(NamedTuple):
    """x quantized for the integer-dot kernels (kernels/triton/imatvec.py): per group of 32 values x ~ s X with X a
    24-bit integer, held as X = 256 hi + lo (hi int16, lo uint8 [..., K]); s and the float sums of x per group,
    f32 [..., K / 32]."""

    hi: torch.Tensor
    lo: torch.Tensor
    s: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str) -> X24:
        """Uninitialised buffers for x [*shape] (shape[-1] % 32 == 0)."""
        g = (*shape[:-1], shape[-1] // 32)
        return cls(torch.empty(shape, dtype=torch.int16, device=device), torch.empty(shape, dtype=torch.uint8,
                   device=device), torch.empty(g, device=device), torch.empty(g, device=device))


class Route(NamedTuple):
    """Routing done by the gate/up op itself (`moe_gate_up(route=...)`): the router's logits [E] f32 in, the
    chosen experts' weights [K] f32 out (their ids go to the op's ids), as `route_topk` (softmax over all E, the
    K largest, ties to the lower index; divided by their sum with `renormalise`)."""

    logits: torch.Tensor
    weights_out: torch.Tensor
    renormalise: bool


class TorchOps:
    """Reference implementations of the decode-step ops (allocate freely; correctness only).

    Permuted activations (`permute_k4`): the fast step asks `perm(qtype, k)` whether a product wants its input
    permuted; where it does, it passes the permuted copy too (`x_perm`, `rms_norm(out_perm=)`) and has
    gate/up write h permuted for down (`perm_out` / `h_perm`). TorchOps asks for none (`perm` is False) but
    takes them all, reading a given x_perm instead of x, so that a test can run the step's permuted wiring
    on these twins (tests/engine/test_fast_decode.py).
    """

    name = "torch"
    attn_phase = 0  # which of `attention_phases` the step being launched is in (the fast step sets it)

    @staticmethod
    def step_context() -> AbstractContextManager[None]:
        """Entered around each decode step's launches (TritonOps: programmatic dependent launch, `pdl`)."""
        return nullcontext()

    @staticmethod
    def attention_phases(n_ctx: int, n_head: int, device: torch.device) -> tuple[int, ...]:
        """The KV lengths from which each attention variant runs, ascending from 1 (here one; TritonOps: short and
        long phases); the fast step sets `attn_phase` per step and captures a graph per phase."""
        return (1,)

    @staticmethod
    def perm(qtype: int, k: int, kind: str | None = None) -> bool:
        """Whether products of this weight type over K inputs (of `kind`: "mv", "gate_up", "down"; None: any)
        read permuted activations (never, here)."""
        return False

    @staticmethod
    def ints(qtype: int, k: int, kind: str) -> bool:
        """Whether products of this type over K inputs (of `kind`) read x quantized to 24 bits (X24): the
        integer-dot kernels' input, never read here (the products below multiply the float x)."""
        return False

    @staticmethod
    def ints_take(qtype: int, kind: str, w: torch.Tensor, k: int) -> bool:
        """Whether product `kind` of matrix w over K inputs runs on the integer kernels (never, here)."""
        return False

    @staticmethod
    def repack(qtype: int, kind: str, w: torch.Tensor, ints: bool = True) -> torch.Tensor:
        """The rows product `kind` reads for matrix w: the file's own, here."""
        return w

    @staticmethod
    def qmatvec(w: torch.Tensor, qtype: int, x: torch.Tensor, out: torch.Tensor,
                residual: torch.Tensor | None = None, x_perm: torch.Tensor | None = None,
                x24: Any = None) -> torch.Tensor:
        """out [M] = W [M, K] @ x [K] (+ residual [M]); w: raw rows [M, row_bytes]. x_perm: permute_k4(x),
        read instead of x when given; x24 (`ints`) is not read."""
        if x_perm is not None:
            x = unpermute_k4(x_perm)
        y = _deq(w, qtype, x.shape[-1]) @ x
        out.copy_(y if residual is None else y + residual)
        return out

    def qmatvecs(self, prods: list[tuple[torch.Tensor, int, torch.Tensor]], x: torch.Tensor,
                 x_perm: torch.Tensor | None = None, x24: Any = None) -> None:
        """`qmatvec` of several matrices over the same x: prods = [(w, qtype, out), ...] (a layer's q/k/v runs)."""
        for w, qtype, out in prods:
            self.qmatvec(w, qtype, x, out, x_perm=x_perm, x24=x24)

    @staticmethod
    def moe_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, qtype_gate: int, qtype_up: int,
                    x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, act: str = "silu",
                    x_perm: torch.Tensor | None = None, perm_out: bool = False,
                    route: Route | None = None, x24: Any = None, h_x24: Any = None) -> torch.Tensor:
        """out [K, F] = act(Wg[ids] @ x) * (Wu[ids] @ x); w_*: [E, F, row_bytes], ids: [K] int32 device.
        x_perm: permute_k4(x), read instead of x when given; perm_out: rows of out in permute_k4 order;
        route: choose the experts first (`route_topk` into ids and route.weights_out)."""
        if route is not None:
            TorchOps.route_topk(route.logits, ids.shape[0], route.renormalise, route.weights_out, ids)
        if x_perm is not None:
            x = unpermute_k4(x_perm)
        g = _deq(w_gate.index_select(0, ids.long()), qtype_gate, x.shape[-1]) @ x  # [K, F]
        u = _deq(w_up.index_select(0, ids.long()), qtype_up, x.shape[-1]) @ x  # [K, F]
        h = ref.ACTIVATIONS[act](g) * u
        out.copy_(permute_k4(h) if perm_out else h)
        return out

    @staticmethod
    def moe_down(w_down: torch.Tensor, qtype: int, h: torch.Tensor, ids: torch.Tensor,
                 weights: torch.Tensor, residual: torch.Tensor, out: torch.Tensor,
                 h_perm: bool = False, h_x24: Any = None, route: Route | None = None) -> torch.Tensor:
        """out [N] = residual + sum_k weights[k] * Wd[ids[k]] @ h[k]; w_down: [E, N, row_bytes], h: [K, F]
        (in permute_k4 order with h_perm). route: the router output the ids and weights came from (not needed here)."""
        if h_perm:
            h = unpermute_k4(h)
        y = torch.einsum("knf,kf->kn", _deq(w_down.index_select(0, ids.long()), qtype, h.shape[-1]), h)  # [K, N]
        out.copy_(residual + (weights[:, None] * y).sum(0))
        return out

    @staticmethod
    def embed(w: torch.Tensor, qtype: int, ids: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """out [n, N] = scale * dequantize(W[ids]); w: raw rows [V, row_bytes], ids: [n] device."""
        e = _deq(w.index_select(0, ids.long()), qtype, out.shape[-1])
        out.copy_(e * scale if scale != 1.0 else e)
        return out

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor,
                 out_perm: torch.Tensor | None = None, out_x24: Any = None) -> torch.Tensor:
        """out [N] = x * rsqrt(mean(x^2) + eps) * w (and into out_perm in permute_k4 order; out_x24 unused)."""
        out.copy_(ref.rms_norm(x, w, eps))
        if out_perm is not None:
            out_perm.copy_(permute_k4(out))
        return out

    @staticmethod
    def router(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Router logits out [E] = W [E, N] (float32) @ x [N]."""
        return torch.mv(w, x, out=out)

    @staticmethod
    def norm_router(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w_router: torch.Tensor, out: torch.Tensor,
                    xn: torch.Tensor, xn_perm: torch.Tensor | None = None, xn_x24: Any = None) -> torch.Tensor:
        """`rms_norm` of x into xn (and xn_perm), then `router` of xn into out [E]."""
        TorchOps.rms_norm(x, norm_w, eps, xn, xn_perm)
        return TorchOps.router(xn, w_router, out)

    @staticmethod
    def route_topk(logits: torch.Tensor, k: int, renormalise: bool, weights_out: torch.Tensor,
                   ids_out: torch.Tensor) -> None:
        """logits [E] -> softmax over all experts, top-k -> weights_out [K] f32, ids_out [K] int32."""
        w, ids = ref.route(logits[None], k, renormalise)
        weights_out.copy_(w[0])
        ids_out.copy_(ids[0])

    @staticmethod
    def argmax(logits: torch.Tensor, out_id: torch.Tensor,
               chain: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """logits [V] -> out_id [1] int64 (the first maximum); chain: (tok, pos, kv_len) [1] buffers of the next
        step, see `advance`."""
        out_id.copy_(logits.argmax().view(1))
        if chain is not None:
            TorchOps.advance(out_id, *chain)

    @staticmethod
    def advance(next_id: torch.Tensor, tok: torch.Tensor, pos: torch.Tensor, kv_len: torch.Tensor) -> None:
        """The next decode step's inputs on the device: tok = next_id, pos += 1, kv_len += 1 ([1] int64 each)."""
        tok.copy_(next_id)
        pos.add_(1)
        kv_len.add_(1)

    @staticmethod
    def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor | None,
                           k_norm_w: torch.Tensor | None, pos_t: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, q_out: torch.Tensor, *, eps: float, qk_norm: str,
                           rope_style: str, rope_dim: int, base: float, scale: float,
                           freq_factors: torch.Tensor | None) -> None:
        """Raw projections q [H*D], k [Hkv*D], v [Hkv*Dv] -> QK-norm, RoPE at position pos_t [1] (device),
        q_out [H, D] f32, and k/v stored in row pos of k_cache [n_ctx, Hkv, D] / v_cache [n_ctx, Hkv, Dv]."""
        H, D = q_out.shape
        Hkv = k_cache.shape[1]
        if qk_norm == "full":
            q, k = ref.rms_norm(q, q_norm_w, eps), ref.rms_norm(k, k_norm_w, eps)
        q, k = q.view(1, H, D), k.view(1, Hkv, D)
        if qk_norm == "head":
            q, k = ref.rms_norm(q, q_norm_w, eps), ref.rms_norm(k, k_norm_w, eps)
        cos, sin = ref.rope_angles(pos_t, rope_dim, base, scale, freq_factors)
        q_out.copy_(ref.apply_rope(q, cos, sin, rope_style)[0])
        k_cache.index_copy_(0, pos_t.long(), ref.apply_rope(k, cos, sin, rope_style).to(k_cache.dtype))
        v_cache.index_copy_(0, pos_t.long(), v.view(1, Hkv, -1).to(v_cache.dtype))

    @staticmethod
    def rope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor | None,
                       k_norm_w: torch.Tensor | None, pos_t: torch.Tensor, kv_len_t: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, q_rot: torch.Tensor, out: torch.Tensor, *,
                       eps: float, qk_norm: str, rope_style: str, rope_dim: int, base: float, scale: float,
                       freq_factors: torch.Tensor | None, attn_scale: float, window: int,
                       out_perm: torch.Tensor | None = None, out_x24: Any = None) -> None:
        """`qk_norm_rope_store` (q_rot [H, D] its rotated q) then `attention_decode` of q_rot: one step's attention
        from the raw projections. pos_t [1] = kv_len_t - 1 (the row this step writes)."""
        TorchOps.qk_norm_rope_store(q, k, v, q_norm_w, k_norm_w, pos_t, k_cache, v_cache, q_rot, eps=eps,
                                    qk_norm=qk_norm, rope_style=rope_style, rope_dim=rope_dim, base=base,
                                    scale=scale, freq_factors=freq_factors)
        TorchOps.attention_decode(q_rot, k_cache, v_cache, kv_len_t, attn_scale, window, out, out_perm)

    @staticmethod
    def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len_t: torch.Tensor,
                         scale: float, window: int, out: torch.Tensor,
                         out_perm: torch.Tensor | None = None, out_x24: Any = None) -> None:
        """One query q [H, D] at position L-1 over cache rows 0..L-1 (kv_len_t [1] = L) -> out [H, Dv] f32
        (and out flattened in permute_k4 order into out_perm [H * Dv]; out_x24 unused)."""
        out.copy_(ref.attention(q[None], k_cache, v_cache, kv_len_t - 1, scale, window)[0])
        if out_perm is not None:
            out_perm.copy_(permute_k4(out.reshape(-1)))
