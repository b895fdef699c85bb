"""llama-bench-style speed measurement: ppN, tgN at a KV depth, t/s, effective GB/s, % of the roofline.

Definitions (the same as llama-bench's):

- ppN: one forward pass of an N-token prompt (random token ids), `Engine.forward(..., last_only=True)`.
- tgN: N single-token steps at positions depth..depth+N-1 through `Engine.decode_stream`, as `generate`
  runs them: logits, the token chosen on the device and its id copied to the host for every step; the
  next step is queued before the host waits for that copy (llama-bench waits after each step instead:
  `--tg-loop step`, `Engine.decode` per step).
- depth d: the KV cache is filled with d random tokens (untimed) before the timed part.
- Each repetition starts from `Engine.reset()`; `warmup` untimed repetitions run first (ppN: at least
  two when warming up at all: the engine captures a prompt length's CUDA graph on its second run);
  t/s is the median over repetitions, with the standard deviation as spread. Timing synchronises the
  device.

Bytes per token (for GB/s and the roofline) come from the file's tensor table: every tensor a decode
step reads, expert tensors (`*_exps`) scaled by n_expert_used / n_expert, one row of `token_embd` (all
of it when it is also the output matrix), plus the KV cache attended at that depth. Bandwidth is a
>= 1 GiB device-to-device copy timed in the same run (read + write bytes). Roofline t/s = bandwidth /
bytes per token; it bounds decode (tg). Prompt processing is compute-bound: for ppN the JSON reports
TFLOP/s (2 x active matrix params x N) and the table leaves % roofline empty.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from gguf import LlamaFileType

from moerun.errors import MoerunError

if TYPE_CHECKING:
    from moerun.engine.engine import Engine
    from moerun.gguf.reader import GGUFFile
    from moerun.models.config import ModelConfig

GiB = 1 << 30
TG_LOOPS = ("stream", "step")  # time_tg's loops
_SIZE_WORDS = {"S": "Small", "M": "Medium", "L": "Large"}


@dataclass(frozen=True)
class TestSpec:
    """One llama-bench test: kind "pp" (prompt of n tokens) or "tg" (n decode steps), after `depth` tokens."""

    kind: str
    n: int
    depth: int = 0

    @property
    def name(self) -> str:
        """llama-bench's test name: "pp512", "tg128 @ d4096"."""
        return f"{self.kind}{self.n}" + (f" @ d{self.depth}" if self.depth else "")


@dataclass
class TestResult:
    """Timings of one test and the figures derived from them."""

    test: str
    kind: str
    n: int
    depth: int
    times_s: list[float]                 # timed repetitions, warm-up excluded
    tps: list[float]                     # n / time per repetition
    tps_median: float
    tps_std: float
    bytes_per_token: float               # weights + KV read per token (tg); per prompt token (pp)
    gbps: float                          # effective GB/s at the median rate
    roofline_tps: float | None = None    # tg only: bandwidth / bytes per token
    roofline_pct: float | None = None
    tflops: float | None = None          # pp only: 2 x active params x N / time
    path: str = ""


@dataclass
class Report:
    """Everything one `moerun bench` run measured, ready for markdown or JSON."""

    model: str
    file: str
    file_size_bytes: int
    size_bytes: int
    params: int
    backend: str
    device: str
    dtype: str
    kernel_paths: dict[str, str]
    bandwidth: dict[str, Any]
    results: list[TestResult] = field(default_factory=list)
    system: dict[str, Any] = field(default_factory=dict)
    tg_loop: str = "stream"  # tgN's loop: "stream" (Engine.decode_stream) or "step" (Engine.decode, waits each)
    ops: str = ""  # the fused decode step's kernels (Engine.ops_name; "" without a fused step)


# ---- test plan ---------------------------------------------------------------------------------


