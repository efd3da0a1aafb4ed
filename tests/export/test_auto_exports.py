"""What `lora.target_modules: auto` trains exports to every format its family has, or the run's start and the
export's refusal both say the same thing and give the --set whose adapter does export (issue 69, item 5).

Per family: a tiny model with auto's targets (router LoRA as the default section has it), every factor random;
export_refusals (what the run's start says) against each writer's own outcome; where refused, the adapter of the
--set (or lora.router: false) the refusal gives is exported by the same writer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from moe_qlora.config.sections import LoraSection
from moe_qlora.export import family_tables, vllm_lora
from moe_qlora.export.exportability import export_refusals
from moe_qlora.export.gguf_lora import write_gguf
from moe_qlora.export.per_expert_lora import write_per_expert
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model

from helpers.adapters import random_adapter
from helpers.tiny_configs import tiny_config_any

WRITERS = {"gguf": write_gguf, "vllm": vllm_lora.write_vllm, "per-expert": write_per_expert}
SET_TARGETS = re.compile(r"--set lora\.target_modules=\[([^\]]*)\]")


def formats_of(model_type: str) -> list[str]:
    """The formats that write this family at all (a family-wide refusal is the export tables' own test)."""
    formats = ["gguf"]
    if family_tables.vllm_layout(model_type) != "refused":
        formats.append("vllm")
    if model_type not in family_tables.PER_EXPERT_UNREAD:
        formats.append("per-expert")
    return formats


def adapter_of(base: Path, out: Path, lora: LoraSection):
    """(model with random non-zero LoRA, its adapter folder)."""
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator
    return random_adapter(base, out, lora)


def targets_of(adapter: Path) -> list[str]:
    return sorted(json.loads((adapter / "adapter_config.json").read_text())["target_modules"] or [])


def retrained(refusal: str, lora: LoraSection, adapter: Path) -> LoraSection:
    """The lora section the refusal's advice gives: its --set list, or the router left out."""
    if m := SET_TARGETS.search(refusal):
        kept = [t for t in m[1].split(",") if t]
        assert set(kept) < set(targets_of(adapter)), refusal  # it drops targets, never adds one
        return lora.model_copy(update={"target_modules": kept})
    assert "train with lora.router: false" in refusal, refusal
    return lora.model_copy(update={"router": False})


@pytest.mark.parametrize("model_type", sorted(family_tables.FAMILIES))
def test_autos_adapter_exports_or_the_start_and_the_refusal_give_the_set_that_does(model_type, tmp_path):
    tok = build_byte_tokenizer()
    base = save_tiny_model(tmp_path / "base", tiny_config_any(model_type, len(tok)), tokenizer=tok)
    lora = LoraSection(rank=4, alpha=8.0, target_modules="auto")
    model, adapter = adapter_of(base, tmp_path / "auto", lora)
    said = export_refusals(model, targets_of(adapter), 4)
    for fmt in formats_of(model_type):
        out = tmp_path / f"out-{fmt}"
        try:
            WRITERS[fmt](adapter, out)
        except family_tables.ExportError as exc:
            assert said.get(fmt) == str(exc), (fmt, said.get(fmt), str(exc))  # the start said it, word for word
            _, fixed = adapter_of(base, tmp_path / f"fixed-{fmt}", retrained(str(exc), lora, adapter))
            assert WRITERS[fmt](fixed, tmp_path / f"fixed-out-{fmt}").exists(), fmt
        else:
            assert fmt not in said, (fmt, said[fmt])  # and never cried wolf
            assert out.exists()
