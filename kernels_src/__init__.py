"""Triton kernels of fused-kernels, one kernel family per module.

Modules here hold only ``@triton.jit`` functions and thin launchers that take tensors and explicit launch
parameters. The torch-facing package (``torch-ext/fused_kernels``) validates inputs, picks launch
configurations and registers the ops; the builder copies this directory into each CUDA variant as
``_kernels/``.
"""