def parse_counts(text: str | int | list[int]) -> list[int]:
    """"512,1024" -> [512, 1024] (llama-bench's comma lists); values must be >= 0."""
    if isinstance(text, int):
        return [text]
    if isinstance(text, list):
        return text
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise MoerunError(f"expected a comma-separated list of integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise MoerunError(f"counts must be >= 0, got {text!r}")
    return values


def plan(prompts: list[int], gens: list[int], depths: list[int]) -> list[TestSpec]:
    """llama-bench's order: for each depth, every ppN then every tgN; zeros skip that test."""
    return [TestSpec(kind, n, d) for d in depths for kind, ns in (("pp", prompts), ("tg", gens)) for n in ns if n > 0]


# ---- bytes and parameters from the tensor table ------------------------------------------------


def _tied(file: GGUFFile) -> bool:
    return "output.weight" not in file.tensors


def weight_bytes_per_token(file: GGUFFile, cfg: ModelConfig) -> float:
    """Bytes of weights one decode step reads: active experts only, one embedding row (unless tied)."""
    total = 0.0
    for name, t in file.tensors.items():
        if name == "token_embd.weight" and not _tied(file):
            total += t.n_bytes / t.shape[0]
        elif "_exps" in name and cfg.n_expert:
            total += t.n_bytes * cfg.n_expert_used / cfg.n_expert
        else:
            total += t.n_bytes
    return total


def kv_bytes_per_position(cfg: ModelConfig, elem_size: float) -> float:
    """Bytes of keys + values of one position in one layer."""
    return cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v) * elem_size


def kv_read_bytes(cfg: ModelConfig, elem_size: float, pos: int) -> float:
    """KV bytes the token at position `pos` attends over (positions 0..pos; sliding-window layers less)."""
    per = kv_bytes_per_position(cfg, elem_size)
    swa = cfg.swa_layers or (False,) * cfg.n_layer
    return sum(per * (min(pos + 1, cfg.sliding_window) if s and cfg.sliding_window else pos + 1) for s in swa)


def tg_bytes_per_token(file: GGUFFile, cfg: ModelConfig, elem_size: float, depth: int, n: int) -> float:
    """Mean bytes per step of tgN at `depth`: weights + KV read, averaged over positions depth..depth+n-1."""
    kv = sum(kv_read_bytes(cfg, elem_size, depth + i) for i in range(n)) / n
    return weight_bytes_per_token(file, cfg) + kv


def pp_bytes(file: GGUFFile, cfg: ModelConfig, elem_size: float, depth: int, n: int) -> float:
    """Bytes one ppN forward reads at least: every weight once (experts by the expected share that n tokens
    route to, uniform routing), the n embedding rows, and the KV cache once through depth + n."""
    total = 0.0
    share = 1 - (1 - cfg.n_expert_used / cfg.n_expert) ** n if cfg.n_expert else 1.0
    for name, t in file.tensors.items():
        if name == "token_embd.weight" and not _tied(file):
            total += t.n_bytes * min(n, t.shape[0]) / t.shape[0]
        elif "_exps" in name and cfg.n_expert:
            total += t.n_bytes * share
        else:
            total += t.n_bytes
    return total + kv_read_bytes(cfg, elem_size, depth + n - 1)


def active_params(file: GGUFFile, cfg: ModelConfig) -> float:
    """Matrix weights one token multiplies by (experts scaled by n_expert_used / n_expert; no lookup)."""
    total = 0.0
    for name, t in file.tensors.items():
        if len(t.shape) < 2 or (name == "token_embd.weight" and not _tied(file)):
            continue
        scale = cfg.n_expert_used / cfg.n_expert if "_exps" in name and cfg.n_expert else 1.0
        total += math.prod(t.shape) * scale
    return total


