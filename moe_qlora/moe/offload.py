"""Expert offload: the NF4 expert stacks of every offloaded MoE layer live in host memory (pinned when there is a
GPU) and are copied to the device when their layer runs, at most `max_resident` layers at a time.

The schedule: entering layer i (its first stack read of a call) makes it resident, waiting for its copy if one is
in flight, and starts the copy of the layer used next on a side stream: i + 1 in a forward, i - 1 inside the
backward (where gradient checkpointing recomputes layer i and then differentiates it, last layer first), and
layer 0 after the last one in a no-grad forward (generation: the next token starts over). Before a copy, least
recently used layers are dropped, never the one running, so at most `max_resident` layers' stacks are on the
device. What bounds it: one layer computing while the next arrives needs two; one disables prefetch.

The MoE layer never holds the device tensors beyond a call: its plan keeps an OffloadedStack handle, which
resolves its tensors each time they are read (the backward reads them again, the copy coming back if needed).
LoRA factors, their gradients and the optimizer state are untouched: they stay on the device.
On the CPU the "device" copy is a separate buffer and the stream a synchronous copy: the same schedule runs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import bitsandbytes as bnb
import torch
from torch import nn

from moe_qlora.moe.nf4 import NF4Stack


def in_backward() -> bool:
    """Inside autograd's backward: a checkpointed layer's recompute, or a backward function."""
    return torch._C._current_graph_task_id() != -1


def stack_tensors(stack: NF4Stack) -> list[torch.Tensor]:
    return [stack.packed, stack.absmax, *(stack.nested[:2] if stack.nested is not None else ())]


def with_tensors(stack: NF4Stack, tensors: list[torch.Tensor]) -> NF4Stack:
    """`stack` with its tensors replaced, in stack_tensors' order."""
    nested = (tensors[2], tensors[3], stack.nested[2]) if stack.nested is not None else None
    return NF4Stack(tensors[0], tensors[1], nested, stack.shape, stack.blocksize)


def stack_nbytes(stack: NF4Stack) -> int:
    return sum(t.numel() * t.element_size() for t in stack_tensors(stack))


class CopyStream:
    """Where host-to-device copies run: a CUDA side stream, the consumer waiting on an event (the copy overlaps
    the compute before it); on the CPU a copy into a new buffer, done at once."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def copy(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
        if self.stream is None:
            return [t.clone() for t in tensors], None
        with torch.cuda.stream(self.stream):
            copies = [t.to(self.device, non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(self.stream)
        return copies, event

    def wait(self, event, tensors: list[torch.Tensor]) -> None:
        """Make the compute stream wait for the copy; the tensors, allocated on the side stream, are marked as
        used by the compute stream so the allocator does not hand their memory to another copy too early."""
        if event is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)


@dataclass
class Resident:
    stacks: dict[str, NF4Stack]
    event: object = None


@dataclass
class ExpertOffloader:
    """The host copies of every offloaded layer's stacks, and the layers resident on the device."""

    host: list[dict[str, NF4Stack]]
    copier: CopyStream
    max_resident: int = 2
    resident: OrderedDict = field(default_factory=OrderedDict)  # layer -> Resident, least recently used first
    current: int | None = None
    log: list | None = None  # (layer, phase, resident layers, was it resident on entering): set by tests
    bytes_copied: int = 0

    def stack(self, layer: int, name: str) -> NF4Stack:
        if layer != self.current:
            self.enter(layer)
        entry = self.resident[layer]
        if entry.event is not None:
            tensors = [t for s in entry.stacks.values() for t in stack_tensors(s)]
            self.copier.wait(entry.event, tensors)
            entry.event = None
        return entry.stacks[name]

    def enter(self, layer: int) -> None:
        """Layer `layer` starts a call: make it resident, then start the copy of the layer used next."""
        self.current = layer
        hit = layer in self.resident
        if not hit:
            self.load(layer)
        self.resident.move_to_end(layer)
        if self.max_resident > 1 and (upcoming := self.next_layer(layer)) is not None:
            if upcoming not in self.resident:
                self.load(upcoming)
        if self.log is not None:
            phase = "backward" if in_backward() else ("forward" if torch.is_grad_enabled() else "no_grad")
            self.log.append((layer, phase, sorted(self.resident), hit))

    def next_layer(self, layer: int) -> int | None:
        n = len(self.host)
        if in_backward():
            return layer - 1 if layer > 0 else None
        if layer + 1 < n:
            return layer + 1
        return 0 if not torch.is_grad_enabled() and n > 1 else None

    def load(self, layer: int) -> None:
        while len(self.resident) >= self.max_resident:
            oldest = next(k for k in self.resident if k != self.current)
            del self.resident[oldest]
        stacks = {}
        event = None
        for name, stack in self.host[layer].items():
            copies, event = self.copier.copy(stack_tensors(stack))
            stacks[name] = with_tensors(stack, copies)
            self.bytes_copied += stack_nbytes(stack)
        self.resident[layer] = Resident(stacks, event)  # one event: the copies were queued in order

    def release(self) -> None:
        """Drop every resident layer (the end of a run, or before evaluation frees memory)."""
        self.resident.clear()
        self.current = None


class OffloadedStack:
    """Stands for an NF4Stack of an offloaded layer in the MoE layer's plan: shape and blocksize at hand, every
    other attribute read from the device copy, fetched when it is not resident."""

    offloaded = True

    def __init__(self, offloader: ExpertOffloader, layer: int, name: str):
        host = offloader.host[layer][name]
        self.offloader, self.layer, self.name = offloader, layer, name
        self.shape, self.blocksize = host.shape, host.blocksize

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def expert_numel(self) -> int:
        return self.shape[1] * self.shape[2]

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy and pickle protocols: not the stack's
            raise AttributeError(attr)
        return getattr(self.offloader.stack(self.layer, self.name), attr)


def moved(t: torch.Tensor, device, pin: bool) -> torch.Tensor:
    out = t.detach().to(device, copy=True)
    return out.pin_memory() if pin and out.device.type == "cpu" else out


def move_param(param: bnb.nn.Params4bit, device, *, pin: bool = False) -> None:
    """A Params4bit's codes and its quant state's tensors moved to `device` in place (host memory pinned if
    `pin`)."""
    qs = param.quant_state
    param.data = moved(param.data, device, pin)
    qs.absmax = moved(qs.absmax, device, pin)
    if qs.nested:
        qs.state2.absmax = moved(qs.state2.absmax, device, pin)
        qs.state2.code = moved(qs.state2.code, device, pin)


def offload_experts(modules: list[nn.Module], device, *, max_resident: int = 2) -> ExpertOffloader:
    """Offload the NF4 stacks of `modules` (experts modules in the order the forward calls them) to host memory
    and route their reads through one ExpertOffloader; returns it. Pinned memory when `device` is a GPU."""
    pin = torch.device(device).type == "cuda"
    host = []
    for module in modules:
        stacks = {}
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, bnb.nn.Params4bit):  # biases stay on the device
                continue
            move_param(param, "cpu", pin=pin)
            stacks[name] = NF4Stack.from_param(param)
        host.append(stacks)
    offloader = ExpertOffloader(host, CopyStream(torch.device(device)), max_resident=max_resident)
    for layer, module in enumerate(modules):
        module.moe_offload = (offloader, layer)
    return offloader
