"""What happens to a trained adapter: PEFT's format written and verified, GGUF and per-expert formats, norm checks.

May import moe_qlora.common, moe, config, model.
"""
