"""Per-expert LoRA: the factors of every expert of one layer (ExpertLoRA), attached to every experts module of a
model on the device it computes on.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_qlora.moe.expert_stacks import check_supported_layout, expert_dims, experts_modules


class ExpertLoRA(nn.Module):
    """LoRA factors for every expert of one layer (fp32 master weights).

    gate_up_a: (E, r, H)  gate_up_b: (E, 2I, r), or (E, I, r) for non-gated experts (up_proj)
    down_a: (E, r, I)  down_b: (E, H, r)
    Expert e's update is scale * B_e A_e with scale = alpha / r; B starts at zero so training starts at the base model.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        alpha: float,
        gated: bool = True,
        device=None,
        generator=None,
    ):
        super().__init__()
        shapes = {
            "gate_up_a": (num_experts, rank, hidden),
            "gate_up_b": (num_experts, (2 if gated else 1) * intermediate, rank),
            "down_a": (num_experts, rank, intermediate),
            "down_b": (num_experts, hidden, rank),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.float32, device=device)))
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.active = True  # False: the experts compute the frozen base alone (GRPO's reference policy)
        # Rows routed to each expert while training (router load), read and reset by the trainer.
        self.register_buffer("routed_rows", torch.zeros(num_experts, dtype=torch.long, device=device), persistent=False)
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # Same distribution PEFT gives lora_A (kaiming-uniform, a=sqrt(5), fan_in = in features), per expert.
        for a in (self.gate_up_a, self.down_a):
            bound = 1.0 / math.sqrt(a.shape[-1])
            nn.init.uniform_(a, -bound, bound, generator=generator)
        nn.init.zeros_(self.gate_up_b)
        nn.init.zeros_(self.down_b)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four factors as the kernels take them: under expert parallelism this rank's experts of each
        (DTensor.to_local, through which autograd gives the DTensor its gradient)."""
        return tuple(_local(p) for p in (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b))

    def extra_repr(self) -> str:
        return f"experts={self.gate_up_a.shape[0]}, rank={self.rank}, alpha={self.alpha}"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # a DTensor (expert parallelism): this rank's rows


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its input embeddings' device. Not its experts' stacks' device, which is the host
    for offloaded layers (model.expert_offload) while their LoRA, routing and gradients live on the GPU."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return embeddings.weight.device
    return next(model.parameters()).device  # a bare experts module (benchmarks, tests): where its stacks are


def attach_expert_lora(
    model: nn.Module, *, rank: int, alpha: float, seed: int, device: torch.device | str | None = None
) -> list[str]:
    """Add an ExpertLoRA to every experts module (checked for a supported layout first), on `device` (default:
    where the model computes, compute_device). Returns their names."""
    device = torch.device(device) if device is not None else compute_device(model)
    names = []
    generator = torch.Generator().manual_seed(seed)
    for name, module in experts_modules(model):
        check_supported_layout(module, name)
        e, hidden, inter = expert_dims(module)
        lora = ExpertLoRA(
            num_experts=e,
            hidden=hidden,
            intermediate=inter,
            rank=rank,
            alpha=alpha,
            gated=module.has_gate,
            generator=generator,
        )
        module.moe_lora = lora.to(device)
        names.append(name)
    return names
