"""The `moe-qlora` command: one typer app; each command parses its options and calls the packages below.

May import moe_qlora.common, moe, config, data, model, export, inference and train; nothing imports it.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe", "config", "data", "model", "export", "inference", "train")
