"""Choosing the decode-step ops: fused Triton kernels where a weight type has one, torch otherwise."""

from __future__ import annotations

from typing import Any

from moerun.errors import MoerunError
from moerun.kernels.torch_ops import TorchOps


def make_ops(name: str) -> Any:
    """"torch" -> TorchOps; "triton" -> TritonOps (falls back to torch per weight type without a kernel);
    "triton-bytes" -> TritonOps without the word kernels (every type on the byte-decoding matvecs);
    "triton-unpadded" -> TritonOps reading only the file's rows (no repacked Q6_K copies);
    "triton-words" -> TritonOps without the integer-dot kernels (Q4_K on the word kernels' float decode);
    "triton-int-all" -> TritonOps with every integer-dot kernel and variant, also the untimed ones (Q8_0, Q6_K
    gate/up, Q4_K's whole sub-block pairs per thread: imatvec.PAIR_WORDS)."""
    if name == "torch":
        return TorchOps()
    if name in OPS_NAMES:
        from moerun.kernels.triton.imatvec import ALL_INT_KINDS, PAIR_WORDS, WORDS_PER_THREAD
        from moerun.kernels.triton_ops import TritonOps

        return TritonOps(words=name != "triton-bytes", pad=name in ("triton", "triton-words", "triton-int-all"),
                         ints=name in ("triton", "triton-int-all"),
                         int_kinds=ALL_INT_KINDS if name == "triton-int-all" else None,
                         int_words=PAIR_WORDS if name == "triton-int-all" else WORDS_PER_THREAD)
    raise MoerunError(f"unknown decode ops {name!r}; use one of {', '.join(OPS_NAMES)} or 'torch'")


OPS_NAMES = ("triton", "triton-bytes", "triton-unpadded", "triton-words", "triton-int-all")  # the TritonOps variants
