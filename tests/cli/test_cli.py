"""The `moerun` command line, run for real in subprocesses: generate on the built-in model (its greedy
text equals the Python API's), info, a two-turn chat through stdin reusing the cache, and every error
path as one line on stderr with a non-zero exit and no traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.device import TEST_DEVICE

import moerun
from moerun.synth import synthesize

PROMPT = "Water boils at"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private MOERUN_CACHE holding the built-in model (assembled once for the module)."""
    from moerun.default_model import default_model_path

    root = tmp_path_factory.mktemp("moerun-cache")
    old = os.environ.get("MOERUN_CACHE")
    os.environ["MOERUN_CACHE"] = str(root)
    try:
        default_model_path(quiet=True)
    finally:
        if old is None:
            del os.environ["MOERUN_CACHE"]
        else:
            os.environ["MOERUN_CACHE"] = old
    return root


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-olmoe.gguf"
    synthesize("tiny-olmoe-1b-7b", "q4_k_m", path, seed=0, progress=False)
    return path


def moerun_cli(*args: str, cache: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOERUN_DEVICE": TEST_DEVICE, "PYTHONIOENCODING": "utf-8"}
    if cache is not None:
        env["MOERUN_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "moerun", *args], capture_output=True, text=True, env=env,
                          input=stdin if stdin is not None else "", timeout=300, encoding="utf-8")


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "error" in lines[0]
    return lines[0]


# -- generate -----------------------------------------------------------------------------------------------

def test_generate_default_model_matches_api(cache: Path) -> None:
    r = moerun_cli("generate", "-p", PROMPT, "-n", "8", "--temp", "0", cache=cache)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(PROMPT) and r.stdout.endswith("\n")
    text = r.stdout[len(PROMPT):-1]  # the CLI ends its output with one newline
    assert text.strip()
    model = moerun.load(cache / "gemma-3-270m-q4_k_m.gguf", device=TEST_DEVICE)
    assert text == model.generate(PROMPT, max_tokens=8, temperature=0)
    assert re.search(r"prompt: 4 tokens .* t/s\).*generation: 8 tokens.* t/s\)", r.stderr), r.stderr
    assert "first run only" not in r.stderr  # the cached model is reused


def test_generate_seed_reproduces_and_stop(tiny_file: Path) -> None:
    args = ["generate", "-m", str(tiny_file), "-p", "hello", "-n", "16", "--seed", "3", "--temp", "1.2",
            "--no-display-prompt", "--ignore-eos"]
    a, b = moerun_cli(*args), moerun_cli(*args)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()
    stop = a.stdout[4:6]
    c = moerun_cli(*args, "--stop", stop)
    assert c.returncode == 0 and c.stdout == a.stdout[: a.stdout.index(stop)] + "\n"
    assert "stop: stop" in c.stderr


def test_generate_prompt_file(tiny_file: Path, tmp_path: Path) -> None:
    f = tmp_path / "prompt.txt"
    f.write_text("hello", encoding="utf-8")
    a = moerun_cli("generate", "-m", str(tiny_file), "-f", str(f), "-n", "4", "--temp", "0")
    b = moerun_cli("generate", "-m", str(tiny_file), "-p", "hello", "-n", "4", "--temp", "0")
    assert a.returncode == 0 and a.stdout == b.stdout


# -- info -----------------------------------------------------------------------------------------------------

def test_info_default_model(cache: Path) -> None:
    r = moerun_cli("info", cache=cache)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for pattern in [r"architecture\s+gemma3", r"parameters\s+268\.\d+ M", r"context length\s+32768",
                    r"layers\s+18", r"Q4_K\s+\d+ tensors", r"Q6_K", r"Q8_0", r"Q5_0", r"F32",
                    r"tokenizer\s+llama .*262144 tokens", r"bos / eos\s+2 '<bos>' / 1 '<eos>'", r"chat template"]:
        assert re.search(pattern, out), (pattern, out)


def test_info_synthetic_moe(tiny_file: Path) -> None:
    r = moerun_cli("info", str(tiny_file))
    assert r.returncode == 0, r.stderr
    assert re.search(r"architecture\s+olmoe", r.stdout)
    assert re.search(r"experts\s+\d+, \d+ used per token", r.stdout)
    assert re.search(r"tokenizer\s+gpt2 \(pre-tokenizer olmo\)", r.stdout)
    assert re.search(r"quant mix\s+\d+ tensors", r.stdout)


# -- chat -----------------------------------------------------------------------------------------------------

def test_chat_two_turns_reuse_cache(cache: Path) -> None:
    r = moerun_cli("--verbose", "chat", "-n", "6", "--temp", "0", cache=cache,
                   stdin="What is the capital of France?\nAnd of Italy?\n/exit\nnot read\n")
    assert r.returncode == 0, r.stderr
    turns = re.findall(r"turn (\d): reused (\d+) of (\d+) prompt tokens", r.stderr)
    assert [t[0] for t in turns] == ["1", "2"], r.stderr
    assert int(turns[0][1]) == 0
    assert int(turns[1][1]) > int(turns[0][2]) // 2, turns  # the first turn's prompt came from the cache
    assert len(r.stdout.strip().splitlines()) >= 2


# -- errors: one line, non-zero exit, no traceback --------------------------------------------------------------

def test_missing_file() -> None:
    assert "no such file" in one_line_error(moerun_cli("generate", "-m", "/no/such/model.gguf", "-p", "x"))
    assert "no such file" in one_line_error(moerun_cli("info", "/no/such/model.gguf"))


def test_not_a_gguf(tmp_path: Path) -> None:
    f = tmp_path / "notes.gguf"
    f.write_text("just some text, not a model\n")
    assert "not a GGUF" in one_line_error(moerun_cli("info", str(f)))
    assert "not a GGUF" in one_line_error(moerun_cli("chat", "-m", str(f)))


BAD_FLAGS = [
    ["generate", "--temp", "abc", "-p", "x"],
    ["generate", "-n", "-5", "-p", "x"],
    ["generate", "--no-such-flag"],
    ["chat", "--seed", "-7"],
]
MORE_BAD_FLAGS = [
    ["generate", "--top-p", "1.5", "-p", "x"],
    ["generate", "--repeat-penalty", "0", "-p", "x"],
    ["generate", "-c", "lots", "-p", "x"],
    ["chat", "--min-p", "nan"],
    ["info", "a.gguf", "b.gguf"],
]


@pytest.mark.parametrize("args", BAD_FLAGS, ids=lambda a: " ".join(a[:2]))
def test_bad_flag_values(args: list[str]) -> None:
    line = one_line_error(moerun_cli(*args))
    assert line.startswith(f"moerun {args[0]}: error: argument ") or "unrecognized" in line


@pytest.mark.parametrize("args", MORE_BAD_FLAGS, ids=lambda a: " ".join(a[:2]))
def test_more_bad_flag_values_in_process(args: list[str], capsys: pytest.CaptureFixture) -> None:
    """The same parser in-process (no subprocess start-up per case)."""
    from moerun.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"moerun {args[0]}: error: "), err


def test_no_prompt(tiny_file: Path) -> None:
    assert "no prompt" in one_line_error(moerun_cli("generate", "-m", str(tiny_file)))


def test_help_explains_every_flag() -> None:
    from moerun.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    for cmd in ("generate", "chat", "info"):
        for action in subparsers[cmd]._actions:
            assert action.help and len(action.help) > 8, (cmd, action.option_strings)
    r = moerun_cli("generate", "--help")
    assert r.returncode == 0
    for flag in ("--model", "--prompt", "--n-predict", "--temp", "--top-k", "--top-p", "--min-p",
                 "--repeat-penalty", "--seed", "--ctx-size", "--stop", "--file", "--device", "--dtype"):
        assert flag in r.stdout, flag
