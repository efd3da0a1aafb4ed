"""Faults a long run meets, met for real where this machine allows: a torn metrics line, a full disk (a real
tmpfs when the test can mount one: CI runs as root), out of memory (injected: torch.OutOfMemoryError exists on
CPU builds too), a reward function that raises or hangs. Each stops with one message naming what, where and what
to do, keeps what was written, and resumes exactly."""

import errno
import logging
import shutil
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from moe_qlora.common.fileio import DiskFullError
from moe_qlora.common.reporting import MetricsError, MetricsLog, read_jsonl
from moe_qlora.model.distributed import SINGLE
from moe_qlora.train.checkpoint import verify
from moe_qlora.train.faults import attempt, local_stretch

from helpers.crash import assert_same_adapter, assert_same_run, logged_losses, run_cli

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
CONFIG = f"""# moe-qlora train --config this.yaml
model: {{name_or_path: "builtin:tiny-mixtral"}}
lora: {{rank: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}}
data: {{train_files: ["{ROOT / "data" / "demo_sft.jsonl"}"], max_seq_len: 48}}
train: {{max_steps: {STEPS}, epochs: 10, micro_batch_size: 4, grad_accum: 1, lr: 5.0e-3, warmup_steps: 2,
         save_every: 4, keep_checkpoints: 3, seed: 3}}
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "faults.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def reference(config, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = run_cli("train", config, out, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# ------------------------------------------------------------------------------------------------ metrics


def test_a_torn_last_line_is_dropped_with_a_warning_and_elsewhere_is_an_error(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="moe_qlora.common.reporting"):
        assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert f"{path}, line 3: torn" in caplog.text
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl, line 2: not a JSON object"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "missing.jsonl") == [] and read_jsonl(path.with_name("e.jsonl")) == []


def test_the_log_opens_past_a_torn_tail_and_writes_whole_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"ste')
    log = MetricsLog(path)
    log.write({"step": 2})
    log.close()
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_full_disk_while_logging_names_the_log(tmp_path, monkeypatch):
    """The stand-in raises what an unbuffered write raises on a full disk: OSError(ENOSPC), no filename."""
    log = MetricsLog(tmp_path / "metrics.jsonl")

    class FullFile:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log, "_file", FullFile())
    with pytest.raises(DiskFullError, match=r"writing .*metrics.jsonl \(it needs 12 B, .* free there\)"):
        log.write({"step": 1})


def killed_at_step_6(config, env, tmp_path) -> Path:
    out = tmp_path / "killed"
    proc = run_cli("train", config, out, env, failpoint="checkpoint-write@8")  # SIGKILL while writing step 8's
    assert proc.returncode == -signal.SIGKILL
    return out


@pytest.mark.parametrize("damage", ["torn", "empty", "missing"])
def test_resume_is_exact_after_the_metrics_log_is_damaged(config, env, reference, tmp_path, damage):
    """The issue's reproduction: a run killed after its step-4 checkpoint (steps 5-8 logged), metrics.jsonl's last
    40 bytes cut (a torn line), emptied or deleted; --resume continues at step 5 and ends as the uninterrupted run,
    adapter tensor for tensor and losses of the steps it logged."""
    out = killed_at_step_6(config, env, tmp_path)
    metrics = out / "metrics.jsonl"
    if damage == "torn":
        metrics.write_bytes(metrics.read_bytes()[:-40])
    elif damage == "empty":
        metrics.write_text("")
    else:
        metrics.unlink()
    proc = run_cli("train", config, out, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "Traceback" not in proc.stderr
    if damage == "torn":
        assert "metrics.jsonl, line" in proc.stderr and "torn" in proc.stderr
        assert_same_run(out, reference)
    else:  # the records of steps 1-4 are gone with the file; those written after the resume are the reference's
        assert_same_adapter(out, reference)
        assert logged_losses(out) == [(s, loss) for s, loss in logged_losses(reference) if s > 4]


# ------------------------------------------------------------------------------------------------ full disk


@pytest.fixture
def small_disk(tmp_path):
    """A real 1.4 MB tmpfs (as root), or None where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1400k", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_stops_the_run_with_one_message_and_keeps_the_last_checkpoint(config, env, small_disk, tmp_path):
    """The issue's reproduction, output.dir on a 1.4 MB tmpfs (checkpoints of ~0.4 MB each, every 5 steps):
    one sentence naming the path, what it needed and what is free, the intact checkpoint and the resume
    command; exit 1, no traceback. Where no tmpfs can be mounted, the failpoint raises what safetensors raises."""
    out = (small_disk or tmp_path) / "run"
    failpoint = None if small_disk else "checkpoint-write:enospc@10"
    proc = run_cli(
        "train",
        config,
        out,
        env,
        "--set",
        "train.save_every=5",
        "--set",
        "train.keep_checkpoints=5",
        "--set",
        "train.max_steps=40",
        failpoint=failpoint,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "error: no space left on device writing" in proc.stderr
    assert "free there" in proc.stderr and "resume with: moe-qlora train --config" in proc.stderr
    kept = sorted((out / "checkpoints").glob("step-*"))
    assert kept and all(verify(c) is None for c in kept)
    assert f"The last good checkpoint, {kept[-1]}, is intact" in proc.stderr.replace("\n", "")
    assert not list((out / "checkpoints").glob(".step-*"))  # no half-written folder left
    if small_disk:  # older checkpoints are there to free: the advice names the setting that frees them
        assert "add --set train.keep_checkpoints=1 to the resume" in " ".join(proc.stderr.split())
    # The advice that follows works: with fewer checkpoints kept, the resume makes room before it writes (pruning
    # only after the new one is written, it filled the same disk again at its first save).
    sets = ["--set", "train.save_every=5", "--set", "train.keep_checkpoints=1", "--set", "train.max_steps=40"]
    resumed = run_cli("train", config, out, env, "--resume", *sets)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {kept[-1]}" in " ".join(resumed.stdout.split())
    assert [c.name for c in (out / "checkpoints").glob("step-*")] == ["step-00000040"]


def test_export_to_a_full_disk_is_one_sentence(reference, env, small_disk, tmp_path, monkeypatch):
    """Export of the reference adapter into a full filesystem (real tmpfs, filled first), or with save_file
    raising safetensors' own SafetensorError where no tmpfs can be mounted."""
    if small_disk is None:
        pytest.skip("needs root to mount a tmpfs; the run above covers the stand-in")
    (small_disk / "filler").write_bytes(b"\0" * (1400 * 1024 - 8192))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_qlora",
            "export",
            str(reference / "adapter"),
            "--format",
            "gguf",
            "--out",
            str(small_disk / "a.gguf"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on device writing {small_disk / 'a.gguf'}" in proc.stderr.replace("\n", "")
    assert not list(small_disk.glob(".a.gguf.tmp-*"))


# ------------------------------------------------------------------------------------------------ out of memory


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_out_of_memory_checkpoints_the_last_step_and_resumes_exactly(config, env, reference, tmp_path, phase):
    out = tmp_path / "oom"
    proc = run_cli("train", config, out, env, env_extra={"MOE_QLORA_INJECT_OOM": f"7:{phase}"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.replace("\n", " ")
    assert f"out of memory at step 7 ({phase}): peak" in message and "host memory" in message
    assert "moe-qlora plan predicted" in message and "train.micro_batch_size=2" in message
    assert "Step 6, the last completed, is checkpointed" in message and "resume with:" in message
    assert verify(out / "checkpoints" / "step-00000006") is None
    proc = run_cli("train", config, out, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(out, reference)


def test_out_of_memory_in_the_optimizer_step_keeps_the_earlier_checkpoint(config, env, reference, tmp_path):
    """The optimizer may have updated part of the weights when it ran out: those are not saved; the run resumes
    from step 4's checkpoint and still ends on the reference."""
    out = tmp_path / "oom-optimizer"
    proc = run_cli("train", config, out, env, env_extra={"MOE_QLORA_INJECT_OOM": "7:optimizer"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Not checkpointed: the optimizer had already updated part of the weights" in proc.stderr.replace("\n", " ")
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step-00000004"]
    assert run_cli("train", config, out, env, "--resume").returncode == 0
    assert_same_run(out, reference)


def test_out_of_memory_with_optimizer_in_backward_restores_the_half_stepped_tensors(config, env, tmp_path):
    """Stepped inside the backward, some tensors are updated when the memory runs out: they are restored before
    the last completed step is saved, so the resumed run ends on the uninterrupted one."""
    extra = ("--set", "train.optimizer_in_backward=true")
    reference = tmp_path / "reference"
    assert run_cli("train", config, reference, env, *extra).returncode == 0
    out = tmp_path / "oom"
    proc = run_cli(
        "train", config, out, env, *extra, env_extra={"MOE_QLORA_INJECT_OOM": "7:optimizer (in backward)#3"}
    )  # two stepped
    assert proc.returncode == 1 and "Step 6, the last completed, is checkpointed" in proc.stderr.replace("\n", " ")
    assert run_cli("train", config, out, env, *extra, "--resume").returncode == 0
    assert_same_run(out, reference)


def failing_step(alive: list):
    """A step that holds an 'activation' (only its frame refers to it) when it runs out of memory."""
    activations = torch.ones(1024)
    alive.append(weakref.ref(activations))
    raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")


def test_a_step_that_ran_out_of_memory_leaves_nothing_of_its_frames_to_the_checkpoint():
    """Issue 43: the checkpoint after a failure ran inside the `except`, so the traceback kept the step's
    activations alive. The loop now gets the failure back once the step is left: its tensors are gone. Control:
    the exception kept as it was caught (with its traceback) keeps them."""
    alive = []
    result, failure = attempt(SINGLE, local_stretch, SINGLE, failing_step, alive)
    assert result is None and failure.agreed and isinstance(failure.error, torch.OutOfMemoryError)
    assert alive[0]() is None
    try:
        failing_step(alive)
    except torch.OutOfMemoryError as exc:
        kept = exc
    assert alive[1]() is not None
    del kept
    with pytest.raises(ValueError, match="a bug"):  # one process: what is not a fault raises as it is
        attempt(SINGLE, local_stretch, SINGLE, lambda: int("a bug"))


# ------------------------------------------------------------------------------------------------ rewards

GRPO = f"""# moe-qlora grpo --config this.yaml
model: {{name_or_path: "builtin:tiny-mixtral"}}
lora: {{rank: 4, alpha: 8}}
data: {{train_files: ["{ROOT / "data" / "demo_grpo.jsonl"}"], max_seq_len: 32}}
train: {{max_steps: 6, epochs: 2, micro_batch_size: 8, lr: 5.0e-3, warmup_steps: 1, seed: 5}}
grpo:
  prompts_per_step: 3
  group_size: 4
  max_new_tokens: 3
  reward_timeout_s: 2
  rewards: [{{function: exact_match}}, {{function: "REWARD_FILE:flaky"}}]
"""
FLAKY = """import time
calls = []
def flaky(prompts, completions, **columns):
    calls.append(len(completions))
    if len(calls) > 2:  # the first two steps score, then the service goes away
        if "MODE" == "hang":
            time.sleep(120)
        raise ValueError("reward server unreachable")
    return [0.5] * len(completions)
"""


def grpo_run(tmp_path, env, mode, *extra):
    reward = tmp_path / "flaky.py"
    reward.write_text(FLAKY.replace("MODE", mode))
    config = tmp_path / "grpo.yaml"
    config.write_text(GRPO.replace("REWARD_FILE", str(reward)))
    out = tmp_path / "run"
    return run_cli("grpo", config, out, env, *extra), out


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_failing_reward_function_stops_the_run_naming_it_after_a_checkpoint(env, tmp_path, mode):
    proc, out = grpo_run(tmp_path, env, mode)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.replace("\n", " ")
    assert "flaky'" in message and "prompt 0 of step 3" in message and "demo_grpo.jsonl" in message
    assert ("reward server unreachable" if mode == "raise" else "did not return within") in message
    assert "Step 2, the last completed, is checkpointed" in message and "resume with:" in message
    assert verify(out / "checkpoints" / "step-00000002") is None


def test_reward_errors_zero_scores_failing_samples_and_counts_them(env, tmp_path):
    proc, out = grpo_run(tmp_path, env, "raise", "--set", "grpo.reward_errors=zero")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r.get("reward_errors", 0) for r in records] == [0, 0, 12, 12, 12, 12]
    assert "samples score 0 (grpo.reward_errors: zero)" in proc.stderr
    shutil.rmtree(out)
