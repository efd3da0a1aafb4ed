"""Exact resume after a crash: real subprocesses, real SIGKILL, compared tensor for tensor with a run that was
never interrupted (same seed). LoRA dropout is on, so the RNG state has to come back exactly too."""

import random
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_qlora.common.fileio import current_umask

from helpers.crash import assert_same_run, cli_command, kill_after_steps, logged_losses, run_cli, signal_after_steps
from helpers.once import once_per_session

ROOT = Path(__file__).resolve().parents[2]
STEP_NAME = re.compile(r"^step-\d{8}$")
STEPS, SAVE_EVERY = 24, 4
CONFIG = f"""# moe-qlora train --config this.yaml
model: {{name_or_path: "builtin:tiny-mixtral"}}
lora: {{rank: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}}
data: {{train_files: ["{ROOT / "data" / "demo_sft.jsonl"}"], max_seq_len: 48}}
train: {{max_steps: {STEPS}, epochs: 10, micro_batch_size: 4, grad_accum: 2, lr: 5.0e-3, warmup_steps: 2,
         save_every: {SAVE_EVERY}, keep_checkpoints: 2, seed: 3}}
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "resume.yaml"
    path.write_text(CONFIG)
    return path


def command(config, out, *extra):
    return cli_command("train", config, out, *extra)


def run(config, out, env, *extra, failpoint=None):
    return run_cli("train", config, out, env, *extra, failpoint=failpoint)


@pytest.fixture
def reference(config, env, tmp_path_factory):
    """The uninterrupted run, made once a session (helpers.once: whichever xdist worker asks first)."""
    folder, proc = once_per_session(tmp_path_factory, "resume-reference", lambda f: run(config, f / "run", env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = folder / "run"
    assert [s for s, _ in logged_losses(out)] == list(range(1, STEPS + 1))
    return out


def test_sigkill_at_a_random_step_then_resume_is_exact(config, env, reference, tmp_path):
    kill_after = random.Random(0).randint(SAVE_EVERY + 1, STEPS - 3)  # lines in metrics.jsonl: steps done
    done = kill_after_steps(command(config, tmp_path, "--debug"), env, tmp_path, kill_after)
    assert done < STEPS
    proc = run(config, tmp_path, env, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert_same_run(tmp_path, reference)


def test_the_summarys_best_loss_counts_the_steps_before_a_resume(tmp_path):
    """The summary's best was this invocation's steps alone: after a resume, the resumed part's. It is the whole
    run's, read from metrics.jsonl (which holds the steps before the resume too)."""
    from rich.console import Console

    from moe_qlora.common.reporting import NoReporters
    from moe_qlora.train.sft import SftRecipe

    logged = [(1, 3.0), (2, 0.5), (3, 2.0), (4, 1.5)]  # steps 1-2 before the resume, 3-4 after
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {x}}}\n' for s, x in logged))
    recipe = object.__new__(SftRecipe)  # what result() reads of a recipe that resumed at step 2 and ran 2 steps
    recipe.command, recipe.tokens, recipe.history = "train", 100, [2.0, 1.5]
    recipe.metrics, recipe.console = NoReporters(tmp_path), Console(record=True, width=200)
    recipe.result(tmp_path / "adapter", seconds=1.0)
    assert "1.5000 at the end, best 0.5000" in recipe.console.export_text()
    (tmp_path / "metrics.jsonl").unlink()  # control: without the run's log, the resumed steps' best
    recipe.console = Console(record=True, width=200)
    recipe.result(tmp_path / "adapter", seconds=1.0)
    assert "best 1.5000" in recipe.console.export_text()


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
    assert "(train.lr 0.005 -> 0.001)" in " ".join(proc.stderr.split())  # the key that changed, old -> new
    proc = run(config, tmp_path, env, "--resume-anyway", "--set", "lora.rank=8")  # another LoRA: never resumable
    said = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"\(\d+(, \d+)*\) saved, \(\d+(, \d+)*\) now; lora\.rank changed\?", said), said
    assert "start a new run (another output.dir)" in said
    proc = run(config, tmp_path, env, "--resume-anyway", "--set", "train.lr=1e-3")  # the checkpoint left intact
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    proc = run(config, tmp_path / "new-run", env, "--set", "lora.rank=8")  # the advice followed: it trains
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_failed_save_stops_the_run_and_leaves_the_previous_checkpoint(config, env, tmp_path):
    proc = run(config, tmp_path, env, failpoint="checkpoint-write:enospc@8")  # safetensors' SafetensorError
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no space left on device writing" in proc.stderr.replace("\n", " ")
    checkpoints = tmp_path / "checkpoints"
    assert sorted(d.name for d in checkpoints.iterdir()) == ["step-00000004"]  # no step-8, no temporary folder
    from moe_qlora.train.checkpoint import verify

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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_exits_130_or_143_and_resume_is_exact(config, env, reference, tmp_path, sig):
    """Ctrl-C or a scheduler's SIGTERM with no periodic checkpointing at all: the run finishes its step,
    writes a checkpoint, says how to resume and exits 128 + signal; the resumed run equals an uninterrupted
    one and metrics.jsonl holds each step once."""
    off = ["--set", "train.save_every=0", "--set", "train.save_every_minutes=0"]
    proc = signal_after_steps(command(config, tmp_path, *off), env, tmp_path, 6, sig)
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    message = " ".join(proc.stderr.split())
    step = int(message.split("interrupted at step ")[1].split(";")[0])
    assert 6 <= step < STEPS
    assert f"resume with: moe-qlora train --config {config} --set output.dir={tmp_path}" in message
    assert message.rstrip().endswith("--resume")
    assert [d.name for d in (tmp_path / "checkpoints").iterdir()] == [f"step-{step:08d}"]
    proc = run(config, tmp_path, env, "--resume", *off)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{step:08d}'}" in " ".join(proc.stdout.split())
    assert_same_run(tmp_path, reference)


