"""The LR schedule (train/schedule.py): its shape, and one curve in optimizer updates, whether a run starts on it
(Recipe.setup) or a resume is put back on it after some steps (Recipe.continue_data_parallel), however many
updates a step takes."""

import math
from pathlib import Path

import pytest
import torch

from moe_qlora.config.load import validate_config
from moe_qlora.train.grpo import GrpoRecipe
from moe_qlora.train.schedule import lr_multiplier, lr_schedule

ROOT = Path(__file__).resolve().parents[2]
STEPS, LR = 4, 0.1


def test_schedule_warmup_then_cosine_to_zero():
    kw = dict(total_updates=10, warmup_updates=2)
    assert [lr_multiplier(s, schedule="cosine", **kw) for s in (0, 1)] == [0.5, 1.0]
    assert lr_multiplier(2, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(6, schedule="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(10, schedule="cosine", **kw) == pytest.approx(0.0, abs=1e-12)
    assert lr_multiplier(6, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_multiplier(9, schedule="constant", **kw) == 1.0


def test_a_warmup_longer_than_the_run_is_clamped_to_it_not_refused():
    """`--set train.max_steps=3` on the demo (warmup_steps 5) was refused; the warmup now ends at the run's last
    update, as transformers' and TRL's schedules let a smoke test of a few steps run."""
    clamped = [lr_multiplier(u, total_updates=3, warmup_updates=5, schedule="cosine") for u in range(3)]
    assert clamped == pytest.approx([1 / 3, 2 / 3, 1.0])  # unclamped it would have stopped at 3/5 of the LR
    assert [lr_multiplier(u, total_updates=3, warmup_updates=3, schedule="cosine") for u in range(3)] == clamped
    cfg = validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "data": {"train_files": ["x.jsonl"]},
            "train": {"max_steps": 3, "warmup_steps": 5},
        }
    )
    assert (cfg.train.max_steps, cfg.train.warmup_steps) == (3, 5)


class StepsNotUpdates(GrpoRecipe):
    """Broken control: the old split, setup() building the schedule over updates (steps x updates_per_step) and a
    resume putting the run back on one over steps (what steps.schedule_at was given)."""

    def schedule_after(self, steps: int):
        if steps == 0:  # setup()'s
            return super().schedule_after(0)
        return lr_schedule(self.optimizer, self.cfg.train, total_updates=self.total, done_updates=steps)


def grpo_recipe(out: Path, cls: type[GrpoRecipe], passes: int) -> GrpoRecipe:
    """A GRPO recipe of STEPS steps, `passes` optimizer updates each, with what setup() puts on it for the
    schedule (its total steps; the optimizer is set by started_and_resumed)."""
    raw = {
        "model": {"name_or_path": "builtin:tiny-mixtral"},
        "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")]},
        "train": {"max_steps": STEPS, "warmup_steps": 2, "schedule": "cosine", "lr": LR},
        "grpo": {"rewards": [{"function": "exact_match"}], "passes": passes},
        "output": {"dir": str(out)},
    }
    recipe = cls(validate_config(raw))
    recipe.total = STEPS
    return recipe


def started_and_resumed(recipe: GrpoRecipe) -> tuple[list[float], list[float]]:
    """The LR after each step 0..total: on the schedule the run starts on, stepped once per optimizer update as
    the loop steps it; and on the schedule a resume after that step is put back on, each on its own optimizer."""

    def fresh_optimizer():
        recipe.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        return recipe.optimizer

    optimizer = fresh_optimizer()
    schedule, started = recipe.schedule_after(0), []
    for step in range(recipe.total + 1):
        for _ in range(recipe.updates_per_step() if step else 0):
            optimizer.step()
            schedule.step()
        started.append(optimizer.param_groups[0]["lr"])
    resumed = []
    for step in range(recipe.total + 1):
        lrs = fresh_optimizer().param_groups
        recipe.schedule_after(step)
        resumed.append(lrs[0]["lr"])
    return started, resumed


@pytest.mark.parametrize(
    ("cls", "passes", "agree"),
    [
        (GrpoRecipe, 3, True),  # three updates a step: the resume lands where the run was
        (GrpoRecipe, 1, True),
        (StepsNotUpdates, 1, True),  # the old split is right while a step is one update (SFT, DPO)
        (StepsNotUpdates, 3, False),  # broken control: and wrong as soon as a step takes several
    ],
)
def test_a_resume_is_put_back_on_the_schedule_the_run_started_on(tmp_path, monkeypatch, cls, passes, agree):
    monkeypatch.setenv("WORLD_SIZE", "1")
    started, resumed = started_and_resumed(grpo_recipe(tmp_path / "run", cls, passes))
    assert started[-1] == pytest.approx(0.0, abs=1e-12)  # the decay ends at the run's last update
    assert (resumed == pytest.approx(started, rel=1e-12)) is agree, (started, resumed)
