"""The recipes in configs/recipes/: each validates, names a model whose config.json ships in configs/models/, says in
its header what `moe-qlora plan` prints for it (the same figure, checked by running the header's own plan command,
offline) on a GPU it fits, and its settings train 2 steps together on a tiny model of the same family on the CPU.

Header lines the checks read (one per device the recipe is made for; the KV cache line in grpo recipes only):
    # GPU: 24 GB (plan: 21.10 GiB; `moe-qlora plan --config configs/recipes/X.yaml --model configs/models/Y ...`)
    # KV cache: 1.12 GiB (...)   what sampling holds beside the training step (plan does not count it)
"""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.load import load_config
from moe_qlora.config.sections import RunConfig
from moe_qlora.model.tiny import TINY_FAMILIES

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
HEADROOM_GIB = 0.5  # as scripts/will_it_fit.py: allocator fragmentation (the CUDA context is a row of the plan)

# The hub id each recipe trains -> the folder of its config.json in configs/models/ (the hub's values, no weights).
SHIPPED_CONFIGS = {
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
    "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
    "openai/gpt-oss-20b": "gpt-oss-20b",  # its config.json as published (MXFP4 experts: quantization_config)
    "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
    "allenai/OLMoE-1B-7B-0924": "olmoe-1b-7b",
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",  # the FP8 release's config.json (quantization_config: fp8, 128 x 128)
}

# Total parameters as the model cards give them, in billions: the shipped config.json must build that model.
PUBLISHED_PARAMS_B = {
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235,
    "mixtral-8x7b": 46.7,
    "deepseek-v2-lite": 15.7,
    "gpt-oss-20b": 20.9,
    "qwen3-next-80b-a3b": 80,
    "olmoe-1b-7b": 6.9,
    "deepseek-v3": 671,  # without the multi-token-prediction module (14B more, which transformers does not build)
}

FIT_LINE = re.compile(r"^# (GPU|CPU): (\d+) GB[^(]*\(plan: (\d+\.\d\d) GiB; `(moe-qlora plan [^`]+)`\)$", re.M)
KV_LINE = re.compile(r"^# KV cache: (\d+\.\d\d) GiB", re.M)


@dataclass(frozen=True)
class FitClaim:
    """One header line: the recipe fits a `device` of `gb` GiB; `command` prints `plan_gib` as its total."""

    device: str
    gb: int
    plan_gib: str  # as written, two decimals
    command: str


def fit_claims(text: str) -> list[FitClaim]:
    return [FitClaim(d, int(gb), gib, cmd) for d, gb, gib, cmd in FIT_LINE.findall(text)]


def check_fit(claim: FitClaim, total_bytes: int, extra_bytes: int = 0) -> None:
    """The header's figure is plan's total to the digit, and it (with what plan leaves out, `extra_bytes`) fits
    the device with HEADROOM_GIB to spare. Raises AssertionError saying which does not hold."""
    printed = f"{total_bytes / 2**30:.2f}"
    if printed != claim.plan_gib:
        raise AssertionError(f"header says plan: {claim.plan_gib} GiB, `{claim.command}` prints {printed} GiB")
    need = (total_bytes + extra_bytes) / 2**30
    if need > claim.gb - HEADROOM_GIB:
        raise AssertionError(
            f"{need:.2f} GiB does not fit a {claim.gb} GB {claim.device} with {HEADROOM_GIB} GiB to spare"
        )


