"""The MoE layer: routing, NF4 expert stacks, per-expert LoRA, and its forward and backward (a torch reference,
grouped kernels in kernels/), installed into transformers' experts modules.

May import moe_qlora.common only.
"""
