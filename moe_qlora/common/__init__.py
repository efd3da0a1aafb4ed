"""What every layer uses: atomic writes and full-disk errors, the lock that keeps one process per run folder,
memory readings, the CPU threads and the CUDA allocator's settings, the hub-or-path rule, metrics as JSONL (with
TensorBoard and W&B beside them), the faults tests inject, read once, and how a process ends.

May import nothing from moe_qlora.
"""

# What this package may import from moe_qlora (tests/test_layout.py enforces it; docs/architecture.md shows it).
MAY_IMPORT = ()
