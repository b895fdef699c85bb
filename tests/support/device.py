"""The device the model tests run on: CPU by default; MOERUN_TEST_DEVICE=cuda on the GPU machine."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("MOERUN_TEST_DEVICE", "cpu")

# Engine arguments for tests that compare against float32 references: float32 compute and KV cache
# everywhere (on CUDA the default cache is float16 and fast prefill multiplies in bf16).
ENGINE_KW: dict = {"device": TEST_DEVICE, "dtype": "float32", "kv_dtype": "float32"}
