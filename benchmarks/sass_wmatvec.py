"""Static SASS of the Q4_K and Q6_K word kernels (kernels/triton/wmatvec.py) for sm_90, without a GPU.

    python benchmarks/sass_wmatvec.py [--tiles 2x4x1x2,4x4x1x2] [--kinds mv,gate_up,down,mv6,down6]

The wrappers are called at OLMoE sizes on CPU tensors with the kernel replaced by a recorder; the launch
is specialised as Triton's launcher would and compiled for sm_90 with Triton's bundled ptxas (helpers
from sass_qgemm.py). Reported per kernel and tile: registers, spill stack, the K loop's instructions per
weight (static loop body x threads / weights a trip decodes) and its mix by class (NOTES.md section 7).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import numpy as np
import torch
from sass_qgemm import _Recorder, classify, compile_launch, main_loop, sass_of

from moerun.kernels.triton import tcmatvec as tc
from moerun.kernels.triton import wmatvec as wk
from moerun.quant import random_blocks

N, F, E, TOPK = 2048, 1024, 64, 8
KERNELS = {"mv": "_wmv_kernel", "gate_up": "_wgate_up_kernel", "down": "_wdown_kernel", "mv6": "_wmvx_kernel",
           "down6": "_wdownx_kernel",
           "tcmv": "_tcmv_kernel", "tcgate_up": "_tcgate_up_kernel", "tcdown": "_tcdown_kernel",
           "tcmv6": "_tcmv_kernel", "tcdown6": "_tcdown_kernel",
           "tcmv8": "_tcmv_kernel", "tcgate_up8": "_tcgate_up_kernel", "tcdown8": "_tcdown_kernel"}
# mv6 / down6: Q6_K; tc*: tcmatvec.py's tensor-core kernels (Q4_K; tc*6 Q6_K, tc*8 Q8_0; 64 rows, 4 warps)


def _blocks(qtype: int, size: int, *lead_k: int) -> torch.Tensor:
    *lead, k = lead_k
    n = int(np.prod(lead))
    raw = random_blocks(qtype, n * k // 256, np.random.default_rng(0))
    return torch.from_numpy(raw).reshape(*lead, k // 256 * size)


def _q4k(*lead_k: int) -> torch.Tensor:
    return _blocks(12, 144, *lead_k)


def _q6k(*lead_k: int) -> torch.Tensor:
    return _blocks(14, 210, *lead_k)


def _q8(*lead_k: int) -> torch.Tensor:
    *lead, k = lead_k
    n = int(np.prod(lead))
    return torch.from_numpy(random_blocks(8, n * k // 32, np.random.default_rng(0))).reshape(*lead, k // 32 * 34)


def record(kind: str, tile: wk.WTile) -> tuple[tuple, dict]:
    """The wrapper's launch (args, kwargs) for one kernel kind at OLMoE sizes, on CPU tensors."""
    name = KERNELS[kind]
    mod = tc if kind.startswith("tc") else wk
    rec = _Recorder(getattr(mod, name))
    real = getattr(mod, name)
    setattr(mod, name, rec)
    ids = torch.arange(TOPK, dtype=torch.int32)
    try:
        if kind == "tcmv":
            tc.qmatvec_tc(_q4k(N, N), tc.empty_x(N, torch.device("cpu")), torch.empty(N))
        elif kind == "tcgate_up":
            w = _q4k(E, F, N)
            tc.moe_gate_up_tc(w, w, tc.empty_x(N, torch.device("cpu")), ids, tc.empty_x(F, torch.device("cpu"), TOPK))
        elif kind == "tcmv6":
            tc.qmatvec_tc(_q6k(N, N), tc.empty_x(N, torch.device("cpu")), torch.empty(N), qtype=14)
        elif kind == "tcmv8":
            tc.qmatvec_tc(_q8(N, N), tc.empty_x(N, torch.device("cpu")), torch.empty(N), qtype=8)
        elif kind == "tcgate_up8":
            w = _q8(E, F, N)
            tc.moe_gate_up_tc(w, w, tc.empty_x(N, torch.device("cpu")), ids, tc.empty_x(F, torch.device("cpu"), TOPK),
                              qtype=8, out_fmt=8)
        elif kind == "tcdown8":
            tc.moe_down_tc(_q8(E, N, F), tc.empty_x(F, torch.device("cpu"), TOPK), ids, torch.ones(TOPK),
                           torch.zeros(N), torch.empty(N), qtype=8)
        elif kind == "tcdown6":
            tc.moe_down_tc(_q6k(E, N, F), tc.empty_x(F, torch.device("cpu"), TOPK), ids, torch.ones(TOPK),
                           torch.zeros(N), torch.empty(N), qtype=14)
        elif kind == "tcdown":
            tc.moe_down_tc(_q4k(E, N, F), tc.empty_x(F, torch.device("cpu"), TOPK), ids, torch.ones(TOPK),
                           torch.zeros(N), torch.empty(N))
        elif kind == "mv":
            wk.qmatvec_w(_q4k(N, N), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "mv6":
            wk.qmatvec_w6(_q6k(N, N), torch.zeros(N), torch.empty(N), tile=tile)
        elif kind == "down6":
            wk.moe_down_w6(_q6k(E, N, F), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                           torch.empty(N), tile=tile)
        elif kind == "gate_up":
            w = _q4k(E, F, N)
            wk.moe_gate_up_w(w, w, torch.zeros(N), ids, torch.empty(TOPK, F), perm_out=True, tile=tile)
        else:
            wk.moe_down_w(_q4k(E, N, F), torch.zeros(TOPK, F), ids, torch.ones(TOPK), torch.zeros(N),
                          torch.empty(N), tile=tile)
    finally:
        setattr(mod, name, real)
    return rec.launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="1x4x1x2,2x4x1x2,4x4x1x2,4x2x1x2,4x8x2x2", help="RxNBxWARPSxSTAGES")
    ap.add_argument("--kinds", default="mv,gate_up,down", help=f"of {', '.join(KERNELS)}")
    args = ap.parse_args()
    cols = ["LDG", "LDS", "STS", "BAR", "I2F", "IALU", "MOV", "FP32", "FP16", "CTRL", "other"]
    print("| kernel | tile | regs | spill B | loop instr | /weight | " + " | ".join(cols) + " |")
    print("|---|---|---:|---:|---:|---:|" + "---:|" * len(cols))
    for kind in args.kinds.split(","):
        for spec in ["-"] if kind.startswith("tc") else args.tiles.split(","):
            tile = wk.WTile(tc.TC_BN, 1, 4) if kind.startswith("tc") else wk.WTile(*(int(v) for v in spec.split("x")))
            a, kw = record(kind, tile)
            ck = compile_launch(getattr(tc if kind.startswith("tc") else wk, KERNELS[kind]), a, kw)
            sass, res = sass_of(ck)
            body = main_loop(sass)
            per_trip = tile.rows * kw.get("NB", 1) * 256 * (2 if "gate_up" in kind else 1)  # per loop trip
            norm = 32 * tile.num_warps / per_trip
            cnt = Counter(classify(op) for op in body)
            mix = " | ".join(f"{cnt.get(c, 0) * norm:.2f}" for c in cols)
            regs = ",".join(re.findall(r"REG:(\d+)", res))
            stack = ",".join(re.findall(r"STACK:(\d+)", res))
            print(f"| {kind} | {spec} | {regs} | {stack} | {len(body)} | {len(body) * norm:.2f} | {mix} |", flush=True)


if __name__ == "__main__":
    main()
