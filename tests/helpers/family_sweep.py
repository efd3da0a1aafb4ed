"""The family sweep: every MoE model type of the installed transformers, built from a tiny config, run
through the whole tool. Used by tests/model/test_family_sweep.py, which also keeps docs/families.md's table true.

Per model type: load in 4-bit with `lora.target_modules: auto` (a refusal is recorded with its message),
3 optimizer steps on random tokens, the adapter written and verified (PEFT's from_pretrained puts every
tensor into its module: no missing or unexpected keys), and the first experts module against the
family's own eager experts on the dequantized weights (output and all 6 gradients, 4e-6 * max|ref|).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from moe_qlora.config.sections import ConfigError, LoraSection
from moe_qlora.export.adapter import save_adapter, verify_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.classes import text_model_from_config
from moe_qlora.model.loaded_model import declared_experts
from moe_qlora.model.loading import LoadOptions, ModelLoadError, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model
from moe_qlora.moe.expert_stacks import UnsupportedExpertsError, experts_modules

from helpers.oracle import assert_all_close, ragged_routing, run_experts_pair
from helpers.tiny_configs import tiny_config_any

REFUSALS = (ModelLoadError, UnsupportedExpertsError, ConfigError)
LORA = LoraSection(rank=4, alpha=8.0, target_modules="auto")


def _defines_experts_class(model_type: str) -> bool:
    source = Path(transformers.__file__).parent / "models" / model_type / f"modeling_{model_type}.py"
    return source.exists() and "Experts(nn.Module)" in source.read_text()


def moe_model_types() -> list[str]:
    """Causal-LM and image-text-to-text model types that are MoE: an expert count in the default config (or its
    text config), or an experts class in the modeling file."""
    found = []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        if model_type not in CONFIG_MAPPING:
            continue
        try:
            config = CONFIG_MAPPING[model_type]()
            moe = declared_experts(config) > 1 or declared_experts(getattr(config, "text_config", None)) > 1
        except Exception:
            moe = False
        if moe or _defines_experts_class(model_type):
            found.append(model_type)
    return found


@dataclass
class SweepRow:
    model_type: str
    status: str  # supported | refused | no tiny config | error
    detail: str


MAX_TINY_PARAMETERS = 20_000_000


def parameters_on_meta(config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in text_model_from_config(config).parameters())


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sweep_one(model_type: str, workdir: Path) -> SweepRow:
    tok = build_byte_tokenizer()
    try:
        config = tiny_config_any(model_type, len(tok))
        size = parameters_on_meta(config)
        if size > MAX_TINY_PARAMETERS:  # a sub-config (a vision tower) the generic shrink does not reach
            raise ValueError(f"still {size / 1e6:.0f}M parameters after shrinking")
        path = save_tiny_model(workdir / model_type, config, tokenizer=tok)
    except Exception as exc:  # the config class cannot be shrunk generically: a limit of the sweep, said so
        return SweepRow(model_type, "no tiny config", f"{type(exc).__name__}: {_one_line(exc)}")
    try:
        model = attach_adapters(load_model(LoadOptions(str(path))), LORA, seed=0)
    except REFUSALS as exc:
        return SweepRow(model_type, "refused", _one_line(exc))
    if not experts_modules(model):
        return SweepRow(model_type, "error", "loaded, but no experts module was found")
    try:
        losses = train_a_few_steps(model)
        if not all(math.isfinite(v) for v in losses):
            return SweepRow(model_type, "error", f"non-finite loss {losses}")
        adapter = save_adapter(model, workdir / f"{model_type}-adapter", cfg=LORA, base_model_name_or_path=str(path))
        n = verify_adapter(model, adapter)
        check_first_experts(model)
    except Exception as exc:
        return SweepRow(model_type, "error", f"{type(exc).__name__}: {_one_line(exc)}")
    layers = len(experts_modules(model))
    return SweepRow(model_type, "supported", f"{layers} MoE layer(s), {n} adapter tensors load in PEFT")


def train_a_few_steps(model, steps: int = 3) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(7, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def check_first_experts(model) -> None:
    """Ours against the family's eager experts on dequantized weights (trained, so B is non-zero)."""
    _, experts = experts_modules(model)[0]
    e = experts.moe_lora.gate_up_a.shape[0]
    idx, weights = ragged_routing(13, e, 2)
    hidden = experts.moe_lora.gate_up_a.shape[-1]
    x = torch.randn(13, hidden, generator=torch.Generator().manual_seed(5))
    config = getattr(experts, "config", None) or model.config.get_text_config()  # a multimodal model's text config
    assert_all_close(*run_experts_pair(experts, config, x, idx, weights))


def sweep(workdir: Path, model_types: list[str] | None = None) -> list[SweepRow]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [sweep_one(mt, workdir) for mt in (model_types or moe_model_types())]


TABLE_START = "<!-- family-table:start (generated by tests/model/test_family_sweep.py) -->"
TABLE_END = "<!-- family-table:end -->"


def render_table(rows: list[SweepRow], transformers_version: str) -> str:
    lines = [
        TABLE_START,
        f"Every MoE causal-LM and image-text-to-text model type of transformers {transformers_version}, from a "
        "tiny config:",
        "",
        "| model type | status | what the sweep found |",
        "|---|---|---|",
    ]
    lines += [f"| `{r.model_type}` | {r.status} | {r.detail.replace('|', '/')} |" for r in rows]
    supported = sum(r.status == "supported" for r in rows)
    refused = sum(r.status == "refused" for r in rows)
    untested = sum(r.status == "no tiny config" for r in rows)
    lines += [
        "",
        f"{supported} of {len(rows)} supported, {refused} refused with their reason, {untested} untested "
        "(no tiny config: the reason is the sweep's, not the family's).",
        TABLE_END,
    ]
    return "\n".join(lines)
