"""A few eager decode steps (and a fast prefill) of tiny synthetic models with every Triton decode kernel, for
compute-sanitizer (device machine; `benchmarks/gpu_run.sh sanitize`):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 benchmarks/sanitize_step.py
    compute-sanitizer --tool racecheck python3 benchmarks/sanitize_step.py

Each (preset, type, ops) case prefills 20 tokens, then decodes 3 steps without a CUDA graph (so every launch is
a kernel the tool sees: `decode_stream`, then one `decode` teacher-forced), and checks each step's logits
against ops="torch" (relative error <= 1e-3). Exits 1 on a mismatch; the tool's own findings go to its report
(use --error-exitcode 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from moerun.engine.engine import Engine
from moerun.kernels.ops import FEATURES
from moerun.synth import cached_synth

PRESETS = ("tiny-olmoe-1b-7b", "tiny-qwen3-30b-a3b", "tiny-llama-3.2-1b")
TYPES = ("q4_k_m", "q8_0", "f16")
OPS = ("triton", "triton-bytes") + (("triton+" + "+".join(FEATURES),) if FEATURES else ())  # + unmeasured ones


def steps(path: str, ops: str, forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Prefill, one streamed step, two `decode` steps, fed forced[i] (teacher-forced) or the engine's own
    tokens -> (tokens chosen, the last step's logits)."""
    eng = Engine(path, fast=True, graph=False, ops=ops, n_ctx=64, progress=False)
    try:
        toks = [eng.prefill(list(range(1, 21)))]
        toks += list(eng.decode_stream((forced or toks)[0], 1))
        for i in (1, 2):
            toks.append(eng.decode((forced or toks)[i]))
        return toks, eng.fast.logits.clone()
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("sanitize_step.py: needs a CUDA device (or TRITON_INTERPRET=1, to try the script on the CPU)",
              file=sys.stderr)
        return 2
    bad = 0
    for preset in args.presets.split(","):
        for ftype in args.types.split(","):
            path = str(cached_synth(preset, ftype, progress=False))
            want, ref = steps(path, "torch")
            for ops in args.ops.split(","):
                _, logits = steps(path, ops, forced=want)
                err = float((logits - ref).norm() / ref.norm())
                bad += not err <= 1e-3
                print(f"{preset} {ftype} {ops}: last step's relative logit error {err:.1e}"
                      f"{'' if err <= 1e-3 else ' > 1e-3'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
