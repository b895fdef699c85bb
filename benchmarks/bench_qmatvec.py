"""GPU micro-benchmark of the fused quantized matvec kernels at OLMoE-1B-7B decode sizes.

    python benchmarks/bench_qmatvec.py                      # all types, default tiles
    python benchmarks/bench_qmatvec.py --types q4_k,q6_k --sweep --json benchmarks/results/qmatvec.json

Each kernel runs inside a CUDA graph that replays R launches on different weights (R copies of a
dense matrix; for experts R disjoint sets of selected experts), so the figure is what a decode step
sees: no Python launch cost, cold L2 (R * bytes >= ~3x the L2 size), back-to-back kernels. GB/s counts
the weight bytes each launch reads (plus activations); "%copy" compares it with a device-to-device
copy (read + write bytes / time) measured in the same run, and "bf16 mv" with torch's bf16 matvec of
the same shape (cuBLAS) under the same ring. --sweep tries a grid of tiles per case, prints the best
and a TILES dict to paste into moerun/kernels/triton/qmatvec.py.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from collections.abc import Callable

import numpy as np
import torch
import triton
from _timing import capture_graph, event_ms
from gguf import GGMLQuantizationType as T

from moerun.kernels.torch_ops import permute_k4, unpermute_k4
from moerun.kernels.triton import imatvec as I
from moerun.kernels.triton import qmatvec as Q
from moerun.kernels.triton import wmatvec as W
from moerun.quant import random_blocks

HIDDEN, FFN, N_EXPERTS, N_SEL, VOCAB = 2048, 1024, 64, 8, 50304
TYPES = {t.name.lower(): int(t) for t in (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.Q4_0, T.Q5_0, T.F16, T.BF16, T.F32)}
NAMES = {v: k for k, v in TYPES.items()}


def fill(qtype: int, lead: tuple[int, ...], k: int, device: torch.device) -> torch.Tensor:
    """uint8 [*lead, row_bytes] of valid random blocks (a 16 MB pool tiled on the GPU: speed ignores values)."""
    bs, ts, _ = Q.GEOMETRY[qtype]
    n = math.prod(lead) * (k // bs)
    pool_n = min(n, (16 << 20) // ts)
    pool = torch.from_numpy(random_blocks(qtype, pool_n, np.random.default_rng(0), scale=0.05)).to(device)
    reps = -(-n // pool_n)
    return pool.repeat(reps, 1)[:n].reshape(*lead, k // bs * ts).contiguous()


def graph_time(fns: list[Callable[[], object]], iters: int = 20) -> float:
    """Seconds per call of the fns, replayed back to back in one CUDA graph (median of 5 timings)."""
    g = capture_graph(fns, warmup=fns)
    times = [event_ms(g.replay, calls=iters) / 1e3 / (iters * len(fns)) for _ in range(5)]
    return float(np.median(times))


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = graph_time([lambda: b.copy_(a)], iters=10)
    return 2 * n / t


class Case:
    """One kernel launch shape: kind ("mv" | "gate_up" | "down"), type, M rows, K inputs."""

    def __init__(self, kind: str, qtype: int, m: int, k: int, label: str, device: torch.device, l2: int):
        self.kind, self.qtype, self.m, self.k, self.label = kind, qtype, m, k, label
        bs, ts, _ = Q.GEOMETRY[qtype]
        row = k // bs * ts
        dev = device
        self.l2 = l2
        if kind == "mv":
            self.bytes = m * row + 4 * (k + m)
            self.ring = max(2, -(-3 * l2 // (m * row)))
            w = fill(qtype, (m,), k, dev)
            self.ws = [w] + [w.clone() for _ in range(self.ring - 1)]
            self.x = torch.randn(k, device=dev)
            self.out = torch.empty(m, device=dev)
            self.res = torch.randn(m, device=dev)
        else:
            n_mat = 2 if kind == "gate_up" else 1
            acts = k + m * N_SEL if kind == "gate_up" else k * N_SEL + 2 * m  # x + out, or h + residual + out
            self.bytes = n_mat * N_SEL * m * row + 4 * acts
            # disjoint expert sets (8 x the selected bytes), times enough weight copies to exceed 3x L2
            sets = N_EXPERTS // N_SEL
            copies = max(1, -(-3 * l2 // (sets * self.bytes)))
            perm = torch.randperm(N_EXPERTS, generator=torch.Generator().manual_seed(0))
            ids = [perm[i * N_SEL:(i + 1) * N_SEL].to(torch.int32).to(dev) for i in range(sets)]
            self.launches = []  # (w, w2 | None, ids)
            for _ in range(copies):
                w = fill(qtype, (N_EXPERTS, m), k, dev)
                w2 = fill(qtype, (N_EXPERTS, m), k, dev) if kind == "gate_up" else None
                self.launches += [(w, w2, i) for i in ids]
            self.x = torch.randn(k, device=dev) if kind == "gate_up" else torch.randn(N_SEL, k, device=dev)
            self.out = torch.empty(N_SEL, m, device=dev) if kind == "gate_up" else torch.empty(m, device=dev)
            self.res = torch.randn(m, device=dev)
            self.wts = torch.rand(N_SEL, device=dev)

    def fns(self, tile: Q.Tile | None, ahead: int = Q.EXPERTS_AHEAD) -> list[Callable[[], object]]:
        """The byte kernels (qmatvec.py); ahead: down's experts_ahead (F32 / F16 / BF16)."""
        qt = self.qtype
        if self.kind == "mv":
            return [lambda w=w: Q.qmatvec(w, qt, self.x, self.out, self.res, tile=tile) for w in self.ws]
        if self.kind == "gate_up":
            return [lambda w=w, w2=w2, i=i: Q.moe_gate_up(w, w2, qt, qt, self.x, i, self.out, "silu", tile=tile)
                    for w, w2, i in self.launches]
        return [lambda w=w, i=i: Q.moe_down(w, qt, self.x, i, self.wts, self.res, self.out, tile=tile,
                                            experts_ahead=ahead)
                for w, _, i in self.launches]

    def wfns(self, tile: W.WTile | None, copy: Callable[[torch.Tensor], torch.Tensor] | None = None
             ) -> list[Callable[[], object]]:
        """The word kernels (wmatvec.KERNELS) on the same launches; x permuted once outside the timed region.
        copy: the weights copied by it first (Q6_K: `pad_q6k`'s word-aligned blocks, `bytes_q6k`'s bytes)."""
        xp = permute_k4(self.x)
        fn = W.KERNELS[self.kind][self.qtype]
        done: dict[int, torch.Tensor] = {}  # each weight tensor copied once

        def pad(w: torch.Tensor | None) -> torch.Tensor | None:
            if w is None or copy is None:
                return w
            return done.setdefault(id(w), copy(w))

        if self.kind == "mv":
            ws = [pad(w) for w in self.ws]
            return [lambda w=w: fn(w, xp, self.out, self.res, tile=tile) for w in ws]
        launches = [(pad(w), pad(w2), i) for w, w2, i in self.launches]
        if self.kind == "gate_up":
            return [lambda w=w, w2=w2, i=i: fn(w, w2, xp, i, self.out, "silu", perm_out=True, tile=tile)
                    for w, w2, i in launches]
        return [lambda w=w, i=i: fn(w, xp, i, self.wts, self.res, self.out, tile=tile) for w, _, i in launches]

    def ifns(self, tile: W.WTile | None, words: int, ahead: int = Q.EXPERTS_AHEAD) -> list[Callable[[], object]]:
        """The integer-dot kernels (imatvec.py) on the same launches; x quantized once and the weights copied into
        the kernels' layout (Q6_K, Q8_0: imatvec.COPIES) outside the timed region. ahead: down's experts_ahead."""
        xq = I.quantize_x24(self.x)
        qt, copy = self.qtype, I.COPIES.get(self.qtype)
        done: dict[int, torch.Tensor] = self.__dict__.setdefault("_icopies", {})  # each weight tensor copied once

        def c(w: torch.Tensor | None) -> torch.Tensor | None:
            return w if w is None or copy is None else done.setdefault(id(w), copy(w))

        ws = [c(w) for w in getattr(self, "ws", [])]
        launches = [(c(w), c(w2), i) for w, w2, i in getattr(self, "launches", [])]
        if self.kind == "mv":
            return [lambda w=w: I.qmatvec_i(w, xq, self.out, self.res, tile=tile, words=words, qtype=qt)
                    for w in ws]
        if self.kind == "gate_up":
            return [lambda w=w, w2=w2, i=i: I.moe_gate_up_i(w, w2, xq, i, self.out, "silu", tile=tile, words=words,
                                                            qtype=qt)
                    for w, w2, i in launches]
        return [lambda w=w, i=i: I.moe_down_i(w, xq, i, self.wts, self.res, self.out, tile=tile, words=words,
                                              qtype=qt, experts_ahead=ahead)
                for w, _, i in launches]

    def icheck(self, tile: W.WTile | None, words: int, ahead: int = Q.EXPERTS_AHEAD) -> float:
        """Largest |integer - word kernel| / max |word kernel| over one launch (same weights and x)."""
        ifn, wfn = self.ifns(tile, words, ahead)[0], self.wfns(None)[0]
        wfn()
        want = self.out.clone()
        ifn()
        got = self.out.clone()
        if self.kind == "gate_up":  # the word kernel stored h permuted
            want = unpermute_k4(want)
        return float((got - want).abs().max() / want.abs().max())

    def bf16_fns(self) -> tuple[list[Callable[[], object]], int]:
        """torch bf16 matvec(s) reading the same number of weights per launch (cuBLAS reference)."""
        n_mat = {"mv": 1, "gate_up": 2 * N_SEL, "down": N_SEL}[self.kind]
        m, k = self.m * n_mat, self.k
        ring = max(2, -(-3 * self.l2 // (2 * m * k)))
        ws = [torch.randn(m, k, device=self.x.device, dtype=torch.bfloat16) for _ in range(ring)]
        x = torch.randn(k, device=self.x.device, dtype=torch.bfloat16)
        out = torch.empty(m, device=self.x.device, dtype=torch.bfloat16)
        return [lambda w=w: torch.mv(w, x, out=out) for w in ws], 2 * m * k

    def free(self) -> None:
        for a in ("ws", "launches", "_icopies"):
            if hasattr(self, a):
                delattr(self, a)


def has_words(qtype: int, kind: str) -> bool:
    """Whether a word kernel exists for this type and kind of product."""
    return qtype in W.KERNELS[kind]


def candidate_tiles(case: Case, bms: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                    steps: tuple[int, ...] = (1024, 2048, 4096, 8192)) -> list[Q.Tile]:
    """A grid around the heuristic: BLOCK_M in bms, K-steps of `steps` weights, up to 3 warp counts."""
    bs = Q.GEOMETRY[case.qtype][0]
    n_blocks = case.k // bs
    mats = 2 if case.kind == "gate_up" else 1
    tiles = []
    for bm in bms:
        if bm > triton.next_power_of_2(case.m):
            continue
        for wps in steps:
            nb = max(1, wps // (bm * bs * mats))
            if nb > triton.next_power_of_2(n_blocks) or nb * bm * bs * mats != wps:
                continue
            w0 = max(2, min(8, wps // (32 * 32)))
            for warps in sorted({w0, min(8, 2 * w0), max(1, w0 // 2)}):
                tiles.append(Q.Tile(bm, nb, warps, 1))
    return tiles


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated: " + ",".join(TYPES))
    ap.add_argument("--kinds", default="mv,gate_up,down,out", help="mv (2048x2048), gate_up, down, out (vocab)")
    ap.add_argument("--sweep", action="store_true", help="try a grid of tiles per case")
    ap.add_argument("--bms", default="1,2,4,8,16,32", help="the sweep's rows per program (comma-separated)")
    ap.add_argument("--steps", default="1024,2048,4096,8192",
                    help="the sweep's weights per program per K-step (comma-separated)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--itiles", default="",
                    help="integer-dot tiles to time (Q4_K, Q6_K, Q8_0): RxNBxWARPSxSTAGES[xWORDS] (Q4_K's words per "
                         "thread: 4 or 8) or default ('' = none)")
    ap.add_argument("--ahead", default=str(Q.EXPERTS_AHEAD),
                    help="each --itiles tile of down (and the F32 / F16 / BF16 byte down) at each of these "
                         "experts_ahead (comma-separated: that many experts' loads before their arithmetic; "
                         f"default: the kernels' {Q.EXPERTS_AHEAD})")
    ap.add_argument("--wtiles", default="default,1x4x1x2,2x4x1x2,4x4x1x2,4x8x2x2,2x8x1x2,4x4x2x2,8x4x1x2",
                    help="Q4_K word-kernel tiles to time too: RxNBxWARPSxSTAGES or default ('' = none)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth(dev)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB, copy {bw / 1e9:.0f} GB/s "
          f"(read+write), triton {triton.__version__}, torch {torch.__version__}")
    kinds = args.kinds.split(",")
    rows = []
    best_tiles: dict[tuple[str, int, int, int], Q.Tile] = {}
    for name in args.types.split(","):
        qt = TYPES[name]
        shapes = [("mv", HIDDEN, HIDDEN, "attn 2048x2048"), ("gate_up", FFN, HIDDEN, "experts gate+up 8x1024x2048"),
                  ("down", HIDDEN, FFN, "experts down 8x2048x1024"), ("out", VOCAB, HIDDEN, "output 50304x2048")]
        for kind, m, k, label in shapes:
            if kind not in kinds:
                continue
            case = Case("mv" if kind == "out" else kind, qt, m, k, label, dev, l2)
            default = Q.tile_for(case.kind, qt, m, k, N_SEL, dev)
            t = graph_time(case.fns(None))
            row = {"type": name, "case": label, "kind": case.kind, "M": m, "K": k, "bytes": case.bytes,
                   "tile": list(default), "us": t * 1e6, "GBps": case.bytes / t / 1e9, "pct_copy": case.bytes / t / bw}
            aheads = [int(a) for a in args.ahead.split(",")] if case.kind == "down" else [Q.EXPERTS_AHEAD]
            for ahead in [a for a in aheads if a != Q.EXPERTS_AHEAD] if qt in Q.FLOATS else []:
                ta = graph_time(case.fns(None, ahead))
                row.setdefault("ahead", {})[ahead] = ta * 1e6
                print(f"{name:5} {label:28} {ta * 1e6:8.2f} us {case.bytes / ta / 1e9:6.0f} GB/s experts_ahead {ahead}",
                      flush=True)
            fns, nbytes = case.bf16_fns()
            tb = graph_time(fns)
            row["bf16_mv_GBps"] = nbytes / tb / 1e9
            del fns
            if args.sweep:
                results = []
                grid = candidate_tiles(case, tuple(int(b) for b in args.bms.split(",")),
                                       tuple(int(s) for s in args.steps.split(",")))
                for tile in grid:
                    try:
                        results.append((graph_time(case.fns(tile), iters=10), tile))
                    except Exception as e:  # e.g. out of resources: report and go on
                        print(f"  {tile}: {type(e).__name__}: {str(e)[:80]}")
                results.sort()
                print(f"{name:5} {label:28} sweep of {len(grid)}, fastest: " + ", ".join(
                    f"{tuple(tl_)} {ts * 1e6:.2f} us" for ts, tl_ in results[:5]), flush=True)
                row["sweep"] = [[list(tl_), ts * 1e6] for ts, tl_ in results]
                if results:
                    bt, btile = results[0]
                    row["best_tile"], row["best_us"], row["best_GBps"] = list(btile), bt * 1e6, case.bytes / bt / 1e9
                    best_tiles[(case.kind, qt, m, k)] = btile
            for spec in [w for w in args.wtiles.split(",") if w] if has_words(qt, case.kind) else []:
                wt = None if spec == "default" else W.WTile(*map(int, spec.split("x")))
                tw = graph_time(case.wfns(wt))
                row.setdefault("words", {})[spec] = tw * 1e6
                print(f"{name:5} {label:28} {tw * 1e6:8.2f} us {case.bytes / tw / 1e9:6.0f} GB/s words {spec}",
                      flush=True)
                # Q6_K also on its word-aligned (padded) copy and its one-byte-per-value copy (Q6B)
                for layout, copy in [("padded", W.pad_q6k), ("bytes", W.bytes_q6k)] if qt == int(T.Q6_K) else []:
                    tw = graph_time(case.wfns(wt, copy))
                    row.setdefault(f"words_{layout}", {})[spec] = tw * 1e6
                    print(f"{name:5} {label:28} {tw * 1e6:8.2f} us {case.bytes / tw / 1e9:6.0f} GB/s words {spec} "
                          f"{layout}", flush=True)
                    torch.cuda.empty_cache()
            specs = [w for w in args.itiles.split(",") if w] if qt in I.LAYOUTS else []
            for spec, ahead in [(sp, a) for sp in specs for a in aheads]:
                parts = [] if spec == "default" else [int(v) for v in spec.split("x")]
                words = parts[4] if len(parts) > 4 else I.WORDS_PER_THREAD
                it = W.WTile(*parts[:4]) if parts else None
                err = case.icheck(it, words, ahead)
                ti = graph_time(case.ifns(it, words, ahead))
                key = spec if ahead == Q.EXPERTS_AHEAD else f"{spec}@ahead{ahead}"
                row.setdefault("int", {})[key] = [ti * 1e6, err]
                print(f"{name:5} {label:28} {ti * 1e6:8.2f} us {case.bytes / ti / 1e9:6.0f} GB/s int {key} "
                      f"(rel. diff {err:.1e})", flush=True)
            rows.append(row)
            best = f"  best {tuple(row['best_tile'])} {row['best_us']:.2f} us {row['best_GBps']:.0f} GB/s" \
                if "best_tile" in row else ""
            print(f"{name:5} {label:28} {row['us']:8.2f} us {row['GBps']:6.0f} GB/s {100 * row['pct_copy']:5.1f}%copy "
                  f"(bf16 mv {row['bf16_mv_GBps']:5.0f} GB/s) tile {tuple(default)}{best}", flush=True)
            case.free()
            torch.cuda.empty_cache()
    if best_tiles:
        print("\nTILES = {")
        for (kind, qt, m, k), tile in best_tiles.items():
            print(f"    ({kind!r}, {qt}, {m}, {k}): Tile{tuple(tile)},  # {NAMES[qt]}")
        print("}")
    if args.json:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "gpu": props.name, "time": time.time(), "copy_GBps": bw / 1e9,
                       "triton": triton.__version__, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
