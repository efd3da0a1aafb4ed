"""What one micro-batch's tokens hold while a run trains: the activations autograd keeps, eager attention's
matrices, the loss's logits (budget.one_device_plan adds them to the weights). N = micro-batch tokens,
d = compute bytes.
"""

from __future__ import annotations

import math

from torch import nn

from moe_qlora.config.sections import RunConfig, resolve_compute_dtype
from moe_qlora.model.attention import choose_attention, eager_attention_bytes
from moe_qlora.moe.expert_stacks import expert_dims, is_experts_module

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def micro_batch_tokens(cfg: RunConfig) -> int:
    """Tokens one forward holds at most: micro_batch_size sequences of data.max_seq_len; a config with a `dpo:`
    section is a `moe-qlora dpo` run, whose micro-batch of pairs is 2 x micro_batch_size sequences (chosen and
    rejected in one forward)."""
    rows = cfg.train.micro_batch_size * (2 if cfg.dpo is not None else 1)
    return rows * cfg.data.max_seq_len


def mlp_row_tokens(cfg: RunConfig) -> int:
    """Tokens the MoE layer and the MLPs work on at once: a chunk (moe/token_chunks.py), or the micro-batch
    (train.mlp_chunk_tokens 0, or auto, which plan.plan_run resolves before it plans with it)."""
    tokens, chunk = micro_batch_tokens(cfg), cfg.train.mlp_chunk_tokens
    return min(tokens, chunk) if chunk not in (0, "auto") else tokens


def activation_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """An estimate of activation memory for one micro-batch (N = batch * seq tokens, d = compute bytes).

    Checkpointed layers keep their input (N H d); the others, and the one being recomputed, keep a layer's
    activations (layer_activation_bytes). Eager attention's matrices are their own row (attention_bytes), as is
    the loss (loss_bytes). With train.offload_activations the checkpointed inputs are on the host but
    OFFLOADED_ON_GPU of them.
    """
    c, t = model.config, cfg.train
    tokens = micro_batch_tokens(cfg)
    d = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    layers = c.num_hidden_layers
    checkpointed = math.ceil(layers / t.checkpoint_interval) if t.gradient_checkpointing else 0
    kept_full = layers - checkpointed + (1 if checkpointed else 0)
    on_gpu = min(checkpointed, OFFLOADED_ON_GPU) if offloads_activations(cfg) else checkpointed
    return on_gpu * tokens * c.hidden_size * d + kept_full * layer_activation_bytes(model, cfg, device=device)


def layer_activation_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """What one decoder layer keeps for its backward: attention, norms and residuals (attention_layer_bytes),
    N K (2I + 2r) d for the MoE rows (h and the LoRA projections) and 2 N E fp32 for the router. Attention
    without an N x N matrix (SDPA, flex). With MLP chunks (train.mlp_chunk_tokens) the MoE rows are a chunk's,
    C K (2I + 2r) d, and each chunk keeps its input (N H d)."""
    c, lora = model.config, cfg.lora
    tokens = micro_batch_tokens(cfg)
    d, hidden = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)], c.hidden_size
    moe = [m for m in model.modules() if is_experts_module(m)]
    k = getattr(c, "num_experts_per_tok", 0) or 0
    experts, _, inter = expert_dims(moe[0]) if moe else (0, hidden, 0)
    rows = mlp_row_tokens(cfg)
    chunk_inputs = tokens * hidden * d if rows < tokens else 0
    moe_rows = rows * k * (2 * inter + 2 * lora.rank) * d
    return attention_layer_bytes(model, tokens, d) + chunk_inputs + moe_rows + 2 * tokens * experts * 4


def recomputed_layer_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """The part of activation_bytes held in the backward alone: the checkpointed layer being recomputed (none
    without checkpointing, where every layer's activations are held from the forward on)."""
    return layer_activation_bytes(model, cfg, device=device) if cfg.train.gradient_checkpointing else 0


# What a decoder layer's attention, norms and residuals hold at the peak of its forward and backward, per token, in
# units of d bytes, for widths H (hidden), A (q + k + v as the attention runs them) and W (the widest tensor an
# RMSNorm runs over: H, or q's width where the attention norms q per head). Fit to the peak of the tensors one
# layer's forward and backward create (tests/model/test_activation_estimate.py measures it on the CPU at the real
# widths of Qwen3-30B-A3B, Qwen3-235B-A22B, Mixtral-8x7B, Mixtral-8x22B and OLMoE, and holds this within
# [1, 1.25] of it). In bf16 the norms compute in fp32: their backward's temporaries at W are twice as many units.
# The peak is inside a norm's backward, the saved activations still held (bf16: 18.5 N H d for Mixtral-8x7B,
# 30 for Qwen3-30B-A3B, whose per-head q norm runs over 2H; the 12 N H d counted before issue 68's GPU run
# held for neither).
ATTENTION_UNITS = {2: (6.0, 4.0, 8.0), 4: (5.0, 2.5, 3.0)}  # d: (per H, per A, per W)
# A linear-attention layer (Qwen3-Next's gated delta net through transformers' torch path: its chunked recurrence
# keeps per-chunk states and decays) holds far more: measured 106 N H d in bf16 and 69 in fp32 at the peak of one
# real-width layer (tests/model/test_activation_estimate.py), counted 5% above. The recomputed layer may be of
# either kind: the larger counts.
LINEAR_ATTENTION_UNITS = {2: 112.0, 4: 73.0}  # d: per H