def model_label(file: GGUFFile) -> str:
    """llama-bench's model column: "{general.name or arch} {file type}", e.g. "OLMoE 1B-7B Q4_K - Medium"."""
    name = file.get("general.name") or file.get("general.architecture") or "?"
    ftype = file.get("general.file_type")
    try:
        word = LlamaFileType(ftype).name.removeprefix("MOSTLY_")
    except ValueError:
        return f"{name} ftype {ftype}"
    except TypeError:
        return str(name)
    if word == "ALL_F32":
        word = "all F32"
    elif word == "Q2_K":
        word = "Q2_K - Medium"
    elif "_K_" in word:
        base, size = word.rsplit("_", 1)
        word = f"{base} - {_SIZE_WORDS.get(size, size)}"
    return f"{name} {word}"


# ---- timing ------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int = GiB, reps: int = 5) -> dict[str, Any]:
    """Best-of-`reps` device-to-device copy of an `nbytes` tensor; GB/s counts read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch / warm-up
    best = math.inf
    for _ in range(reps):
        sync(device)
        t0 = perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, perf_counter() - t0)
    del src, dst
    return {"copy_bytes": nbytes, "reps": reps, "best_s": best, "gbps": 2 * nbytes / best / 1e9}


def _random_tokens(gen: torch.Generator, n_vocab: int, n: int) -> list[int]:
    return torch.randint(0, n_vocab, (n,), generator=gen).tolist()


def _fill(engine: Engine, gen: torch.Generator, depth: int) -> None:
    """Empty the cache, then fill `depth` positions with random tokens."""
    engine.reset()
    if depth:
        engine.forward(_random_tokens(gen, engine.cfg.n_vocab, depth), last_only=True)


def time_pp(engine: Engine, n: int, depth: int, gen: torch.Generator) -> float:
    """Seconds of one forward of an n-token prompt after `depth` cached tokens."""
    _fill(engine, gen, depth)
    tokens = _random_tokens(gen, engine.cfg.n_vocab, n)
    sync(engine.device)
    t0 = perf_counter()
    engine.forward(tokens, last_only=True)
    sync(engine.device)
    return perf_counter() - t0


def time_tg(engine: Engine, n: int, depth: int, gen: torch.Generator, loop: str = "stream") -> float:
    """Seconds of n decode steps at positions depth..depth+n-1, each step's token reaching the host. loop
    "stream": as `generate` runs them (`decode_stream`: the next step queued before the host waits for the
    token); "step": `decode` one at a time, the host waiting for each token before it queues the next step."""
    _fill(engine, gen, depth)
    tok = _random_tokens(gen, engine.cfg.n_vocab, 1)[0]
    sync(engine.device)
    t0 = perf_counter()
    if loop == "stream":
        for _ in engine.decode_stream(tok, n):
            pass
    else:
        for _ in range(n):
            tok = engine.decode(tok)
    sync(engine.device)
    return perf_counter() - t0


def run_test(engine: Engine, spec: TestSpec, reps: int, warmup: int = 1, seed: int = 0,
             tg_loop: str = "stream") -> list[float]:
    """`warmup` untimed then `reps` timed repetitions of `spec` -> seconds of each timed one."""
    gen = torch.Generator().manual_seed(seed)

    def timer() -> float:
        if spec.kind == "pp":
            return time_pp(engine, spec.n, spec.depth, gen)
        return time_tg(engine, spec.n, spec.depth, gen, tg_loop)

    for _ in range(max(warmup, 2) if spec.kind == "pp" and warmup else warmup):
        timer()
    return [timer() for _ in range(reps)]


# ---- the whole run -----------------------------------------------------------------------------


def _dtypes(engine: Engine) -> str:
    """"float32" or, with fast prefill, "float32, prefill bfloat16": the dtypes the tests multiply in."""
    dt = str(engine.dtype).removeprefix("torch.")
    p = engine.prefiller
    return dt if p is None else f"{dt}, prefill {'float32' if p.exact else 'bfloat16'}"


def weight_path(engine: Engine) -> str:
    """"Q4_K:torch-dequant Q6_K:torch-dequant": the kernel path of each type matrices use."""
    types = sorted({t.type_name for t in engine.file.tensors.values() if len(t.shape) >= 2})
    paths = engine.kernel_paths()
    return " ".join(f"{t}:{paths.get(t, '?')}" for t in types)


def cache_element_size(engine: Engine) -> float:
    """Bytes per K/V element of the engine's cache (from its total size, whatever its layout)."""
    cfg = engine.cfg
    return engine.cache.nbytes / (engine.n_ctx * cfg.n_layer * cfg.n_head_kv * (cfg.head_dim + cfg.head_dim_v))


