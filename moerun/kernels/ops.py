"""Choosing the decode-step ops: fused Triton kernels where a weight type has one, torch otherwise.

An ops name is a base, optionally followed by features: "triton", "triton+FEATURE", "triton+FEATURE+OTHER".
Features switch on variants that are prepared and tested but not yet measured faster, so that one device
call can time each against the default (`moerun bench --ops A,B`). Each variant measured so far was either made
the default or deleted; those below wait for their measurement. A feature "KIND@BMxNBxWARPS" (TILE_KINDS) is a
launch tile for the F32 / F16 / BF16 byte kernels' product KIND, to time a tile a micro-benchmark sweep found
(`benchmarks/bench_qmatvec.py --sweep`) inside the whole step.
"""

from __future__ import annotations

from typing import Any

from moerun.errors import MoerunError
from moerun.kernels.torch_ops import TorchOps

# base name -> TritonOps arguments
BASES: dict[str, dict[str, Any]] = {
    "triton": {},                                                 # the default: every measured-faster kernel
    "triton-words": {"ints": False},                              # Q4_K on the word kernels' float decode
    "triton-unpadded": {"ints": False, "pad": False},             # also the Q6_K matrices on the file's rows
    "triton-bytes": {"ints": False, "pad": False, "words": False},  # every type on the byte-decoding matvecs
    "triton-nopdl": {"pdl": False},  # plain launches: for profiles (with PDL a kernel's time includes its wait)
}
# feature -> what it switches on (`make_ops` sets its TritonOps arguments, FEATURE_ARGS)
FEATURES: dict[str, str] = {
    "plain64": "the long attention phase on f16 caches as on the others (attention.ATTN_LONG: elementwise tiles of "
               "64 positions, 128 registers, 4 programs per SM; the default before NOTES.md 9i)",
    "dot32": "the long attention phase's q.k and p.v on the tensor cores (f16 caches), tiles of 32 positions (114 "
             "registers: 4 programs per SM; NOTES.md 9e)",
    "dot64": "the long attention phase's q.k and p.v on the tensor cores (f16 caches), tiles of 64 positions (166 "
             "registers: 3 programs per SM; NOTES.md 9e)",
    "dot64a": "dot64 with each next tile's loads before the tile before's arithmetic (226 registers: 2 programs per "
              "SM; NOTES.md 9e)",
    "dot32ae": "the long phase's f16 default (ATTN_LONG_F16) with its first 32-position tile loaded before the PDL "
               "wait, while the q/k/v product runs, as the short phase's (158 registers: still 3 per SM; NOTES.md 9j)",
    "dot32e": "dot32 with its first tile before the PDL wait (114 registers: 4 programs per SM, 33 splits; NOTES.md "
              "9j)",
}
# (attn_long_f16: the long phase's variant on f16 caches, an attention.AttnVariant's fields in order: block_n, warps,
# programs_per_sm, early, ahead, dot)
FEATURE_ARGS: dict[str, dict[str, Any]] = {
    "plain64": {"attn_long_f16": (64, 4, 4, False, False, False)},
    "dot32": {"attn_long_f16": (32, 4, 4, False, False, True)},
    "dot64": {"attn_long_f16": (64, 4, 3, False, False, True)},
    "dot64a": {"attn_long_f16": (64, 4, 2, False, True, True)},
    "dot32ae": {"attn_long_f16": (32, 4, 3, True, True, True)},
    "dot32e": {"attn_long_f16": (32, 4, 4, True, False, True)},
}
ATTN_KEYS = ("attn_long", "attn_long_f16")  # the TritonOps arguments that set a long-phase attention variant


def attention_features() -> dict[str, tuple]:
    """The features that set a long-phase attention variant: name -> its fields (`ATTN_KEYS`)."""
    return {name: kw[key] for name, kw in FEATURE_ARGS.items() for key in ATTN_KEYS if key in kw}


INT_FEATURES: tuple[str, ...] = ()  # features of the integer-dot kernels: only with base "triton"
# "KIND@BMxNBxWARPS" features: the byte kernels' products of float weights a tile can be given for ("out": a
# matvec of at least `qmatvec.LARGE_MV_ROWS` rows, the output matrix; "mv": the smaller ones)
TILE_KINDS: tuple[str, ...] = ("mv", "out", "gate_up", "down")


def parse_tile(feature: str) -> tuple[str, tuple[int, int, int]] | None:
    """"gate_up@2x1024x4" -> ("gate_up", (2, 1024, 4)): rows per program, blocks per K-step, warps (powers of
    two); None where the feature has no '@'. Raises MoerunError naming what is wrong."""
    if "@" not in feature:
        return None
    kind, _, spec = feature.partition("@")
    parts = spec.split("x")
    if kind not in TILE_KINDS or len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise MoerunError(f"bad tile feature {feature!r}: want KIND@BMxNBxWARPS with KIND one of "
                          f"{', '.join(TILE_KINDS)}, e.g. gate_up@2x1024x4")
    bm, nb, warps = (int(p) for p in parts)
    if not all(v > 0 and v & (v - 1) == 0 for v in (bm, nb, warps)) or warps > 16:
        raise MoerunError(f"bad tile feature {feature!r}: BM, NB and WARPS must be powers of two (WARPS <= 16)")
    return kind, (bm, nb, warps)


def features_text() -> str:
    """FEATURES for messages and help: "name: what; ...", or that there are none."""
    if not FEATURES:
        return "none at present"
    return "; ".join(f"{k}: {v}" for k, v in FEATURES.items())


def parse_ops(name: str) -> tuple[str, tuple[str, ...]]:
    """"triton+FEATURE" -> ("triton", ("FEATURE",)). Raises MoerunError naming the bad part."""
    base, *feats = name.split("+")
    if base not in BASES:
        raise MoerunError(f"unknown decode ops {name!r}: the base {base!r} is not one of "
                          f"{', '.join(BASES)} (or 'torch'); features after '+': {features_text()}")
    for f in feats:
        if parse_tile(f) is not None:
            continue
        if f not in FEATURES:
            raise MoerunError(f"unknown decode ops feature {f!r} in {name!r}; features: {features_text()}")
        if f in INT_FEATURES and BASES[base].get("ints", True) is False:
            raise MoerunError(f"decode ops {name!r}: feature {f!r} needs the integer-dot kernels (base 'triton')")
    return base, tuple(dict.fromkeys(feats))


def make_ops(name: str) -> Any:
    """"torch" -> TorchOps; otherwise TritonOps (falls back to torch per weight type without a kernel) for a base
    of BASES with the FEATURES after '+' (`parse_ops`)."""
    if name == "torch":
        return TorchOps()
    base, feats = parse_ops(name)
    from moerun.kernels.triton_ops import TritonOps

    kw = dict(BASES[base])
    for f in feats:
        tile = parse_tile(f)
        if tile is None:
            kw.update(FEATURE_ARGS[f])
        else:
            kw.setdefault("float_tiles", {})[tile[0]] = tile[1]
    return TritonOps(**kw)
