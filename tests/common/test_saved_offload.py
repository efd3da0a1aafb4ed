"""train.offload_activations: the checkpointed layers' inputs kept in host memory (common/saved_offload.py).

The device calls go through CheckedCopies, the CPU stand-in whose copies finish one copy late, as a copy engine
behind the compute would, and which raises on the two orders a GPU gets wrong (a device tensor let go of before
its copy out finished; a tensor handed to the backward before the compute stream waited for its copy back).
Oracle: the same model without offload. Copies are exact, so the loss and every LoRA gradient are bitwise equal.
Controls: an offload that lets go without checking, and one that hands a tensor back without waiting, raise.
"""

import pytest
import torch

from moe_qlora.common.saved_offload import CheckedCopies, CopyHazard, SavedOffload
from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing, offload_layer_inputs
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny

from helpers.oracle import randomize_lora_b

LAYERS = 2  # the tiny models' decoder layers, each checkpointed


def tiny_model(family: str):
    model = attach_adapters(load_model(LoadOptions(str(ensure_tiny(family)))), LoraSection(rank=4, alpha=8.0), seed=0)
    randomize_lora_b(model)
    configure_checkpointing(model, enabled=True, interval=1)
    return model.train()


def loss_and_grads(model):
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_offloaded_inputs_train_bitwise_as_kept(family):
    model = tiny_model(family)
    loss, grads = loss_and_grads(model)
    copies = CheckedCopies()
    offload = offload_layer_inputs(model, torch.device("cpu"), copies)
    offload.min_bytes = 0  # the tiny model's layer inputs are a few KiB: offload them all the same
    offloaded_loss, offloaded = loss_and_grads(model)
    assert torch.equal(offloaded_loss, loss)
    assert offloaded.keys() == grads.keys() and all(torch.equal(offloaded[n], g) for n, g in grads.items())
    hidden_bytes = 2 * 24 * model.config.hidden_size * 4
    sent = [size for kind, size, *_ in copies.log if kind == "to_host"]
    assert sent.count(hidden_bytes) >= LAYERS  # each checkpointed layer's input went to the host
    assert sum(kind == "to_device" for kind, *_ in copies.log) == len(sent) - (copies.lag + 1)
    # none read before it was on its way back: the last saved were still on the device (their copies out not yet
    # finished), every other came back ahead, started when the backward read the one saved after it
    assert offload.fetched_late == 0


def test_in_the_forward_only_the_copies_not_finished_keep_their_device_tensor():
    model = tiny_model("mixtral")
    copies = CheckedCopies(lag=1)
    offload = offload_layer_inputs(model, torch.device("cpu"), copies)
    offload.min_bytes = 0
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    on_device = [s for s in offload.order if s.device_tensor is not None]
    assert len(offload.order) > LAYERS and len(on_device) <= copies.lag + 1
    loss.backward()


class ReleasesUnchecked(SavedOffload):
    """Broken: lets go of every device tensor at once, its copy to the host finished or not."""

    def release_finished(self):
        for saved in self.order:
            if saved.device_tensor is not None and not saved.back:
                self.copies.release(saved.device_tensor)
                saved.device_tensor = None


class ReadsUnwaited(SavedOffload):
    """Broken: hands the backward a tensor coming back without making the compute stream wait for it."""

    def unpack(self, saved):
        if not hasattr(saved, "host"):
            return saved
        if saved.device_tensor is None:
            self.fetch(saved)
        tensor, saved.device_tensor, saved.back = saved.device_tensor, None, False
        self.copies.read(tensor)
        return tensor


@pytest.mark.parametrize(
    ("broken", "hazard"), [(ReleasesUnchecked, "let go of before"), (ReadsUnwaited, "before the compute stream waited")]
)
def test_a_wrong_order_is_caught(broken, hazard):
    copies = CheckedCopies(lag=1)
    offload = broken(copies, torch.device("cpu"), min_bytes=0)
    x = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(CopyHazard, match=hazard):
        with offload.offloading():
            y = (x * 2).sin().cos().exp()
        y.sum().backward()
