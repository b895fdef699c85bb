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


ATTN_ROWS = [
    {"kernel": "attention", "dtype": "float16", "kv_len": 4096, "us": 9.0},
    {"kernel": "attention pipe32", "dtype": "float16", "kv_len": 4096, "us": 7.0, "step_us": 12.0},
    {"kernel": "attention pipe32", "dtype": "float16", "kv_len": 2048, "us": 1.0},
    {"kernel": "attention dot64", "dtype": "float16", "kv_len": 4096, "us": 8.0, "step_us": 9.5},
    {"kernel": "attention ahead32", "dtype": "float16", "kv_len": 4096, "us": 6.0},
    {"kernel": "attention pps=4", "dtype": "float16", "kv_len": 4096, "us": 5.0},
    {"kernel": "attention dot32", "dtype": "float32", "kv_len": 4096, "us": 1.0},
]


def test_fastest_attention_features(tmp_path, capsys, monkeypatch):
    """--attn: the features' rows at 4,096 positions, fastest first by the step's launch (`step_us`) where a row has
    it (pipe32's loop alone is faster than dot64's, its step launch slower: NOTES.md 9i), else by `us`; rows that are
    no feature (the default, the pps=4 policy) or at another length / cache dtype are left out."""
    feats = {"pipe32", "dot64", "ahead32", "dot32"}
    assert sweep_ops.ops_from_attn(ATTN_ROWS, feats, 2) == ["triton", "triton+ahead32", "triton+dot64"]
    assert sweep_ops.ops_from_attn(ATTN_ROWS, {"dot64"}, 5) == ["triton", "triton+dot64"]
    with pytest.raises(ValueError, match="no attention row of a feature"):
        sweep_ops.ops_from_attn(ATTN_ROWS, {"dot32"}, 2)
    f = tmp_path / "decode_ops.json"
    f.write_text(json.dumps({"rows": ATTN_ROWS}))
    from moerun.kernels import ops

    # main's features: FEATURE_ARGS's entries with an attention variant (either key of ops.ATTN_KEYS)
    monkeypatch.setattr(ops, "FEATURE_ARGS", {"pipe32": {"attn_long": ()}, "dot64": {"attn_long_f16": ()},
                                              "ahead32": {"ints": False}})
    assert sweep_ops.main([str(f), "--attn", "--top", "1"]) == 0
    assert capsys.readouterr().out.strip() == "triton,triton+dot64"
    assert sweep_ops.main([str(f)]) == 1
    assert "--kind is required" in capsys.readouterr().err
