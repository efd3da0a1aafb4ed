"""TRL's own loss code as the test oracle: GRPOTrainer._compute_loss and DPOTrainer._compute_loss of the installed
TRL (the test extra pins trl==1.16.0), called on log-probability tables the test chooses.

A trainer is built without its __init__ (no model, no dataset, no accelerate state): the attributes its
_compute_loss reads are set from a real GRPOConfig / DPOConfig, so TRL's defaults are TRL's, and the model's
forward is replaced by the tables. What runs is TRL's code from the log-probabilities on: the ratios, clipping,
KL, masks, normalisers, the f-divergences, every loss type's formula, WPO's weights and LD-DPO's split.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import torch

TRL_VERSION = "1.16.0"


class OneProcess:
    """What the loss code asks of accelerate's Accelerator, for one process."""

    num_processes = 1
    sync_gradients = True
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def autocast(self):
        return contextlib.nullcontext()


def _training_module() -> torch.nn.Module:
    return torch.nn.Linear(1, 1).train()


def config(cls, **kwargs):
    """A TRL config (GRPOConfig, DPOConfig) for one CPU process. Its output folder is named, never written: no
    trainer built here saves anything."""
    out = os.path.join(tempfile.gettempdir(), "moe-qlora-trl-oracle")
    return cls(output_dir=out, report_to="none", use_cpu=True, bf16=False, **kwargs)


def grpo_trainer(micro_batches: int, **options):
    """A GRPOTrainer whose _compute_loss runs on tables given to `grpo_micro_loss`; `options`: GRPOConfig keys.
    The attributes are those TRL 1.16's __init__ copies from its config."""
    from trl import GRPOConfig, GRPOTrainer

    args = config(GRPOConfig, gradient_accumulation_steps=micro_batches, steps_per_generation=micro_batches, **options)
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args, t.model, t.accelerator = args, _training_module(), OneProcess()
    t.loss_type, t.beta, t.max_completion_length = args.loss_type, args.beta, args.max_completion_length
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.importance_sampling_level, t.off_policy_mask_threshold = (
        args.importance_sampling_level,
        args.off_policy_mask_threshold,
    )
    t.top_entropy_quantile, t.entropy_coef, t.use_adaptive_entropy = (
        args.top_entropy_quantile,
        args.entropy_coef,
        args.use_adaptive_entropy,
    )
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t._last_world_entropy, t._entropy_window_stats = float("inf"), None
    t.use_vllm, t.vllm_importance_sampling_correction = False, args.vllm_importance_sampling_correction
    t.aux_loss_enabled, t._metrics = False, {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = micro_batches
    return t


def grpo_micro_loss(trainer, logp, old, ref, advantages, mask, entropies, *, batch_tokens: int) -> torch.Tensor:
    """TRL's loss of one micro-batch: logp, old, ref, mask, entropies (B, T); advantages (B,); batch_tokens: the
    completion tokens of the whole generation batch (TRL's num_items_in_batch)."""
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropies, None)
    rows = logp.shape[0]
    inputs = {
        "prompt_ids": torch.ones(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": torch.ones_like(mask, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(batch_tokens)),
    }
    return trainer._compute_loss(None, inputs)


class TokenTables(torch.nn.Module):
    """The policy (or the reference) as DPOTrainer's fused LM head sees it: per-token log-probabilities of the
    (chosen; rejected) rows, (2P, L - 1), and log sum_v p_v^2 at each position (WPO's weights)."""

    def __init__(self, logps: torch.Tensor, log_sum_sq: torch.Tensor):
        super().__init__()
        self.logps, self.log_sum_sq = logps, log_sum_sq
        self.is_gradient_checkpointing = False

    def forward(self, **kwargs):
        zeros = torch.zeros_like(self.logps)
        return SimpleNamespace(
            log_probs=self.logps,
            log_sum_sq_probs=self.log_sum_sq,
            entropy=zeros,
            mean_logits=zeros,
            is_top1=zeros.bool(),
            aux_loss=None,
        )


def dpo_trainer(**options):
    """A DPOTrainer whose _compute_loss runs on TokenTables; `options`: DPOConfig keys (loss_type a list or a str).
    The attributes are those TRL 1.16's __init__ copies from its config."""
    from trl import DPOConfig, DPOTrainer

    args = config(DPOConfig, precompute_ref_log_probs=True, **options)
    t = DPOTrainer.__new__(DPOTrainer)
    t.args, t.accelerator = args, OneProcess()
    t.beta, t.precompute_ref_logps = args.beta, True
    t.ref_model = None  # the reference's log-probabilities are given (precompute_ref_log_probs)
    t.loss_types = args.loss_type
    t.loss_weights = args.loss_weights or [1.0] * len(t.loss_types)
    t.ld_alpha, t.f_divergence_type = args.ld_alpha, args.f_divergence_type
    t.f_alpha_divergence_coef, t.label_smoothing, t.use_weighting = (
        args.f_alpha_divergence_coef,
        args.label_smoothing,
        args.use_weighting,
    )
    t.aux_loss_enabled, t._metrics = False, {"train": defaultdict(list), "eval": defaultdict(list)}
    t._total_train_tokens, t._tp_size = 0, 1
    return t


def dpo_loss(trainer, policy: TokenTables, reference: TokenTables, completion_mask: torch.Tensor) -> torch.Tensor:
    """TRL's loss of one batch of pairs: the reference's summed log-probabilities from TRL's compute_ref_log_probs
    (LD-DPO's weighting included), then _compute_loss. completion_mask: (2P, L), chosen rows first."""
    inputs = {
        "input_ids": torch.ones_like(completion_mask, dtype=torch.long),
        "attention_mask": torch.ones_like(completion_mask, dtype=torch.long),
        "completion_mask": completion_mask.long(),
    }
    trainer.model = policy.train()
    with torch.no_grad():
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(reference, inputs)
    trainer.model = policy.train()
    return trainer._compute_loss(
        policy, {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}, False
    )


def dpo_refusal(**options) -> BaseException | None:
    """What TRL 1.16 raises for these DPOConfig options when a DPOTrainer is built (a two-layer Llama and one
    preference row), or None when it builds. TRL's own checks: DPOConfig.__post_init__ and DPOTrainer.__init__."""
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from moe_qlora.model.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    size = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **size))
    rows = Dataset.from_dict({"prompt": ["Say A\n"], "chosen": ["A"], "rejected": ["B"]})
    try:
        args = config(DPOConfig, **options)
        DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    except (ValueError, NotImplementedError) as refused:
        return refused
    return None
