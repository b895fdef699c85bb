"""Triton kernels for decode; import only where triton is available (set TRITON_INTERPRET=1 before import on CPU)."""

from __future__ import annotations

from moerun.kernels.triton.qmatvec import SUPPORTED, TILES, Tile, moe_down, moe_gate_up, qmatvec

__all__ = ["SUPPORTED", "TILES", "Tile", "moe_down", "moe_gate_up", "qmatvec"]
