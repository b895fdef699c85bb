"""Static SASS of the split attention kernel (kernels/triton/attention.py) for sm_90, without a GPU.

    python benchmarks/sass_attention.py [--variants short,long,dot32,...] [--n-ctx 4224] [--dump DIR] [--check]

Each variant (`short` / `long` / `long_f16`: attention.ATTN_SHORT / ATTN_LONG / ATTN_LONG_F16; any other name: an
ops feature's long-phase variant, moerun.kernels.ops.attention_features; or a variant's fields, "(32;4;3;1;1;1)":
block_n, warps, programs_per_sm, early, ahead, dot) is launched as the fast step launches it at OLMoE-1B-7B's shape
(16 heads of 128, f16 caches of n_ctx positions, full QK-norm + NeoX RoPE prologue, the fused combine, PDL) on CPU
tensors with the kernel replaced by a recorder, then compiled for sm_90 with Triton's bundled ptxas
(`sass_qgemm.compile_launch`).
Reported: splits at 132 SMs, registers per thread, shared memory, the programs per SM both allow (65,536 registers,
228 KB), the tile loop's instructions (per tile and per 64 positions) and its global loads, cp.async copies
(LDGSTS) and tensor-core instructions. How NOTES.md's static tables (9c, 9e, 9g) were made. --check: exit 1
where a variant's resources leave fewer programs per SM than its split policy aims at (`programs_per_sm`: its
splits would then run in two waves; tests/bench/test_sass_attention.py runs it).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret

import torch  # noqa: E402
from sass_qgemm import _Recorder, classify, compile_launch, main_loop, sass_of  # noqa: E402

from moerun.kernels.ops import attention_features  # noqa: E402
from moerun.kernels.triton import attention as ak  # noqa: E402
from moerun.kernels.triton.decode_ops import rope_table  # noqa: E402

H, D, SMS = 16, 128, 132
REGS_PER_SM, SMEM_PER_SM, SMEM_RESERVED = 65536, 228 * 1024, 1024  # sm_90; the driver reserves 1 KB per block


def variant(name: str) -> ak.AttnVariant:
    """short, long, long_f16, a feature's name, or any of them @N: with N programs per SM instead."""
    if "@" in name:
        base, _, pps = name.partition("@")
        return variant(base)._replace(programs_per_sm=int(pps))
    if name.startswith("("):  # a variant's fields: (32;4;3;1;1;1) = block_n, warps, programs_per_sm, early, ahead, dot
        f = [int(x) for x in name.strip("()").split(";")]
        return ak.AttnVariant(f[0], f[1], f[2], bool(f[3]), bool(f[4]), bool(f[5]))
    if name == "short":
        return ak.ATTN_SHORT
    if name == "long":
        return ak.ATTN_LONG
    if name == "long_f16":
        return ak.ATTN_LONG_F16
    feats = attention_features()
    if name not in feats:
        raise SystemExit(f"unknown variant {name!r}: short, long, long_f16 or one of "
                         f"{', '.join(feats) or '(no features)'}")
    return ak.AttnVariant(*feats[name])


def record(v: ak.AttnVariant, n_ctx: int) -> tuple[int, tuple, dict]:
    """(splits, args, kwargs) of the fast step's launch of variant v."""
    splits = ak.attention_splits(n_ctx, H, SMS, v.block_n, v.programs_per_sm)
    kc = torch.zeros(n_ctx, H, D, dtype=torch.float16)
    rope = ak.RopeStore(torch.randn(H * D), torch.randn(H * D), torch.ones(H * D), torch.ones(H * D),
                        rope_table(n_ctx, D, 10000.0), 1e-6, "full", "neox")
    rec = _Recorder(ak._attn_split_kernel)
    real, ak._attn_split_kernel = ak._attn_split_kernel, rec
    try:
        ak.attention_decode(torch.randn(H, D), kc, kc.clone(), torch.tensor([n_ctx]), D ** -0.5, 0,
                            torch.empty(H, D), ak.attention_scratch(H, D, splits, "cpu"), block_n=v.block_n,
                            num_warps=v.warps, rope=rope, counters=torch.zeros(H, dtype=torch.int32), early=v.early,
                            ahead=v.ahead, dot=v.dot)
    finally:
        ak._attn_split_kernel = real
    args, kw = rec.launch
    kw = {k: val for k, val in kw.items() if k != "launch_pdl"} | {"PDL": True}
    kw.setdefault("num_stages", 3)
    return splits, args, kw


def fits(regs: int, smem: int, warps: int) -> tuple[int, int]:
    """Programs of `warps` warps an sm_90 SM holds at `regs` registers per thread and `smem` bytes of shared
    memory each: (by registers, by shared memory)."""
    return REGS_PER_SM // (regs * 32 * warps), SMEM_PER_SM // (smem + SMEM_RESERVED)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(["short", "long", "long_f16", *attention_features()]))
    ap.add_argument("--n-ctx", type=int, default=4224, help="cache positions (the bench's -d 4096 cache: 4224)")
    ap.add_argument("--dump", default=None, help="write each variant's SASS into this folder")
    ap.add_argument("--check", action="store_true", help="exit 1 where a variant fits fewer programs per SM than "
                    "its programs_per_sm")
    args = ap.parse_args()
    short = []
    print("| variant | tile, warps | splits | registers | shared KB | programs / SM (regs, smem) "
          "| loop instr. per tile | per 64 positions | LDG | LDGSTS | HMMA |\n|---|---|---:|---:|---:|---|---:|---:|"
          "---:|---:|---:|")
    for name in args.variants.split(","):
        v = variant(name)
        splits, a, kw = record(v, args.n_ctx)
        ck = compile_launch(ak._attn_split_kernel, a, kw)
        sass, res = sass_of(ck)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                f.write(sass)
        regs = int(re.findall(r"REG:(\d+)", res)[0])
        smem = ck.metadata.shared
        by_regs, by_smem = fits(regs, smem, v.warps)
        if min(by_regs, by_smem) < v.programs_per_sm:
            short.append(f"{name}: {min(by_regs, by_smem)} programs per SM fit ({regs} registers, {smem} B shared), "
                         f"its split policy aims at {v.programs_per_sm}")
        body = main_loop(sass)
        cls = Counter(classify(op) for op in body)
        hmma = sum(op.startswith("HMMA") for op in body)
        print(f"| {name} | {v.block_n}, {v.warps} | {splits} | {regs} | {smem / 1024:.0f} "
              f"| {min(by_regs, by_smem)} ({by_regs}, {by_smem}) | {len(body)} | {len(body) * 64 // v.block_n} "
              f"| {cls['LDG']} | {cls['LDGSTS']} | {hmma} |", flush=True)
    for line in short:
        print(line)
    return 1 if args.check and short else 0


if __name__ == "__main__":
    raise SystemExit(main())
