"""Static SASS of the prefill GEMM kernel (kernels/triton/qgemm.py) for sm_90, without a GPU.

    python benchmarks/sass_qgemm.py [--types Q4_K,Q6_K,Q8_0,F16] [--tiles 64x64x4x2] [--configs gate_up,dense]
                                    [--dump DIR]

The public wrappers (qgemm, moe_gate_up, moe_down) are called at OLMoE sizes on CPU tensors with the
kernel replaced by a recorder; the recorded launch is specialised exactly as Triton's launcher would
(ints divisible by 16 / equal to 1, pointer alignment) and compiled for sm_90 with Triton's bundled
ptxas (bf16 tensor-core mode: EXACT = EMULATE = False). Reported per configuration: registers/thread,
spill stack, shared memory, the main K loop's size and its instruction mix by class, normalised to
thread-instructions per weight decoded (per-thread count x threads / weights the loop decodes per trip:
BLOCK_N x BK, twice when gated).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile
from collections import Counter

import numpy as np
import torch
import triton
from gguf import GGMLQuantizationType as Q
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import native_specialize_impl

from moerun.kernels.triton import qgemm as qg
from moerun.kernels.triton.qmatvec import GEOMETRY
from moerun.quant import random_blocks

T, N, F, E, TOPK = 512, 2048, 1024, 64, 8
TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

# instruction classes, by opcode (the part before the first '.'), in table order
CLASSES = {
    "LDG": ("LDG",), "LDGSTS": ("LDGSTS",), "LDS": ("LDS", "LDSM"), "STS": ("STS",), "STG": ("STG",),
    "I2F": ("I2F", "I2FP"), "F2F": ("F2F", "F2FP", "F2I"),
    "IALU": ("IADD3", "IMAD", "IMADWIDE", "LOP3", "SHF", "LEA", "PRMT", "ISETP", "SEL", "IABS", "IMNMX", "BMSK",
             "SGXT", "POPC", "FLO", "BREV", "IDP"),
    "MOV": ("MOV", "S2R", "S2UR", "CS2R", "R2UR", "UMOV", "IMAD.MOV"),
    "FP32": ("FFMA", "FMUL", "FADD", "FSEL", "FSETP", "FMNMX"),
    "FP16": ("HFMA2", "HADD2", "HMUL2", "HSETP2"),
    "MMA": ("HGMMA", "HMMA", "WARPGROUP", "WARPSYNC"),
    "BAR": ("BAR", "SYNCS", "DEPBAR", "ARRIVES", "MEMBAR"),
    "UNIF": ("UIADD3", "ULDC", "USHF", "ULOP3", "UISETP", "ULEA", "UIMAD", "USEL", "UPRMT", "UFLO", "UPOPC",
             "R2UR", "UMOV"),
    "CTRL": ("BRA", "BSSY", "BSYNC", "EXIT", "PLOP3", "VOTEU", "VOTE", "P2R", "R2P", "ISETP.NE.U32"),
}


def classify(op: str) -> str:
    base = op.split(".")[0]
    if op.startswith("IMAD.MOV"):
        return "MOV"
    if op.startswith("IMAD.WIDE"):
        return "IALU"
    for name, ops in CLASSES.items():
        if base in ops:
            return name
    return "other"


class _Recorder:
    """Stands in for the @triton.jit kernel: kernel[grid](*args, **kw) records the launch."""

    def __init__(self, fn):
        self.fn = fn
        self.launch = None

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.launch = (args, kw)

        return go


def _weights(qtype: int, lead: tuple[int, ...], k: int, gen: np.random.Generator) -> torch.Tensor:
    bs, ts, _ = GEOMETRY[qtype]
    n = int(np.prod(lead))
    return torch.from_numpy(random_blocks(qtype, n * k // bs, gen, scale=0.5)).reshape(*lead, k // bs * ts)


def _align(ids: torch.Tensor, n_expert: int, block_m: int):
    """The routing on the CPU (torch ops; moe_align itself may be a GPU kernel)."""
    fn = getattr(qg, "moe_align_torch", None) or qg.moe_align
    return fn(ids, n_expert, block_m)


def record(config: str, qtype: int, tile: qg.GemmTile) -> tuple[tuple, dict]:
    """The wrapper's launch (args, kwargs) for one configuration, on CPU tensors."""
    gen = np.random.default_rng(0)
    x = torch.randn(T, N).bfloat16()
    rec = _Recorder(qg._qgemm_kernel)
    real, qg._qgemm_kernel = qg._qgemm_kernel, rec
    try:
        if config == "dense":
            qg.qgemm(x, _weights(qtype, (N,), N, gen), qtype, torch.empty(T, N), tile=tile)
        else:
            ids = torch.stack([torch.randperm(E)[:TOPK] for _ in range(T)]).int()
            r = _align(ids, E, tile.block_m)
            h = torch.empty(r.rows.shape[0], F, dtype=torch.bfloat16)
            if config == "gate_up":
                w = _weights(qtype, (E, F), N, gen)
                qg.moe_gate_up(x, w, w.clone(), qtype, qtype, r, h, tile=tile)
            else:
                qg.moe_down(h, _weights(qtype, (E, N), F, gen), qtype, r, torch.rand(T * TOPK),
                            torch.empty(T * TOPK, N), tile=tile)
    finally:
        qg._qgemm_kernel = real
    return rec.launch


