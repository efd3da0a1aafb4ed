"""What happens to a trained adapter: PEFT's format written and verified, norm checks, the run's prompt format
recorded, and the other formats, one module each over the family tables, by name in writers.WRITERS.
May import moe_qlora.common, moe, config, data (the prompt format it records) and model.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe", "config", "data", "model")
