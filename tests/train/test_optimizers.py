"""train.optimizer (torch AdamW, bitsandbytes 8-bit) and train.optimizer_in_backward.

The 8-bit optimizer is compared with bitsandbytes' own on pre-clamped gradients (gclip must mean the same
for every optimizer); the in-backward step with the ordinary one over whole training runs; the undo of a
step whose gradient turns non-finite after other tensors were updated, bit for bit."""

import math
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import ConfigError
from moe_qlora.train import sft as trainer
from moe_qlora.train.optim import ClippedAdamW, ClippedAdamW8bit, StepInBackward, build_optimizer

from helpers.runs import checkpoint_tensors, tiny_run_config


def config(out, **train):
    defaults = {"micro_batch_size": 4, "lr": 5e-3, "schedule": "cosine", "warmup_steps": 1, "seed": 0, "max_steps": 4}
    train = {**defaults, "save_every": 1, "keep_checkpoints": 10, **train}
    return tiny_run_config(out, lora={"target_modules": ["q_proj", "v_proj"]}, **train)


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


# ------------------------------------------------------------------------------------------ 8-bit AdamW


def eight_bit_steps(opt_cls, grads, **kwargs):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8192))
    opt = opt_cls([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def test_gclip_clamps_before_bitsandbytes_8bit_update():
    """ClippedAdamW8bit(gclip) equals bitsandbytes' AdamW8bit fed the clamped gradients, bit for bit; the
    state is really 8-bit. Broken control: unclamped gradients give another result."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(8192, generator=gen) * 3 for _ in range(3)]
    ours, state = eight_bit_steps(ClippedAdamW8bit, grads, gclip=0.5)
    theirs, _ = eight_bit_steps(bnb.optim.AdamW8bit, [g.clamp(-0.5, 0.5) for g in grads])
    unclamped, _ = eight_bit_steps(bnb.optim.AdamW8bit, grads)
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, unclamped)


def test_8bit_adamw_tracks_fp32_adamw():
    """Block-wise 8-bit moments give nearly the fp32 update. After 3 steps of lr 1e-2 (each element moves
    up to ~3e-2), the mean difference is under 2% of the mean movement and the largest under 15% of 3 lr
    (an element whose second moment is tiny amplifies the moments' quantization error)."""
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(8192, generator=gen) for _ in range(3)]
    eight, _ = eight_bit_steps(ClippedAdamW8bit, grads)
    full, _ = eight_bit_steps(ClippedAdamW, grads, foreach=False)
    start, _ = eight_bit_steps(ClippedAdamW, [])
    moved = (full - start).abs().mean()
    assert moved > 1e-2
    assert (eight - full).abs().mean() < 0.02 * moved
    assert (eight - full).abs().max() < 0.15 * 3e-2


# ------------------------------------------------------------------------------------------ in backward


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_optimizer_in_backward_equals_the_ordinary_step(tmp_path, optimizer):
    """4 steps with gclip active: the adapter equals the ordinary optimizer's within 1e-6 (both apply the
    same element-wise update, one tensor at a time instead of all after the backward)."""
    common = {"optimizer": optimizer, "gclip": 0.01}
    ordinary = trainer.train(config(tmp_path / "ordinary", **common), Console(quiet=True))
    inside = trainer.train(config(tmp_path / "inside", optimizer_in_backward=True, **common), Console(quiet=True))
    a, b, start = adapter(tmp_path / "ordinary"), adapter(tmp_path / "inside"), None
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)
    assert ordinary.losses == pytest.approx(inside.losses, abs=1e-6)
    moments = checkpoint_tensors(tmp_path / "inside", 4)[1]
    if optimizer == "adamw_8bit":
        assert any(v.dtype == torch.uint8 for v in moments.values())
    del start


def test_a_nonfinite_gradient_inside_the_backward_undoes_the_whole_step(tmp_path, monkeypatch):
    """The gradient of a first-layer tensor (complete last in the backward) turns NaN at step 3 while the
    loss stays finite: the tensors already updated in that backward are put back, so weights and moments
    equal a run that stopped after step 2, bit for bit."""
    trainer.train(config(tmp_path / "two", max_steps=2, optimizer_in_backward=True), Console(quiet=True))
    real, calls = trainer.token_loss_sum, {"n": 0}

    def nan_gradient_on_step_3(model, batch, **kwargs):
        calls["n"] += 1
        loss, n, aux = real(model, batch, **kwargs)
        if calls["n"] == 3:
            first = next(p for name, p in model.named_parameters() if p.requires_grad and ".layers.0." in name)
            loss = loss + 0 * torch.sqrt(first - first).sum()  # value 0, gradient 0 * inf = NaN
        return loss, n, aux

    monkeypatch.setattr(trainer, "token_loss_sum", nan_gradient_on_step_3)
    cfg = config(tmp_path / "three", max_steps=3, optimizer_in_backward=True, nan_policy="skip", save_every=1)
    result = trainer.train(cfg, Console(quiet=True))
    assert math.isfinite(result.losses[-1])  # the loss was finite: only the gradient was not
    for a, b in zip(checkpoint_tensors(tmp_path / "two", 2), checkpoint_tensors(tmp_path / "three", 3), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def chain(undo: bool):
    """y = w2 * (w1 * x); w2's gradient completes first in the backward, w1's last (poisoned with NaN)."""
    w1 = torch.nn.Parameter(torch.ones(4))
    w2 = torch.nn.Parameter(torch.full((4,), 2.0))
    cfg = validate_config(
        {
            "model": {"name_or_path": "x"},
            "data": {"train_files": ["x"]},
            "train": {"optimizer_in_backward": True, "lr": 0.1},
        }
    ).train
    opt = build_optimizer([w1, w2], cfg)
    stepper = StepInBackward(opt, undo=undo)
    x = torch.arange(4.0)
    for poisoned in (False, True):
        stepper.begin()
        h = w1 * x
        if poisoned:
            h.register_hook(lambda g: g * math.nan)
        (w2 * h).sum().backward()
        before_finish = w2.detach().clone()
        _, skipped = stepper.finish(True)
        if not poisoned:
            after_first = (w1.detach().clone(), w2.detach().clone(), opt.state[w2]["exp_avg"].clone())
    return after_first, (w1.detach(), w2.detach(), opt.state[w2]["exp_avg"]), skipped, before_finish


def test_undo_restores_tensors_updated_before_the_nan_and_control_without_it():
    after_first, after_second, skipped, w2_before_finish = chain(undo=True)
    assert skipped
    assert not torch.equal(w2_before_finish, after_first[1])  # w2 really was updated inside the backward
    assert all(torch.equal(a, b) for a, b in zip(after_first, after_second, strict=True))
    control_first, control_second, _, _ = chain(undo=False)  # broken control: no undo
    assert not torch.equal(control_first[1], control_second[1])


def test_optimizer_in_backward_refuses_accumulation_and_global_norm_clipping():
    base = {"model": {"name_or_path": "x"}, "data": {"train_files": ["x"]}}
    for extra, words in (({"grad_accum": 2}, "train.grad_accum"), ({"max_grad_norm": 1.0}, "max_grad_norm")):
        with pytest.raises(ConfigError, match=words):
            validate_config({**base, "train": {"optimizer_in_backward": True, **extra}})
    with pytest.raises(ConfigError, match="train.optimizer"):
        validate_config({**base, "train": {"optimizer": "adam_4bit"}})


def test_grpo_refuses_optimizer_in_backward(tmp_path):
    from moe_qlora.train import grpo

    cfg = validate_config(
        {
            "model": {"name_or_path": "builtin:tiny-mixtral"},
            "data": {"train_files": ["x"]},
            "train": {"optimizer_in_backward": True},
            "output": {"dir": str(tmp_path)},
            "grpo": {"rewards": [{"function": "exact_match"}]},
        }
    )
    with pytest.raises(ConfigError, match="for `train` only"):
        grpo.grpo(cfg, Console(quiet=True))