def attention_layer_bytes(model: nn.Module, tokens: int, d: int) -> int:
    """Peak bytes of one decoder layer's attention, norms and residuals over `tokens` tokens in d-byte compute
    (ATTENTION_UNITS): linear in the tokens, SDPA's and flex attention's blocks included; eager attention's
    N x N matrices are attention_bytes'."""
    c = model.config.get_text_config()
    q, k, v = attention_widths(c)
    per_h, per_a, per_w = ATTENTION_UNITS.get(d, ATTENTION_UNITS[2])
    units = per_h * c.hidden_size + per_a * (q + k + v) + per_w * normed_width(model, c.hidden_size, q, k)
    if "linear_attention" in (getattr(c, "layer_types", None) or ()):
        units = max(units, LINEAR_ATTENTION_UNITS.get(d, LINEAR_ATTENTION_UNITS[2]) * c.hidden_size)
    return int(tokens * units * d)


def attention_widths(c) -> tuple[int, int, int]:
    """The widths of q, k and v per token as the attention runs them: heads x head_dim; multi-head latent
    attention (DeepSeek-V2/V3) expands k and v to every head, qk_nope + qk_rope wide for q and k."""
    heads = c.num_attention_heads
    if getattr(c, "qk_nope_head_dim", None):
        qk = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
        return qk, qk, heads * c.v_head_dim
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
    return heads * head_dim, kv, kv


def normed_width(model: nn.Module, hidden: int, q: int, k: int) -> int:
    """The widest tensor a layer's RMSNorm runs over: the hidden states, or q and k where the attention norms them
    (`q_norm` / `k_norm`: Qwen3, OLMoE, Gemma), per head or over the whole width."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return max(hidden, q if "q_norm" in names else 0, k if "k_norm" in names else 0)


# Checkpointed layers' inputs on the GPU with train.offload_activations (common/saved_offload.py): the one the
# backward reads and the one coming back for it; in the forward, the one being copied out and the next made.
OFFLOADED_ON_GPU = 2


def offloads_activations(cfg: RunConfig) -> bool:
    """train.offload_activations as planned: true (auto counts as false here: plan.plan_run resolves it)."""
    return cfg.train.offload_activations is True and cfg.train.gradient_checkpointing


def host_activation_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """Page-locked host memory the offloaded layer inputs take: every checkpointed layer's, N H d each."""
    if not offloads_activations(cfg):
        return 0
    c, t = model.config, cfg.train
    d = DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)]
    return math.ceil(c.num_hidden_layers / t.checkpoint_interval) * micro_batch_tokens(cfg) * c.hidden_size * d


def attention_bytes(model: nn.Module, cfg: RunConfig, *, device: str) -> int:
    """Eager attention's score matrices (attention.eager_attention_bytes) when the family runs it on `device`
    (attention.choose_attention), else 0: SDPA's and flex attention's blocks are small beside the activations."""
    if not choose_attention(type(model), device).builds_scores:
        return 0
    c, t = model.config.get_text_config(), cfg.train
    rows = t.micro_batch_size * (2 if cfg.dpo is not None else 1)
    layers = c.num_hidden_layers
    checkpointed = math.ceil(layers / t.checkpoint_interval) if t.gradient_checkpointing else 0
    return eager_attention_bytes(
        rows=rows,
        heads=c.num_attention_heads,
        seq_len=cfg.data.max_seq_len,
        itemsize=DTYPE_BYTES[resolve_compute_dtype(cfg.model.compute_dtype, device)],
        layers_kept=layers - checkpointed + (1 if checkpointed else 0),
    )


def loss_bytes(model: nn.Module, cfg: RunConfig) -> int:
    """Logits the loss holds at once. Chunked (train.loss_chunk_tokens, losses.py): one fp32 (chunk, vocab)
    buffer reused for logits, softmax and gradient, plus logsumexp's temporary: 2 x 4 bytes. Full logits:
    ~3 x (tokens, vocab) fp32 for the micro-batch (logits, log-softmax, gradient)."""
    tokens = micro_batch_tokens(cfg)
    chunk = cfg.train.loss_chunk_tokens
    vocab = model.config.get_text_config().vocab_size
    return 2 * 4 * min(tokens, chunk) * vocab if chunk else 3 * 4 * tokens * vocab