def compile_launch(fn, args: tuple, kw: dict):
    """Specialise a recorded launch as the launcher would and compile it for sm_90."""
    backend = make_backend(TARGET)
    params = list(inspect.signature(fn.fn).parameters)
    opt_keys = {"num_warps", "num_stages"}
    bound = dict(zip(params, args, strict=False))  # the rest come as keywords
    bound.update({k: v for k, v in kw.items() if k not in opt_keys})
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(params):
        v = bound[name]
        if i in fn.constexprs:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
            continue
        ty, attr = native_specialize_impl(backend, v, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = attr
        elif attr:
            attrs[(i,)] = backend.parse_attr(attr)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={k: kw[k] for k in opt_keys})


def sass_of(ck) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    return sass, res


def main_loop(sass: str) -> list[str]:
    """Opcodes (with modifiers) of the largest backward-branch loop: the K loop."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)[^;]*);", sass)
    ins = [(int(a, 16), op) for a, _, op in lines if op != "NOP"]
    best: list[str] = []
    for a, text, op in lines:
        tgt = re.search(r"BRA\s+.*?0x([0-9a-f]+)", text) if op == "BRA" else None
        if tgt and int(tgt.group(1), 16) < int(a, 16):
            body = [o for x, o in ins if int(tgt.group(1), 16) <= x <= int(a, 16)]
            if len(body) > len(best):
                best = body
    return best


def report(label: str, ck, tile: qg.GemmTile, gated: bool, dump: str | None) -> dict:
    sass, res = sass_of(ck)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, label.replace(" ", "_") + ".sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(dump, label.replace(" ", "_") + ".ttgir"), "w") as f:
            f.write(ck.asm["ttgir"])
    body = main_loop(sass)
    threads = 32 * tile.num_warps
    per_trip = tile.block_n * qg.BK * (2 if gated else 1)
    norm = threads / per_trip
    cnt = Counter(classify(op) for op in body)
    ldg = Counter(op for op in body if op.startswith("LDG"))
    return {
        "label": label, "regs": ",".join(re.findall(r"REG:(\d+)", res)),
        "stack": ",".join(re.findall(r"STACK:(\d+)", res)), "smem": ck.metadata.shared,
        "body": len(body), "per_w": len(body) * norm, "cls": {k: v * norm for k, v in cnt.items()},
        "ldg": ", ".join(f"{v}x{k.removeprefix('LDG.E').lstrip('.') or '32'}" for k, v in sorted(ldg.items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,F16")
    ap.add_argument("--tiles", default="64x64x4x2", help="BMxBNxWARPSxSTAGES, suffix sw = swapped operands")
    ap.add_argument("--configs", default="gate_up,dense")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS and TTGIR into this folder")
    args = ap.parse_args()
    rows = []
    for spec in args.tiles.split(","):
        tile = qg.GemmTile(*(int(v) for v in spec.removesuffix("sw").split("x")), swap=spec.endswith("sw"))
        for config in args.configs.split(","):
            for tname in args.types.split(","):
                qt = int(Q[tname])
                a, kw = record(config, qt, tile)
                label = f"{tname} {config} {spec}"
                try:
                    ck = compile_launch(qg._qgemm_kernel, a, kw)
                except Exception as e:  # noqa: BLE001 - one failing configuration should not cost the rest
                    print(f"{label}: {type(e).__name__}: {str(e)[:1500]}")
                    continue
                rows.append(report(label, ck, tile, config == "gate_up", args.dump))
                r = rows[-1]
                print(f"{label}: {r['per_w']:.1f} instr/weight, regs {r['regs']}, stack {r['stack']}", flush=True)
    cols = ["LDG", "LDGSTS", "LDS", "STS", "I2F", "F2F", "IALU", "MOV", "UNIF", "FP32", "FP16", "MMA", "BAR",
            "CTRL", "other"]
    print("\nThread-instructions per weight decoded in the K loop (sm_90 SASS, static loop body):\n")
    print("| config | regs | spill B | smem B | loop instr | /weight | " + " | ".join(cols) + " | LDG widths (loop) |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(cols) + "---|")
    for r in rows:
        c = " | ".join(f"{r['cls'].get(k, 0):.2f}" for k in cols)
        print(f"| {r['label']} | {r['regs']} | {r['stack']} | {r['smem']} | {r['body']} | {r['per_w']:.2f} | {c} "
              f"| {r['ldg']} |")


if __name__ == "__main__":
    main()
