"""The MoE layer: routing, NF4 and MXFP4 expert stacks, per-expert LoRA, and its forward and backward (a torch
reference, grouped kernels in kernels/), installed into transformers' experts modules.

May import moe_qlora.common only.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common",)
