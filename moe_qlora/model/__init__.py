"""The trainable model: loaded in 4-bit with its experts in NF4, LoRA attached by family, sharded over ranks, and
the bytes a run will need (budget, plan).

May import moe_qlora.common, moe, config.
"""
