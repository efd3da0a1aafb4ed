"""Which attention a model runs, chosen per family and device rather than left to transformers' default.

SDPA where the family has it (no heads x N x N matrix on CUDA; transformers' default too). A family without it
(gpt-oss, whose attention sinks SDPA cannot take, and the others whose PreTrainedModel declares
`_supports_sdpa = False`) runs flex attention on CUDA: block-sparse, no N x N matrix, the sinks renormalised
through its log-sum-exp. Only where neither runs (such a family on the CPU) does it run eager attention, which
builds each layer's scores, softmax and saved probabilities: that is said in the run's summary and counted by
`moe-qlora plan` (eager_attention_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str  # transformers' attn_implementation: sdpa, flex_attention or eager
    why: str

    @property
    def builds_scores(self) -> bool:
        """Whether each layer holds a (batch, heads, N, N) score matrix: eager attention."""
        return self.implementation == "eager"

    def describe(self) -> str:
        return f"{self.implementation} ({self.why})"

    def load_kwargs(self) -> dict:
        """from_pretrained's arguments for this choice: flex attention asked for by name; SDPA and eager are what
        transformers picks by itself, and naming them would force them on every sub-model too (a multimodal
        model's audio or vision tower without SDPA refuses it: Gemma-4)."""
        return {"attn_implementation": self.implementation} if self.implementation == "flex_attention" else {}

    def as_loaded(self, config) -> AttentionChoice:
        """This choice, or what the loaded model's text config says it runs where that differs."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        loaded = getattr(text, "_attn_implementation", None) or self.implementation
        if loaded == self.implementation:
            return self
        return AttentionChoice(loaded, f"transformers' choice for {type(text).__name__}")


def choose_attention(model_class: type, device: str) -> AttentionChoice:
    """The attention `model_class` (a transformers PreTrainedModel class) runs on `device`."""
    family = model_class.__name__
    if getattr(model_class, "_supports_sdpa", False):
        return AttentionChoice("sdpa", "scaled_dot_product_attention")
    if torch.device(device).type == "cuda" and getattr(model_class, "_supports_flex_attn", False):
        return AttentionChoice("flex_attention", f"{family} has no SDPA path; flex attention builds no N x N matrix")
    where = "flex attention needs CUDA" if getattr(model_class, "_supports_flex_attn", False) else "nor flex"
    return AttentionChoice(
        "eager", f"{family} has no SDPA path and {where}: each layer builds its heads x N x N scores"
    )


def eager_attention_bytes(*, rows: int, heads: int, seq_len: int, itemsize: int, layers_kept: int) -> int:
    """What eager attention holds at its peak beyond the rest of the activations, for micro-batches of `rows`
    sequences of `seq_len` tokens: every layer whose activations are kept for the backward (`layers_kept`: the
    layers not checkpointed, plus the one being recomputed) keeps its probabilities (rows x heads x N x (N + 1):
    gpt-oss's sink column) for the matmul's and softmax's backward, and the layer being computed holds two more
    such matrices at once (the scores and their softmax in the forward; the gradients of both in the backward).
    Besides, the forward's additive causal mask (rows x 1 x N x N in the compute dtype), which transformers builds
    for eager attention only (SDPA is given none): 256 MiB in fp32 at 8,192 tokens."""
    matrix = rows * heads * seq_len * (seq_len + 1) * itemsize
    mask = rows * seq_len * seq_len * itemsize
    return (layers_kept + 2) * matrix + mask


def position_limit_note(config, seq_len: int) -> str | None:
    """What to say when rows of `seq_len` tokens run past the positions the model was trained on
    (max_position_embeddings), with what the family does there: its rope_scaling, or RoPE extrapolated as is."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not limit or seq_len <= limit:
        return None
    scaling = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    past = (
        f"its rope_scaling ({kind}, factor {scaling.get('factor')}) stretches the positions"
        if kind not in (None, "default")
        else "RoPE is extrapolated past them as is, which the model never saw"
    )
    return f"data.max_seq_len {seq_len} is past the model's max_position_embeddings {limit}: {past}"
