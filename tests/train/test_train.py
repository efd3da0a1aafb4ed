"""Training: accumulation and checkpointing change no gradient; the demo runs from the CLI and learns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.sections import LoraSection
from moe_qlora.data.examples import Example, collate
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.train.sft import accumulate_gradients

ROOT = Path(__file__).resolve().parents[2]


def model_with_adapters(path):
    lora = LoraSection(rank=4, target_modules=["q_proj", "o_proj"])
    model = attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)
    with torch.no_grad():  # non-zero B so that every factor gets a gradient
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))
    return model


def examples(n=4):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 6 + 3 * i  # ragged: padding in the batched case
        ids = torch.randint(10, 200, (length,), generator=g).tolist()
        out.append(Example(ids, [-100] * 3 + ids[3:], f"x:{i}"))
    return out


def grads_of(model, batches):
    model.zero_grad(set_to_none=True)
    loss, _, _ = accumulate_gradients(model, batches)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_one_batch_of_4_equals_4_accumulated_micro_batches(tiny_mixtral_dir):
    model = model_with_adapters(tiny_mixtral_dir)
    ex = examples()
    loss_a, big = grads_of(model, [collate(ex, 0)])
    loss_b, small = grads_of(model, [collate([e], 0) for e in ex])
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=1e-5, rtol=1e-4, msg=name)


def test_gradient_checkpointing_changes_no_gradient(tiny_mixtral_dir):
    model = model_with_adapters(tiny_mixtral_dir)
    model.train()
    batch = [collate(examples(), 0)]
    configure_checkpointing(model, enabled=False, interval=1)
    _, plain = grads_of(model, batch)
    assert configure_checkpointing(model, enabled=True, interval=2) == 1  # layers 0 of 2
    _, ckpt = grads_of(model, batch)
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


def test_demo_trains_from_the_cli_loss_falls_and_adapter_is_healthy(demo_run):
    """The README's demo command, run as a user would (conftest's demo_run: a subprocess of the installed CLI)."""
    assert demo_run.proc.returncode == 0, demo_run.proc.stderr[-2000:]
    records = [json.loads(line) for line in (demo_run.out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == records[-1]["step"] == 210
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.3 * first, (first, last)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "epoch"} <= set(records[0])
    # the attention it ran, said at the start and recorded with the run (Mixtral: SDPA)
    assert json.loads((demo_run.out / "run_choices.json").read_text())["attention"] == "sdpa"
    assert "attention: sdpa" in demo_run.proc.stdout
    check = subprocess.run(
        [sys.executable, "-m", "moe_qlora", "check-norms", str(demo_run.out / "adapter")],
        cwd=ROOT,
        env=demo_run.env,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout[-3000:]


def test_cli_user_errors_exit_2_with_one_sentence(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: x\ndata:\n  train_files: [a.jsonl]\nlora:\n  rnk: 4\n")
    result = CliRunner().invoke(app, ["train", "--config", str(bad)])
    assert result.exit_code == 2
    assert "unknown key 'lora.rnk'" in result.output and "Traceback" not in result.output
    good = tmp_path / "good.yaml"
    data = ROOT / "data" / "demo_sft.jsonl"
    good.write_text(f"model:\n  name_or_path: {tmp_path / 'nope'}\ndata:\n  train_files: [{data}]\n")
    result = CliRunner().invoke(app, ["train", "--config", str(good)])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_same_seed_same_adapter_and_losses_other_seed_differs(tmp_path):
    """Bitwise reproducible on the CPU, including LoRA init and dropout; the seed really matters."""
    from rich.console import Console
    from safetensors.torch import load_file

    from moe_qlora.config.load import validate_config
    from moe_qlora.train.sft import train

    def run(seed, name):
        cfg = validate_config(
            {
                "model": {"name_or_path": "builtin:tiny-mixtral"},
                "lora": {"rank": 4, "dropout": 0.1, "target_modules": ["q_proj"]},
                "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")], "max_seq_len": 48},
                "train": {"max_steps": 5, "micro_batch_size": 4, "lr": 5e-3, "seed": seed},
                "output": {"dir": str(tmp_path / name)},
            }
        )
        result = train(cfg, Console(quiet=True))
        return result.losses, load_file(str(result.adapter_dir / "adapter_model.safetensors"))

    (la, a), (lb, b), (lc, c) = run(0, "a"), run(0, "b"), run(1, "c")
    assert la == lb and all(torch.equal(a[k], b[k]) for k in a)
    assert la != lc and any(not torch.equal(a[k], c[k]) for k in a)
