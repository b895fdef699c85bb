"""A Qwen3-30B-A3B-shaped Q4_K_M file (17 GB) loads and produces a token on a CPU machine with far
less memory than a dequantized copy would need: the weights stay memory-mapped and quantized.

The file is the real header from `moerun synth`'s plan with its tensor data left as a sparse hole
(all-zero blocks are valid and dequantize to 0), so the test needs no disk space or download.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from moerun.synth import plan_file

SCRIPT = """
import sys, time
from moerun.engine.engine import Engine
t = time.time()
eng = Engine(sys.argv[1], device="cpu", n_ctx=64, dequant_budget_bytes=1 << 30)
tok = eng.prefill([1])
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
print(tok, int(status["RssAnon"].split()[0]) * 1024, eng.cfg.n_layer, eng.cfg.n_expert, time.time() - t)
"""


def test_qwen3_30b_a3b_q4_k_m_loads_and_runs_in_bounded_memory(tmp_path: Path) -> None:
    plan = plan_file("qwen3-30b-a3b", "q4_k_m")
    path = tmp_path / "qwen3-30b-a3b-q4_k_m.gguf"
    with open(path, "wb") as f:
        f.write(plan.header)
        f.truncate(plan.size)  # sparse: no blocks are written
    assert path.stat().st_size > 17 * 10**9
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    tok, rss_anon, n_layer, n_expert, seconds = out.stdout.split()
    assert (int(n_layer), int(n_expert)) == (48, 128)
    assert 0 <= int(tok) < 151936
    # 17 GB of weights, 1 GiB dequantization cache: private memory stays a small fraction of the file
    assert int(rss_anon) < 4 << 30, f"private memory {int(rss_anon) / 2**30:.1f} GiB"
