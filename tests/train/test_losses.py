"""Chunked cross-entropy through the output head (losses.py) against the full logits differentiated by autograd.

Tolerances: fp32, only the summation order of the logsumexp and of the chunked hidden-state gradient differ:
1e-6 relative to the tensor's largest value at the function level, 1e-5 through a whole model (LoRA grads
summed over layers and experts).
"""

import pytest
import torch
import torch.nn.functional as F

from moe_qlora.config.sections import LoraSection
from moe_qlora.data.examples import IGNORE
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.train.losses import ChunkedTokenLogProbs, chunked_loss_matches, completion_logprobs
from moe_qlora.train.sft import token_loss_sum

from helpers.oracle import randomize_lora_b


def full_logprobs(hidden, weight, bias, targets, scale):
    z = F.linear(hidden, weight, bias).float() * scale
    return z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)


def close(a, b, rel):
    a, b = a.detach(), b.detach()  # compared as values (float() of a tensor that requires grad warns)
    return float((a - b).abs().max()) <= rel * float(b.abs().max())


@pytest.mark.parametrize("chunk", [1, 8, 37, 100], ids=["per_token", "ragged_last_chunk", "one_chunk", "over_n"])
def test_chunked_logprobs_and_gradient_equal_the_full_computation(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g)
    weight, bias = torch.randn(50, 16, generator=g), torch.randn(50, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    ours = ChunkedTokenLogProbs.apply(h1, weight, bias, targets, 0.7, chunk)
    ref = full_logprobs(h2, weight, bias, targets, 0.7)
    (ours * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert close(ours, ref, 1e-6) and close(h1.grad, h2.grad, 1e-6)
    # broken control: the wrong targets (rolled by one) must not pass the same comparison
    wrong = ChunkedTokenLogProbs.apply(hidden, weight, bias, targets.roll(1), 0.7, chunk)
    assert not close(wrong, ref, 1e-6)


@pytest.fixture(scope="module")
def model(tiny_mixtral_dir):
    m = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), LoraSection(rank=4, alpha=8.0), seed=0)
    randomize_lora_b(m)
    return m


def batch_with_masks_and_weights():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(7, 200, (3, 20), generator=g)
    labels = ids.clone()
    labels[:, :6] = IGNORE  # prompt tokens
    labels[2, 15:] = IGNORE  # padding of a shorter row
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "weights": torch.tensor([1.0, 0.0, 2.5])}


def loss_and_grads(model, batch, chunk):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss, n, _ = token_loss_sum(model, batch, loss_chunk=chunk)
    loss.backward()
    return loss.detach(), n, [p.grad.clone() for p in params]


def test_sft_loss_and_every_lora_gradient_equal_the_full_logits(model):
    """Masking (prompt, padding) and per-sample weights (rwsft, a zero weight among them) included."""
    batch = batch_with_masks_and_weights()
    full_loss, n, full_grads = loss_and_grads(model, batch, 0)
    loss, n2, grads = loss_and_grads(model, batch, 7)
    assert model._moe_qlora_chunked_loss is True and n == n2
    assert close(loss, full_loss, 1e-5)
    assert len(grads) > 10 and all(close(a, b, 1e-5) for a, b in zip(grads, full_grads, strict=True))


def test_grpo_logprobs_at_a_temperature_equal_the_full_logits(model):
    batch = batch_with_masks_and_weights()
    full, mask = completion_logprobs(model, batch, 0.7, chunk=0)
    chunked, mask2 = completion_logprobs(model, batch, 0.7, chunk=9)
    assert torch.equal(mask, mask2) and close(chunked, full, 1e-5)
    assert float(full.detach()[~mask].abs().max()) == 0.0


def test_a_model_that_transforms_its_logits_falls_back_to_the_full_logits(tiny_mixtral_dir):
    """A non-linear transform after the head (Gemma's soft-capping, emulated on the instance) would make the
    chunked path wrong: the first call sees it and computes full logits instead. (Granite's linear
    logits_scaling is not such a case: dividing the head's input divides its output.)"""
    capped = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), LoraSection(rank=4, alpha=8.0), seed=0)
    forward = capped.forward

    def soft_capped(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = 3.0 * torch.tanh(out.logits / 3.0)
        return out

    capped.forward = soft_capped
    batch = batch_with_masks_and_weights()
    assert "differ" in chunked_loss_matches(capped, batch)
    full_loss, _, _ = loss_and_grads(capped, batch, 0)
    loss, _, _ = loss_and_grads(capped, batch, 7)
    assert capped._moe_qlora_chunked_loss is False and torch.equal(loss, full_loss)
