"""The self-check of the GPU MoE paths (moe_qlora/moe/self_check.py): a path that raises or computes wrong at its first
call falls back (triton -> grouped_mm -> torch) with one warning, and the run goes on with the reference's
numbers; a path that is right is kept. The fault is injected (common.injection.injected in-process,
MOE_QLORA_INJECT_KERNEL_FAULT for a subprocess), the stand-in for a GPU kernel that fails on the user's device:
`wrong` scales the path's output by 1.5, `raise` raises."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_qlora.moe import self_check
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import kernel_self_check, set_moe_kernels

from helpers.oracle import quantized_with_lora, ragged_routing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tiny_mixtral_dir):
    return quantized_with_lora(tiny_mixtral_dir)


def experts_step(model, kernels, *, check=True, tokens=12):
    """(output, grad x) of the first experts module of `model` through `kernels`, with a fresh self-check."""
    set_moe_kernels(model, kernels, self_check=check)
    name, experts = experts_modules(model)[0]
    idx, weights = ragged_routing(tokens, experts.moe_lora.gate_up_a.shape[0], 2)
    x = torch.randn(tokens, experts.moe_lora.gate_up_a.shape[2], generator=torch.Generator().manual_seed(2))
    x.requires_grad_(True)
    out = experts(x, idx, weights)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def test_a_right_path_is_kept(model, caplog):
    torch_out, torch_grad = experts_step(model, "torch")
    with caplog.at_level(logging.WARNING, logger="moe_qlora.moe.self_check"):
        out, grad = experts_step(model, "grouped_mm")
    checker = kernel_self_check(model)
    assert len(checker.verdicts) == 1 and not checker.failed and not caplog.records
    # grouped_mm's own numbers (fp32: the reference's to the summation order), not a fallback's
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, torch_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fault", ["wrong", "raise"])
def test_a_failing_path_falls_back_to_the_reference_with_one_warning(model, fault, inject_faults, caplog):
    torch_out, torch_grad = experts_step(model, "torch")
    inject_faults(kernel_fault=f"grouped_mm:{fault}")
    with caplog.at_level(logging.WARNING, logger="moe_qlora.moe.self_check"):
        out, grad = experts_step(model, "grouped_mm")
        again, _ = experts_step_same_checker(model)
    assert torch.equal(out, torch_out) and torch.equal(grad, torch_grad) and torch.equal(again, torch_out)
    (record,) = caplog.records  # one warning, not one per call
    message = record.getMessage()
    assert "grouped_mm failed" in message and "(8, 256, 64)" in message and "runs torch instead" in message
    assert ("differs from the torch reference" if fault == "wrong" else "InjectedKernelFault") in message
    # Control: with the self-check off the fault reaches the output (or raises).
    if fault == "wrong":
        broken, _ = experts_step(model, "grouped_mm", check=False)
        assert (broken - torch_out).abs().max() > 0.1 * torch_out.abs().max()
    else:
        with pytest.raises(self_check.InjectedKernelFault):
            experts_step(model, "grouped_mm", check=False)


def experts_step_same_checker(model):
    """A second call through the model's existing self-check (its verdicts kept)."""
    _, experts = experts_modules(model)[0]
    idx, weights = ragged_routing(12, experts.moe_lora.gate_up_a.shape[0], 2)
    x = torch.randn(12, experts.moe_lora.gate_up_a.shape[2], generator=torch.Generator().manual_seed(2))
    return experts(x, idx, weights).detach(), None


@pytest.mark.usefixtures("small_triton_blocks")
def test_triton_falls_back_to_grouped_mm_which_is_checked_too(model, inject_faults, caplog):
    """triton raising falls back to grouped_mm, which is itself checked (and kept: it is right); triton runs in
    the interpreter here."""
    torch_out, _ = experts_step(model, "torch")
    inject_faults(kernel_fault="triton:raise")
    with caplog.at_level(logging.WARNING, logger="moe_qlora.moe.self_check"):
        out, _ = experts_step(model, "triton")
    checker = kernel_self_check(model)
    assert sorted(key[0] for key in checker.verdicts) == ["grouped_mm", "triton"]
    assert [key[0] for key in checker.failed] == ["triton"] and len(caplog.records) == 1
    assert "runs grouped_mm instead" in caplog.records[0].getMessage()
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


def test_each_rows_class_is_checked_once(model):
    """The key holds the rows per expert class (what picks a launch's tiles): 12 and 400 tokens over 8 experts
    (3 and 100 rows per expert) are two checks; a second 12-token call is none."""
    experts_step(model, "grouped_mm")
    checker = kernel_self_check(model)
    experts_step_same_checker(model)
    _, experts = experts_modules(model)[0]
    idx, weights = ragged_routing(400, 8, 2)
    experts(torch.randn(400, 64), idx, weights)
    assert sorted(key[-1] for key in checker.verdicts) == [16, 128] and not checker.failed


def test_out_of_memory_in_the_check_is_not_a_kernel_fault(model, monkeypatch):
    """Running out of memory says nothing about the kernel: it propagates instead of falling back."""

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(self_check, "_relative_difference", oom)
    with pytest.raises(torch.OutOfMemoryError):
        experts_step(model, "grouped_mm")


