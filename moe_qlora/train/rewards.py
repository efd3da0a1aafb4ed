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

import torch

from moe_qlora.config.sections import ConfigError, RewardFunctionSpec

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
        module = _module_from_file(module_name) if module_name.endswith(".py") else importlib.import_module(
            module_name)  # fmt: skip
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


def score(functions: Sequence[RewardFunction], prompts: list[str], completions: list[str],
          columns: dict[str, list], *, policy: RewardPolicy = RewardPolicy(), groups: list[int] | None = None,
          sources: list[str] | None = None) -> tuple[list[float], dict[str, list[float]], int]:  # fmt: skip
    """(total reward per completion, each function's rewards, samples scored 0 after an error). Every value
    must be a finite number. `groups`: each completion's prompt index in the step (named when a call fails),
    `sources`: each completion's prompt row (file:line)."""
    per_fn, errors = {}, 0
    for f in functions:
        try:
            values = _checked_values(f, call_bounded(f.fn, policy.timeout_s, prompts, completions, **columns, **f.args),
                                     len(completions))  # fmt: skip
        except RewardError:
            raise
        except Exception as exc:
            values, failed = _score_around_failure(f, prompts, completions, columns, policy, groups, sources, exc)
            errors += failed
        per_fn[f.name] = values
    totals = [sum(f.weight * per_fn[f.name][i] for f in functions) for i in range(len(completions))]
    return totals, per_fn, errors


def _checked_values(f: RewardFunction, values, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward {f.name!r} returned {got} for {n} completions; "
                          "expected a list with one float per completion")  # fmt: skip
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        raise RewardError(f"reward {f.name!r} returned non-finite or non-numeric values, e.g. {bad[0]!r}")
    return [float(v) for v in values]


def _score_around_failure(f: RewardFunction, prompts, completions, columns, policy: RewardPolicy, groups, sources,
                          exc: Exception) -> tuple[list[float], int]:  # fmt: skip
    """After a call of `f` on the whole batch failed with `exc`: find the prompt whose completions make it fail
    (each prompt's completions scored alone; a timeout is not retried, every prompt is taken as failing), then
    abort naming it, or score its samples 0. Returns (values, samples scored 0)."""
    groups = groups if groups is not None else [0] * len(completions)
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    values, failed = [0.0] * len(completions), 0
    for g, rows in by_group.items():
        error = exc
        if not isinstance(exc, RewardTimeout):
            try:
                sub = call_bounded(f.fn, policy.timeout_s, [prompts[i] for i in rows], [completions[i] for i in rows],
                                   **{k: [v[i] for i in rows] for k, v in columns.items()}, **f.args)  # fmt: skip
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


def group_advantages(rewards: torch.Tensor, group_sizes: list[int], *, scale: bool, eps: float) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) within each group g (std unbiased, as TRL), or r_i - mean_g.

    rewards: (N,) in group order, N = sum(group_sizes). A group whose rewards are all equal gets A = 0
    exactly: its completions carry no learning signal (r - mean is 0 before any division).
    """
    out = torch.empty_like(rewards, dtype=torch.float64)
    start = 0
    for size in group_sizes:
        r = rewards[start : start + size].double()
        if bool((r == r[0]).all()):
            out[start : start + size] = 0.0  # exactly 0: no mean-rounding noise, no 0/0 when eps is 0
        else:
            centred = r - r.mean()
            out[start : start + size] = centred / (r.std(unbiased=True) + eps) if scale else centred
        start += size
    return out.float()


def flat_groups(group_sizes: list[int], advantages: torch.Tensor) -> int:
    """How many groups carry no signal (every advantage zero)."""
    start, n = 0, 0
    for size in group_sizes:
        n += int(bool((advantages[start : start + size] == 0).all()))
        start += size
    return n
