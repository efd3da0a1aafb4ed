"""Reward functions for GRPO and group-relative advantages.

A reward function takes the batch's prompts, completions and the other columns of each prompt's row
(`answer`, ...), one entry per completion, and returns one finite float per completion. The total reward
is the weighted sum of the configured functions; advantages are taken within each prompt's group.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from moe_qlora.config.grpo import RewardFunctionSpec
from moe_qlora.config.sections import ConfigError
from moe_qlora.model.distributed import SINGLE, Ranks, sum_scalars

log = logging.getLogger(__name__)

RewardFn = Callable[..., list[float]]


class RewardError(ValueError):
    """A reward function that returned something unusable, or was asked for a column that is not there."""


def _column(columns: dict, name: str, fn: str) -> list:
    if name not in columns:
        raise RewardError(f"reward {fn!r} needs a {name!r} field in every prompt row; the rows have {sorted(columns)}")
    return columns[name]


def exact_match(prompts, completions, *, normalize: bool = True, **columns) -> list[float]:
    """1.0 where the completion equals the row's `answer` (whitespace-stripped and case-folded if normalize)."""
    answers = _column(columns, "answer", "exact_match")

    def norm(s) -> str:
        s = str(s)
        return " ".join(s.split()).casefold() if normalize else s

    return [float(norm(c) == norm(a)) for c, a in zip(completions, answers, strict=True)]


def regex(prompts, completions, *, pattern: str, mode: str = "search", **columns) -> list[float]:
    """Format reward. mode search: 1.0 if the pattern occurs; fullmatch: if it matches the whole completion;
    share: the fraction of the completion's characters inside matches (a dense reward)."""
    rx = re.compile(pattern)
    if mode == "search":
        return [float(rx.search(c) is not None) for c in completions]
    if mode == "fullmatch":
        return [float(rx.fullmatch(c) is not None) for c in completions]
    if mode == "share":
        return [sum(m.end() - m.start() for m in rx.finditer(c)) / max(len(c), 1) for c in completions]
    raise RewardError(f"regex reward: mode must be search, fullmatch or share, got {mode!r}")


def length(prompts, completions, *, target: int, **columns) -> list[float]:
    """Length penalty: -|characters - target| / target (0 at the target, -1 for an empty completion)."""
    if target <= 0:
        raise RewardError(f"length reward: target must be a positive number of characters, got {target!r}")
    return [-abs(len(c) - target) / target for c in completions]


def ends_with(prompts, completions, *, suffix: str, strip: bool = True, **columns) -> list[float]:
    """1.0 where the completion (right-stripped of whitespace if strip) ends with `suffix`."""
    return [float((c.rstrip() if strip else c).endswith(suffix)) for c in completions]


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "regex": regex, "length": length, "ends_with": ends_with}


@dataclass(frozen=True)
class RewardFunction:
    name: str
    fn: RewardFn
    weight: float
    args: dict


def resolve_reward(spec: RewardFunctionSpec, index: int) -> RewardFunction:
    """A built-in by name, or `module:function` imported from the Python path (the config asked for it)."""
    key = f"grpo.rewards.{index}.function"
    if spec.function in BUILTINS:
        return RewardFunction(spec.function, BUILTINS[spec.function], spec.weight, dict(spec.args))
    module_name, sep, attr = spec.function.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{key}: {spec.function!r} is neither a built-in ({', '.join(BUILTINS)}) nor `module:function` "
            "or `path/to/file.py:function`"
        )
    try:
        module = _module_from_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as exc:
        raise ConfigError(f"{key}: cannot load {spec.function!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {spec.function!r} is not callable")
    if spec.args:
        raise ConfigError(f"{key}: args are for built-ins; a user function gets (prompts, completions, **columns)")
    return RewardFunction(spec.function, fn, spec.weight, {})


