"""An adapter as a run writes it, made without training: the tests' model with every LoRA factor random and
non-zero (B too, which training starts at zero), saved in PEFT's format."""

from pathlib import Path

import torch

from moe_qlora.config.sections import LoraSection


def randomized(model, seed: int = 0):
    """`model` with every trainable tensor drawn from N(0, 0.1^2) by a generator of its own (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def random_adapter(base: Path, out: Path, lora: LoraSection, *, seed: int = 0):
    """(the 4-bit model of `base` with `lora` attached and randomized, its adapter saved to `out`)."""
    from moe_qlora.export.adapter import save_adapter
    from moe_qlora.model.adapters import attach_adapters
    from moe_qlora.model.loading import LoadOptions, load_model

    model = randomized(attach_adapters(load_model(LoadOptions(str(base))), lora, seed=0), seed)
    return model, save_adapter(model, out, cfg=lora, base_model_name_or_path=str(base))
