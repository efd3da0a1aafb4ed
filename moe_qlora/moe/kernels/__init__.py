"""Grouped MoE primitives: Triton kernels for NVIDIA GPUs and the torch references they are checked against."""
