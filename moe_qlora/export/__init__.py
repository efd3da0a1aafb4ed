"""What happens to a trained adapter: PEFT's format written and verified, norm checks, and the other formats, one
module each (per_expert_lora, vllm_lora, gguf_lora) over the family tables (family_tables, gguf_archs), by name in
writers.WRITERS. May import moe_qlora.common, moe, config, model.
"""