def bench(engine: Engine, tests: list[TestSpec], *, reps: int = 5, warmup: int = 1, seed: int = 0,
          bandwidth: dict[str, Any] | None = None, bandwidth_bytes: int = GiB, tg_loop: str = "stream") -> Report:
    """Run `tests` on `engine` and derive t/s, GB/s and % of the roofline; bandwidth measured unless given.
    tg_loop: "stream" or "step" (`time_tg`)."""
    if reps < 1:
        raise MoerunError(f"repetitions must be >= 1, got {reps}")
    if tg_loop not in TG_LOOPS:
        raise MoerunError(f"unknown tg loop {tg_loop!r}; use one of {', '.join(TG_LOOPS)}")
    need = max((t.depth + t.n for t in tests), default=0)
    if need > engine.n_ctx:
        raise MoerunError(f"the tests need {need} positions but the engine's context size is {engine.n_ctx}")
    file, cfg = engine.file, engine.cfg
    bw = bandwidth if bandwidth is not None else measure_bandwidth(engine.device, bandwidth_bytes)
    elem = cache_element_size(engine)
    path = weight_path(engine)
    report = Report(
        model=model_label(file), file=str(file.path), file_size_bytes=file.path.stat().st_size,
        size_bytes=sum(t.n_bytes for t in file.tensors.values()),
        params=sum(math.prod(t.shape) for t in file.tensors.values()),
        backend="CUDA" if engine.device.type == "cuda" else engine.device.type.upper(),
        device=str(engine.device), dtype=_dtypes(engine),
        kernel_paths=engine.kernel_paths(), bandwidth=bw, system=system_info(engine.device), tg_loop=tg_loop,
        ops=engine.ops_name or "")
    for spec in tests:
        times = run_test(engine, spec, reps, warmup, seed, tg_loop)
        tps = [spec.n / t for t in times]
        med = statistics.median(tps)
        r = TestResult(test=spec.name, kind=spec.kind, n=spec.n, depth=spec.depth, times_s=times, tps=tps,
                       tps_median=med, tps_std=statistics.stdev(tps) if len(tps) > 1 else 0.0,
                       bytes_per_token=0.0, gbps=0.0, path=path if spec.kind == "tg" else engine.prefill_path())
        if spec.kind == "tg":
            r.bytes_per_token = tg_bytes_per_token(file, cfg, elem, spec.depth, spec.n)
            r.roofline_tps = bw["gbps"] * 1e9 / r.bytes_per_token
            r.roofline_pct = 100 * med / r.roofline_tps
        else:
            r.bytes_per_token = pp_bytes(file, cfg, elem, spec.depth, spec.n) / spec.n
            r.tflops = 2 * active_params(file, cfg) * med / 1e12
        r.gbps = r.bytes_per_token * med / 1e9
        report.results.append(r)
    engine.reset()
    return report


def bench_ops(engine: Engine, ops: list[str], tests: list[TestSpec], *, rounds: int = 1,
              bandwidth_bytes: int = GiB, **kw: Any) -> list[Report]:
    """A same-process A/B of decode kernels: `rounds` times, each of `ops` in turn (`Engine.set_ops` on the one
    loaded model), `bench`; the bandwidth is measured once. Returns the reports in run order (A B A B ...)."""
    if rounds < 1:
        raise MoerunError(f"rounds must be >= 1, got {rounds}")
    bw = kw.pop("bandwidth", None) or measure_bandwidth(engine.device, bandwidth_bytes)
    reports = []
    for _ in range(rounds):
        for name in ops:
            if name != engine.ops_name:  # (the first run keeps the step the engine was built with)
                engine.set_ops(name)
            reports.append(bench(engine, tests, bandwidth=bw, **kw))
    return reports