def _module_from_file(path: str):
    """A reward module given as a file (relative paths were resolved against the config file)."""
    if not Path(path).is_file():
        raise OSError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(f"moe_qlora_reward_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RewardFailed(RuntimeError):
    """A reward function that raised or did not return in time (grpo.reward_errors: abort)."""


class RewardTimeout(TimeoutError):
    """A reward function call that ran past grpo.reward_timeout_s."""


@dataclass(frozen=True)
class RewardPolicy:
    """What a failing reward function call does: `abort` raises RewardFailed naming the function, the step and
    the prompt; `zero` scores the failing samples 0 and counts them. Each call is bounded by `timeout_s`."""

    on_error: str = "abort"
    timeout_s: float | None = None
    step: int = 0


def call_bounded(fn: Callable, timeout_s: float | None, *args, **kwargs):
    """fn(*args, **kwargs), raising RewardTimeout after `timeout_s`. The call runs on a daemon thread: a hung
    function cannot be stopped from Python, but it no longer holds the run (nor its exit)."""
    if timeout_s is None:
        return fn(*args, **kwargs)
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="moe-qlora-reward")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"did not return within grpo.reward_timeout_s = {timeout_s:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def score(
    functions: Sequence[RewardFunction],
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    *,
    policy: RewardPolicy = RewardPolicy(),
    groups: list[int] | None = None,
    sources: list[str] | None = None,
) -> tuple[list[float], dict[str, list[float]], int]:
    """(total reward per completion, each function's rewards, samples scored 0 after an error). Every value
    must be a finite number, or None where the function does not score that sample (TRL's convention): the
    total is then the weighted sum of the others, and NaN where no function scored it (its advantage is 0).
    `groups`: each completion's prompt index in the step (named when a call fails), `sources`: each
    completion's prompt row (file:line). Unscored values are NaN in the lists returned."""
    per_fn, errors = {}, 0
    for f in functions:
        try:
            values = _checked_values(
                f, call_bounded(f.fn, policy.timeout_s, prompts, completions, **columns, **f.args), len(completions)
            )
        except RewardError:
            raise
        except Exception as exc:
            batch = RewardBatch(prompts, completions, columns, groups, sources)
            values, failed = _score_around_failure(f, batch, policy, exc)
            errors += failed
        per_fn[f.name] = values
    return weighted_totals(per_fn, {f.name: f.weight for f in functions}), per_fn, errors


def weighted_totals(per_fn: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """Each sample's weighted sum over the functions that scored it (NaN: unscored); NaN if none did."""
    n = len(next(iter(per_fn.values()), []))
    totals = []
    for i in range(n):
        scored = [weights[name] * values[i] for name, values in per_fn.items() if not math.isnan(values[i])]
        totals.append(math.fsum(scored) if scored else math.nan)
    return totals


def _checked_values(f: RewardFunction, values, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(
            f"reward {f.name!r} returned {got} for {n} completions; expected a list with one float per completion"
        )
    bad = [v for v in values if v is not None and not _finite_number(v)]
    if bad:
        raise RewardError(
            f"reward {f.name!r} returned non-finite or non-numeric values, e.g. {bad[0]!r} "
            "(None: this function does not score that sample)"
        )
    return [math.nan if v is None else float(v) for v in values]


def _finite_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


class RewardBatch(NamedTuple):
    """What a reward function is called on: prompts, completions, the dataset's extra columns (each a list), and
    each completion's prompt index in the step and prompt row (file:line), named when a call fails."""

    prompts: list
    completions: list
    columns: dict
    groups: list[int] | None
    sources: list[str] | None


def _score_around_failure(
    f: RewardFunction, batch: RewardBatch, policy: RewardPolicy, exc: Exception
) -> tuple[list[float], int]:
    """After a call of `f` on the whole batch failed with `exc`: find the prompt whose completions make it fail
    (each prompt's completions scored alone; a timeout is not retried, every prompt is taken as failing), then
    abort naming it, or score its samples 0. Returns (values, samples scored 0)."""
    prompts, completions, columns, groups, sources = batch
    groups = groups if groups is not None else [0] * len(completions)
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    values, failed = [0.0] * len(completions), 0
    for g, rows in by_group.items():
        error = exc
        if not isinstance(exc, RewardTimeout):
            try:
                sub = call_bounded(
                    f.fn,
                    policy.timeout_s,
                    [prompts[i] for i in rows],
                    [completions[i] for i in rows],
                    **{k: [v[i] for i in rows] for k, v in columns.items()},
                    **f.args,
                )
                for i, v in zip(rows, _checked_values(f, sub, len(rows)), strict=True):
                    values[i] = v
                continue
            except RewardError:
                raise
            except Exception as sub_exc:
                error = sub_exc
        where = f"prompt {g} of step {policy.step}" + (f" ({sources[rows[0]]})" if sources else "")
        message = f"reward {f.name!r} failed on {where}: {type(error).__name__}: {error}"
        if policy.on_error == "abort":
            raise RewardFailed(message + " (grpo.reward_errors: zero scores such samples 0 instead)") from error
        log.warning("%s; its %d samples score 0 (grpo.reward_errors: zero)", message, len(rows))
        failed += len(rows)
    return values, failed


def nan_std(values: torch.Tensor) -> float:
    """The unbiased std of the non-NaN values (TRL's nanstd); NaN with fewer than two."""
    finite = values[~values.isnan()].double()
    return float(finite.std(unbiased=True)) if finite.numel() > 1 else math.nan


def group_advantages(
    rewards: torch.Tensor, group_sizes: list[int], *, scale: str | bool, eps: float, batch_std: float | None = None
) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std + eps) within each group g, as TRL's scale_rewards: group: the group's std
    (unbiased); batch: `batch_std`, the whole rollout batch's (all ranks); none: r_i - mean_g (True / False:
    group / none).

    rewards: (N,) in group order, N = sum(group_sizes); NaN for a sample no reward function scored, which is
    left out of its group's mean and std and gets A = 0, as does every sample of a group with one scored
    sample under group scaling. A group whose rewards are all equal gets A = 0 exactly: its completions carry
    no learning signal (r - mean is 0 before any division).
    """
    scale = {True: "group", False: "none"}.get(scale, scale)
    out = torch.zeros_like(rewards, dtype=torch.float64)
    start = 0
    for size in group_sizes:
        r = rewards[start : start + size].double()
        scored = ~r.isnan()
        values = r[scored]
        if values.numel() and not bool((values == values[0]).all()):
            centred = values - values.mean()
            std = {"group": nan_std(values), "batch": batch_std, "none": None}[scale]
            if std is not None:
                centred = centred / (std + eps)
            out[start : start + size][scored] = centred.nan_to_num(nan=0.0)
        start += size
    return out.float()


def normalized_then_summed(
    per_fn: dict[str, list[float]], weights: dict[str, float], group_sizes: list[int], *, eps: float
) -> torch.Tensor:
    """GDPO's aggregation (TRL's normalize_then_sum) before its batch whitening: each function's rewards z-scored
    within each group (unbiased std + eps; NaN where unscored, or the group has one scored value), then the
    weighted sum over the functions that have a value; NaN where none has. (N,) float64."""
    columns = []
    for name, values in per_fn.items():
        r = torch.tensor(values, dtype=torch.float64)
        z, start = torch.full_like(r, math.nan), 0
        for size in group_sizes:
            g = r[start : start + size]
            scored = g[~g.isnan()]
            if scored.numel():
                z[start : start + size] = (g - scored.mean()) / (nan_std(g) + eps)
            start += size
        columns.append(weights[name] * z)
    stacked = torch.stack(columns, dim=1)
    summed = stacked.nansum(dim=1)
    summed[stacked.isnan().all(dim=1)] = math.nan
    return summed


def whitened(values: torch.Tensor, mean: float, std: float, eps: float) -> torch.Tensor:
    """(v - mean) / (std + eps), 0 where v is NaN or the std is undefined: normalize_then_sum's last step, with
    the whole batch's mean and std (all ranks)."""
    return ((values - mean) / (std + eps)).nan_to_num(nan=0.0).float()


