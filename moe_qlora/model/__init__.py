"""The model, built in one place (build.py): loaded in 4-bit with its experts in NF4, LoRA attached by family, the
MoE kernels chosen, offloaded or sharded over ranks; and the bytes a run will need (budget, plan).

May import moe_qlora.common, moe, config (an adapter to start from is read by export/, passed in).
"""
