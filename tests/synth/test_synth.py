"""Tiny synthetic files of every preset and type: valid GGUF, finite values, moerun and llama.cpp run them;
seeds, the cache, and the `moerun synth` command."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from support import llamacpp

from moerun.cli import main as cli_main
from moerun.engine.engine import Engine
from moerun.synth import FILE_TYPES, PRESETS, cached_synth, expected_size, plan_file, synthesize
from moerun.synth import writer as synth_writer

TINY = [name for name in PRESETS if name.startswith("tiny-")]
TOKENS = [5, 300, 17, 1000, 42, 7]
needs_llamacpp = pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(preset, type) -> the tiny file, written once per module on first use."""
    folder = tmp_path_factory.mktemp("synth")

    class Files(dict):
        def __missing__(self, key: tuple[str, str]) -> Path:
            path = synthesize(key[0], key[1], folder / f"{key[0]}-{key[1]}.gguf", seed=1, progress=False)
            self[key] = path
            return path

    return Files()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("ftype", list(FILE_TYPES))
@pytest.mark.parametrize("name", TINY)
def test_tiny_file_is_valid_and_runs(name: str, ftype: str, files: dict) -> None:
    path = files[name, ftype]
    plan = plan_file(name, ftype)
    assert path.stat().st_size == plan.size == expected_size(name, ftype)

    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == [t.spec.name for t in plan.tensors]
    for t, planned in zip(reader.tensors, plan.tensors, strict=True):
        assert t.tensor_type == planned.ggml_type, t.name
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all(), t.name
        if len(planned.spec.shape) > 1:
            std = float(values.std())
            assert 0.2 < std * planned.spec.row**0.5 < 3, (t.name, std)  # ~ 1/sqrt(fan_in)

    eng = Engine(path, device="cpu")
    try:
        ours = eng.forward(TOKENS).numpy()  # [T, V]
    finally:
        eng.close()
    assert np.isfinite(ours).all() and ours.std() > 0.3

    if llamacpp.available():
        ref = llamacpp.llamacpp_logits(str(path), TOKENS)
        assert ref.shape == ours.shape and np.isfinite(ref).all() and ref.std() > 0.3
        if ftype == "f16":  # no activation quantization in llama.cpp's F16 matmuls: close agreement
            assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-2


def test_seed_reproducible(tmp_path: Path, files: dict) -> None:
    name, ftype = "tiny-qwen3-30b-a3b", "q4_k_m"
    again = synthesize(name, ftype, tmp_path / "again.gguf", seed=1, progress=False)
    other = synthesize(name, ftype, tmp_path / "other.gguf", seed=2, progress=False)
    assert _digest(again) == _digest(files[name, ftype])
    assert _digest(other) != _digest(again)
    header = len(plan_file(name, ftype).header)
    assert again.read_bytes()[:header] == other.read_bytes()[:header]  # the seed only changes the weights


