"""GPU micro-benchmark of the non-matmul decode kernels (moerun/kernels/triton/decode_ops.py).

    python benchmarks/bench_decode_ops.py [--json benchmarks/results/decode_ops-<gpu>.json]

Every time is measured inside a CUDA graph (how the engine runs them): REPS launches captured once, the graph
replayed ITERS times, median per launch. Attention uses one cache pair per layer (16 layers, OLMoE-1B-7B shape:
16 heads, no GQA, D=128, n_ctx 4096) and cycles through them, so the KV bytes come from HBM, not from L2.
Achieved GB/s counts the K and V bytes one layer must read (kv_len x Hkv x (D + Dv) x element size), compared with
a device-to-device copy measured in the same run (read + write bytes / time). `us` is the split launch and the
reduce launch without the RoPE prologue; `step us` the one launch as the fast step makes it (the full-width QK-norm +
NeoX RoPE + KV store prologue, the fused combine), which is what `sweep_ops.py --attn` ranks the features by: the
pipelined loops led `us` and lost in the step (NOTES.md 9i).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable

import torch
from _timing import capture_graph, event_ms

from moerun.kernels import reference as ref
from moerun.kernels.ops import attention_features
from moerun.kernels.triton import attention as ak
from moerun.kernels.triton import decode_ops as ops

H, HKV, D, N_CTX, LAYERS = 16, 16, 128, 4096, 16


def graph_us(fns: list[Callable[[], object]], iters: int = 30) -> float:
    """Median microseconds per launch of `fns` (called in order, captured in one CUDA graph)."""
    g = capture_graph(fns, warmup=fns[:3])
    times = [event_ms(g.replay) * 1e3 / len(fns) for _ in range(iters)]
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy: (read + write bytes) / time, in GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = graph_us([lambda: b.copy_(a)] * 5, iters=10)
    return 2 * nbytes / us / 1e3


def bench_attention(dtype: torch.dtype, kv_lens: list[int], sm: int, bw: float, rows: list[dict],
                    block_n: int = ak.ATTN_BLOCK_N, num_warps: int = 4,
                    programs_per_sm: int = ak.ATTN_PROGRAMS_PER_SM, tag: str = "",
                    min_split: int = ak.ATTN_MIN_SPLIT, ahead: bool = False, dot: bool = False,
                    early: bool = True) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(N_CTX, HKV, D, device="cuda", generator=g).to(dtype) for _ in range(LAYERS)]
    vs = [torch.randn(N_CTX, HKV, D, device="cuda", generator=g).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(H, D, device="cuda", generator=g)
    out = torch.empty(H, D, device="cuda")
    n_splits = ak.attention_splits(N_CTX, H, sm, block_n, programs_per_sm)
    scratch = ak.attention_scratch(H, D, n_splits, "cuda")
    scale = D ** -0.5
    # the step's launch: q, k, v raw projections, OLMoE's full-width QK-norm, NeoX RoPE, the fused combine
    kr, vr = (torch.randn(HKV * D, device="cuda", generator=g) for _ in range(2))
    rope = ak.RopeStore(kr, vr, torch.ones(H * D, device="cuda"), torch.ones(HKV * D, device="cuda"),
                        ops.rope_table(N_CTX, D, 10000.0, device="cuda"), 1e-6, "full", "neox")
    counters = torch.zeros(H, dtype=torch.int32, device="cuda")
    for L in kv_lens:
        kv_len_t = torch.tensor([L], device="cuda", dtype=torch.int32)

        def call(i: int, split: bool = True, reduce: bool = True, kv_len_t: torch.Tensor = kv_len_t) -> None:
            ak.attention_decode(q, ks[i], vs[i], kv_len_t, scale, 0, out, scratch, block_n, num_warps, split, reduce,
                                 min_split=min_split, ahead=ahead, dot=dot)

        def step(i: int, kv_len_t: torch.Tensor = kv_len_t) -> None:
            ak.attention_decode(q, ks[i], vs[i], kv_len_t, scale, 0, out, scratch, block_n, num_warps, rope=rope,
                                counters=counters, min_split=min_split, early=early, ahead=ahead, dot=dot)

        t_step = graph_us([lambda i=i: step(i) for i in range(LAYERS)])  # (writes row L-1: before the check below)
        call(0)
        want = ref.attention(q[None], ks[0][:L], vs[0][:L], torch.tensor([L - 1], device="cuda"), scale)[0]
        err = float((out - want).abs().max() / want.abs().max())
        t_all = graph_us([lambda i=i: call(i) for i in range(LAYERS)])
        t_split = graph_us([lambda i=i: call(i, reduce=False) for i in range(LAYERS)])
        t_red = graph_us([lambda i=i: call(i, split=False) for i in range(LAYERS)])
        kv_bytes = L * HKV * 2 * D * ks[0].element_size()
        gbs = kv_bytes / t_all / 1e3
        rows.append(dict(kernel=f"attention{tag}", dtype=str(dtype).removeprefix("torch."), kv_len=L,
                         splits=n_splits, block_n=block_n, num_warps=num_warps, us=t_all, split_us=t_split,
                         reduce_us=t_red, step_us=t_step, kv_mb=kv_bytes / 1e6, gbs=gbs, pct_copy_bw=100 * gbs / bw,
                         max_rel_err=err))
        print(f"| attention{tag} | {rows[-1]['dtype']} | {L:5d} | {n_splits:3d} x {block_n:3d}/{num_warps}w "
              f"| {t_all:7.2f} | {t_split:7.2f} | {t_red:6.2f} | {t_step:7.2f} | {kv_bytes / 1e6:6.2f} | {gbs:7.0f} "
              f"| {100 * gbs / bw:5.1f}% | {err:.1e} |", flush=True)


def bench_small(rows: list[dict]) -> None:
    dev = "cuda"
    f32 = dict(device=dev, dtype=torch.float32)
    cases: list[tuple[str, Callable[[], object]]] = []
    for n in (2048, 8192):
        x, w, o = torch.randn(n, **f32), torch.randn(n, **f32), torch.empty(n, **f32)
        cases.append((f"rms_norm N={n}", lambda x=x, w=w, o=o: ops.rms_norm(x, w, 1e-6, o)))
    table = ops.rope_table(N_CTX, D, 10000.0, device=dev)
    pos_t = torch.tensor([1000], device=dev, dtype=torch.int32)
    kc, vc = torch.zeros(N_CTX, HKV, D, device=dev, dtype=torch.float16), torch.zeros(N_CTX, HKV, D, device=dev,
                                                                                      dtype=torch.float16)
    q, k, v = torch.randn(H * D, **f32), torch.randn(HKV * D, **f32), torch.randn(HKV * D, **f32)
    qo = torch.empty(H, D, **f32)
    for norm in ("none", "head", "full"):
        qw = torch.randn(H * D if norm == "full" else D, **f32)
        kw = torch.randn(HKV * D if norm == "full" else D, **f32)
        cases.append((f"qk_norm_rope_store {norm} neox f16 H=16 D=128",
                      lambda qw=qw, kw=kw, norm=norm: ops.qk_norm_rope_store(q, k, v, qw, kw, table, pos_t, kc, vc,
                                                                              qo, 1e-6, norm, "neox")))
    for e, kk in ((64, 8), (128, 8), (256, 16)):
        lg, wo, io = torch.randn(e, **f32), torch.empty(kk, **f32), torch.empty(kk, device=dev, dtype=torch.int32)
        cases.append((f"route_topk E={e} k={kk}", lambda lg=lg, wo=wo, io=io, kk=kk: ops.route_topk(lg, kk, True, wo,
                                                                                                     io)))
        x, wr = torch.randn(2048, **f32), torch.randn(e, 2048, **f32)
        cases.append((f"router_logits E={e} N=2048", lambda x=x, wr=wr, lg=lg: ops.router_logits(x, wr, lg)))
        cases.append((f"router_topk E={e} N=2048 k={kk}",
                      lambda x=x, wr=wr, lg=lg, wo=wo, io=io, kk=kk: ops.router_topk(x, wr, kk, True, lg, wo, io)))
    for vocab in (50304, 262144):
        lg, oid = torch.randn(vocab, **f32), torch.empty(1, device=dev, dtype=torch.int64)
        sc = ops.argmax_scratch(vocab, dev)
        ops.argmax(lg, oid, sc)
        assert int(oid) == int(lg.argmax()), "argmax mismatch"
        cases.append((f"argmax V={vocab}", lambda lg=lg, oid=oid, sc=sc: ops.argmax(lg, oid, sc)))
    empty = torch.empty(1, **f32)
    cases.append(("(floor) torch fill_ of 1 float", lambda: empty.fill_(0.0)))
    print("\n| kernel | us per call (in a CUDA graph) |\n|---|---:|")
    for name, fn in cases:
        us = graph_us([fn] * 50)
        rows.append(dict(kernel=name, us=us))
        print(f"| {name} | {us:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--no-sweep", action="store_true", help="skip the block_n / warps / splits sweep at 4096")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sm = props.multi_processor_count
    bw = copy_bandwidth_gbs()
    print(f"{props.name}, {sm} SMs; device copy {bw:.0f} GB/s (read + write)\n")
    rows: list[dict] = []
    print("| kernel | cache | kv_len | splits x block_n/warps | us | split us | reduce us | step us | KV MB | GB/s "
          "| % copy bw | max rel err |\n|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float16, torch.float32):
        bench_attention(dtype, [1, 17, 128, 512, 4095, 4096], sm, bw, rows)
    # the long phase's variants (f16 caches): ATTN_LONG ("pps=4": 4 programs per SM, 33 splits at OLMoE's shape;
    # NOTES.md 8a, 8n), ATTN_LONG_F16 (the f16 default, NOTES.md 9i), then the ops features' variants not yet measured
    # (moerun.kernels.ops.attention_features), each row tagged with its feature's name (`sweep_ops.py --attn` picks
    # the fastest `step us` for the whole-step A/B)
    long_rows = [("pps=4", ak.ATTN_LONG, [512, 2048, 4096]), ("long_f16", ak.ATTN_LONG_F16, [2048, 4096])]
    long_rows += [(name, ak.AttnVariant(*fields), [2048, 4096]) for name, fields in attention_features().items()]
    for name, v, kv_lens in long_rows:
        bench_attention(torch.float16, kv_lens, sm, bw, rows, v.block_n, v.warps, v.programs_per_sm,
                        tag=f" {name}", ahead=v.ahead, dot=v.dot, early=v.early)
    if not args.no_sweep:
        # (min_split = block_n: every split with a tile of work is live, as before c8b9bfd; 128 caps them at len/128)
        for block_n, warps, pps, ms in ((32, 4, 4, 32), (64, 4, 2, 64), (64, 4, 8, 64), (64, 4, 8, 128),
                                        (128, 4, 4, 128), (128, 8, 4, 128), (64, 8, 8, 64)):
            bench_attention(torch.float16, [512, 4096], sm, bw, rows, block_n, warps, pps, tag=f" pps={pps} ms={ms}",
                            min_split=ms)
    bench_small(rows)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump(dict(commit=commit, gpu=props.name, sm_count=sm, copy_gbs=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
