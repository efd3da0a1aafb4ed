"""The MoE layer's kernel names, defined once: what `model.kernels` accepts (config/sections.py reads them) and the
paths the layer runs (experts.py). Kept apart so that reading a config imports no torch.

torch: the per-expert reference (CPU); triton: grouped Triton kernels decoding NF4 in registers (CUDA, or
TRITON_INTERPRET=1); grouped_mm: each NF4 stack decoded to a buffer, then torch._grouped_mm (any device); auto: per
call, triton below `fused_below_rows` rows per expert and grouped_mm above (CUDA); torch-grouped: the grouped
formulation on the kernels' torch references (a CPU check of that path, not a config choice).
"""

KERNEL_CHOICES = ("auto", "triton", "grouped_mm", "torch")
KERNELS = (*KERNEL_CHOICES, "torch-grouped")
