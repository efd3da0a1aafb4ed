"""moe-qlora: QLoRA fine-tuning of Mixture-of-Experts LLMs with every expert frozen in NF4."""

__version__ = "0.1.0"
