"""The training methods as recipes (recipe.py: the loop they share; sft.py, grpo.py, dpo.py: their steps), and what
runs need around a step: the update, optimizers, checkpoints and resume, a run's lifecycle, and what it does on a fault.
May import moe_qlora.common, moe, config, data, model and export.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe", "config", "data", "model", "export")