def broken_lora_weight_grads(monkeypatch):
    """The outer-product results with experts rolled in dB2: output and input gradient untouched."""
    from moe_qlora.moe import grouped_layer

    real = grouped_layer._lora_weight_grads
    monkeypatch.setattr(grouped_layer, "_lora_weight_grads", lambda *a: [*real(*a)[:3], real(*a)[3].roll(1, dims=0)])


def dropped_routing_weight_grad(monkeypatch):
    """The routing weights' gradient dropped: output, input and LoRA gradients untouched."""
    from moe_qlora.moe import grouped_layer

    real = grouped_layer.grouped_backward
    monkeypatch.setattr(
        grouped_layer, "grouped_backward", lambda *a: (lambda g: (g[0], torch.zeros_like(g[1]), *g[2:]))(real(*a))
    )


@pytest.mark.parametrize(
    ("breaks", "gradient"),
    [(broken_lora_weight_grads, "down_b gradient"), (dropped_routing_weight_grad, "routing-weight gradient")],
)
def test_a_path_wrong_only_in_a_weight_gradient_falls_back(model, monkeypatch, caplog, breaks, gradient):
    """The check compares every gradient the layer gives, not the output and input gradient alone: a path right
    in both but wrong in the expert LoRA's outer products, or in the routing weights' gradient, is caught."""
    breaks(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="moe_qlora.moe.self_check"):
        experts_step(model, "grouped_mm")
    (why,) = kernel_self_check(model).failed.values()
    assert why.startswith(f"{gradient} differs from the torch reference")


def test_the_unbroken_weight_gradients_pass_the_check(model):
    """Control for the test above: the same call with the real backward passes (fp32: ~1e-6 of 1e-4)."""
    experts_step(model, "grouped_mm")
    assert not kernel_self_check(model).failed


def test_a_rows_class_first_seen_without_gradients_is_probed_again_with_them(model, monkeypatch):
    """GRPO samples under inference_mode first: that probe checks the forward only. The first call with
    gradients for the same rows class is probed again, backward included (here it finds the broken backward)."""
    set_moe_kernels(model, "grouped_mm", self_check=True)
    _, experts = experts_modules(model)[0]
    idx, weights = ragged_routing(12, 8, 2)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        experts(x, idx, weights)
    checker = kernel_self_check(model)
    assert [key[-2] for key in checker.verdicts] == [False] and not checker.failed
    broken_lora_weight_grads(monkeypatch)
    experts(x.clone().requires_grad_(True), idx, weights).sum().backward()
    assert sorted(key[-2] for key in checker.verdicts) == [False, True]
    assert [key[-2] for key in checker.failed] == [True]


def test_a_device_fault_at_a_probe_stops_with_one_clear_message(model, inject_faults):
    """An illegal address poisons the CUDA context: no fallback can run, so the probe raises a message naming the
    path and shapes and the way out. The stand-in raises what torch raises for it (torch.AcceleratorError)."""
    inject_faults(kernel_fault="grouped_mm:device")
    with pytest.raises(self_check.DeviceFaultError) as info:
        experts_step(model, "grouped_mm")
    message = str(info.value)
    assert "the grouped_mm path faulted on the device for experts (8, 256, 64) / (8, 64, 128)" in message
    assert "rerun with --set model.kernels=torch" in message and "illegal memory access" in message


def demo_losses(tmp_path, name, *overrides, fault=None):
    env = {**os.environ, "MOE_QLORA_CACHE": str(tmp_path / "cache")}
    env.pop(self_check.FAULT_ENV, None)
    if fault:
        env[self_check.FAULT_ENV] = fault
    run = [
        sys.executable,
        "-m",
        "moe_qlora",
        "train",
        "--config",
        "configs/demo.yaml",
        "--set",
        f"output.dir={tmp_path / name}",
        "--set",
        "train.max_steps=12",
        *overrides,
    ]
    proc = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines], proc.stdout + proc.stderr


@pytest.mark.slow
def test_demo_with_a_broken_grouped_mm_falls_back_and_trains_as_the_reference(tmp_path):
    """The demo with model.kernels=grouped_mm and a wrong grouped_mm: one warning, every layer on the torch
    reference, and the losses of model.kernels=torch within 1e-4. (Without the fault nothing falls back:
    test_a_right_path_is_kept, in-process.)"""
    reference, _ = demo_losses(tmp_path, "torch", "--set", "model.kernels=torch")
    fallen, log = demo_losses(tmp_path, "broken", "--set", "model.kernels=grouped_mm", fault="grouped_mm:wrong")
    assert log.count("MoE self-check: grouped_mm failed") == 1 and "runs torch instead" in log
    assert len(fallen) == len(reference) == 12
    assert max(abs(a - b) for a, b in zip(fallen, reference, strict=True)) <= 1e-4
    # Control: the injected fault, unchecked, changes the training.
    broken, _ = demo_losses(
        tmp_path,
        "unchecked",
        "--set",
        "model.kernels=grouped_mm",
        "--set",
        "model.kernel_self_check=false",
        fault="grouped_mm:wrong",
    )
    assert max(abs(a - b) for a, b in zip(broken, reference, strict=True)) > 1e-2