def flat_groups(group_sizes: list[int], advantages: torch.Tensor) -> int:
    """How many groups carry no signal (every advantage zero)."""
    start, n = 0, 0
    for size in group_sizes:
        n += int(bool((advantages[start : start + size] == 0).all()))
        start += size
    return n


def batch_moments(values: torch.Tensor, ranks: Ranks = SINGLE) -> tuple[float, float]:
    """Mean and unbiased std of the non-NaN values over every rank's share of the rollout batch (NaN std with
    fewer than two values)."""
    finite = values[~values.isnan()].double()
    n, total, squares = sum_scalars(ranks, finite.numel(), float(finite.sum()), float((finite**2).sum()))
    if n == 0:
        return math.nan, math.nan
    mean = total / n
    if n < 2:
        return mean, math.nan
    if not ranks.enabled:  # one process: the two-pass std, as TRL's nanstd computes it
        return mean, nan_std(finite)
    return mean, math.sqrt(max(squares - total * total / n, 0.0) / (n - 1))


def rollout_advantages(
    rewards: list[float],
    per_fn: dict[str, list[float]],
    group_sizes: list[int],
    g,
    weights: dict[str, float],
    ranks: Ranks = SINGLE,
) -> torch.Tensor:
    """Each completion's advantage from its rewards (NaN: scored by no function), as TRL's
    multi_objective_aggregation and scale_rewards define it; the batch's statistics over all ranks."""
    if g.multi_objective_aggregation == "normalize_then_sum":
        summed = normalized_then_summed(per_fn, weights, group_sizes, eps=g.std_eps)
        mean, std = batch_moments(summed, ranks)
        return whitened(summed, mean, std, g.std_eps)
    r = torch.tensor(rewards, dtype=torch.float64)
    batch_std = batch_moments(r, ranks)[1] if g.scale_rewards == "batch" else None
    return group_advantages(r, group_sizes, scale=g.scale_rewards, eps=g.std_eps, batch_std=batch_std)
