"""Static SASS of the Q4_K and Q6_K word kernels (kernels/triton/wmatvec.py) for sm_90, without a GPU.

    python benchmarks/sass_wmatvec.py [--tiles 2x4x1x2,4x4x1x2] [--kinds mv,gate_up,down,mv6,down6] [--order]

The wrappers are called at OLMoE sizes on CPU tensors with the kernel replaced by a recorder; the launch
is specialised as Triton's launcher would and compiled for sm_90 with Triton's bundled ptxas (helpers
from sass_qgemm.py). Reported per kernel and tile: registers, spill stack, the K loop's instructions per
weight (static loop body x threads / weights a trip decodes) and its mix by class (NOTES.md section 7).
--order adds each kernel's global loads (L), barriers (B) and dot / FMA instructions (D) in SASS order, run-length
coded: a load after a D waits for the arithmetic before it, so "L8 D15 L1 D19" is a chain of round trips and
"L208 B1 L1 D384" one (NOTES.md 7x).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import numpy as np
import torch
from sass_qgemm import _Recorder, classify, compile_launch, main_loop, sass_of

from moerun.kernels.triton import imatvec as ik
from moerun.kernels.triton import wmatvec as wk
from moerun.quant import random_blocks

N, F, E, TOPK = 2048, 1024, 64, 8
KERNELS = {"mv": "_wmv_kernel", "gate_up": "_wgate_up_kernel", "gate_up_route": "_wgate_up_kernel",
           "down": "_wdown_kernel", "mv6": "_wmvx_kernel", "down6": "_wdownx_kernel", "mv8": "_wmvx_kernel",
           "down8": "_wdownx_kernel", "gate_up8": "_wgate_upx_kernel", "mv6b": "_wmvx_kernel",
           "down6b": "_wdownx_kernel"}  # mv6 / down6: Q6_K; *6b: Q6_K on `bytes_q6k`'s copy; *8: Q8_0;
# gate_up_route: gate/up choosing its experts from the router's logits (wk.Route); igate_up_route: the integer gate/up
# as the decode step launches it (routing from the logits, h quantized for down)
IKERNELS = {"imv": "_imv_kernel", "imv6": "_imv_kernel", "imv8": "_imv_kernel", "igate_up": "_igate_up_kernel",
            "igate_up6": "_igate_up_kernel", "igate_up8": "_igate_up_kernel",
            "igate_up_route": "_igate_up_kernel", "idown": "_idown_kernel",
            "idown6": "_idown_kernel", "idown8": "_idown_kernel"}  # imatvec.py (Q4_K; *6 / *8: Q6_K / Q8_0 copies)
ITYPES = {"6": 14, "8": 8}
WORDS = ik.WORDS_PER_THREAD
AHEAD = 2  # the integer down kernel's experts_ahead (its default, qmatvec.EXPERTS_AHEAD)


def _blocks(qtype: int, size: int, *lead_k: int) -> torch.Tensor:
    *lead, k = lead_k
    n = int(np.prod(lead))
    raw = random_blocks(qtype, n * k // (32 if qtype == 8 else 256), np.random.default_rng(0))  # Q8_0: 32 per block
    return torch.from_numpy(raw).reshape(*lead, k // 256 * size)


def _q4k(*lead_k: int) -> torch.Tensor:
    return _blocks(12, 144, *lead_k)


def _q6k(*lead_k: int) -> torch.Tensor:
    return _blocks(14, 210, *lead_k)


def _q80(*lead_k: int) -> torch.Tensor:
    return _blocks(8, 272, *lead_k)


def record(kind: str, tile: wk.WTile) -> tuple[tuple, dict]:
    """The wrapper's launch (args, kwargs) for one kernel kind at OLMoE sizes, on CPU tensors."""
    mod, name = (ik, IKERNELS[kind]) if kind in IKERNELS else (wk, KERNELS[kind])
    rec = _Recorder(getattr(mod, name))
    real = getattr(mod, name)
    setattr(mod, name, rec)
    ids = torch.arange(TOPK, dtype=torch.int32)
    try:
        if kind in IKERNELS:
            qt = ITYPES.get(kind[-1], 12)
            cpu = torch.device("cpu")

            def w(*lead_k: int) -> torch.Tensor:  # in the layout the integer kernels read
                raw = {12: _q4k, 14: _q6k, 8: _q80}[qt](*lead_k)
                return raw if qt == 12 else ik.COPIES[qt](raw)

            if kind.startswith("imv"):
                ik.qmatvec_i(w(N, N), ik.X24.empty((N,), cpu), torch.empty(N), qtype=qt, tile=tile, words=WORDS)
            elif kind == "igate_up_route":  # as the decode step: routing from the logits, h quantized for down
                wg = w(E, F, N)
                ik.moe_gate_up_i(wg, wg, ik.X24.empty((N,), cpu), ids, torch.empty(TOPK, F), qtype=qt, tile=tile,
                                 words=WORDS, route=wk.Route(torch.zeros(E), torch.empty(TOPK), False),
                                 h_out=ik.X24.empty((TOPK, F), cpu),
                                 counters=torch.zeros(TOPK * F // 32, dtype=torch.int32))
            elif kind.startswith("igate_up"):
                wg = w(E, F, N)
                ik.moe_gate_up_i(wg, wg, ik.X24.empty((N,), cpu), ids, torch.empty(TOPK, F), qtype=qt, tile=tile,
                                 words=WORDS)
            else:
                ik.moe_down_i(w(E, N, F), ik.X24.empty((TOPK, F), cpu), ids, torch.ones(TOPK), torch.zeros(N),
                              torch.empty(N), qtype=qt, tile=tile, words=WORDS, experts_ahead=AHEAD)
        elif kind == "mv":
            wk.qmatvec_w(_q4k(N, N), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "mv6":
            wk.qmatvec_w6(_q6k(N, N), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "mv6b":  # Q6_K on `bytes_q6k`'s copy
            wk.qmatvec_w6(wk.bytes_q6k(_q6k(N, N)), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "down6b":
            wk.moe_down_w6(wk.bytes_q6k(_q6k(E, N, F)), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                           torch.empty(N), tile=tile)
        elif kind == "mv8":
            wk.qmatvec_w8(_q80(N, N), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "down8":
            wk.moe_down_w8(_q80(E, N, F), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                           torch.empty(N), tile=tile)
        elif kind == "gate_up8":
            w = _q80(E, F, N)
            wk.moe_gate_up_w8(w, w, torch.zeros(N), ids, torch.empty(TOPK, F), perm_out=True, tile=tile)
        elif kind == "down6":
            wk.moe_down_w6(_q6k(E, N, F), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                           torch.empty(N), tile=tile)
        elif kind in ("gate_up", "gate_up_route"):
            w = _q4k(E, F, N)
            route = wk.Route(torch.zeros(E), torch.empty(TOPK), False) if kind == "gate_up_route" else None
            wk.moe_gate_up_w(w, w, torch.zeros(N), ids, torch.empty(TOPK, F), perm_out=True, tile=tile, route=route)
        else:
            wk.moe_down_w(_q4k(E, N, F), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                          torch.empty(N), tile=tile)
    finally:
        setattr(mod, name, real)
    return rec.launch


def issue_order(sass: str) -> str:
    """Loads (L), barriers (B) and dot / FMA instructions (D) in SASS order, run-length coded: "L8 D15 L1 D19"."""
    runs: list[list] = []
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass):
        c = "L" if op.startswith("LDG") else "B" if op.startswith("BAR") else \
            "D" if op.startswith(("IDP", "FFMA", "HFMA2")) else None
        if c and runs and runs[-1][0] == c:
            runs[-1][1] += 1
        elif c:
            runs.append([c, 1])
    return " ".join(f"{c}{n}" for c, n in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="1x4x1x2,2x4x1x2,4x4x1x2,4x2x1x2,4x8x2x2", help="RxNBxWARPSxSTAGES")
    ap.add_argument("--kinds", default="mv,gate_up,down", help=f"of {', '.join([*KERNELS, *IKERNELS])}")
    ap.add_argument("--words", type=int, default=ik.WORDS_PER_THREAD, help="imatvec's qs words per thread")
    ap.add_argument("--order", action="store_true", help="also each kernel's loads / barriers / dots in SASS order")
    ap.add_argument("--ahead", type=int, default=2,
                    help="the integer down kernel's experts_ahead (> 1: no K loop; the whole kernel is counted)")
    args = ap.parse_args()
    global WORDS, AHEAD
    WORDS, AHEAD = args.words, args.ahead
    cols = ["LDG", "LDS", "STS", "BAR", "I2F", "IALU", "MOV", "FP32", "FP16", "CTRL", "other"]
    print("| kernel | tile | regs | spill B | shared B | LDGSTS | loop instr | /weight | " + " | ".join(cols) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cols))
    orders: list[str] = []
    for kind in args.kinds.split(","):
        for spec in args.tiles.split(","):
            tile = wk.WTile(*(int(v) for v in spec.split("x")))
            a, kw = record(kind, tile)
            fn = getattr(ik, IKERNELS[kind]) if kind in IKERNELS else getattr(wk, KERNELS[kind])
            ck = compile_launch(fn, a, kw)
            sass, res = sass_of(ck)
            body = main_loop(sass)
            # weights a loop trip decodes
            per_trip = tile.rows * kw["NB"] * 256 * (2 if "gate_up" in kind else 1)
            if kw.get("EU", 1) > 1:  # experts ahead: every loop unrolled; the whole kernel and all its weights
                body = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
                body = [op for op in body if op != "NOP"]
                per_trip = tile.rows * kw["N_BLOCKS"] * 256 * kw["N_SEL"]
            norm = 32 * tile.num_warps / per_trip
            cnt = Counter(classify(op) for op in body)
            mix = " | ".join(f"{cnt.get(c, 0) * norm:.2f}" for c in cols)
            regs = ",".join(re.findall(r"REG:(\d+)", res))
            stack = ",".join(re.findall(r"STACK:(\d+)", res))
            cp = len(re.findall(r"\bLDGSTS\b", sass))
            print(f"| {kind} | {spec} | {regs} | {stack} | {ck.metadata.shared} | {cp} | {len(body)} | "
                  f"{len(body) * norm:.2f} | {mix} |", flush=True)
            if args.order:
                orders.append(f"{kind} {spec}: {issue_order(sass)}")
    for line in orders:
        print(line)


if __name__ == "__main__":
    main()
