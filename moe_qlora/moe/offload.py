"""Expert offload: the NF4 expert stacks of every offloaded MoE layer live in host memory, one page-locked block
per layer, and are copied into one of `max_resident` device buffers (allocated once, reused) when their layer
runs: at most `max_resident` layers' stacks are on the device, in memory that never grows.

The schedule: entering layer i (its first stack read of a call) makes it resident, waiting for its copy if one is
in flight, and starts the copy of the layer used next on a side stream: i + 1 in a forward, i - 1 inside the
backward (where gradient checkpointing recomputes layer i and then differentiates it, last layer first), and
layer 0 after the last one in a no-grad forward (generation: the next token starts over). A copy goes into the
buffer of the least recently used layer (never the one running), ordered after every compute queued so far,
which includes each read of the layer it replaces; the compute stream waits for the copy before its first read.
What bounds it: one layer computing while the next arrives needs two buffers; one disables prefetch.

The MoE layer never holds the device tensors beyond a call: its plan keeps an OffloadedStack handle, which
resolves its tensors each time they are read (the backward reads them again, the copy coming back if needed).
LoRA factors, their gradients and the optimizer state are untouched: they stay on the device.
The device calls (stream, events, page-locking) are common/streams.py's: on the CPU a copy is done at once and
the same schedule runs; CheckedStreams checks its orderings as a GPU needs them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import bitsandbytes as bnb
import torch
from torch import nn

from moe_qlora.common.streams import HostStreams, streams_for
from moe_qlora.moe.layer_state import layer_state
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


ALIGN = 256  # bytes: each tensor of a layer's block starts aligned for wide vector loads


@dataclass(frozen=True)
class LayerLayout:
    """Where each tensor of one layer's stacks sits in its flat block: the same offsets in host memory and in
    a device buffer, so one copy moves the whole layer."""

    parts: dict[str, list[tuple[int, torch.dtype, tuple[int, ...]]]]  # stack name -> (offset, dtype, shape) each
    stacks: dict[str, NF4Stack]  # the stacks as loaded: shapes, blocksize, nested offset
    nbytes: int

    @classmethod
    def of(cls, stacks: dict[str, NF4Stack]) -> LayerLayout:
        parts, offset = {}, 0
        for name, stack in stacks.items():
            parts[name] = []
            for t in stack_tensors(stack):
                parts[name].append((offset, t.dtype, tuple(t.shape)))
                offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        return cls(parts, stacks, offset)

    def views(self, block: torch.Tensor) -> dict[str, NF4Stack]:
        """The stacks as views into `block`, a flat uint8 tensor of at least `nbytes`."""
        out = {}
        for name, parts in self.parts.items():
            tensors = [view_of(block, offset, dtype, shape) for offset, dtype, shape in parts]
            out[name] = with_tensors(self.stacks[name], tensors)
        return out


def view_of(block: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return block[offset : offset + nbytes].view(dtype).view(shape)


@dataclass
class HostLayer:
    """One offloaded layer in host memory: its stacks packed into one page-locked block."""

    layout: LayerLayout
    block: torch.Tensor  # (nbytes,) uint8


@dataclass
class Slot:
    """One of the `max_resident` device buffers, reused by whichever layer is copied into it."""

    buffer: torch.Tensor  # (largest layer's nbytes,) uint8 on the device
    stacks: dict[str, NF4Stack] | None = None
    copied: object = None  # the copy's event, until the compute stream has waited for it


@dataclass
class ExpertOffloader:
    """The host copies of every offloaded layer's stacks, and `max_resident` device buffers they are copied
    into: at most that many layers on the device, in memory allocated once.

    A copy into a buffer is ordered after the compute that read the layer it replaces (an event recorded on the
    compute stream when the layer is evicted); the compute stream waits for the copy before it first reads."""

    host: list[HostLayer]
    streams: HostStreams
    max_resident: int = 2
    slots: list[Slot] = field(default_factory=list)
    resident: OrderedDict = field(default_factory=OrderedDict)  # layer -> slot index, least recently used first
    current: int | None = None
    log: list | None = None  # (layer, phase, resident layers, was it resident on entering): set by tests
    bytes_copied: int = 0

    def __post_init__(self):
        size = max((h.layout.nbytes for h in self.host), default=0)
        self.slots = [Slot(self.streams.device_buffer(size)) for _ in range(min(self.max_resident, len(self.host)))]

    def stack(self, layer: int, name: str) -> NF4Stack:
        if layer != self.current:
            self.enter(layer)
        slot = self.slots[self.resident[layer]]
        if slot.copied is not None:
            self.streams.wait(slot.copied, slot.buffer)
            slot.copied = None
        self.streams.read(slot.buffer)
        return slot.stacks[name]

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

    def free_slot(self) -> int:
        """A slot to copy into: an unused one, else the least recently used layer's (never the current one)."""
        used = set(self.resident.values())
        for i in range(len(self.slots)):
            if i not in used:
                return i
        oldest = next(k for k in self.resident if k != self.current)
        return self.resident.pop(oldest)

    def load(self, layer: int) -> None:
        i = self.free_slot()
        slot, host = self.slots[i], self.host[layer]
        # every read of the layer leaving this slot is queued on the compute stream by now
        after = self.streams.compute_point()
        slot.copied = self.streams.copy(slot.buffer[: host.layout.nbytes], host.block, after=after)
        slot.stacks = host.layout.views(slot.buffer)
        self.resident[layer] = i
        self.bytes_copied += host.layout.nbytes

    def release(self) -> None:
        """Forget every resident layer (the buffers stay allocated: they are the window plan counts)."""
        self.resident.clear()
        self.current = None
        for slot in self.slots:
            slot.stacks = slot.copied = None


