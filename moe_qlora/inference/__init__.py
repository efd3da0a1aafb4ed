"""Using a trained adapter: generation with it, and merging it into the base model's weights.

May import moe_qlora.common, moe, config, model and export (the adapter's records); nothing from train.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe", "config", "model", "export")
