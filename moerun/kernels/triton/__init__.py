"""Triton kernels for GPU decode (one module per kernel family; import the module you need).

qmatvec: fused quantized matrix-vector products (dense, MoE gate/up, MoE down) on raw GGUF blocks.
On a machine without CUDA set TRITON_INTERPRET=1 before triton is first imported to run them on CPU.
"""
