"""`moerun bench`: the definitions of ppN / tgN / depth / repetitions, proved with a counting hook on the
model's forward; bytes per token against an independent count; output shapes; the CLI; and `generate`
running at tg128's rate (the bench times the same step generation uses)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.hf_to_gguf import write_gguf
from support.tiny_models import TINY

from moerun import bench
from moerun.engine.engine import Engine

Q4_K_BYTES_PER_256 = 2 + 2 + 12 + 128  # d, dmin (f16), 12 packed 6-bit scales/mins, 256 4-bit quants
FAKE_BANDWIDTH = {"copy_bytes": 1 << 20, "reps": 1, "best_s": 1e-3, "gbps": 2.0}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A Q4_K tiny OLMoE file (8 experts, top-2, 2 layers) and the HF model it was written from."""
    model = TINY["olmoe"](0)
    path = tmp_path_factory.mktemp("bench") / "tiny-olmoe-q4_k.gguf"
    write_gguf(model, path, qtype="q4_k")
    return path, model


@pytest.fixture(scope="module")
def engine(tiny: tuple[Path, object]) -> Engine:
    eng = Engine(tiny[0], device="cpu", n_ctx=512)
    yield eng
    eng.close()


class Recorder:
    """Counting hook: logs every model forward as ("fwd", T, pos0), every reset, and every clock read
    ("clock", value returned)."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple] = []
        forward, reset = engine.model.forward, engine.reset

        def counted_forward(tokens: torch.Tensor, pos0: int, cache: object, last_only: bool = False) -> torch.Tensor:
            self.log.append(("fwd", int(tokens.shape[0]), pos0))
            return forward(tokens, pos0, cache, last_only=last_only)

        def counted_reset() -> None:
            self.log.append(("reset",))
            reset()

        def clock() -> float:  # strictly convex in the event count: every repetition times differently
            self.log.append(("clock", float(len(self.log)) ** 2))
            return self.log[-1][1]

        monkeypatch.setattr(engine.model, "forward", counted_forward)
        monkeypatch.setattr(engine, "reset", counted_reset)
        monkeypatch.setattr(bench, "perf_counter", clock)

    def repetitions(self) -> list[list[tuple]]:
        """The log split at each reset (each repetition starts with one)."""
        reps: list[list[tuple]] = []
        for event in self.log:
            if event[0] == "reset":
                reps.append([])
            else:
                assert reps, "a forward ran before the first reset"
                reps[-1].append(event)
        return reps


def _split(rep: list[tuple]) -> tuple[list[tuple], list[tuple], float]:
    """One repetition -> (forwards before the first clock read, forwards between the two reads, the time
    those two reads measure)."""
    clocks = [i for i, e in enumerate(rep) if e[0] == "clock"]
    assert len(clocks) == 2 and clocks[1] == len(rep) - 1, rep
    return rep[: clocks[0]], rep[clocks[0] + 1 : clocks[1]], rep[clocks[1]][1] - rep[clocks[0]][1]


def _assert_fill(before: list[tuple], depth: int) -> None:
    """The untimed part of a repetition fills exactly positions 0..depth-1 (and nothing when depth is 0)."""
    pos = 0
    for _, T, pos0 in before:
        assert pos0 == pos
        pos += T
    assert pos == depth


@pytest.mark.parametrize("loop", bench.TG_LOOPS)
@pytest.mark.parametrize("depth", [0, 7])
def test_tg_is_n_decode_steps_at_advancing_positions(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                     depth: int, loop: str) -> None:
    rec = Recorder(engine, monkeypatch)
    times = bench.run_test(engine, bench.TestSpec("tg", 5, depth), reps=3, warmup=1, tg_loop=loop)
    reps = rec.repetitions()
    assert len(reps) == 1 + 3  # cache cleared before the warm-up and before every timed repetition
    spans = [_split(rep) for rep in reps]
    assert times == [t for _, _, t in spans[1:]]  # the warm-up repetition's time is not among them
    for before, timed, _ in spans:
        _assert_fill(before, depth)
        assert timed == [("fwd", 1, depth + i) for i in range(5)]


@pytest.mark.parametrize("depth", [0, 9])
def test_pp_is_one_forward_of_n_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch, depth: int) -> None:
    rec = Recorder(engine, monkeypatch)
    times = bench.run_test(engine, bench.TestSpec("pp", 16, depth), reps=2, warmup=2)
    reps = rec.repetitions()
    assert len(reps) == 2 + 2
    spans = [_split(rep) for rep in reps]
    assert times == [t for _, _, t in spans[2:]]  # the two warm-ups are excluded
    for before, timed, _ in spans:
        _assert_fill(before, depth)
        assert timed == [("fwd", 16, depth)]


def test_plan_and_counts() -> None:
    assert bench.parse_counts("512,1024") == [512, 1024]
    assert bench.parse_counts("0") == [0]
    names = [t.name for t in bench.plan([512, 0], [128], [0, 4096])]
    assert names == ["pp512", "tg128", "pp512 @ d4096", "tg128 @ d4096"]
    assert bench.plan([0], [0], [0]) == []
    with pytest.raises(bench.MoerunError):
        bench.parse_counts("12,x")


def test_bytes_per_token_matches_an_independent_count(tiny: tuple[Path, object], engine: Engine) -> None:
    """Counted from the HF model's parameters: Q4_K matrices, f32 norms and router, top-k experts of E,
    one embedding row, plus f32 K and V of every attended position."""
    _, model = tiny
    hp = model.config
    share = hp.num_experts_per_tok / hp.num_experts
    expected = 0.0
    for name, p in model.named_parameters():
        if p.ndim == 1 or name.endswith("mlp.gate.weight"):
            b = p.numel() * 4
        else:
            b = p.numel() * Q4_K_BYTES_PER_256 / 256
        if "embed_tokens" in name:
            b /= p.shape[0]
        elif ".experts." in name:
            b *= share
        expected += b
    assert bench.weight_bytes_per_token(engine.file, engine.cfg) == pytest.approx(expected, rel=1e-12)

    head_dim = hp.hidden_size // hp.num_attention_heads
    kv_per_pos = hp.num_hidden_layers * hp.num_key_value_heads * 2 * head_dim * 4  # K and V, f32 cache
    depth, n = 100, 8
    mean_positions = sum(depth + i + 1 for i in range(n)) / n  # step i attends over positions 0..depth+i
    got = bench.tg_bytes_per_token(engine.file, engine.cfg, 4, depth, n)
    assert got == pytest.approx(expected + mean_positions * kv_per_pos, rel=1e-12)
    assert bench.cache_element_size(engine) == 4


def test_report_markdown_and_json(engine: Engine) -> None:
    tests = bench.plan([8], [4], [0, 3])
    report = bench.bench(engine, tests, reps=2, warmup=1, bandwidth=FAKE_BANDWIDTH)
    md = bench.markdown(report).splitlines()
    assert [c.strip() for c in md[0].strip("|").split("|")] == [
        "model", "size", "params", "backend", "test", "t/s", "GB/s", "% roofline", "path"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md[2:6]]
    assert [r[4] for r in rows] == ["pp8", "tg4", "pp8 @ d3", "tg4 @ d3"]
    assert all(r[0] == "tiny-olmoe Q4_K - Small" and r[3] == "CPU" and " ± " in r[5] for r in rows)
    assert rows[0][7] == "" and float(rows[1][7]) > 0  # roofline % for tg only
    assert rows[1][8] == "F32:torch-dequant Q4_K:torch-dequant"
    assert md[-1].startswith("build: ")

    data = json.loads(json.dumps(bench.to_json(report)))
    for key in ("model", "file", "size_bytes", "params", "device", "dtype", "kernel_paths", "bandwidth", "system"):
        assert key in data
    for key in ("commit", "source_sha", "date", "torch", "triton", "gpu_name", "driver"):
        assert key in data["system"]
    assert f"(source {data['system']['source_sha']})" in md[-1]
    tg = data["results"][1]
    assert len(tg["times_s"]) == 2 and tg["tps_median"] == pytest.approx(statistics.median(tg["tps"]))
    assert tg["roofline_tps"] == pytest.approx(2e9 / tg["bytes_per_token"])
    assert tg["roofline_pct"] == pytest.approx(100 * tg["tps_median"] / tg["roofline_tps"])
    assert data["results"][0]["tflops"] > 0 and data["results"][0]["roofline_pct"] is None


def test_source_sha_names_the_code(tmp_path: Path) -> None:
    """The source hash changes with any .py file's content or name, and nothing else."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("ignored")
    first = bench.source_sha(tmp_path)
    assert len(first) == 12 and first == bench.source_sha(tmp_path)
    (tmp_path / "notes.txt").write_text("changed")
    assert bench.source_sha(tmp_path) == first
    (tmp_path / "a.py").write_text("x = 2\n")
    assert bench.source_sha(tmp_path) != first
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    assert bench.source_sha(tmp_path) not in (first, bench.source_sha(tmp_path / "missing"))


