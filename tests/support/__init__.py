"""Test-only helpers: tiny HF models, the HF -> GGUF writer, and oracles we did not write."""
