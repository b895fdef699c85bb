"""benchmarks/sweep_ops.py: a sweep JSON's fastest tiles as --ops variants the ops parser takes."""

import importlib.util
import json
from pathlib import Path

import pytest

from moerun.kernels.ops import parse_tile

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sweep_ops.py"
_spec = importlib.util.spec_from_file_location("sweep_ops", _PATH)
sweep_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep_ops)

ROWS = [
    {"case": "output 50304x2048", "kind": "mv", "tile": [32, 64, 8, 1],
     "sweep": [[[8, 256, 4, 1], 80.0], [[32, 64, 8, 1], 70.0], [[4, 512, 4, 1], 75.0], [[16, 128, 4, 1], 90.0]]},
    {"case": "experts down 8x2048x1024", "kind": "down", "tile": [2, 1024, 2, 1], "sweep": [[[4, 512, 4, 1], 1.0]]},
]


def test_fastest_non_default_tiles_in_order():
    ops = sweep_ops.ops_from_sweep(ROWS, "out", 2)
    assert ops == ["triton", "triton+out@4x512x4", "triton+out@8x256x4"]  # the default (70 us) is left out
    assert [parse_tile(o.split("+")[1]) for o in ops[1:]] == [("out", (4, 512, 4)), ("out", (8, 256, 4))]
    assert sweep_ops.ops_from_sweep(ROWS, "down", 5) == ["triton", "triton+down@4x512x4"]


def test_errors_name_the_missing_case(tmp_path, capsys):
    with pytest.raises(ValueError, match="no swept 'gate_up' case.*experts down"):
        sweep_ops.ops_from_sweep(ROWS, "gate_up", 3)
    with pytest.raises(ValueError, match="kind 'qkv'"):
        sweep_ops.ops_from_sweep(ROWS, "qkv", 3)
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"rows": ROWS}))
    assert sweep_ops.main([str(f), "--kind", "gate_up"]) == 1
    assert "sweep.json" in capsys.readouterr().err
    assert sweep_ops.main([str(f), "--kind", "out", "--top", "1"]) == 0
    assert capsys.readouterr().out.strip() == "triton,triton+out@4x512x4"