def test_bandwidth_measurement_counts_read_and_write() -> None:
    bw = bench.measure_bandwidth(torch.device("cpu"), 1 << 24, reps=2)
    assert bw["gbps"] == pytest.approx(2 * bw["copy_bytes"] / bw["best_s"] / 1e9)


def test_generate_runs_at_tg128_rate(engine: Engine) -> None:
    """generate(n=128) with a one-token prompt is 128 steps of the same kind as tg128's: same rate within
    10%. Robust to a loaded machine: runs alternate, each generate run is compared with the tg128 run just
    before it, the median of those ratios counts, and a noisy attempt is retried twice."""
    def gen_seconds() -> float:
        t0 = time.perf_counter()
        out = list(engine.generate([3], 128))
        dt = time.perf_counter() - t0
        assert len(out) == 128
        return dt

    ratios: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded 2-core machine, competing intra-op threads make times erratic
    try:
        for _attempt in range(3):
            ratios = []
            for _ in range(7):
                (tg,) = bench.run_test(engine, bench.TestSpec("tg", 128), reps=1, warmup=0)
                ratios.append(tg / gen_seconds())  # generate's rate / tg128's rate
            if abs(statistics.median(ratios) - 1) < 0.10:
                break
    finally:
        torch.set_num_threads(threads)
    assert abs(statistics.median(ratios) - 1) < 0.10, f"generate / tg128 rate ratios: {ratios}"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moerun", "bench", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=None if env is None else {**os.environ, **env})