class OffloadedStack:
    """Stands for an NF4Stack of an offloaded layer in the MoE layer's plan: shape and blocksize at hand, every
    other attribute read from the device copy, fetched when it is not resident."""

    offloaded = True

    def __init__(self, offloader: ExpertOffloader, layer: int, name: str):
        host = offloader.host[layer].layout.stacks[name]
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


def moved(t: torch.Tensor, device) -> torch.Tensor:
    return t.detach().to(device, copy=True)


def move_param(param: bnb.nn.Params4bit, device) -> None:
    """A Params4bit's codes and its quant state's tensors moved to `device` in place (pageable host memory for
    the CPU: offload_experts packs and page-locks the offloaded layers' in one block each)."""
    qs = param.quant_state
    param.data = moved(param.data, device)
    qs.absmax = moved(qs.absmax, device)
    if qs.nested:
        qs.state2.absmax = moved(qs.state2.absmax, device)
        qs.state2.code = moved(qs.state2.code, device)


def repoint_param(param: bnb.nn.Params4bit, stack: NF4Stack) -> None:
    """Make `param` and its quant state read `stack`'s tensors (views into a host block)."""
    qs = param.quant_state
    param.data = stack.packed
    qs.absmax = stack.absmax
    if qs.nested:
        qs.state2.absmax, qs.state2.code = stack.nested[0], stack.nested[1]


def pack_to_host(module: nn.Module, streams: HostStreams) -> HostLayer:
    """The NF4 stacks of `module` copied into one host block, page-locked; its parameters now read the block
    (their previous storage is freed when nothing else holds it)."""
    params = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, bnb.nn.Params4bit)}
    layout = LayerLayout.of({n: NF4Stack.from_param(p) for n, p in params.items()})
    block = streams.host_block(layout.nbytes)
    for name, stack in layout.views(block).items():
        for dst, src in zip(stack_tensors(stack), stack_tensors(layout.stacks[name]), strict=True):
            dst.copy_(src)
        repoint_param(params[name], stack)
    layout = LayerLayout(layout.parts, layout.views(block), layout.nbytes)  # hold no reference to the old tensors
    return HostLayer(layout, block)


def host_layer_bytes(stacks: dict[str, NF4Stack]) -> int:
    """Host bytes one offloaded layer takes: its block, tensors aligned as LayerLayout lays them out."""
    return LayerLayout.of(stacks).nbytes


def offload_experts(
    modules: list[nn.Module], device, *, max_resident: int = 2, streams: HostStreams | None = None
) -> ExpertOffloader:
    """Offload the NF4 stacks of `modules` (experts modules in the order the forward calls them) to host memory
    and route their reads through one ExpertOffloader; returns it. `streams` defaults to the device's own
    (CudaStreams on a GPU: host blocks page-locked, copies on a side stream)."""
    streams = streams if streams is not None else streams_for(device)
    host = [pack_to_host(module, streams) for module in modules]
    offloader = ExpertOffloader(host, streams, max_resident=max_resident)
    for layer, module in enumerate(modules):
        layer_state(module).offload = (offloader, layer)
    return offloader
