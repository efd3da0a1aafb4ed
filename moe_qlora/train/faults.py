"""What a run does when a step cannot finish (out of memory, a reward function that fails): the step in flight
is abandoned, the last completed step is checkpointed if it is not already, and the run stops with one message
that says what happened, where (position.POSITION), and what to change. Shared by `train` and `grpo`.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import torch

from moe_qlora.train.position import POSITION, restore_rng_states


class StepFailed(Exception):
    """A step that could not finish; the message says why and where the run can resume (exit code 1)."""


def device_memory(device: torch.device) -> tuple[float, float, str]:
    """(peak GiB used, total GiB, what) on the run's device: CUDA's allocator peak and the card's memory, or on
    the CPU the process's peak resident set and the machine's memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return torch.cuda.max_memory_allocated(device) / 2**30, total / 2**30, torch.cuda.get_device_name(device)
    from moe_qlora.common.memory import peak_rss_mib

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return peak_rss_mib() / 1024, total / 2**30, "host memory"


# The knobs an out-of-memory run can turn, in the order the message tries them: (key, the value to set given
# the config, whether it applies). Their planned saving decides the order they are printed in.
KNOBS: list[tuple[str, Callable, Callable]] = [
    ("train.micro_batch_size", lambda c: max(1, c.train.micro_batch_size // 2), lambda c: c.train.micro_batch_size > 1),
    ("data.max_seq_len", lambda c: max(16, c.data.max_seq_len // 2), lambda c: c.data.max_seq_len > 16),
    ("train.optimizer", lambda c: "adamw_8bit", lambda c: c.train.optimizer == "adamw"),
    ("train.optimizer_in_backward", lambda c: "true", lambda c: not c.train.optimizer_in_backward),
    ("train.loss_chunk_tokens", lambda c: 1024, lambda c: c.train.loss_chunk_tokens == 0),
    ("train.gradient_checkpointing", lambda c: "true", lambda c: not c.train.gradient_checkpointing),
]


def knob_savings(cfg, model_path: str, device: str) -> tuple[float | None, list[tuple[str, float]]]:
    """(planned GiB of `cfg`, [(key=value, planned GiB saved)] largest saving first) from `moe-qlora plan`'s
    arithmetic; a knob the config validators refuse for this run (e.g. optimizer_in_backward with grad_accum
    > 1) is left out. (None, []) when the plan cannot be made."""
    from moe_qlora.config.load import deep_merge, parse_overrides, validate_config
    from moe_qlora.model.budget import meta_model
    from moe_qlora.model.plan import plan_run

    try:
        model = meta_model(model_path, cfg.model.trust_remote_code)
        base = plan_run(cfg, name_or_path=model_path, device=device, model=model).total / 2**30
    except Exception:  # planning is advice: the run's own failure is what must be reported
        return None, []
    raw = cfg.model_dump(mode="json")
    savings = []
    for key, value_of, applies in KNOBS:
        if not applies(cfg):
            continue
        setting = f"{key}={value_of(cfg)}"
        try:
            changed = validate_config(deep_merge(raw, parse_overrides([setting])))
            total = plan_run(changed, name_or_path=model_path, device=device, model=model).total / 2**30
        except Exception:
            continue
        if base - total > 0:
            savings.append((setting, base - total))
    return base, sorted(savings, key=lambda s: -s[1])


def out_of_memory_message(cfg, model_path: str, device: torch.device, step: int, phase_name: str,
                          saved: str) -> str:  # fmt: skip
    """The message of a run stopped by torch.OutOfMemoryError: the step and phase, peak and total memory, what
    `plan` predicted, the knobs in order of planned saving, and where the run resumes."""
    peak, total, what = device_memory(device)
    planned, savings = knob_savings(cfg, model_path, device.type)
    plan_text = f"; moe-qlora plan predicted {planned:.2f} GiB" if planned is not None else ""
    lines = [f"out of memory at step {step} ({phase_name}): peak {peak:.2f} GiB of {total:.2f} GiB ({what})"
             f"{plan_text}. {saved}."]  # fmt: skip
    if savings:
        lines.append("To fit, try (planned saving, largest first; --set KEY=VALUE):")
        lines += [f"  {setting:<40} -{saving:.2f} GiB" for setting, saving in savings]
    return "\n".join(lines)


def release_after_failure(model, optimizer) -> None:
    """Drop the abandoned step's gradients and cached blocks, so the checkpoint that follows has room."""
    optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def checkpoint_completed(done, checkpoint, out, *, consistent: bool) -> str:
    """Checkpoint the last completed step `done` unless it is already (or there is none, or the weights in memory
    are past it); returns the sentence saying where the run can resume."""
    from moe_qlora.train.checkpoint import latest_valid_checkpoint

    existing = out / "checkpoints" / f"step-{done.step:08d}"
    if done.step and consistent and not existing.is_dir():
        if POSITION.rng is not None:
            restore_rng_states(POSITION.rng)
        checkpoint(done)
        return f"Step {done.step}, the last completed, is checkpointed in {existing}"
    if done.step and existing.is_dir():
        return f"Step {done.step}, the last completed, was already checkpointed in {existing}"
    found = latest_valid_checkpoint(out)
    if not consistent and done.step:
        why = "the optimizer had already updated part of the weights in this step, so they were not saved"
        where = f"the last checkpoint is {found}" if found else "no checkpoint was written yet"
        return f"Not checkpointed: {why}; {where}"
    return "No step had completed: nothing to checkpoint"


def stop_on_out_of_memory(cfg, model_path: str, out, training: dict, done, checkpoint, stepper=None) -> StepFailed:
    """After torch.OutOfMemoryError in a step: the half-stepped tensors restored (optimizer_in_backward), the
    step's gradients and cached blocks released, the last completed step checkpointed; the StepFailed to raise."""
    step, where = POSITION.step, POSITION.phase
    consistent = not POSITION.updated
    if stepper is not None:
        stepper.finish(False)  # with undo (always on with optimizer_in_backward): every stepped tensor restored
        consistent = True
    release_after_failure(training["model"], training["optimizer"])
    saved = checkpoint_completed(done, checkpoint, out, consistent=consistent)
    device = next(training["model"].parameters()).device
    return StepFailed(out_of_memory_message(cfg, model_path, device, step, where, saved))
