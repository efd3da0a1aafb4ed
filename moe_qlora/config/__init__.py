"""The run config: its sections (pydantic), and reading YAML with --set overrides into one validated RunConfig.

May import moe_qlora.common, and moe.kernel_names (the kernels' names, no torch).
"""
