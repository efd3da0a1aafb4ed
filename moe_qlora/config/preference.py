"""`moe-qlora dpo`'s section: which preference objective, its temperature and margins, and the SFT term."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moe_qlora.config.base import Section

REFERENCE_FREE = ("simpo", "orpo")  # no reference policy: nothing is computed before the first step
LENGTH_AVERAGED = ("ipo", "simpo", "orpo")  # their log-probabilities are per-token means, as in the papers and TRL
SMOOTHED = ("sigmoid", "robust", "simpo")  # the losses label_smoothing enters
DEFAULT_BETA = {"simpo": 2.0}  # SimPO's paper (and TRL's docs for it); 0.1 elsewhere, TRL's default


class DpoSection(Section):
    """Preference training on (prompt, chosen, rejected) rows. With a reference (every loss type but simpo and
    orpo) the reference is the policy at step 0, scored once before the first step (no second model)."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO (Rafailov et al. 2023), -log sigmoid(beta * margin); ipo: (margin - 1/(2 beta))^2 "
        "on per-token mean log-probs (Azar et al. 2023); hinge: relu(1 - beta * margin) (SLiC); robust: DPO "
        "unbiased under label noise label_smoothing (Chowdhury et al. 2024); simpo: reference-free, per-token "
        "mean log-probs, margin simpo_gamma (Meng et al. 2024); orpo: reference-free odds ratio plus the NLL of "
        "the chosen completion (Hong et al. 2024). margin: (policy - reference) log-ratio of chosen minus rejected",
    )
    beta: float | None = Field(
        None,
        gt=0,
        description="the temperature of the margin (orpo: the weight of the odds-ratio term, its lambda); "
        "default 0.1, simpo 2.0",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="the assumed share of flipped labels (conservative DPO for sigmoid and simpo, robust's "
        "noise rate); sigmoid, robust and simpo only",
    )
    simpo_gamma: float | None = Field(
        None, ge=0.0, description="simpo: the target reward margin gamma (beta * margin >= gamma); default 0.5"
    )
    sft_weight: float | None = Field(
        None,
        ge=0.0,
        description="weight of the chosen completion's mean token NLL added to the loss (RPO's alpha; TRL's "
        "rpo_alpha / cpo_alpha); default 0, orpo 1 (its SFT term)",
    )

    @model_validator(mode="after")
    def _options_of_the_loss_type(self):
        """Fill the per-type defaults and refuse what the chosen loss would ignore."""
        if self.beta is None:
            self.beta = DEFAULT_BETA.get(self.loss_type, 0.1)
        if self.sft_weight is None:
            self.sft_weight = 1.0 if self.loss_type == "orpo" else 0.0
        if self.label_smoothing and self.loss_type not in SMOOTHED:
            raise ValueError(
                f"label_smoothing enters the {', '.join(SMOOTHED)} losses only; loss_type {self.loss_type} "
                "would ignore it"
            )
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ValueError(f"simpo_gamma is SimPO's margin; loss_type {self.loss_type} would ignore it")
        if self.simpo_gamma is None and self.loss_type == "simpo":
            self.simpo_gamma = 0.5  # SimPO's paper and TRL
        return self

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in REFERENCE_FREE

    @property
    def length_averaged(self) -> bool:
        return self.loss_type in LENGTH_AVERAGED
