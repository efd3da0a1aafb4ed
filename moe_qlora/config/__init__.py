"""The run config: its sections (pydantic), and reading YAML with --set overrides into one validated RunConfig.

May import moe_qlora.common, and moe.kernel_names (the kernels' names, no torch).
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ("common", "moe.kernel_names")