def test_cli_json_and_output_file(tiny: tuple[Path, object], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _cli("-m", str(tiny[0]), "-p", "16", "-n", "8", "-r", "2", "-o", "json", "--bandwidth-gib", "0.02",
                "--output-file", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [r["test"] for r in data["results"]] == ["pp16", "tg8"]
    assert json.loads(out.read_text())["results"][1]["n"] == 8


def test_cli_bad_file_is_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    proc = _cli("-m", str(bad), "-p", "4", "-n", "2")
    assert proc.returncode != 0
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and "bad.gguf" in proc.stderr


@pytest.mark.parametrize("choice, model", [
    ((), "tiny-olmoe-1b-7b (synthetic) Q4_K - Medium"),
    (("--preset", "tiny-qwen3-30b-a3b", "--type", "q8_0"), "tiny-qwen3-30b-a3b (synthetic) Q8_0"),
])
def test_cli_without_model_benches_a_synthetic_file(tmp_path: Path, choice: tuple[str, ...], model: str) -> None:
    """No -m: the default tiny synthetic model (or --preset/--type), written once into $MOERUN_CACHE."""
    args = (*choice, "-p", "8", "-n", "4", "-r", "1", "--bandwidth-gib", "0.02")
    proc = _cli(*args, env={"MOERUN_CACHE": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "model" not in line]
    assert len(rows) == 2 and all(row.startswith(f"| {model} ") for row in rows), proc.stdout
    assert len(list(tmp_path.rglob("*.gguf"))) == 1


def test_cli_ops_picks_the_decode_kernels(tiny: tuple[Path, object]) -> None:
    """--ops names the fused step's kernels: the path column shows them (torch twins here, on any machine)."""
    proc = _cli("-m", str(tiny[0]), "-p", "0", "-n", "4", "-r", "1", "-o", "json", "--bandwidth-gib", "0.02",
                "--decode", "fast", "--ops", "torch")
    assert proc.returncode == 0, proc.stderr
    path = json.loads(proc.stdout)["results"][0]["path"]
    assert "torch" in path and "triton" not in path, path
    bad = _cli("-m", str(tiny[0]), "-n", "4", "--ops", "cuda-magic")
    assert bad.returncode != 0 and "--ops" in bad.stderr


def test_bench_ops_rebuilds_the_step_per_ops(tiny: tuple[Path, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench_ops`: rounds x ops reports in run order (A B A B), each timed on a step built for its ops on the one
    loaded model (`Engine.set_ops`; the first on the engine's own), greedy tokens unchanged by the rebuild; a bad
    ops name leaves the step as it was. (The torch twins under two names here: the Triton ops need a GPU.)"""
    from moerun.errors import MoerunError
    from moerun.kernels import ops as kops

    eng = Engine(tiny[0], device="cpu", n_ctx=64, fast=True, ops="torch")
    want = eng.generate_greedy([3, 5, 7], 6)
    real = kops.make_ops
    monkeypatch.setattr("moerun.engine.engine.make_ops", lambda name: real("torch" if name == "torch-b" else name))
    built: list[object] = []
    set_ops = eng.set_ops

    def counted(name: str) -> None:
        set_ops(name)
        built.append(eng.fast)

    monkeypatch.setattr(eng, "set_ops", counted)
    reports = bench.bench_ops(eng, ["torch", "torch-b"], bench.plan([], [4], [0]), rounds=2, reps=1,
                              bandwidth=FAKE_BANDWIDTH)
    assert [r.ops for r in reports] == ["torch", "torch-b", "torch", "torch-b"]
    assert len({id(f) for f in built}) == 3 and eng.fast is built[-1]  # the first run: the engine's own step
    assert all(r.results[0].test == "tg4" and r.results[0].tps_median > 0 for r in reports)
    assert eng.generate_greedy([3, 5, 7], 6) == want
    summary = bench.ab_summary(reports).splitlines()
    assert summary[0] == "| ops | test | t/s per round | median |" and len(summary) == 4
    assert summary[2].startswith("| torch | tg4 | ") and summary[2].count(" / ") == 1
    with pytest.raises(MoerunError, match="unknown decode ops"):
        eng.set_ops("cuda-magic")
    assert eng.fast is built[-1] and eng.ops_name == "torch-b"
    with pytest.raises(MoerunError, match="rounds"):
        bench.bench_ops(eng, ["torch"], bench.plan([], [4], [0]), rounds=0, bandwidth=FAKE_BANDWIDTH)
    eng.close()


def test_cli_several_ops_is_an_ab(tiny: tuple[Path, object]) -> None:
    """--ops A,B: each in turn per round on one loaded model, a table per run and the summary; -o json a list."""
    args = ("-m", str(tiny[0]), "-p", "0", "-n", "4", "-r", "1", "--bandwidth-gib", "0.02", "--decode", "fast")
    proc = _cli(*args, "--ops", "torch,torch", "--rounds", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--ops torch\n") == 6
    summary = proc.stdout[proc.stdout.index("| ops | test |"):].splitlines()
    assert summary[2].startswith("| torch | tg4 | ") and summary[2].count(" / ") == 5
    data = json.loads(_cli(*args, "--ops", "torch,torch", "-o", "json").stdout)
    assert [d["ops"] for d in data] == ["torch"] * 4 and data[0]["results"][0]["test"] == "tg4"
    bad = _cli(*args, "--rounds", "2")
    assert bad.returncode != 0 and "--rounds" in bad.stderr
    bad = _cli("-m", str(tiny[0]), "-p", "0", "-n", "4", "--device", "cpu", "--decode", "reference", "--ops",
               "torch,torch")
    assert bad.returncode != 0 and "fused decode step" in bad.stderr
