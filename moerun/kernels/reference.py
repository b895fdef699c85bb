"""Plain-torch reference kernels: the definitions every fast kernel is checked against.

Shapes: T = tokens in the batch, S = cached positions attended to, H = query heads,
Hkv = key/value heads, D = head dim, E = experts, K = experts used per token.
Activations are float32; with bf16 compute only the matrix products take bf16 inputs (weights and
the rounded activation), accumulating in float32. Reductions (norms, softmax) always run in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moerun.models.spec import Activation, RopeStyle

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] float32, w: [N] float32 -> [..., N] float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_angles(pos: torch.Tensor, dim: int, base: float, scale: float = 1.0,
                freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """pos: [T] int -> (cos, sin), each [T, dim/2] float32.

    theta_i = (pos / scale) * base^(-2i/dim) / freq_factors[i]  (llama.cpp's ggml_rope_ext).
    """
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=pos.device).float() / dim))
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    ang = (pos.float() / scale)[:, None] * inv[None, :]  # [T, dim/2]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, R/2] with R <= D rotated dims -> [T, H, D].

    "neox" rotates pairs (i, i + R/2); "norm" rotates adjacent pairs (2i, 2i + 1).
    """
    r = 2 * cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    if style == "neox":
        x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float, window: int = 0) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of T queries over cache positions 0..S-1.

    q: [T, H, D] float32, k: [S, Hkv, D], v: [S, Hkv, Dv] (cache dtype), q_pos: [T] -> [T, H, Dv] float32.
    Query at position p sees keys j <= p, and with a window W only those with p - j < W.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.float().repeat_interleave(group, dim=1)  # [S, H, Dv]
    scores = torch.einsum("thd,shd->hts", q, k) * scale  # [H, T, S]
    kv_pos = torch.arange(k.shape[0], device=q.device)
    masked = kv_pos[None, :] > q_pos[:, None]  # [T, S]
    if window:
        masked |= (q_pos[:, None] - kv_pos[None, :]) >= window
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [T, N] float32, w: [M, N] in the compute dtype -> [T, M] float32.

    The input is rounded to the weight's dtype (bf16 compute) and the product returned in float32.
    """
    return (x.to(w.dtype) @ w.T).float()


def gated_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              act: Activation) -> torch.Tensor:
    """x: [T, N] float32; gate, up: [F, N]; down: [N, F] -> [T, N] float32 = down(act(gate x) * up x)."""
    return linear(ACTIVATIONS[act](linear(x, gate)) * linear(x, up), down)


def route(router_logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then top-k. router_logits: [T, E] -> (weights [T, K] f32, ids [T, K])."""
    probs = router_logits.float().softmax(-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids
