"""The settings that make a run fit: each knob an out-of-memory run can turn, with the memory `moe-qlora plan`'s
arithmetic says it saves (on one meta model built once); what `plan --gpu-gb` proposes and what an
out-of-memory message lists, largest saving first.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_qlora.config.load import deep_merge, parse_overrides, validate_config
from moe_qlora.model.budget import meta_model
from moe_qlora.model.plan import plan_run

# The knobs an out-of-memory run can turn, in the order the message tries them: (key, the value to set given
# the config, whether it applies). Their planned saving decides the order they are printed in. Expert offload
# trades PCIe copies for memory (and FSDP refuses it): last.
KNOBS: list[tuple[str, Callable, Callable]] = [
    ("train.micro_batch_size", lambda c: max(1, c.train.micro_batch_size // 2), lambda c: c.train.micro_batch_size > 1),
    ("data.max_seq_len", lambda c: max(16, c.data.max_seq_len // 2), lambda c: c.data.max_seq_len > 16),
    ("train.optimizer", lambda c: "adamw_8bit", lambda c: c.train.optimizer == "adamw"),
    ("train.optimizer_in_backward", lambda c: "true", lambda c: not c.train.optimizer_in_backward),
    ("train.loss_chunk_tokens", lambda c: 1024, lambda c: c.train.loss_chunk_tokens == 0),
    ("train.gradient_checkpointing", lambda c: "true", lambda c: not c.train.gradient_checkpointing),
    ("train.mlp_chunk_tokens", lambda c: "auto", lambda c: c.train.mlp_chunk_tokens == 0),
    (
        "train.offload_activations",
        lambda c: "auto",
        lambda c: c.train.offload_activations is False and c.train.gradient_checkpointing,
    ),
    (
        "model.expert_offload",
        lambda c: "auto",
        lambda c: c.model.expert_offload == "none" and c.train.parallel != "fsdp",
    ),
]


class Replan:
    """`moe-qlora plan`'s total (GiB) of a run's config with some settings (key=value) changed, on one meta model
    built once. plan_args: plan_run's gpus, parallel and gpu_gib."""

    def __init__(self, cfg, model_path: str, device: str, **plan_args):
        self.cfg, self.model_path, self.device, self.plan_args = cfg, model_path, device, plan_args
        self.model = meta_model(model_path, cfg.model.trust_remote_code)

    def total(self, settings: list[str]) -> float:
        """Raises (a ConfigError, a validation error) for settings the config validators refuse for this run."""
        cfg = self.cfg
        if settings:
            cfg = validate_config(deep_merge(cfg.model_dump(mode="json"), parse_overrides(settings)))
        plan = plan_run(cfg, name_or_path=self.model_path, device=self.device, model=self.model, **self.plan_args)
        return plan.total / 2**30


def knob_savings(cfg, model_path: str, device: str, **plan_args) -> tuple[float | None, list[tuple[str, float]]]:
    """(planned GiB of `cfg`, [(key=value, planned GiB saved)] largest saving first) from `moe-qlora plan`'s
    arithmetic (plan_args: plan_run's gpus, parallel, gpu_gib); a knob the config validators refuse for this run
    (e.g. optimizer_in_backward with grad_accum > 1) is left out. (None, []) when the plan cannot be made."""
    try:
        replan = Replan(cfg, model_path, device, **plan_args)
        base = replan.total([])
    except Exception:  # planning is advice: the run's own failure is what must be reported
        return None, []
    return base, sorted(setting_savings(replan, base), key=lambda s: -s[1])


def setting_savings(replan: Replan, base: float) -> list[tuple[str, float]]:
    """[(key=value, GiB saved)] of each knob that applies to the run and saves memory, alone."""
    savings = []
    for key, value_of, applies in KNOBS:
        if not applies(replan.cfg):
            continue
        setting = f"{key}={value_of(replan.cfg)}"
        try:
            total = replan.total([setting])
        except Exception:
            continue
        if base - total > 0:
            savings.append((setting, base - total))
    return savings


def settings_to_fit(cfg, model_path: str, device: str, *, gpu_gib: float, **plan_args) -> tuple[list[str], float]:
    """(settings, planned GiB) that make the run fit a GPU of `gpu_gib` GiB: the knob of largest saving among those
    that fit alone; when none does, the largest savings together, added one at a time until they fit. ([], the
    planned GiB of all together) when nothing fits, ([], nan) when no plan can be made."""
    try:
        replan = Replan(cfg, model_path, device, gpu_gib=gpu_gib, **plan_args)
        base = replan.total([])
    except Exception:  # as in knob_savings: advice, never a failure of its own
        return [], float("nan")
    savings = sorted(setting_savings(replan, base), key=lambda s: -s[1])
    for setting, saving in savings:
        if base - saving <= gpu_gib:
            return [setting], base - saving
    together, total = [], base
    for setting, _ in savings:
        try:
            total = replan.total([*together, setting])
        except Exception:  # refused beside the ones before it
            continue
        together.append(setting)
        if total <= gpu_gib:
            return together, total
    return [], total


LONGEST_STEP = 128  # tokens: plan --longest tries multiples of it
LONGEST_MAX = 1 << 21  # 2,097,152 tokens: the search's ceiling


def longest_seq_len(cfg, model_path: str, device: str, *, gpu_gib: float, **plan_args) -> tuple[int, float] | None:
    """(the longest data.max_seq_len, a multiple of LONGEST_STEP up to LONGEST_MAX, whose plan fits one GPU of
    gpu_gib GiB with the rest of `cfg` as it is; its planned GiB), or None when not even LONGEST_STEP tokens fit.
    Whether a plan fits never turns from no to yes as the length grows (each setting's total grows with it, and
    train.mlp_chunk_tokens auto takes the best of them), so a bisection: about 15 plans of one meta model."""
    replan = Replan(cfg, model_path, device, gpu_gib=gpu_gib, **plan_args)

    def planned(steps: int) -> float:
        return replan.total([f"data.max_seq_len={steps * LONGEST_STEP}"])

    fit, over = 0, LONGEST_MAX // LONGEST_STEP + 1  # fit: the longest known to fit (0: none); over: the shortest not
    while over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if planned(mid) <= gpu_gib else (fit, mid)
    return (fit * LONGEST_STEP, planned(fit)) if fit else None


def knob_lines(savings: list[tuple[str, float]]) -> str:
    """The knobs an out-of-memory run can turn, in order of planned saving; empty when the plan has none."""
    if not savings:
        return ""
    lines = ["To fit, try (planned saving, largest first; --set KEY=VALUE):"]
    return "\n".join(lines + [f"  {setting:<40} -{saving:.2f} GiB" for setting, saving in savings])
