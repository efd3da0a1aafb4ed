"""The model, built in one place (build.py): loaded in 4-bit with its experts in NF4, LoRA attached by family (or
read from a PEFT adapter), the MoE kernels chosen, offloaded or sharded over ranks; and the bytes a run will need.

May import moe_qlora.common, moe and config.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe", "config")
