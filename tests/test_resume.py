"""Exact resume after a crash: real subprocesses, real SIGKILL, compared tensor for tensor with a run that was
never interrupted (same seed). LoRA dropout is on, so the RNG state has to come back exactly too."""

import json
import random
import signal
from pathlib import Path

import pytest
import torch
from crash import assert_same_adapter, cli_command, isolated_env, kill_after_steps, run_cli
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_EVERY = 24, 4
CONFIG = f"""# moe-qlora train --config this.yaml
model: {{name_or_path: "builtin:tiny-mixtral"}}
lora: {{rank: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}}
data: {{train_files: ["{ROOT / "data" / "demo_sft.jsonl"}"], max_seq_len: 48}}
train: {{max_steps: {STEPS}, epochs: 10, micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, warmup_steps: 2,
         save_every: {SAVE_EVERY}, keep_checkpoints: 2, seed: 3}}
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return isolated_env(tmp_path_factory)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "resume.yaml"
    path.write_text(CONFIG)
    return path


def command(config, out, *extra):
    return cli_command("train", config, out, *extra)


def run(config, out, env, *extra, failpoint=None):
    return run_cli("train", config, out, env, *extra, failpoint=failpoint)


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def assert_same_run(out: Path, reference: Path):
    assert_same_adapter(out, reference)
    assert losses(out) == losses(reference)


@pytest.fixture(scope="module")
def reference(config, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run(config, out, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in losses(out)] == list(range(1, STEPS + 1))
    return out


def test_sigkill_at_a_random_step_then_resume_is_exact(config, env, reference, tmp_path):
    kill_after = random.Random(0).randint(SAVE_EVERY + 1, STEPS - 3)  # lines in metrics.jsonl: steps done
    done = kill_after_steps(command(config, tmp_path, "--debug"), env, tmp_path, kill_after)
    assert done < STEPS
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert_same_run(tmp_path, reference)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(config, env, reference, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write@8")
    assert proc.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "step-00000004" / "manifest.json").exists()
    assert not (checkpoints / "step-00000008").exists()
    assert list(checkpoints.glob(".step-00000008.tmp-*")), "the half-written folder is left under a temporary name"
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4" in proc.stdout
    assert not list(checkpoints.glob(".step-*.tmp-*"))
    assert_same_run(tmp_path, reference)


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(config, env, reference, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write@12")
    assert proc.returncode == -signal.SIGKILL
    newest = tmp_path / "checkpoints" / "step-00000008" / "trainable.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipping checkpoint" in proc.stderr and "does not match its sha256" in proc.stderr
    assert "at step 4" in proc.stdout
    assert_same_run(tmp_path, reference)


def test_resuming_with_another_config_is_refused_unless_asked(config, env, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write@8")
    assert proc.returncode == -signal.SIGKILL
    proc = run(config, tmp_path, env, "--resume", "--set", "train.lr=1e-3")
    assert proc.returncode == 2
    assert "configuration differs" in proc.stderr and "Traceback" not in proc.stderr
    proc = run(config, tmp_path, env, "--resume-anyway", "--set", "train.lr=1e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout


def test_a_failed_save_stops_the_run_and_leaves_the_previous_checkpoint(config, env, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write:enospc@8")
    assert proc.returncode not in (0, -signal.SIGKILL)
    assert "No space left on device" in proc.stderr
    checkpoints = tmp_path / "checkpoints"
    assert sorted(d.name for d in checkpoints.iterdir()) == ["step-00000004"]  # no step-8, no temporary folder
    from moe_qlora.checkpoint import verify

    assert verify(checkpoints / "step-00000004") is None


def test_8bit_adamw_stepped_in_the_backward_resumes_exactly(env, tmp_path_factory):
    """bitsandbytes' 8-bit moments (uint8 codes, scales, maps, an int step) go through the safetensors
    checkpoint and come back in place: the resumed adapter equals an uninterrupted run's, bit for bit."""
    steps = 12
    path = tmp_path_factory.mktemp("cfg8") / "resume8.yaml"
    text = CONFIG.replace(f"max_steps: {STEPS}", f"max_steps: {steps}").replace("grad_accum: 2", "grad_accum: 1")
    text = text.replace(f"save_every: {SAVE_EVERY}, ", "")
    eight_bit = "seed: 3, save_every: 3, optimizer: adamw_8bit, optimizer_in_backward: true}"
    path.write_text(text.replace("seed: 3}", eight_bit))
    reference = tmp_path_factory.mktemp("reference8")
    assert run(path, reference, env).returncode == 0
    out = tmp_path_factory.mktemp("killed8")
    assert kill_after_steps(command(path, out, "--debug"), env, out, 7) < steps
    moments = load_file(str(sorted((out / "checkpoints").iterdir())[-1] / "optimizer.safetensors"))
    assert any(v.dtype == torch.uint8 for v in moments.values())  # the state really is 8-bit
    proc = run(path, out, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(out, reference)
