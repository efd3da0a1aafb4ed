"""Each training method's run-time checks of a config: what the schema cannot see key by key, and what depends
on how many processes the run has. Defined once, torch-free, so that `moe-qlora train|grpo|dpo` (and `--dry-run`)
refuse at once, before any heavy import; the recipes (train/recipe.py) run the same checks when built from Python.
"""

from __future__ import annotations

from moe_qlora.config.sections import ConfigError, RunConfig, check_shardable


def check_sft(cfg: RunConfig, *, world: int, source: str) -> None:
    """SFT and reward-weighted SFT over `world` processes."""
    check_sharding(cfg, world=world)
    if world > 1 and cfg.train.optimizer_in_backward:
        raise ConfigError(
            "train.optimizer_in_backward steps inside each rank's backward, before the gradients "
            "of the ranks are summed: set it false for a data-parallel run"
        )


def check_grpo(cfg: RunConfig, *, world: int, source: str) -> None:
    """GRPO over `world` processes: a grpo section, no step inside the backward, the entropy quantile alone."""
    if cfg.grpo is None:
        raise ConfigError(f"{source}: no `grpo:` section; moe-qlora grpo needs at least grpo.rewards")
    check_sharding(cfg, world=world)
    if cfg.train.optimizer_in_backward:
        raise ConfigError(
            "train.optimizer_in_backward is for `train` only: a GRPO step sums the gradients of all its "
            "rollout micro-batches (and of several passes) before it can update"
        )
    if world > 1 and cfg.grpo.top_entropy_quantile < 1:
        raise ConfigError(
            "grpo.top_entropy_quantile < 1 runs in one process for now: TRL takes the quantile over "
            "the micro-batches of every rank together, which moe-qlora does not gather"
        )


def check_dpo(cfg: RunConfig, *, world: int, source: str) -> None:
    """Preference training over `world` processes: a dpo section, pairs as they are (no packing, no weights),
    data parallel by whole pairs (ddp, fsdp or ep)."""
    if cfg.dpo is None:
        raise ConfigError(f"{source}: no `dpo:` section; moe-qlora dpo needs one (`dpo: {{}}` for DPO's defaults)")
    check_sharding(cfg, world=world)
    refusals = {
        "train.objective: rwsft": (
            cfg.train.objective == "rwsft",
            "weights rows by a reward; preference rows carry their preference in the pair",
        ),
        "data.packing": (cfg.data.packing, "would put a pair's chosen and rejected rows in other sequences"),
        f"data.format: {cfg.data.format}": (
            cfg.data.format != "auto",
            "names an SFT row format; preference rows are read by their keys (prompt, chosen, rejected)",
        ),
        "data.train_on_prompt": (cfg.data.train_on_prompt, "would score the prompt, which chosen and rejected share"),
        "data.all_assistant_turns": (
            cfg.data.all_assistant_turns,
            "is for messages rows; a preference completion is everything after the prompt",
        ),
        "train.optimizer_in_backward": (
            cfg.train.optimizer_in_backward,
            "updates inside the backward; a DPO step's loss is normalised over all its pairs first",
        ),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"{key} is not for `moe-qlora dpo`: it {why}")


def check_sharding(cfg: RunConfig, *, world: int) -> None:
    """train.parallel: fsdp or ep as asked, over several processes: what a sharded run cannot do (auto is decided, and
    checked the same way, when the model is placed: model/placement.py)."""
    if cfg.train.parallel in ("fsdp", "ep") and world > 1:
        check_shardable(cfg, layout=cfg.train.parallel)
    check_ep_settings(cfg, world=world)


def check_ep_settings(cfg: RunConfig, *, world: int) -> None:
    """train.ep_size and train.ep_dense: only under ep (or auto, which may choose it); ep_size at least 2 (1 would
    be ddp through an exchange with itself), and a divisor of the world size."""
    if cfg.train.ep_dense != "replicate" and cfg.train.parallel in ("ddp", "fsdp"):
        raise ConfigError(
            f"train.ep_dense: {cfg.train.ep_dense} places the non-expert part under train.parallel: ep, and this run "
            f"is {cfg.train.parallel}: set train.parallel: ep, or leave train.ep_dense out"
        )
    size = cfg.train.ep_size
    if not size:
        return
    if cfg.train.parallel in ("ddp", "fsdp"):
        raise ConfigError(
            f"train.ep_size: {size} splits the experts under train.parallel: ep, and this run is "
            f"{cfg.train.parallel}: set train.parallel: ep, or leave train.ep_size out"
        )
    if size == 1:
        raise ConfigError("train.ep_size: 1 keeps every expert on every rank, which is train.parallel: ddp: set ddp")
    if world > 1 and world % size:
        raise ConfigError(
            f"train.ep_size: {size} does not divide the {world} ranks launched: use a divisor of {world} (the "
            "ranks of one node, say), or 0 for all of them"
        )


CHECKS = {"train": check_sft, "grpo": check_grpo, "dpo": check_dpo}  # by command


def check_method(command: str, cfg: RunConfig, *, world: int, source: str) -> None:
    """The checks of `command`'s method (ConfigError naming the key, and `source` where the config is at fault)."""
    CHECKS[command](cfg, world=world, source=source)
