"""The premise of `plan`'s not_at_once row (budget.Plan.phases_apart): the loss's logits are freed before the
layers' backward begins, so they never meet what that backward alone holds (the checkpointed layer it
recomputes, the decoded stacks, the MoE rows), and the peak holds the larger of the two, not their sum. Seen on
the CPU with helpers.live_bytes (every storage an op returns, alive until freed) through the training loss
(sft.token_loss_sum) of a tiny Mixtral with a vocabulary of 4,096, its layers checkpointed: the bytes alive when
the first layer's recompute starts, against the logits' bytes. Control: the same step with a hook that keeps the
head's logits (what a loss that held them across the backward would do) is caught. Against the peaks an H200
measured (commit d7073e2), the plan that summed the two phases was 15% above at 4k tokens (the CUDA context
counted); taking the larger, within 1% (docs/memory.md)."""

from __future__ import annotations

import pytest
import torch

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.train.sft import token_loss_sum

from helpers.live_bytes import LiveBytes

VOCAB, ROWS, SEQ = 4096, 2, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Mixtral (hidden 64, 2 layers) with a 4,096-token head: one micro-batch's logits (128 x 4,096 fp32,
    2 MiB) dwarf the layers' saved inputs (128 x 64 fp32 each)."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp("wide-vocab"), tiny_config("mixtral", VOCAB), seed=0, tokenizer=tok)
    m = attach_adapters(load_model(LoadOptions(str(path))), LoraSection(rank=4, alpha=8.0), seed=0)
    assert configure_checkpointing(m, enabled=True, interval=1) == 2
    return m.train()


def alive_at_first_recompute(model, loss_chunk: int, keep_logits: bool) -> tuple[int, int]:
    """(bytes alive when the backward's first layer recompute starts, the peak before the backward): one training
    micro-batch's loss and backward under LiveBytes. keep_logits: a forward hook on the head that keeps its
    output (the control)."""
    ids = torch.randint(300, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    tracker = LiveBytes([*model.parameters(), *model.buffers(), *batch.values()])
    seen, kept, in_backward = [], [], [False]

    def at_layer_start(module, args):
        if in_backward[0] and not seen:
            seen.append(tracker.alive())

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # a layer's first module, not the layer: the recompute calls the layer's forward, not its hooks
    hooks = [layer.input_layernorm.register_forward_pre_hook(at_layer_start) for layer in base.model.layers]
    if keep_logits:
        hooks.append(base.lm_head.register_forward_hook(lambda module, args, out: kept.append(out)))
    try:
        with tracker:
            loss, _, _ = token_loss_sum(model, batch, loss_chunk=loss_chunk)
            before = tracker.peak
            in_backward[0] = True
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
    return seen[0], before


@pytest.mark.parametrize("loss_chunk", [0, 64], ids=["full_logits", "chunked"])
def test_the_losss_logits_are_gone_when_the_layers_backward_begins(model, loss_chunk):
    logits = ROWS * SEQ * VOCAB * 4 if loss_chunk == 0 else loss_chunk * VOCAB * 4
    alive, loss_phase = alive_at_first_recompute(model, loss_chunk, keep_logits=False)
    assert loss_phase >= logits, "the loss's phase holds its logits"
    assert alive < logits / 2, f"{alive} bytes alive at the recompute, the logits {logits}"
    if loss_chunk == 0:  # control: logits held across the backward are seen there
        held, _ = alive_at_first_recompute(model, loss_chunk, keep_logits=True)
        assert held >= logits
