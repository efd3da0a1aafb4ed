"""NaN policy: a skipped step changes no weight and no AdamW moment; abort and K-in-a-row stop the run,
naming the step and its samples; the raw NaN is logged; router load goes to the metrics."""

import json
import math

import pytest
import torch
from rich.console import Console

from moe_qlora.train import sft as trainer
from moe_qlora.train import update

from helpers.runs import checkpoint_tensors, tiny_run_config


def config(out, **train):
    defaults = {"micro_batch_size": 4, "lr": 5e-3, "schedule": "constant", "seed": 0, "save_every": 1}
    train = {**defaults, "keep_checkpoints": 10, **train}
    return tiny_run_config(out, lora={"target_modules": ["q_proj"]}, **train)


def poison(monkeypatch, nan_steps):
    """Make the loss NaN on the given optimizer steps (1-based), as a diverging run would."""
    real, calls = trainer.token_loss_sum, {"n": 0}

    def poisoned(model, batch, **kwargs):
        calls["n"] += 1
        loss, n, aux = real(model, batch, **kwargs)
        return (loss * math.nan if calls["n"] in nan_steps else loss), n, aux

    monkeypatch.setattr(trainer, "token_loss_sum", poisoned)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_skipped_step_changes_no_weight_and_no_moment(tmp_path, monkeypatch):
    trainer.train(config(tmp_path / "two", max_steps=2), Console(quiet=True))
    poison(monkeypatch, {3})
    trainer.train(config(tmp_path / "three", max_steps=3, nan_policy="skip"), Console(quiet=True))
    for a, b in zip(checkpoint_tensors(tmp_path / "two", 2), checkpoint_tensors(tmp_path / "three", 3), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    last = records(tmp_path / "three")[-1]
    assert last["skipped"] is True and math.isnan(last["loss"])  # the raw NaN, not smoothed away


def test_abort_names_the_step_and_its_samples_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    poison(monkeypatch, {2})
    with pytest.raises(update.TrainingAborted, match=r"step 2: loss nan.*samples .*demo_sft.jsonl:\d+"):
        trainer.train(config(tmp_path, max_steps=4), Console(quiet=True))
    assert (tmp_path / "checkpoints" / "step-00000001" / "manifest.json").exists()
    assert not (tmp_path / "checkpoints" / "step-00000002").exists()
    assert math.isnan(records(tmp_path)[-1]["loss"])


def test_k_skips_in_a_row_stop_the_run(tmp_path, monkeypatch):
    poison(monkeypatch, {2, 3, 4})
    with pytest.raises(update.TrainingAborted, match="3 non-finite steps in a row, the last at step 4"):
        trainer.train(config(tmp_path, max_steps=6, nan_policy="skip", max_consecutive_skips=3), Console(quiet=True))


def test_router_load_per_layer_is_logged(tmp_path):
    trainer.train(config(tmp_path, max_steps=2), Console(quiet=True))
    assert records(tmp_path)[0]["aux_loss"] > 0  # Mixtral's load-balancing loss, logged
    load = records(tmp_path)[0]["router_load"]
    assert len(load) == 2 and all(len(layer) == 8 for layer in load)  # 2 MoE layers, 8 experts
    assert all(abs(sum(layer) - 1) < 1e-3 for layer in load)
