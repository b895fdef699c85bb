"""The device the model tests run on: CPU by default; MOERUN_TEST_DEVICE=cuda on the GPU machine."""

from __future__ import annotations

import os

TEST_DEVICE = os.environ.get("MOERUN_TEST_DEVICE", "cpu")
