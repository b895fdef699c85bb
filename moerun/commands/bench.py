"""`moerun bench`: llama-bench-compatible pp/tg measurement (see moerun/bench.py for the definitions)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moerun.errors import MoerunError
from moerun.kernels.ops import features_text, parse_ops

NAME = "bench"
HELP = "measure prompt (ppN) and generation (tgN) speed like llama-bench, with GB/s and % of the roofline"

DEFAULT_PRESET = "tiny-olmoe-1b-7b"
DEFAULT_TYPE = "q4_k_m"
# --decode -> Engine arguments
DECODE_PATHS = {"auto": {}, "fast": {"fast": True}, "eager": {"fast": True, "graph": False},
                "reference": {"fast": False}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="FILE",
                   help="GGUF file (default: a synthetic model, see --preset/--type)")
    p.add_argument("--preset", default=None, help=f"synthetic model preset when no -m (default {DEFAULT_PRESET})")
    p.add_argument("--type", dest="ftype", default=None,
                   help=f"quant type of the synthetic model (default {DEFAULT_TYPE})")
    p.add_argument("-p", "--n-prompt", default="512", metavar="N[,N...]", help="ppN tests; 0 skips (default 512)")
    p.add_argument("-n", "--n-gen", default="128", metavar="N[,N...]", help="tgN tests; 0 skips (default 128)")
    p.add_argument("-d", "--n-depth", default="0", metavar="D[,D...]",
                   help="tokens in the KV cache before each test (default 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions per test (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1; ppN at least 2)")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="output format (default md)")
    p.add_argument("--output-file", metavar="PATH", help="also write the full JSON report to PATH")
    p.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: $MOERUN_DEVICE, else CUDA if present)")
    p.add_argument("--dtype", default=None,
                   help="compute dtype: float32 or bfloat16 (default float32 activations, bf16 prefill GEMMs on CUDA)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; fewer helps on a busy machine)")
    p.add_argument("--bandwidth-gib", type=float, default=1.0,
                   help="size of the device copy that measures bandwidth, GiB (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens (default 0)")
    p.add_argument("--decode", choices=list(DECODE_PATHS), default="auto",
                   help="decode step: fused kernels in a CUDA graph (fast), the same kernels launched eagerly "
                        "(eager; prompts without graphs too), plain torch (reference); default auto = fast "
                        "on CUDA, reference on CPU")
    p.add_argument("--ops", type=_ops_names, default=None, metavar="OPS[+FEATURE...][,OPS...]",
                   help="kernels of the fused decode step: triton (default on CUDA; Q4_K, Q6_K and Q8_0 on the "
                        "integer-dot kernels, the word kernels for the rest), triton-words (no integer-dot "
                        "kernels: Q4_K, Q6_K and Q8_0 on the word kernels), triton-unpadded (also the Q6_K "
                        "matrices on the file's rows, no one-byte-per-value copy), triton-bytes (every type on "
                        "the byte-decoding matvecs), torch "
                        "(plain-torch twins); variants kept for same-call A/B go after '+' (features: "
                        + features_text() + "; and KIND@BMxNBxWARPS, a launch tile of the F32 / F16 / BF16 "
                        "products, KIND mv, out, gate_up or down); several, comma-separated: a same-process A/B "
                        "on the one loaded model, each in turn per round (--rounds), then a summary table")
    p.add_argument("--rounds", type=int, default=None,
                   help="with several --ops: how many times each runs, alternating (default 2)")
    p.add_argument("--tg-loop", choices=["stream", "step"], default="stream",
                   help="tgN's loop: stream (default; as generation runs: each step's token reaches the host while "
                        "the next step is already queued) or step (llama-bench's: the host waits for each token "
                        "before it queues the next step)")
    p.add_argument("--prefill", choices=["auto", "fast", "reference"], default="auto",
                   help="prompt path: batched Triton GEMMs (fast) or plain torch (reference); "
                        "default auto = fast on CUDA, reference on CPU")
    p.add_argument("--prefill-dtype", default=None,
                   help="matrix inputs of the fast prefill: bfloat16 (default on CUDA) or float32 (exact)")


def _ops_names(text: str) -> list[str]:
    """--ops: names `make_ops` takes, comma-separated, checked before the model loads."""
    names = [n.strip() for n in text.split(",")]
    for name in names:
        if name == "torch":
            continue
        try:
            parse_ops(name)
        except MoerunError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _model_path(args: argparse.Namespace) -> Path:
    """-m FILE, or the cached synthetic model of --preset/--type."""
    if args.model:
        if args.preset or args.ftype:
            raise MoerunError("give either -m FILE or --preset/--type, not both")
        return Path(args.model)
    try:
        from moerun.synth import cached_synth
    except ImportError as e:
        raise MoerunError(f"synthetic models are unavailable ({e}); pass -m FILE") from None
    preset, ftype = args.preset or DEFAULT_PRESET, args.ftype or DEFAULT_TYPE
    print(f"moerun bench: synthetic model {preset} {ftype} (cached after the first run)", file=sys.stderr)
    return Path(cached_synth(preset, ftype, seed=0))


def run(args: argparse.Namespace) -> int:
    from moerun import bench
    from moerun.engine.engine import Engine

    tests = bench.plan(bench.parse_counts(args.n_prompt), bench.parse_counts(args.n_gen),
                       bench.parse_counts(args.n_depth) or [0])
    if not tests:
        raise MoerunError("nothing to run: every -p and -n is 0")
    if args.repetitions < 1 or args.warmup < 0:
        raise MoerunError("need -r >= 1 and --warmup >= 0")
    if args.threads is not None:
        if args.threads < 1:
            raise MoerunError(f"-t must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    path = _model_path(args)
    need = max(t.depth + t.n for t in tests)
    prefill = {} if args.prefill == "auto" else {"prefill": args.prefill}
    ops = args.ops or [None]
    if args.rounds is not None and (args.rounds < 1 or len(ops) < 2):
        raise MoerunError("--rounds needs several --ops (A,B,...) and a value >= 1")
    engine = Engine(path, device=args.device, dtype=args.dtype, n_ctx=need, prefill_dtype=args.prefill_dtype,
                    ops=ops[0], **prefill, **DECODE_PATHS[args.decode])
    kw = dict(reps=args.repetitions, warmup=args.warmup, seed=args.seed,
              bandwidth_bytes=int(args.bandwidth_gib * bench.GiB), tg_loop=args.tg_loop)
    try:
        if len(ops) == 1:
            reports = [bench.bench(engine, tests, **kw)]
        elif engine.fast is None:
            raise MoerunError("several --ops need the fused decode step: add --decode fast (or eager)")
        else:
            reports = bench.bench_ops(engine, ops, tests, rounds=args.rounds or 2, **kw)
    finally:
        engine.close()
    data: Any = bench.to_json(reports[0]) if len(reports) == 1 else [bench.to_json(r) for r in reports]
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(data, indent=2) + "\n")
    if args.output == "json":
        print(json.dumps(data, indent=2))
    elif len(reports) == 1:
        print(bench.markdown(reports[0]))
    else:
        print("\n\n".join(f"--ops {r.ops}\n{bench.markdown(r)}" for r in reports))
        print("\n" + bench.ab_summary(reports))
    return 0
