"""What every layer uses: atomic writes and full-disk errors, the lock that keeps one process per run folder,
memory readings, the CPU threads a command computes with and the CUDA allocator's settings, the hub-or-path rule,
metrics written as JSONL (with TensorBoard and W&B beside them), and the faults tests inject, read once.

May import nothing from moe_qlora.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ()
