"""Eval loss: held-out rows (a file, or a seeded share never trained on), token-normalised with the
training's masking and chunked loss, in eval mode without gradients; logged to metrics.jsonl; keep_best keeps
the best adapter; the run's training is unchanged by it."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from moe_qlora.config.sections import ConfigError
from moe_qlora.data.examples import eval_split
from moe_qlora.model import build
from moe_qlora.train import runs
from moe_qlora.train import sft as trainer

from helpers.runs import DEMO_SFT, tiny_run_config

DATA = str(DEMO_SFT)


def config(out, data=None, lora=None, **train):
    train = {"micro_batch_size": 8, "lr": 5e-3, "max_steps": 6, "warmup_steps": 0, "seed": 1, **train}
    lora = {"dropout": 0.1, "target_modules": ["q_proj"], **(lora or {})}
    return tiny_run_config(out, lora=lora, data=data, **train)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_split_is_seeded_disjoint_and_complete():
    examples = list(range(40))
    train, held = eval_split(examples, 0.25, seed=3)
    assert len(held) == 10 and sorted(train + held) == examples and not set(train) & set(held)
    assert eval_split(examples, 0.25, seed=3) == (train, held)
    assert eval_split(examples, 0.25, seed=4)[1] != held


def test_eval_loss_is_logged_equals_a_direct_computation_and_leaves_training_unchanged(tmp_path):
    plain = trainer.train(config(tmp_path / "plain", data={"eval_files": [DATA]}, eval_every=0), Console(quiet=True))
    evald = trainer.train(
        config(tmp_path / "eval", data={"eval_files": [DATA]}, eval_every=2, keep_best=True), Console(quiet=True)
    )
    assert plain.losses == evald.losses  # eval in eval mode under no_grad touches neither weights nor RNG
    a, b = (
        load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (tmp_path / "plain", tmp_path / "eval")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [(r["step"], r["eval_loss"]) for r in records(tmp_path / "eval") if "eval_loss" in r]
    assert [s for s, _ in logged] == [2, 4, 6]
    assert [r["step"] for r in records(tmp_path / "plain") if "eval_loss" in r] == [6]  # at the end only
    # The last eval equals the token-mean loss of the final adapter over the file, computed directly.
    final = config(tmp_path / "x", lora={"init_from": str(tmp_path / "eval" / "adapter")})
    model_path, tokenizer = build.load_tokenizer(final.model)
    model, _, _ = build.load_policy(final, model_path, Console(quiet=True))
    examples, _ = trainer.build_examples(config(tmp_path / "x").data, tokenizer)
    direct = trainer.eval_loss(model, examples, tokenizer.pad_token_id, config(tmp_path / "x").train)
    assert logged[-1][1] == pytest.approx(direct, rel=1e-6)
    best = min(v for _, v in logged)
    best_step = next(s for s, v in logged if v == best)
    assert [r["step"] for r in records(tmp_path / "eval") if r.get("eval_best")][-1] == best_step
    assert (tmp_path / "eval" / "adapter-best" / "adapter_model.safetensors").exists()


def test_the_best_adapter_is_verified_like_the_final_one(tmp_path, monkeypatch):
    """adapter-best is an export too: one written without an expert LoRA tensor stops the run, naming it."""
    from safetensors.torch import save_file

    from moe_qlora.export.adapter import AdapterVerificationError

    real_save = runs.save_adapter

    def save_dropping_an_expert_tensor(model, out, **kwargs):
        written = real_save(model, out, **kwargs)
        if Path(out).name == "adapter-best":
            path = Path(written) / "adapter_model.safetensors"
            tensors = load_file(str(path))
            tensors.pop(next(k for k in sorted(tensors) if ".experts." in k))
            save_file(tensors, str(path))
        return written

    monkeypatch.setattr(runs, "save_adapter", save_dropping_an_expert_tensor)
    cfg = config(tmp_path, data={"eval_files": [DATA]}, eval_every=2, keep_best=True, max_steps=2)
    with pytest.raises(AdapterVerificationError, match="adapter-best would not load as trained.*missing from the file"):
        trainer.train(cfg, Console(quiet=True))


def test_eval_fraction_holds_rows_out_of_training(tmp_path):
    result = trainer.train(config(tmp_path, data={"eval_fraction": 0.25}, max_steps=2), Console(quiet=True))
    assert result.steps == 2 and "eval_loss" in records(tmp_path)[-1]


def test_eval_files_and_fraction_together_are_refused():
    with pytest.raises(ConfigError, match="eval_files or data.eval_fraction"):
        config("x", data={"eval_files": [DATA], "eval_fraction": 0.1})
