"""Packing several rows into one sequence, and when it is not allowed: a model whose layers carry state across
positions (linear attention, Mamba, convolutions) would leak one row into the next, which a probe checks.
"""

from __future__ import annotations

import torch
from rich.console import Console

from moe_qlora.config.sections import ConfigError
from moe_qlora.data.examples import Example, pack_examples


def packed(
    model, examples: list[Example], held_out: list[Example], max_len: int, console: Console
) -> tuple[list[Example], list[Example]]:
    """data.packing: training and eval rows each packed into max_seq_len sequences (never mixed)."""
    if (reason := packing_unsupported(model)) is not None:
        raise ConfigError(f"data.packing: {reason}; set data.packing: false for this model")
    rows = len(examples)
    examples, held_out = pack_examples(examples, max_len), pack_examples(held_out, max_len) if held_out else []
    fill = sum(len(e.input_ids) for e in examples) / (len(examples) * max_len)
    console.print(f"packing: {rows} rows -> {len(examples)} sequences of up to {max_len} tokens ({fill:.0%} full)")
    return examples, held_out


RECURRENT_LAYER_KINDS = ("linear_attention", "mamba", "conv", "recurrent")


def packing_unsupported(model) -> str | None:
    """Why packed rows would see each other in this model, or None.

    Restarting position ids make transformers mask attention per row, where the model hands them to its mask
    builder (GPT-OSS does not); the state of recurrent or convolutional mixers runs across rows regardless.
    Decided by a probe, two rows packed against the second alone, named by the layer kinds where known."""
    config = model.config.get_text_config()
    kinds = set(getattr(config, "layer_types", None) or []) | set(getattr(config, "layers_block_type", None) or [])
    recurrent = sorted(k for k in kinds if any(r in k for r in RECURRENT_LAYER_KINDS))
    if recurrent:
        return f"{', '.join(recurrent)} layers carry state across packed rows (only attention restarts per row)"
    if rows_leak_when_packed(model):
        return (
            f"in {type(model).__name__} a packed row sees the rows before it (its attention masks do not "
            "restart at the positions, or a convolution or recurrent mixer runs across rows)"
        )
    return None


@torch.no_grad()
def rows_leak_when_packed(model, n: int = 8) -> bool:
    """True when the logits of a row packed after another differ from the row alone (fp32: ~1e-6; bf16
    kernels: ~1e-2 of the logits' scale; a leak: O(1))."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    first = torch.arange(3, 3 + n, device=device)[None] % vocab
    second = torch.arange(3 + n, 3 + 2 * n, device=device)[None] % vocab
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            alone = model(input_ids=second, use_cache=False).logits.float()
            positions = torch.arange(n, device=device).repeat(1, 2)
            both = model(input_ids=torch.cat([first, second], 1), position_ids=positions, use_cache=False)
    finally:
        model.train(was_training)
    tol = 1e-3 if both.logits.dtype == torch.float32 else 5e-2
    return float((both.logits[:, n:].float() - alone).abs().max()) > tol * max(1.0, float(alone.abs().max()))
