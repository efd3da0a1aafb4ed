"""`moe-qlora dpo`'s section: which preference objectives (TRL 1.16's fifteen DPO loss types, several at once with
weights, plus SimPO and ORPO), their temperature, the f-divergence, LD-DPO's and WPO's reweighting, and the SFT term.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moe_qlora.config.base import Section

LossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
    "simpo",
    "orpo",
]
REFERENCE_FREE = ("simpo", "orpo")  # no reference policy: nothing is computed before the first step
# The loss types built on the chosen-minus-rejected score alone, where an f-divergence's log Z(x) term cancels
# (f-DPO); TRL 1.16 refuses the others with a divergence other than reverse KL.
F_DIVERGENCE_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
SMOOTHED = ("sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "simpo")  # the losses label_smoothing enters
SORTED = ("aot", "aot_unpaired")  # sort the micro-batch's pairs, so a per-pair weight would land on another pair
DEFAULT_BETA = {"simpo": 2.0}  # SimPO's paper (and TRL's docs for it); 0.1 elsewhere, TRL's default


class DpoSection(Section):
    """Preference training on (prompt, chosen, rejected) rows. With a reference (every loss type but simpo and
    orpo) the reference is the policy at step 0, scored once before the first step (no second model)."""

    loss_type: LossType | list[LossType] = Field(
        "sigmoid",
        description="one loss type or a list of them, summed with loss_weights (MPO). TRL 1.16's: sigmoid (DPO), "
        "hinge (SLiC), ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, "
        "apo_down, discopop, sft (the chosen completion's token NLL), sigmoid_norm (DPO on per-token means); "
        "and reference-free simpo (SimPO) and orpo (ORPO), alone or with sft. docs/training.md has each formula",
    )
    loss_weights: list[float] | None = Field(
        None, description="one weight per loss type of the list (TRL's loss_weights); default 1 each"
    )
    beta: float | None = Field(
        None,
        gt=0,
        description="the temperature of the margin (ipo: its tau; orpo: the weight of the odds-ratio term, its "
        "lambda); default 0.1, simpo 2.0",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="the assumed share of flipped labels: robust's noise rate (below 0.5), exo_pair's epsilon "
        "(above 0; 1e-3 in its paper), aot's and aot_unpaired's smoothing, and conservative DPO for sigmoid "
        "and simpo (TRL 1.16's sigmoid ignores it)",
    )
    f_divergence_type: Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"] = Field(
        "reverse_kl",
        description="the divergence to the reference (f-DPO, 2309.16240): each log-ratio u becomes f'(exp u); "
        "reverse_kl is DPO's. Loss types sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, discopop, sft only",
    )
    f_alpha_divergence_coef: float | None = Field(
        None, description="alpha of alpha_divergence, f'(t) = (t^(alpha - 1) - 1) / (alpha - 1); default 0.5"
    )
    ld_alpha: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="LD-DPO (2409.06411): the log-probabilities of a completion's tokens past the shorter "
        "completion's length count ld_alpha times (0: cut there; 1: plain DPO), in the policy and the reference",
    )
    use_weighting: bool = Field(
        False,
        description="WPO (2406.11827): each pair's loss times exp(mean token log(p / sum_v p_v^2)) of its chosen "
        "and of its rejected completion under the policy (no gradient through the weight)",
    )
    discopop_tau: float | None = Field(None, gt=0, description="discopop: the temperature of its mix; default 0.05")
    simpo_gamma: float | None = Field(
        None, ge=0.0, description="simpo: the target reward margin gamma (beta * margin >= gamma); default 0.5"
    )
    sft_weight: float | None = Field(
        None,
        ge=0.0,
        description="weight of the chosen completions' token NLL added to the loss (RPO's alpha; TRL's loss type "
        "sft with its weight, or cpo_alpha); default 0, orpo 1 (its SFT term); or list sft in loss_type",
    )

    @model_validator(mode="after")
    def _weights_and_defaults(self):
        """Fill the per-type defaults; refuse a weight list of the wrong length and an SFT weight given twice."""
        types = self.loss_types
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} weights for {len(types)} loss types {types}: one each"
            )
        free = [t for t in types if t in REFERENCE_FREE]
        if free and any(t not in (*REFERENCE_FREE, "sft") for t in types) or len(set(free)) > 1:
            raise ValueError(
                f"loss_type {types}: simpo and orpo have no reference (TRL's CPO and ORPO trainers); each runs "
                "alone, or with sft"
            )
        if "sft" in types and self.sft_weight is not None:
            raise ValueError("sft_weight and loss type sft are the same term: give its weight in one of them")
        if self.beta is None:
            self.beta = DEFAULT_BETA.get(free[0] if free else "", 0.1)
        return self

    @model_validator(mode="after")
    def _options_of_the_loss_types(self):
        """Refuse what TRL 1.16 refuses, with its reasons, and what the chosen losses would ignore."""
        types, listed = self.loss_types, ", ".join(self.loss_types)
        if self.f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_TYPES):
            raise ValueError(
                f"f_divergence_type {self.f_divergence_type} needs loss types built on the chosen-minus-rejected "
                f"score alone ({', '.join(F_DIVERGENCE_TYPES)}), where the divergence's normaliser cancels; "
                f"{listed} has no f-divergence form (reverse_kl is DPO's)"
            )
        unweighted = [t for t in types if t in (*SORTED, "sft", *REFERENCE_FREE)]
        if self.use_weighting and unweighted:
            why = {
                "aot": "it sorts the pairs, so a pair's weight would land on another pair",
                "aot_unpaired": "it sorts the pairs, so a pair's weight would land on another pair",
                "sft": "its term is one token mean over the batch, not a loss per pair (sft_weight's NLL is "
                "never weighted)",
                "simpo": "WPO is defined on DPO's losses",
                "orpo": "WPO is defined on DPO's losses",
            }
            raise ValueError(
                f"use_weighting weights each pair's loss; not loss type {unweighted[0]}: {why[unweighted[0]]}"
            )
        if "exo_pair" in types and self.label_smoothing == 0.0:
            raise ValueError("loss type exo_pair needs label_smoothing above 0 (its epsilon; the EXO paper uses 1e-3)")
        if "robust" in types and self.label_smoothing >= 0.5:
            raise ValueError(
                f"loss type robust needs label_smoothing below 0.5 (a noise rate), not {self.label_smoothing}"
            )
        self._refuse_ignored_options(types, listed)
        if self.f_divergence_type == "alpha_divergence" and self.f_alpha_divergence_coef is None:
            self.f_alpha_divergence_coef = 0.5  # TRL's
        if "discopop" in types and self.discopop_tau is None:
            self.discopop_tau = 0.05  # DiscoPOP's paper and TRL
        if "simpo" in types and self.simpo_gamma is None:
            self.simpo_gamma = 0.5  # SimPO's paper and TRL
        return self

    def _refuse_ignored_options(self, types: list[str], listed: str) -> None:
        """An option set for a loss it does not enter is refused, rather than ignored as TRL does."""
        if self.label_smoothing and not set(types) & set(SMOOTHED):
            raise ValueError(f"label_smoothing enters the {', '.join(SMOOTHED)} losses only; {listed} would ignore it")
        if self.f_alpha_divergence_coef is not None and self.f_divergence_type != "alpha_divergence":
            raise ValueError("f_alpha_divergence_coef is alpha_divergence's alpha; f_divergence_type is not that")
        if self.discopop_tau is not None and "discopop" not in types:
            raise ValueError(f"discopop_tau is discopop's temperature; {listed} would ignore it")
        if self.simpo_gamma is not None and "simpo" not in types:
            raise ValueError(f"simpo_gamma is SimPO's margin; loss type {listed} would ignore it")
        if self.ld_alpha is not None and not self.uses_reference:
            raise ValueError(f"ld_alpha reweights the log-ratios to the reference; {listed} has no reference")

    @property
    def loss_types(self) -> list[str]:
        """loss_type as a list."""
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights(self) -> list[float]:
        """One weight per loss type (1 each unless loss_weights)."""
        return list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(self.loss_types)

    @property
    def pair_losses(self) -> list[tuple[str, float]]:
        """(loss type, weight) of the per-pair losses: every listed type but sft, whose weight is sft_weight."""
        return [(t, w) for t, w in zip(self.loss_types, self.weights, strict=True) if t != "sft"]

    @property
    def nll_weight(self) -> float:
        """The weight of the chosen completions' token NLL: sft_weight, or loss type sft's weight, or 1 for orpo
        (its SFT term), else 0."""
        if self.sft_weight is not None:
            return self.sft_weight
        if "sft" in self.loss_types:
            return sum(w for t, w in zip(self.loss_types, self.weights, strict=True) if t == "sft")
        return 1.0 if "orpo" in self.loss_types else 0.0

    @property
    def uses_reference(self) -> bool:
        return not set(self.loss_types) & set(REFERENCE_FREE)

    @property
    def reference_free(self) -> str | None:
        """simpo or orpo, or None."""
        return next((t for t in self.loss_types if t in REFERENCE_FREE), None)