@functools.cache
def run_plan(command: str) -> dict:
    """The JSON `moe-qlora plan` prints for a header's command line (in-process CLI, from the repository root)."""
    args = shlex.split(command)
    assert args[:2] == ["moe-qlora", "plan"], command
    result = CliRunner().invoke(app, [*args[1:], "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def shipped_config(cfg: RunConfig) -> tuple[str, dict]:
    """(folder relative to the repository, config.json) of the recipe's model, shipped without weights."""
    name = cfg.model.name_or_path
    assert name in SHIPPED_CONFIGS, f"{name}: no config.json for it in configs/models/ (SHIPPED_CONFIGS)"
    folder = ROOT / "configs" / "models" / SHIPPED_CONFIGS[name]
    assert not list(folder.glob("*.safetensors")), f"{folder}: weights do not ship"
    return str(folder.relative_to(ROOT)), json.loads((folder / "config.json").read_text())


def sampling_kv_cache_bytes(config: dict, cfg: RunConfig) -> int:
    """KV cache of one GRPO rollout batch: prompts_per_step x group_size sequences of up to max_seq_len tokens,
    K and V of every layer's KV heads in bf16."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2
    return cfg.grpo.prompts_per_step * cfg.grpo.group_size * cfg.data.max_seq_len * per_token


def recipe_command(cfg: RunConfig) -> str:
    """The command a recipe is for: the method whose section it has."""
    return "grpo" if cfg.grpo else "dpo" if cfg.dpo else "train"


@pytest.fixture
def at_root(monkeypatch):
    """The header's commands name paths from the repository root, where a user runs them."""
    monkeypatch.chdir(ROOT)


def test_the_twelve_recipes_are_there():
    names = {p.stem for p in RECIPES}
    assert names == {
        "qwen3-235b-a22b-sft",
        "qwen3-30b-a3b-long",
        "gpt-oss-20b-long",
        "deepseek-v3-sft",
        "qwen3-30b-a3b-sft",
        "qwen3-30b-a3b-grpo",
        "qwen3-30b-a3b-dpo",
        "mixtral-8x7b-sft",
        "deepseek-v2-lite-sft",
        "gpt-oss-20b-sft",
        "qwen3-next-80b-a3b-sft",
        "olmoe-1b-7b-sft",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_and_fits_the_gpu_its_header_names(path, at_root):
    cfg = load_config(path)
    text = path.read_text()
    rel = path.relative_to(ROOT)
    command = recipe_command(cfg)
    claims = fit_claims(text)
    gpus = re.search(r"--gpus (\d+)", claims[0].command) if claims else None
    several = cfg.train.parallel in ("fsdp", "ep")  # launched on as many GPUs as its plan line names
    launcher = f"torchrun --nproc-per-node {gpus.group(1) if gpus else 1} -m moe_qlora" if several else "moe-qlora"
    assert text.startswith(f"# {launcher} {command} --config {rel}\n")
    assert re.search(r"^# Time per step: ", text, re.M), "the header says the time per step, or that it is unmeasured"
    assert Path(cfg.output.dir) == ROOT / "runs" / path.stem
    folder, config = shipped_config(cfg)
    assert config["model_type"] in TINY_FAMILIES  # the tiny model the settings are trained on below
    assert [c.device for c in claims][:1] == ["GPU"], "the header names the GPU the recipe is made for"
    kv = sampling_kv_cache_bytes(config, cfg) if cfg.grpo else 0
    if cfg.grpo:
        (written,) = KV_LINE.findall(text)
        assert written == f"{kv / 2**30:.2f}", f"header says KV cache {written} GiB, the config gives {kv / 2**30:.2f}"
    for claim in claims:
        assert claim.command.startswith(f"moe-qlora plan --config {rel} --model {folder} "), claim.command
        assert f"--gpu-gb {claim.gb}" in claim.command and ("--device cpu" in claim.command) == (claim.device == "CPU")
        plan = run_plan(claim.command)
        published = PUBLISHED_PARAMS_B[Path(folder).name]
        assert abs(plan["params"] / 1e9 - published) < 0.01 * published, (plan["params"], published)
        check_fit(claim, plan["total"], extra_bytes=kv if claim.device == "GPU" else 0)


def test_a_header_figure_that_is_not_plans_or_does_not_fit_is_caught(at_root):
    """The broken controls: the same check refuses a figure off by 0.01 GiB, and a GPU too small for it."""
    claim = fit_claims((ROOT / "configs" / "recipes" / "qwen3-30b-a3b-sft.yaml").read_text())[0]
    total = run_plan(claim.command)["total"]
    check_fit(claim, total)
    off = f"{float(claim.plan_gib) + 0.01:.2f}"
    with pytest.raises(AssertionError, match=f"header says plan: {off} GiB"):
        check_fit(FitClaim(claim.device, claim.gb, off, claim.command), total)
    with pytest.raises(AssertionError, match="does not fit a 16 GB GPU"):
        check_fit(FitClaim(claim.device, 16, claim.plan_gib, claim.command), total)


def tiny_run_overrides(cfg: RunConfig, family: str, out: Path) -> list[str]:
    """--set overrides that keep the recipe's settings but train a tiny model of its family on the CPU, on the demo
    data, short sequences, 2 steps. The rest needs no change for the CPU: compute_dtype and kernels `auto` resolve
    to float32 and the torch reference there, and bitsandbytes' 8-bit AdamW runs on the CPU too."""
    data = (
        ROOT / "data" / {"grpo": "demo_grpo.jsonl", "dpo": "demo_dpo.jsonl"}.get(recipe_command(cfg), "demo_sft.jsonl")
    )
    sets = [
        f"model.name_or_path=builtin:tiny-{family.replace('_', '-')}",
        "model.device=cpu",
        f"data.train_files=[{data}]",
        "data.max_seq_len=32",
        "train.max_steps=2",
        "train.warmup_steps=1",
        f"output.dir={out}",
    ]
    if cfg.train.save_every > 2:
        sets.append("train.save_every=2")
    if cfg.data.eval_files:  # the demo data's held-out share instead of the recipe's hub split
        sets += ["data.eval_files=[]", "data.eval_fraction=0.1"]
    if cfg.model.expert_offload == "auto":
        # auto offloads nothing on a CPU (host memory is the device's); `all` runs the offloader's schedule there
        sets.append("model.expert_offload=all")
    if cfg.grpo:  # a small rollout batch: 2 prompts x 2 completions of 4 tokens
        sets += ["grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=4"]
        # A random tiny model ends no completion within 4 tokens (all would be masked as truncated) and gets no
        # answer right (every advantage 0): either way no gradient would flow. So truncated completions are kept,
        # and a dense reward (the share of letters) joins the recipe's, which still runs on every completion.
        rewards = [r.model_dump() for r in cfg.grpo.rewards]
        rewards.append({"function": "regex", "args": {"pattern": "[A-Za-z]", "mode": "share"}, "weight": 1.0})
        sets += ["grpo.mask_truncated_completions=false", f"grpo.rewards={json.dumps(rewards)}"]
    return sets


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_settings_train_together_on_a_tiny_model(path, tmp_path):
    from moe_qlora.train.dpo import dpo
    from moe_qlora.train.grpo import grpo
    from moe_qlora.train.sft import train

    recipe = load_config(path)
    _, config = shipped_config(recipe)
    overrides = tiny_run_overrides(recipe, config["model_type"], tmp_path / "run")
    cfg = load_config(path, overrides)
    named = {o.partition("=")[0] for o in overrides}
    ours, theirs = cfg.model_dump(), recipe.model_dump()
    for section, keys in theirs.items():  # every key the overrides do not name is the recipe's
        for key, value in (keys or {}).items():
            assert f"{section}.{key}" in named or ours[section][key] == value, f"{section}.{key}"
    run = {"grpo": grpo, "dpo": dpo, "train": train}[recipe_command(cfg)]
    result = run(cfg, Console(quiet=True))
    assert result.steps == 2
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records) and any(r["grad_norm"] > 0 for r in records)
    if cfg.grpo:  # the recipe's reward function ran, and completions were trained on
        assert all(f"reward/{recipe.grpo.rewards[0].function}" in r for r in records), records[0].keys()
        assert any(r["sequences_trained"] > 0 for r in records)
    assert (result.adapter_dir / "adapter_model.safetensors").exists()


def test_the_grpo_recipes_reward_scores_gsm8k_answers():
    """The GRPO recipe's reward, loaded as a run loads it (the file path relative to the recipe), on answers in
    GSM8K's own form (working, then `#### N`): the completion's last number against the number after ####."""
    from moe_qlora.train.rewards import resolve_reward

    cfg = load_config(ROOT / "configs" / "recipes" / "qwen3-30b-a3b-grpo.yaml")
    fn = resolve_reward(cfg.grpo.rewards[0], 0).fn
    answer = [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
        "She earns 1,234.50 a week.\n#### 1,234.5",
        "#### -3",
    ]
    completions = ["48 + 24 = 72, so the answer is 72.", "That is 1234.50 dollars", "The answer is 3."]
    # the third is a broken control: 3 where GSM8K says -3; and GSM8K's working (the 24) is not the answer
    assert fn(["p"] * 3, completions, answer=answer) == [1.0, 1.0, 0.0]
    assert fn(["p"], ["the answer is 24"], answer=answer[:1]) == [0.0]
