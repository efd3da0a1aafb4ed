"""Training rows: where they come from (files, folders, hub datasets), how they become masked token sequences, and
how they render their prompts. May import moe_qlora.common and config.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "config")
