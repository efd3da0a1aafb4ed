"""The recipes' contract (train/recipe.py): each method's run-time checks happen when it is constructed, before
anything is launched, loaded or written; and the shared loop is the only loop.
"""

from pathlib import Path

import pytest

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import ConfigError
from moe_qlora.train.grpo import GrpoRecipe
from moe_qlora.train.recipe import Recipe
from moe_qlora.train.sft import SftRecipe

ROOT = Path(__file__).resolve().parents[2]


def config(out: Path, *, grpo: dict | None = None, **train):
    raw = {
        "model": {"name_or_path": "builtin:tiny-mixtral"},
        "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")]},
        "train": train,
        "output": {"dir": str(out)},
    }
    if grpo is not None:
        raw["grpo"] = {"rewards": [{"function": "exact_match"}], **grpo}
    return validate_config(raw)


@pytest.mark.parametrize(
    ("recipe", "options", "world", "refused"),
    [
        (SftRecipe, {"train": {"optimizer_in_backward": True}}, 2, "optimizer_in_backward steps inside"),
        (SftRecipe, {"train": {"optimizer_in_backward": True}}, 1, None),  # control: one process may
        (GrpoRecipe, {}, 1, "cfg.yaml: no `grpo:` section"),
        (GrpoRecipe, {"grpo": {}, "train": {"optimizer_in_backward": True}}, 1, "is for `train` only"),
        (GrpoRecipe, {"grpo": {"top_entropy_quantile": 0.5}}, 2, "runs in one process for now"),
        (GrpoRecipe, {"grpo": {"top_entropy_quantile": 0.5}}, 1, None),  # control
        (GrpoRecipe, {"grpo": {}, "train": {"parallel": "ep", "optimizer": "adamw_8bit"}}, 2, "a sharded tensor"),
        (GrpoRecipe, {"grpo": {}, "train": {"parallel": "ep"}}, 2, None),  # control: grpo runs under ep
        (SftRecipe, {"train": {"parallel": "fsdp"}}, 1, None),  # control: fsdp on one process is not sharding
    ],
)
def test_each_method_checks_its_config_when_constructed(tmp_path, monkeypatch, recipe, options, world, refused):
    """Refused at construction, naming the key and the config file: nothing is launched, loaded or written."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    out = tmp_path / "run"
    cfg = config(out, grpo=options.get("grpo"), **options.get("train", {}))
    if refused is None:
        assert recipe(cfg, source="cfg.yaml").out == out
    else:
        with pytest.raises(ConfigError, match=refused):
            recipe(cfg, source="cfg.yaml")
    assert not out.exists()


def test_the_methods_define_steps_not_loops():
    """SFT and GRPO override what a method defines; neither has a loop, a run or a setup of its own."""
    shared = {"run", "setup", "train", "run_step", "save_checkpoint", "save_adapter"}
    for method in (SftRecipe, GrpoRecipe):
        assert issubclass(method, Recipe)
        own = {name for name in vars(method) if not name.startswith("__")}
        assert "step" in own and "batches" in own, method
        assert not shared & own, f"{method.__name__} redefines {shared & own}"


def test_a_method_that_leaves_out_its_step_cannot_be_built(tmp_path):
    """What every method must define is abstract: a method without `step` fails when built, not mid-run. The
    control: the same method with a step is built."""
    defined = {name: lambda self, *args: None for name in Recipe.__abstractmethods__ - {"step"}}
    no_step = type("NoStep", (Recipe,), defined)
    with pytest.raises(TypeError, match="abstract method .?step"):
        no_step(config(tmp_path / "run"))
    with_step = type("WithStep", (no_step,), {"step": lambda self, *args: {}})
    assert with_step(config(tmp_path / "run")).out == tmp_path / "run"