def test_a_second_ctrl_c_stops_at_once_without_a_partial_checkpoint(config, env, tmp_path):
    off = ["--set", "train.save_every=0", "--set", "train.save_every_minutes=0"]
    # 5 ms apart, so the second signal nearly always lands inside the step. On a fast machine the first stop
    # can still finish its checkpoint before it arrives: then the exit it interrupts ignores it (exit 130 with
    # the checkpoint's message). Either way: 130, no traceback, never a partial checkpoint.
    proc = signal_after_steps(command(config, tmp_path, *off), env, tmp_path, 3, signal.SIGINT, repeat=2, gap=0.005)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "stopped at once" in proc.stderr or "checkpoint written" in proc.stderr
    root = tmp_path / "checkpoints"
    leftovers = [d.name for d in root.iterdir()] if root.exists() else []
    assert all(STEP_NAME.match(n) for n in leftovers), leftovers  # finished checkpoints only, never a temp folder


def test_resume_from_a_named_checkpoint_sets_newer_ones_aside(config, env, reference, tmp_path):
    """--resume PATH goes back to that checkpoint; the newer ones (another continuation) are renamed, not
    deleted and never pruned or picked by a later --resume; the run ends equal to an uninterrupted one."""
    proc = run(config, tmp_path, env, "--set", "train.keep_checkpoints=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    early = tmp_path / "checkpoints" / f"step-{SAVE_EVERY:08d}"
    proc = run(config, tmp_path, env, "--resume", str(early), "--set", "train.keep_checkpoints=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {early} at step {SAVE_EVERY}" in " ".join(proc.stdout.split())
    names = sorted(d.name for d in (tmp_path / "checkpoints").iterdir())
    assert sum(".superseded-" in n for n in names) == STEPS // SAVE_EVERY - 1  # steps 8..24 of the first pass
    assert_same_run(tmp_path, reference)
    proc = run(config, tmp_path, env, "--resume", str(tmp_path / "checkpoints" / "step-99999999"))
    assert proc.returncode == 2 and "no such checkpoint folder" in proc.stderr


def test_an_output_dir_holding_another_run_is_refused_then_moved_aside_with_overwrite(config, env, tmp_path):
    short = ["--set", "train.max_steps=2", "--set", "train.save_every=1", "--set", "train.warmup_steps=0"]
    assert run(config, tmp_path, env, *short).returncode == 0
    first = (tmp_path / "metrics.jsonl").read_text()
    proc = run(config, tmp_path, env, *short)
    assert proc.returncode == 2
    message = " ".join(proc.stderr.split())
    assert "already holds a run (metrics.jsonl, adapter/, 2 checkpoints)" in message
    assert "--resume" in message and "--overwrite" in message
    assert (tmp_path / "metrics.jsonl").read_text() == first  # nothing touched
    proc = run(config, tmp_path, env, *short, "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = [p for p in tmp_path.parent.iterdir() if p.name.startswith(tmp_path.name + ".old-")]
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == first
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2  # the new run's steps, once


def test_a_run_without_a_terminal_prints_plain_progress_lines_and_a_summary(config, env, tmp_path):
    proc = run(
        config,
        tmp_path,
        env,
        "--set",
        "train.max_steps=4",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.log_every=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("train step ")]
    assert [line.split()[2] for line in lines] == ["2/4", "4/4"]
    assert all(" loss " in line and " lr " in line and " tok/s " in line for line in lines)
    assert " ETA " in lines[0]
    out = " ".join(proc.stdout.split())
    assert "done: 4 steps in" in out and "best" in out
    assert f"moe-qlora check-norms {tmp_path / 'adapter'}" in out
    # Folders get what the umask gives (the subprocess inherits this one), not mkdtemp's 0700.
    assert (tmp_path / "adapter").stat().st_mode & 0o777 == 0o777 & ~current_umask()
    assert current_umask() & 0o070 == 0o070 or (tmp_path / "adapter").stat().st_mode & 0o070
