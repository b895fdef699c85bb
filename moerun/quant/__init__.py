"""Quantization layer: the GGML type table, bit-exact torch dequantizers, QTensor, random blocks."""

from __future__ import annotations

from moerun.quant.qtensor import QTensor
from moerun.quant.random_blocks import random_blocks
from moerun.quant.registry import QUANT_TYPES, QuantType, dequantize, quant_type

__all__ = ["QUANT_TYPES", "QTensor", "QuantType", "dequantize", "quant_type", "random_blocks"]