def ab_summary(reports: list[Report]) -> str:
    """One row per ops and test: the median t/s of each round, then their median (`bench_ops`' reports)."""
    rows: dict[tuple[str, str], list[float]] = {}
    for rep in reports:
        for r in rep.results:
            rows.setdefault((rep.ops, r.test), []).append(r.tps_median)
    lines = ["| ops | test | t/s per round | median |", "|---|---|---|---:|"]
    lines += [f"| {o} | {t} | {' / '.join(f'{v:.2f}' for v in vals)} | {statistics.median(vals):.2f} |"
              for (o, t), vals in rows.items()]
    return "\n".join(lines)


# ---- output ------------------------------------------------------------------------------------


def _size(n_bytes: int) -> str:
    return f"{n_bytes / GiB:.2f} GiB" if n_bytes >= GiB // 100 else f"{n_bytes / (1 << 20):.2f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e7 else f"{n / 1e6:.2f} M"


def markdown(report: Report) -> str:
    """llama-bench's table (model, size, params, backend, test, t/s) plus GB/s, % roofline and path."""
    head = ["model", "size", "params", "backend", "test", "t/s", "GB/s", "% roofline", "path"]
    right = {"size", "params", "t/s", "GB/s", "% roofline"}
    rows = [[report.model, _size(report.size_bytes), _count(report.params), report.backend, r.test,
             f"{r.tps_median:.2f} ± {r.tps_std:.2f}", f"{r.gbps:.2f}",
             "" if r.roofline_pct is None else f"{r.roofline_pct:.1f}", r.path] for r in report.results]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if h in right else c.ljust(w)
                                 for c, w, h in zip(cells, widths, head, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if h in right else "-" * (w + 2)
                          for w, h in zip(widths, head, strict=True)) + "|"
    bw = report.bandwidth
    commit, src = report.system.get("commit", "unknown"), report.system.get("source_sha")
    foot = (f"\nbuild: {commit}{f' (source {src})' if src else ''} | {report.system.get('gpu_name') or report.device}"
            f" | {report.dtype} | tg loop {report.tg_loop}"
            f" | bandwidth {bw['gbps']:.1f} GB/s ({bw['copy_bytes'] / GiB:.2f} GiB device copy)")
    return "\n".join([line(head), rule, *(line(r) for r in rows)]) + "\n" + foot


def to_json(report: Report) -> dict[str, Any]:
    """Everything the run measured as a JSON-ready dict."""
    return asdict(report)


# ---- the environment ---------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_sha(root: Path | None = None) -> str:
    """12 hex digits of a SHA-256 over the package's .py files (paths and contents, sorted): names the code
    that ran even where the git commit cannot (a copied tree with a stale .git, uncommitted edits)."""
    root = root or Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def system_info(device: torch.device) -> dict[str, Any]:
    """moerun's git commit and source hash, GPU name and driver, torch / CUDA / triton versions, date."""
    here = Path(__file__).resolve().parent
    info: dict[str, Any] = {
        # $MOERUN_COMMIT first: a copied tree (the GPU machine's) may carry a stale .git
        "commit": os.environ.get("MOERUN_COMMIT") or _run(["git", "rev-parse", "HEAD"], here) or "unknown",
        "source_sha": source_sha(here),
        "dirty": bool(_run(["git", "status", "--porcelain", "--untracked-files=no"], here)),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": None,
        "gpu_name": None, "driver": None, "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.splitlines()[0] if smi else None
    return info
