"""The export formats by name, as `moe-qlora export --format` and `output.export_formats` name them: one table,
so that the command line and the end of a run write each format with the same writer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moe_qlora.export.gguf_lora import write_gguf
from moe_qlora.export.per_expert_lora import write_per_expert
from moe_qlora.export.vllm_lora import write_vllm

# {format name: writer(adapter_dir, out) -> the path written}; gguf's also takes fuse_gate_up_exps and fuse_qkv
WRITERS: dict[str, Callable[..., Path]] = {"vllm": write_vllm, "per-expert": write_per_expert, "gguf": write_gguf}
