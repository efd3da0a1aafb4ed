"""`moe-qlora grpo`'s section: the rollout batch and sampling, the reward functions, the objective (loss type,
clipping, importance sampling, KL and entropy terms) and offline rollouts from scored completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from moe_qlora.config.base import Section


class RewardFunctionSpec(Section):
    """One reward function of `grpo.rewards`; the total reward is the weighted sum of all of them."""

    function: str = Field(
        description="a built-in (exact_match, regex, length, ends_with) or `module:function` with signature "
        "(prompts, completions, **columns) -> list[float]"
    )
    weight: float = Field(1.0, description="its weight in the total reward")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of a built-in")


DAPO_CLIP_HIGH = 0.28
CISPO_CAP = 5.0  # ScaleRL's epsilon_max for CISPO's importance weight


class GrpoSection(Section):
    """`moe-qlora grpo`: sample a group of completions per prompt, score them, train on the advantages."""

    prompts_per_step: int = Field(2, ge=1, description="prompts per rollout batch (one optimizer step per pass)")
    group_size: int = Field(4, ge=2, description="G completions sampled per prompt; advantages are within a group")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0, description="sampling temperature; log-probs are taken at it too")
    top_p: float = Field(1.0, gt=0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: off")
    stop: list[str] = Field(default_factory=list, description="stop strings: a completion ends after one")
    passes: int = Field(1, ge=1, description="optimizer steps per rollout batch; >1 uses the clipped ratio")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="ratio clipped to [1 - clip_eps, 1 + clip_eps_high]")
    clip_eps_high: float | None = Field(
        None, gt=0, description="upper clip (DAPO's clip-higher); default 0.28 with loss_type dapo, else clip_eps"
    )
    kl_coef: float = Field(0.0, ge=0, description="beta of the KL penalty to the base model (adapters off); 0: off")
    use_bias_correction_kl: bool | None = Field(
        None,
        description="the KL estimate times the ratio pi / pi_old (DeepSeek-V3.2's unbiased KL, 2512.02556); "
        "default: on whenever kl_coef is (TRL 1.16's default, true)",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="advantage = (r - group mean) / (std + std_eps), the std of: group: the group (GRPO); batch: "
        "the whole rollout batch (Lite PPO, 2508.08221); none: not divided (Dr. GRPO); true / false: group / none",
    )
    std_eps: float = Field(1e-4, gt=0, description="(r - mean) / (std + std_eps)")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="several reward functions: sum_then_normalize: the weighted sum, then scale_rewards; "
        "normalize_then_sum: each function z-scored in its group, weighted sum, then whitened over the batch "
        "(GDPO, 2601.05242; scale_rewards unused)",
    )
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = Field(
        "dapo",
        description="the objective, as in TRL: dapo: clipped, / completion tokens of the whole batch; grpo: mean "
        "per completion, then over completions; dr_grpo: / (completions * max_new_tokens), no length bias; "
        "bnpo: / completion tokens of each micro-batch; cispo: log pi times the detached ratio capped at "
        "clip_eps_high (MiniMax-M1, 2506.13585), token mean; sapo: a soft sigmoid gate instead of the clip "
        "(SAPO, 2511.20347), per-completion mean; luspo: GSPO's sequence loss times the completion's length "
        "(LUSPO, 2602.05261); vespo: log pi times a detached weight of the sequence ratio (VESPO, 2602.10693)",
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="cap the ratio at delta for negative advantages too (INTELLECT-2's two-sided "
        "clipping, 2505.07291); above 1 + clip_eps_high; clipped loss types only",
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: the gate's temperature for positive advantages")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: the gate's temperature for the others")
    vespo_k_pos: float = Field(2.0, description="vespo: k of phi(W) = W^k exp(lambda (1 - W)), advantage >= 0")
    vespo_lambda_pos: float = Field(3.0, description="vespo: lambda, advantage >= 0")
    vespo_k_neg: float = Field(3.0, description="vespo: k, advantage < 0")
    vespo_lambda_neg: float = Field(2.0, description="vespo: lambda, advantage < 0")
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="train only the completion tokens in this top fraction of entropy, per "
        "micro-batch (Beyond the 80/20 Rule, 2506.01939; 0.2 there); 1: all",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: loss - entropy_coef * the mean token entropy of the completions"
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        description="leave out of the policy term a completion with a negative advantage whose mean "
        "log(pi_sampled / pi) exceeds this (DeepSeek-V3.2's off-policy sequence masking; 0.5 suggested); acts "
        "from the second pass on (passes > 1), where the policy has moved",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token: one ratio per token (GRPO); sequence: the completion's mean log-ratio (GSPO)"
    )
    mask_truncated_completions: bool = Field(
        False, description="completions cut by max_new_tokens (no EOS or stop string) are left out of the loss"
    )
    rewards: list[RewardFunctionSpec] = Field(default_factory=list, description="reward functions (online mode)")
    reward_errors: Literal["abort", "zero"] = Field(
        "abort",
        description="a reward function that raises or times out: abort (checkpoint the completed steps, name the "
        "function, step and prompt, exit 1) or zero (the failing samples score 0, counted in reward_errors)",
    )
    reward_timeout_s: float = Field(600.0, gt=0, description="seconds one reward function call may take")
    offline_file: str | None = Field(
        None, description="JSONL of {prompt, completions, rewards}: train on these instead of sampling"
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict) and "loss_normalization" in data:
            raise ValueError("grpo.loss_normalization is now grpo.loss_type (token: dapo, sequence: grpo)")
        if isinstance(data, dict) and isinstance(data.get("scale_rewards"), bool):
            data = {**data, "scale_rewards": "group" if data["scale_rewards"] else "none"}  # TRL's old values
        return data

    @model_validator(mode="after")
    def _dapo_clip_higher(self):
        """DAPO's clip-higher (eps_high 0.28) is the default upper clip of loss_type dapo, as in its paper;
        cispo's cap on its importance weight defaults to 5 (ScaleRL's, as TRL's docs advise: TRL itself falls
        back to clip_eps, 0.2, which scales every on-policy token's gradient by 0.2)."""
        if self.clip_eps_high is None and self.loss_type == "dapo":
            self.clip_eps_high = DAPO_CLIP_HIGH
        if self.clip_eps_high is None and self.loss_type == "cispo":
            self.clip_eps_high = CISPO_CAP
        return self

    @model_validator(mode="after")
    def _options_of_the_loss_type(self):
        """Refuse what the chosen objective would ignore or TRL computes over padding."""
        if self.delta is not None and self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            raise ValueError(f"delta caps the clipped objective's ratio; loss_type {self.loss_type} has none")
        if self.delta is not None and self.delta <= 1 + (self.clip_eps_high or self.clip_eps):
            bound = 1 + (self.clip_eps_high or self.clip_eps)
            raise ValueError(
                f"delta ({self.delta:g}) must be above 1 + clip_eps_high ({bound:g}), or it caps "
                "positive advantages too"
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and self.offline_file is not None:
            raise ValueError(
                "multi_objective_aggregation normalize_then_sum needs each reward function's scores; "
                "an offline_file holds only the total"
            )
        if self.use_bias_correction_kl and not self.kl_coef:
            raise ValueError("use_bias_correction_kl corrects the KL term, which is off (kl_coef: 0)")
        if self.use_bias_correction_kl is None:
            self.use_bias_correction_kl = bool(self.kl_coef)  # TRL 1.16: true by default
        return self

    def advice(self) -> list[str]:
        """What TRL 1.16 warns about in a setting it still computes: settings that differ from the papers."""
        notes = []
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            notes.append("loss_type luspo: the paper's setup is importance_sampling_level: sequence")
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            notes.append(
                "loss_type vespo weights by the sequence's likelihood ratio itself: importance_sampling_level: "
                "sequence changes only the ratio in the KL's bias correction"
            )
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            notes.append(
                f"importance_sampling_level sequence with loss_type {self.loss_type} sums per-token terms, which "
                "weights each completion by its length; GSPO's setup is loss_type grpo"
            )
        return notes

    @model_validator(mode="after")
    def _rewards_or_offline(self):
        if self.offline_file is None and not self.rewards:
            raise ValueError("grpo needs reward functions (grpo.rewards) or scored completions (grpo.offline_file)")
        return self
