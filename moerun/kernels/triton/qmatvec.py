"""Fused quantized matrix-vector kernels for batch-1 decode (Triton).

Weights stay in their GGUF bytes: uint8 `[M, row_bytes]` for a matrix, `[E, M, row_bytes]` for stacked
experts; row r holds K / block_size consecutive blocks exactly as in the file. Activations are float32.

- `qmatvec`      out[M] = W[M, K] @ x[K] (+ residual[M]); out may alias residual.
- `moe_gate_up`  out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x) for the n_sel selected experts.
- `moe_down`     out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]); out may alias residual.

One program computes BLOCK_M rows (for gate/up: of one selected expert) and loops over K, NB blocks per
step, decoding the raw block bytes with integer ops (qblocks.py) and accumulating in float32. No atomics:
every sum has a fixed order, so results are bit-identical run to run. Expert ids are read inside the
kernels (never on the host). The wrappers only pick a tile (cached per shape) and launch: no allocation,
no host sync, so they can be captured in a CUDA graph.

Tile sizes: `TILES` overrides the heuristic `default_tile` per (kind, qtype, M, K); see default_tile.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moerun.kernels.gpu import sm_count
from moerun.kernels.torch_ops import Route
from moerun.kernels.triton.decode_ops import down_route_args, expert_id, ranked_experts, route_args
from moerun.kernels.triton.outputs import perm_slot
from moerun.kernels.triton.pdl import begin, launch_args, trigger, wait
from moerun.kernels.triton.qblocks import float_w, float_words, float_x, row_dot, step, total, zeros

# GGML type id -> (block_size, type_size, torch dtype the row bytes are viewed as, or None for raw bytes)
GEOMETRY: dict[int, tuple[int, int, torch.dtype | None]] = {
    0: (1, 4, torch.float32),  # F32
    1: (1, 2, torch.float16),  # F16
    30: (1, 2, torch.bfloat16),  # BF16
    8: (32, 34, None),  # Q8_0
    2: (32, 18, None),  # Q4_0
    6: (32, 22, None),  # Q5_0
    12: (256, 144, None),  # Q4_K
    13: (256, 176, None),  # Q5_K
    14: (256, 210, None),  # Q6_K
}
SUPPORTED: frozenset[int] = frozenset(GEOMETRY)
FLOATS: frozenset[int] = frozenset(q for q, g in GEOMETRY.items() if g[2] is not None)  # F32, F16, BF16

ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu_tanh": 1}


class Tile(NamedTuple):
    """Launch shape: rows per program, blocks per K-step, warps, and the launch's num_stages (no pipelining of these
    loops: `WTile`)."""

    block_m: int
    nb: int
    num_warps: int = 4
    num_stages: int = 1


# Tuned overrides, keyed by (kind, qtype, M, K) with kind in {"mv", "gate_up", "down"}; M = output rows
# (F for gate_up, N for down), K = input length. Filled from benchmarks/bench_qmatvec.py --sweep.
TILES: dict[tuple[str, int, int, int], Tile] = {
    ("mv", 14, 2048, 2048): Tile(2, 4, 2, 1),  # Q6_K attention 2048x2048: 5.63 us vs 6.30 (H200, NOTES.md 7)
}
# Output-sized matrices (M >= LARGE_MV_ROWS) of these types: many one-warp programs of a few rows. Q6_K
# 50304x2048 on the H200: 70.3 us at Tile(4, 1, 1) vs 107.3 at the heuristic's Tile(32, 1, 8) (NOTES.md 7).
LARGE_MV_ROWS = 16384
LARGE_MV_TILES: dict[int, Tile] = {14: Tile(4, 1, 1, 1)}

# Heuristic knobs (see default_tile).
# aim for at least this many programs per SM, per kernel kind. Measured on the H200 in one decode-step
# profile (OLMoE Q4_K_M, benchmarks/NOTES.md section 5): 16 made gate/up 1.56x faster (BM 8 -> 2) but
# down 1.26x and the plain matvec 1.12x slower (BM 2 -> 1), so only gate/up uses it.
PROGRAMS_PER_SM = {"mv": 4, "gate_up": 16, "down": 4}
# ... except where a type measured better otherwise, keyed by (kind, GGML type): Q8_0's gate/up ran tg128
# 626.2 t/s at 4 programs/SM (c940102) and 583.6-592.0 at 16 (a462046, f503105), F16 and Q4_K gained.
PROGRAMS_PER_SM_BY_TYPE: dict[tuple[str, int], int] = {("gate_up", 8): 4}
MAX_BLOCK_M = 32
WEIGHTS_PER_STEP = 4096  # weights decoded per program per K-step (all matrices of the program together)
WEIGHTS_PER_THREAD = 32  # -> num_warps = weights per step / (32 * this), clamped to [2, 8]

_TILE_CACHE: dict[tuple[str, int, int, int, int, str], Tile] = {}


def _pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def default_tile(kind: str, qtype: int, m: int, k: int, n_sel: int, device: torch.device) -> Tile:
    """Heuristic tile for `kind` ("mv" | "gate_up" | "down") of an [m, k] matrix of `qtype`.

    BLOCK_M: the largest power of two (<= MAX_BLOCK_M) that still gives >= PROGRAMS_PER_SM programs per
    SM (gate/up has n_sel row groups per row block; down loops over the experts inside a program, so
    its grid is m / BLOCK_M). NB: enough blocks per step for ~WEIGHTS_PER_STEP weights per program
    (gate/up decodes two matrices per step), capped at the whole row. num_warps follows the step size.
    """
    bs = GEOMETRY[qtype][0]
    n_blocks = k // bs
    rows = m * (n_sel if kind == "gate_up" else 1)
    per_sm = PROGRAMS_PER_SM_BY_TYPE.get((kind, qtype), PROGRAMS_PER_SM[kind])
    bm = min(MAX_BLOCK_M, _pow2_floor(rows // (per_sm * sm_count(device))))
    bm = min(bm, triton.next_power_of_2(m))
    mats = 2 if kind == "gate_up" else 1
    nb = _pow2_floor(max(1, WEIGHTS_PER_STEP // (bm * bs * mats)))
    nb = min(nb, triton.next_power_of_2(n_blocks))
    warps = max(2, min(8, _pow2_floor(bm * nb * bs * mats // (32 * WEIGHTS_PER_THREAD))))
    return Tile(bm, nb, warps, 1)


def tile_for(kind: str, qtype: int, m: int, k: int, n_sel: int, device: torch.device) -> Tile:
    """`TILES[(kind, qtype, m, k)]` if tuned, else LARGE_MV_TILES for output-sized matrices, else
    `default_tile` (cached)."""
    key = (kind, qtype, m, k, n_sel, str(device))
    tile = _TILE_CACHE.get(key)
    if tile is None:
        tile = TILES.get((kind, qtype, m, k))
        if tile is None and kind == "mv" and m >= LARGE_MV_ROWS:
            tile = LARGE_MV_TILES.get(qtype)
        tile = tile or default_tile(kind, qtype, m, k, n_sel, device)
        _TILE_CACHE[key] = tile
    return tile


def _typed(w: torch.Tensor, qtype: int) -> torch.Tensor:
    """Raw row bytes, or for F32/F16/BF16 the same bytes viewed as that dtype (a free view)."""
    view = GEOMETRY[qtype][2]
    return w if view is None else w.view(view)


def _check(qtype: int) -> None:
    if qtype not in GEOMETRY:
        raise NotImplementedError(f"no fused matvec kernel for GGML type {qtype} (supported: {sorted(SUPPORTED)})")


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _qmatvec_kernel(
    w_ptr, x_ptr, res_ptr, out_ptr, M, stride_m,
    N_BLOCKS: tl.constexpr, QTYPE: tl.constexpr, HAS_RES: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr,
    PRE: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (cdiv(M, BM),). w: [M, row] bytes (or typed floats), x: [K] f32, res/out: [M] f32. PRE (F32 / F16 /
    BF16): the first K-step's weights are loaded before the PDL wait (nothing in the step writes weights), x after."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)  # [BM]
    rmask = rows < M
    wrow = w_ptr + rows.to(tl.int64) * stride_m
    if PRE:
        trigger(PDL)
        w0 = float_w(wrow, rmask, 0, N_BLOCKS, NB)  # [BM, NB]
        wait(PDL)
        part = w0.to(tl.float32) * float_x(x_ptr, 0, N_BLOCKS, NB)[None, :]  # `_float`'s first step
        for kb in range(NB, N_BLOCKS, NB):
            part += step(wrow, rmask, kb, N_BLOCKS, x_ptr, QTYPE, BM, NB)
        acc = total(part, QTYPE)
    else:
        begin(PDL)
        acc = row_dot(wrow, rmask, x_ptr, N_BLOCKS, QTYPE, BM, NB)
    if HAS_RES:
        acc += tl.load(res_ptr + rows, mask=rmask, other=0.0)
    tl.store(out_ptr + rows, acc, mask=rmask)


@triton.jit
def _act(g, ACT: tl.constexpr):
    """silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))."""
    if ACT == 0:
        z = g
    else:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)
    return g / (1.0 + tl.exp(-z))


@triton.jit
def _moe_gate_up_kernel(
    wg_ptr, wu_ptr, x_ptr, ids_ptr, route_ptr, wts_ptr, E, out_ptr, F, stride_ge, stride_gm, stride_ue, stride_um,
    stride_out, NBLK_G: tl.constexpr, NBLK_U: tl.constexpr, QG: tl.constexpr, QU: tl.constexpr, ACT: tl.constexpr,
    BM: tl.constexpr, NBG: tl.constexpr, NBU: tl.constexpr, PERM_OUT: tl.constexpr, ROUTE: tl.constexpr,
    N_SEL: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False, LATE: tl.constexpr = False,
):
    """Grid (cdiv(F, BM), n_sel). wg/wu: [E, F, row] bytes, x: [K] f32, ids: [n_sel] int (written with ROUTE:
    `decode_ops.expert_id`), out: [n_sel, F] (rows in natural order, or with PERM_OUT in the word kernels' order,
    `perm_slot`). LATE: the next kernel may launch only after this one's wait (so the router's logits are final
    before it starts: a routed down, `_moe_down_kernel` ROUTE)."""
    if LATE:
        wait(PDL)
        trigger(PDL)
    else:
        begin(PDL)
    sel = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < F
    eid = expert_id(ids_ptr, route_ptr, wts_ptr, E, ROUTE, N_SEL, RENORM, BLOCK_E, BLOCK_K)
    r64 = rows.to(tl.int64)
    wg = wg_ptr + eid * stride_ge + r64 * stride_gm
    wu = wu_ptr + eid * stride_ue + r64 * stride_um
    if QG == QU and NBG == NBU:  # one loop: both matrices' bytes in flight each step
        ga = zeros(QG, BM, NBG)
        ua = zeros(QU, BM, NBU)
        for kb in range(0, NBLK_G, NBG):
            ga += step(wg, rmask, kb, NBLK_G, x_ptr, QG, BM, NBG)
            ua += step(wu, rmask, kb, NBLK_U, x_ptr, QU, BM, NBU)
        g = total(ga, QG)
        u = total(ua, QU)
    else:
        g = row_dot(wg, rmask, x_ptr, NBLK_G, QG, BM, NBG)
        u = row_dot(wu, rmask, x_ptr, NBLK_U, QU, BM, NBU)
    if PERM_OUT:
        dst = perm_slot(rows)
    else:
        dst = rows
    tl.store(out_ptr + sel * stride_out + dst, _act(g, ACT) * u, mask=rmask)


@triton.jit
def _pin_float(w, z):
    """w (F32 / F16 / BF16) ORed bitwise with z, an int32 zero read after a barrier: its arithmetic cannot be
    scheduled above that read (imatvec `_ipin`)."""
    if w.dtype == tl.float32:
        bits = tl.int32
    else:
        bits = tl.int16
    return (w.to(bits, bitcast=True) | z.to(bits)).to(w.dtype, bitcast=True)


# the down kernels' experts per load group (`experts_ahead` of `moe_down` and `imatvec.moe_down_i`): 2 measured
# +1.5% (Q4_K_M), +1.8% (Q8_0), +0.7% (F16) OLMoE tg128 against 1 (one expert at a time), 4 -1.2% (NOTES.md 7y)
EXPERTS_AHEAD = 2


def experts_group(n_sel: int, experts_ahead: int) -> int:
    """The experts a down kernel loads ahead of their arithmetic: the largest divisor of n_sel up to experts_ahead."""
    return max(d for d in range(1, min(experts_ahead, n_sel) + 1) if n_sel % d == 0)


@triton.jit
def chosen_experts(ids_ptr, wts_ptr, N_SEL: tl.constexpr):
    """The N_SEL chosen experts' ids (int64) and routing weights, all read up front: two tuples (the down kernels'
    experts-ahead paths)."""
    eids = ()
    wts = ()
    for i in tl.static_range(N_SEL):
        eids = eids + (tl.load(ids_ptr + i).to(tl.int64),)
        wts = wts + (tl.load(wts_ptr + i),)
    return eids, wts


@triton.jit
def routing_after_wait(ids_ptr, wts_ptr, eids, ROUTE: tl.constexpr, N_SEL: tl.constexpr, PDL: tl.constexpr):
    """A down kernel's experts-ahead prologue after its first loads: with ROUTE (eids ranked from the logits, the
    first experts' weights loaded) the PDL wait, then the routing weights; else `chosen_experts`. -> (eids, wts,
    the pointer whose first value >= 0 `zero_after_barrier` reads: wts or ids)."""
    if ROUTE:
        wait(PDL)
        wts = ()
        for i in tl.static_range(N_SEL):
            wts = wts + (tl.load(wts_ptr + i),)
        pin_ptr = wts_ptr
    else:
        eids, wts = chosen_experts(ids_ptr, wts_ptr, N_SEL)
        pin_ptr = ids_ptr
    return eids, wts, pin_ptr


@triton.jit
def zero_after_barrier(p):
    """A CTA barrier, then 0 as int32 read from memory: the sign bit of a value >= 0 at p (the expert ids, or x24's
    first scale, its float bits). ORed into words loaded before the barrier (`_pin_float`, imatvec `_ipin`) it keeps
    their arithmetic below it, where ptxas would otherwise move it among the loads (NOTES.md 7x)."""
    tl.debug_barrier()
    v = tl.load(p)
    if v.dtype.is_floating():
        v = v.to(tl.int32, bitcast=True)
    return v.to(tl.int32) >> 31


@triton.jit
def _moe_down_kernel(
    w_ptr, h_ptr, ids_ptr, wts_ptr, res_ptr, out_ptr, N, stride_e, stride_m, stride_h,
    N_BLOCKS: tl.constexpr, N_SEL: tl.constexpr, QTYPE: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr,
    EU: tl.constexpr, route_ptr, E, ROUTE: tl.constexpr = False, BLOCK_E: tl.constexpr = 1,
    BLOCK_K: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Grid (cdiv(N, BM),). w: [E, N, row] bytes, h: [n_sel, F] f32, ids/wts: [n_sel], res/out: [N] f32.

    Experts are summed inside the program in order i = 0 .. n_sel-1 (deterministic, no atomics). EU > 1 (F32 / F16 /
    BF16 only): the weights and h of EU experts (every K-step unrolled) are loaded before any of their arithmetic (a
    CTA barrier, then a zero read ORed into the weights), the same sums in the same order. ROUTE (EU > 1): the ids
    ranked from the router's logits [E] at route_ptr (`ranked_experts`) and the first EU experts' weights loaded
    before the PDL wait (ids_ptr never read; h and the routing weights after it); the launch before must be a LATE
    gate/up, so that the logits are final when this one starts.
    """
    tl.static_assert(EU > 1 or not ROUTE)
    if ROUTE:
        trigger(PDL)
    else:
        begin(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    r64 = rows.to(tl.int64) * stride_m
    acc = tl.zeros([BM], dtype=tl.float32)
    if EU > 1:
        STEPS: tl.constexpr = (N_BLOCKS + NB - 1) // NB  # the last may be partial (masked), as in row_dot
        eids = ()
        if ROUTE:
            eids = ranked_experts(route_ptr, E, N_SEL, BLOCK_E, BLOCK_K)
            first = ()
            for u in tl.static_range(EU):
                for j in tl.static_range(STEPS):
                    first = first + (float_w(w_ptr + eids[u] * stride_e + r64, rmask, j * NB, N_BLOCKS, NB),)
        eids, wts, pin_ptr = routing_after_wait(ids_ptr, wts_ptr, eids, ROUTE, N_SEL, PDL)
        for g in tl.static_range(0, N_SEL, EU):
            pend = ()
            for u in tl.static_range(EU):
                for j in tl.static_range(STEPS):
                    if ROUTE and g == 0:
                        pend = pend + ((first[u * STEPS + j], float_x(h_ptr + u * stride_h, j * NB, N_BLOCKS, NB)),)
                    else:
                        pend = pend + (float_words(w_ptr + eids[g + u] * stride_e + r64, rmask, j * NB, N_BLOCKS,
                                                    h_ptr + (g + u) * stride_h, NB),)
            z = zero_after_barrier(pin_ptr)  # the loads above are issued before any arithmetic below waits on them
            for u in tl.static_range(EU):
                part = zeros(QTYPE, BM, NB)
                for j in tl.static_range(STEPS):
                    w, x = pend[u * STEPS + j]
                    part += _pin_float(w, z).to(tl.float32) * x[None, :]
                acc += wts[g + u] * total(part, QTYPE)
    else:
        for i in range(N_SEL):
            eid = tl.load(ids_ptr + i).to(tl.int64)
            part = row_dot(w_ptr + eid * stride_e + r64, rmask, h_ptr + i * stride_h, N_BLOCKS, QTYPE, BM, NB)
            acc += tl.load(wts_ptr + i) * part
    acc += tl.load(res_ptr + rows, mask=rmask, other=0.0)
    tl.store(out_ptr + rows, acc, mask=rmask)


# ---------------------------------------------------------------------------------------------- wrappers


def qmatvec(
    w: torch.Tensor,
    qtype: int,
    x: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    tile: Tile | None = None,
    pre: bool = True,
) -> torch.Tensor:
    """out[M] = W[M, K] @ x[K] (+ residual[M]), W dequantized on the fly from its GGUF bytes.

    w: uint8 [M, row_bytes] (rows contiguous), x: float32 [K] contiguous, out/residual: float32 [M]
    (out may be residual). qtype: GGML type id in SUPPORTED. pre (F32 / F16 / BF16; the others ignore it): the
    first K-step's weights loaded before the PDL wait (F16 tg128 +1.6% on an H100, NOTES.md 8i). Returns out.
    """
    _check(qtype)
    m, k = w.shape[0], x.shape[0]
    t = tile or tile_for("mv", qtype, m, k, 1, w.device)
    wt = _typed(w, qtype)
    _qmatvec_kernel[(triton.cdiv(m, t.block_m),)](
        wt, x, out if residual is None else residual, out, m, wt.stride(0),
        N_BLOCKS=k // GEOMETRY[qtype][0], QTYPE=qtype, HAS_RES=residual is not None, BM=t.block_m, NB=t.nb,
        PRE=pre and qtype in FLOATS, num_warps=t.num_warps, num_stages=t.num_stages, **launch_args(w.device))
    return out


def moe_gate_up(
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    qtype_gate: int,
    qtype_up: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    act: str = "silu",
    *,
    perm_out: bool = False,
    tile: Tile | None = None,
    route: Route | None = None,
    late: bool = False,
) -> torch.Tensor:
    """out[i, :] = act(Wg[ids[i]] @ x) * (Wu[ids[i]] @ x) for i < n_sel, in one launch.

    w_gate/w_up: uint8 [E, F, row_bytes]; x: float32 [K]; ids: int32/int64 [n_sel] on the device (read by
    the kernel; with `route` written by it: each program ranks the router's logits itself and program (0, 0) stores
    the chosen ids and route.weights_out, as `route_topk` would); out: float32 [n_sel, F] (rows contiguous; with
    perm_out each row in the word kernels' order, F % 256 == 0). act: "silu" | "gelu_tanh". late: the next launch
    starts only after this one's PDL wait (before a `moe_down` with `route`). Returns out.
    """
    _check(qtype_gate)
    _check(qtype_up)
    f, k, n_sel = w_gate.shape[1], x.shape[0], ids.shape[0]
    if perm_out and f % 256:
        raise ValueError(f"perm_out needs F % 256 == 0, got F = {f}")
    t = tile or tile_for("gate_up", qtype_gate, f, k, n_sel, w_gate.device)
    nb_u = t.nb * GEOMETRY[qtype_gate][0] // GEOMETRY[qtype_up][0] if qtype_up != qtype_gate else t.nb
    wg, wu = _typed(w_gate, qtype_gate), _typed(w_up, qtype_up)
    rargs, rconst = route_args(route, ids)
    _moe_gate_up_kernel[(triton.cdiv(f, t.block_m), n_sel)](
        wg, wu, x, ids, *rargs, out, f, wg.stride(0), wg.stride(1), wu.stride(0), wu.stride(1), out.stride(0),
        NBLK_G=k // GEOMETRY[qtype_gate][0], NBLK_U=k // GEOMETRY[qtype_up][0], QG=qtype_gate, QU=qtype_up,
        ACT=ACTIVATIONS[act], BM=t.block_m, NBG=t.nb, NBU=max(1, nb_u), PERM_OUT=perm_out, **rconst, LATE=late,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_args(w_gate.device))
    return out


def moe_down(
    w_down: torch.Tensor,
    qtype: int,
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    *,
    tile: Tile | None = None,
    experts_ahead: int = EXPERTS_AHEAD,
    route: Route | None = None,
) -> torch.Tensor:
    """out[N] = residual[N] + sum_i weights[i] * (Wd[ids[i]] @ h[i]), summed in order i = 0..n_sel-1.

    w_down: uint8 [E, N, row_bytes]; h: float32 [n_sel, F] (rows contiguous); ids: int32/int64 [n_sel];
    weights: float32 [n_sel]; residual/out: float32 [N] (out may be residual). experts_ahead (F32 / F16 / BF16; the
    other types ignore it): the experts whose loads a program issues before their arithmetic (the largest divisor
    of n_sel up to it). route (F32 / F16 / BF16, the one a gate/up launched with `late` chose ids and weights from;
    experts_ahead > 1, at most ROUTE_MAX_E experts): the kernel ranks the experts itself from route.logits and loads
    its first experts' weights before the PDL wait; ids is not read, weights is. Returns out.
    """
    _check(qtype)
    n, f, n_sel = w_down.shape[1], h.shape[1], h.shape[0]
    t = tile or tile_for("down", qtype, n, f, n_sel, w_down.device)
    eu = experts_group(n_sel, experts_ahead) if qtype in FLOATS else 1
    rargs, rconst = down_route_args(route, ids, eu, "moe_down")
    wt = _typed(w_down, qtype)
    _moe_down_kernel[(triton.cdiv(n, t.block_m),)](
        wt, h, ids, weights, residual, out, n, wt.stride(0), wt.stride(1), h.stride(0),
        N_BLOCKS=f // GEOMETRY[qtype][0], N_SEL=n_sel, QTYPE=qtype, BM=t.block_m, NB=t.nb, EU=eu,
        route_ptr=rargs[0], E=rargs[1], **rconst,
        num_warps=t.num_warps, num_stages=t.num_stages, **launch_args(w_down.device))
    return out