def test_bytes_do_not_depend_on_chunking(tmp_path: Path, files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(synth_writer, "CHUNK_PIECES", 1)
    monkeypatch.setattr(synth_writer, "MAX_PENDING_WRITES", 0)
    path = synthesize("tiny-mixtral-8x7b", "q8_0", tmp_path / "x.gguf", seed=1, progress=False)
    assert _digest(path) == _digest(files["tiny-mixtral-8x7b", "q8_0"])


def test_memory_bounded_chunks() -> None:
    """A large tensor is produced chunk by chunk, each at most CHUNK_PIECES pieces of ~PIECE_BYTES."""
    plan = plan_file("olmoe-1b-7b", "q4_k_m")
    big = next(t for t in plan.tensors if t.spec.name == "blk.0.ffn_down_exps.weight")
    assert big.n_bytes > 2 * synth_writer.CHUNK_PIECES * synth_writer.PIECE_BYTES  # several chunks
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        chunks = synth_writer._tensor_chunks(plan.preset, 0, big, 0, pool)
        first = next(chunks)
        chunks.close()
    assert sum(a.nbytes for a in first) <= synth_writer.CHUNK_PIECES * (synth_writer.PIECE_BYTES + 256)


def test_cached_synth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = cached_synth("tiny-llama-3.2-1b", "q4_0", seed=3, cache_dir=tmp_path, progress=False)
    assert path.parent == tmp_path and path.stat().st_size == expected_size("tiny-llama-3.2-1b", "q4_0")
    mtime = path.stat().st_mtime_ns
    assert cached_synth("tiny-llama-3.2-1b", "q4_0", seed=3, cache_dir=tmp_path, progress=False) == path
    assert path.stat().st_mtime_ns == mtime  # not rewritten
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary files left
    with open(path, "r+b") as f:  # a truncated cache entry is rewritten
        f.truncate(1000)
    assert cached_synth("tiny-llama-3.2-1b", "q4_0", seed=3, cache_dir=tmp_path, progress=False).stat().st_size \
        == expected_size("tiny-llama-3.2-1b", "q4_0")

    monkeypatch.setenv("MOERUN_CACHE", str(tmp_path / "root"))
    env_path = cached_synth("tiny-llama-3.2-1b", "q4_0", seed=3, progress=False)
    assert env_path.parent == tmp_path / "root" / "synth"
    assert _digest(env_path) == _digest(path)


def test_interrupted_cached_synth_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth_writer, "_write_parts", boom)
    with pytest.raises(KeyboardInterrupt):
        cached_synth("tiny-smollm2-1.7b", "f16", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        synthesize("tiny-smollm2-1.7b", "f16", tmp_path / "direct.gguf", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_insufficient_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(synth_writer.shutil, "disk_usage", lambda p: _Usage())
    out = tmp_path / "x.gguf"
    assert cli_main(["synth", "--preset", "olmoe-1b-7b", "--type", "q4_k_m", "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "not enough disk space: the file needs 3.92 GiB" in err and len(err.splitlines()) == 1
    assert not out.exists()


class _Usage:
    total, used, free = 1 << 40, 1 << 40, 1 << 30


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moerun", "synth", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli(tmp_path: Path, files: dict) -> None:
    out = tmp_path / "cli.gguf"
    r = _cli("--preset", "tiny-olmoe-1b-7b", "--type", "q5_k_m", "-o", str(out), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "tiny-olmoe-1b-7b q5_k_m" in r.stdout and "GB/s" in r.stdout and "B params" in r.stdout
    assert _digest(out) == _digest(files["tiny-olmoe-1b-7b", "q5_k_m"])

    r = _cli("--preset", "tiny-olmoe-1b-7b", "--type", "q5_k_m", "-o", str(out))
    assert r.returncode == 1 and r.stderr.strip() == f"moerun synth: error: {out} exists; pass --force to overwrite it"
    r = _cli("--preset", "olmoe-2b", "-o", str(tmp_path / "y.gguf"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert "unknown preset 'olmoe-2b'" in r.stderr
    r = _cli("--list")
    assert r.returncode == 0
    olmoe = next(line for line in r.stdout.splitlines() if line.startswith("olmoe-1b-7b "))
    assert "3.92 GiB" in olmoe and "6.85 GiB" in olmoe and "12.89 GiB" in olmoe
    assert all(any(line.startswith(name + " ") for line in r.stdout.splitlines()) for name in PRESETS)


def test_cli_in_process(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "x.gguf"
    assert cli_main(["synth", "--preset", "tiny-qwen3-8b", "--type", "bf16", "-o", str(out), "--no-progress"]) == 0
    assert cli_main(["synth", "--preset", "tiny-qwen3-8b", "--type", "q6_k", "-o", str(out), "--force"]) == 0
    assert out.stat().st_size == expected_size("tiny-qwen3-8b", "q6_k")
    capsys.readouterr()
    assert cli_main(["synth", "--preset", "tiny-qwen3-8b", "--type", "q3_k_s", "-o", str(tmp_path / "y.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown type 'q3_k_s'" in err
    assert cli_main(["synth", "--preset", "tiny-qwen3-8b"]) == 1
    assert "-o FILE are required" in capsys.readouterr().err
    assert not (tmp_path / "y.gguf").exists()
