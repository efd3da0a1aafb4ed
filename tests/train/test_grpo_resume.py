"""Exact resume of `moe-qlora grpo` after a crash: real subprocesses and real SIGKILL, at a random step and
in the middle of a checkpoint write. Sampling, LoRA dropout and the clipped multi-pass update all draw on
or depend on restored state, so the resumed run must sample the same completions and end tensor-equal."""

import json
import random
import signal
from pathlib import Path

import pytest

from helpers.crash import assert_same_run as same_run
from helpers.crash import cli_command, kill_after_steps, run_cli, signal_after_steps

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY = 12, 3
CONFIG = f"""# moe-qlora grpo --config this.yaml
model: {{name_or_path: "builtin:tiny-mixtral"}}
lora: {{rank: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}}
data: {{train_files: ["{ROOT / "data" / "demo_grpo.jsonl"}"], max_seq_len: 32}}
train: {{max_steps: {STEPS}, epochs: 2, micro_batch_size: 8, lr: 5.0e-3, warmup_steps: 1, save_every: {SAVE_EVERY},
         keep_checkpoints: 2, seed: 5}}
grpo:
  prompts_per_step: 3
  group_size: 4
  max_new_tokens: 5
  passes: 2
  kl_coef: 0.05
  rewards: [{{function: regex, args: {{pattern: "[0-9]", mode: share}}}}, {{function: exact_match, weight: 0.5}}]
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "grpo.yaml"
    path.write_text(CONFIG)
    return path


def command(config, out, *extra):
    return cli_command("grpo", config, out, *extra)


def run(config, out, env, *extra, failpoint=None):
    return run_cli("grpo", config, out, env, *extra, failpoint=failpoint)


def history(out: Path):
    """What must be identical: per-step loss, rewards and KL, and every sampled completion with its advantage."""
    metrics = [
        (r["step"], r["loss"], r["reward_mean"], r["kl"], r["grad_norm"])
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    ]
    rollouts = [
        (r["step"], r["completion"], r["advantage"])
        for r in map(json.loads, (out / "rollouts.jsonl").read_text().splitlines())
    ]
    return metrics, rollouts


def assert_same_run(out: Path, reference: Path):
    same_run(out, reference, history)


@pytest.fixture(scope="module")
def reference(config, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run(config, out, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, rollouts = history(out)
    assert [m[0] for m in metrics] == list(range(1, STEPS + 1))
    assert len(rollouts) == (10 * 3 + 2 + 3) * 4  # 32 prompts: 10 steps of 3, one of 2 ending epoch 0, one of 3
    return out


def test_grpo_sigkill_at_a_random_step_then_resume_is_exact(config, env, reference, tmp_path):
    kill_after = random.Random(1).randint(SAVE_EVERY + 1, STEPS - 2)
    assert kill_after_steps(command(config, tmp_path), env, tmp_path, kill_after) < STEPS
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert_same_run(tmp_path, reference)


def test_grpo_sigkill_while_writing_a_checkpoint_then_resume_is_exact(config, env, reference, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write@6")
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "checkpoints" / "step-00000006").exists()
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 3" in proc.stdout
    assert_same_run(tmp_path, reference)


def test_grpo_sigterm_checkpoints_exits_143_and_resume_is_exact(config, env, reference, tmp_path):
    """A preemptible GPU's SIGTERM during GRPO with no periodic checkpoint: the step in flight finishes, a
    checkpoint is written, exit 143; the resumed run samples the same completions and ends tensor-equal."""
    off = ["--set", "train.save_every=0", "--set", "train.save_every_minutes=0"]
    proc = signal_after_steps(command(config, tmp_path, *off), env, tmp_path, 4, signal.SIGTERM)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "resume with: moe-qlora grpo --config" in " ".join(proc.stderr.split())
    assert len(list((tmp_path / "checkpoints").iterdir())) == 1
    proc = run(config, tmp_path, env, "--resume", *off)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(tmp_path, reference)
