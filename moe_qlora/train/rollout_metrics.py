"""What a GRPO step logs of its rollout batch: reward, advantage and length statistics (metrics.jsonl), every
scored completion (rollouts.jsonl), and the ranks' shares gathered into one batch.
"""

from __future__ import annotations

import math
import statistics

import torch

from moe_qlora.common.reporting import MetricsLog
from moe_qlora.train.rewards import flat_groups


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def scored(values: list[float]) -> list[float]:
    """The values a reward function gave (NaN: it did not score that sample)."""
    return [v for v in values if not math.isnan(v)]


def _mean_std(values: list[float]) -> dict[str, float | None]:
    values = scored(values)
    return {"mean": statistics.fmean(values) if values else None, "std": statistics.pstdev(values) if values else None}


def rollout_metrics(rollouts, rewards, per_fn, advantages, group_sizes) -> dict:
    """Reward (total and per function, over the samples scored), advantage and completion-length statistics."""
    lengths = [len(r.completion_ids) for r in rollouts]
    totals = _mean_std(rewards)
    record = {
        "reward_mean": totals["mean"],
        "reward_std": totals["std"],
        "unscored": len(rewards) - len(scored(rewards)),
        "advantage": _spread(advantages.tolist()),
        "completion_tokens": _spread(lengths),
        "completion_tokens_total": sum(lengths),
        "flat_groups": flat_groups(group_sizes, advantages),
        "groups": len(group_sizes),
        "truncated_fraction": sum(r.truncated for r in rollouts) / len(rollouts),
    }
    for name, values in per_fn.items():
        record[f"reward/{name}"] = _mean_std(values)
    return record


def _json_number(v: float) -> float | None:
    return None if math.isnan(v) else v


def write_rollouts(log: MetricsLog, step: int, rollouts, rewards, per_fn, advantages) -> None:
    for i, (r, reward, adv) in enumerate(zip(rollouts, rewards, advantages.tolist(), strict=True)):
        log.write(
            {
                "step": step,
                "source": r.prompt.source,
                "group": r.group,
                "prompt": r.prompt.text,
                "completion": r.text,
                "completion_tokens": len(r.completion_ids),
                "truncated": r.truncated,
                "reward": _json_number(reward),
                "rewards": {k: _json_number(v[i]) for k, v in per_fn.items()},
                "advantage": adv,
            }
        )


def whole_batch(shares: list[tuple]) -> tuple:
    """The ranks' (rollouts, rewards, rewards per function, group sizes, advantages), in rank order, as one."""
    rollouts = [r for share in shares for r in share[0]]
    rewards = [x for share in shares for x in share[1]]
    names = sorted({k for share in shares for k in share[2]})
    per_fn = {k: [x for share in shares if share[0] for x in share[2][k]] for k in names}
    sizes = [n for share in shares for n in share[3]]
    return rollouts, rewards, per_fn, sizes, torch.tensor([a for share in shares for a in share[4]])
