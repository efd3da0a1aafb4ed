"""Reward functions and group-relative advantages against values computed by hand."""

import math
import sys
import types

import pytest
import torch

from moe_qlora.config.grpo import RewardFunctionSpec
from moe_qlora.config.sections import ConfigError
from moe_qlora.train.rewards import RewardError, flat_groups, group_advantages, resolve_reward, score


def test_group_advantages_by_hand():
    # Group 1: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    # Group 2: 2, 2, 2, 2 -> all equal: advantage exactly 0 (no signal).
    # Group 3: 3, 0 -> mean 1.5, unbiased std sqrt(2 * 2.25 / 1) = 2.12132
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 0.0])
    adv = group_advantages(rewards, [4, 4, 2], scale=True, eps=0.0)
    a1 = 0.5 / math.sqrt(1 / 3)
    a3 = 1.5 / math.sqrt(4.5)
    expected = [a1, -a1, -a1, a1, 0, 0, 0, 0, a3, -a3]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    assert flat_groups([4, 4, 2], adv) == 1


def test_group_advantages_eps_and_no_scaling():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, [4], scale=True, eps=0.1)
    torch.testing.assert_close(adv, torch.tensor([1, -1, -1, 1]) * 0.5 / (math.sqrt(1 / 3) + 0.1), rtol=0, atol=1e-6)
    centred = group_advantages(rewards, [4], scale=False, eps=0.1)  # Dr. GRPO: mean-centred only
    assert centred.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_group_advantages_use_each_group_not_the_batch():
    # Control: the same rewards normalised over the whole batch would give group 2 non-zero advantages.
    rewards = torch.tensor([0.0, 1.0, 5.0, 5.0])
    adv = group_advantages(rewards, [2, 2], scale=True, eps=0.0)
    assert adv[2:].tolist() == [0.0, 0.0]
    assert adv[0] < 0 < adv[1]


def test_builtin_rewards_by_hand():
    prompts = ["p"] * 4
    completions = ["  Eleven ", "11", "a1b2", ""]
    answers = ["eleven", "11", "12", "x"]
    assert resolve_reward(RewardFunctionSpec(function="exact_match"), 0).fn(prompts, completions, answer=answers) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    rx = resolve_reward(RewardFunctionSpec(function="regex", args={"pattern": "[0-9]", "mode": "share"}), 0)
    assert rx.fn(prompts, completions, **rx.args) == [0.0, 1.0, 0.5, 0.0]
    assert resolve_reward(RewardFunctionSpec(function="regex"), 0).fn(prompts, ["ab1"], pattern=r"^\d") == [0.0]
    length = resolve_reward(RewardFunctionSpec(function="length"), 0).fn
    assert length(prompts, ["abcd", "ab", "abcdefgh", ""], target=4) == [0.0, -0.5, -1.0, -1.0]
    ends = resolve_reward(RewardFunctionSpec(function="ends_with"), 0).fn
    assert ends(prompts, ["done.\n", "done", "."], suffix=".") == [1.0, 0.0, 1.0]


def test_weighted_total_and_user_function(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.count_a = lambda prompts, completions, **columns: [float(c.count("a")) for c in completions]
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    functions = [
        resolve_reward(RewardFunctionSpec(function="my_rewards:count_a", weight=0.5), 0),
        resolve_reward(RewardFunctionSpec(function="exact_match", weight=2.0), 1),
    ]
    totals, per_fn, errors = score(functions, ["p", "p"], ["aa", "b"], {"answer": ["aa", "c"]})
    assert per_fn == {"my_rewards:count_a": [2.0, 0.0], "exact_match": [1.0, 0.0]} and errors == 0
    assert totals == [0.5 * 2 + 2.0 * 1, 0.0]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], "returned 1 for 2 completions"),
        ([1.0, float("nan")], "non-finite"),
        (None, "returned NoneType"),
        (["1", 2.0], "non-numeric"),
    ],
)
def test_bad_reward_values_are_named(monkeypatch, returned, message):
    module = types.ModuleType("bad_rewards")
    module.fn = lambda prompts, completions, **columns: returned
    monkeypatch.setitem(sys.modules, "bad_rewards", module)
    f = resolve_reward(RewardFunctionSpec(function="bad_rewards:fn"), 0)
    with pytest.raises(RewardError, match=message) as err:
        score([f], ["p", "p"], ["a", "b"], {})
    assert "bad_rewards:fn" in str(err.value)


def test_unknown_reward_and_missing_column_are_named():
    with pytest.raises(ConfigError, match=r"grpo.rewards.2.function: 'exact' is neither a built-in"):
        resolve_reward(RewardFunctionSpec(function="exact"), 2)
    with pytest.raises(ConfigError, match="cannot load 'no_such_module_xyz:f'"):
        resolve_reward(RewardFunctionSpec(function="no_such_module_xyz:f"), 0)
    f = resolve_reward(RewardFunctionSpec(function="exact_match"), 0)
    with pytest.raises(RewardError, match="needs a 'answer' field"):
        score([f], ["p"], ["a"], {"solution": ["a"]})


def test_a_raising_reward_function_is_isolated_to_its_prompt(monkeypatch):
    """A call that raises is retried one prompt's completions at a time: abort names the first failing prompt (its
    index in the step and its row); zero scores only that prompt's samples 0 and counts them."""
    from moe_qlora.train.rewards import RewardFailed, RewardPolicy

    module = types.ModuleType("picky_rewards")

    def picky(prompts, completions, **columns):
        if "bad" in completions:
            raise ValueError("reward server unreachable")
        return [1.0] * len(completions)

    module.picky = picky
    monkeypatch.setitem(sys.modules, "picky_rewards", module)
    f = resolve_reward(RewardFunctionSpec(function="picky_rewards:picky"), 0)
    args = (["p"] * 4, ["ok", "ok", "bad", "ok"], {})
    where = dict(groups=[0, 0, 1, 1], sources=["a.jsonl:1", "a.jsonl:1", "a.jsonl:2", "a.jsonl:2"])
    with pytest.raises(
        RewardFailed,
        match=r"'picky_rewards:picky' failed on prompt 1 of step 7 \(a.jsonl:2\): "
        "ValueError: reward server unreachable",
    ):
        score([f], *args, policy=RewardPolicy(step=7), **where)
    totals, _, errors = score([f], *args, policy=RewardPolicy(on_error="zero", step=7), **where)
    assert totals == [1.0, 1.0, 0.0, 0.0] and errors == 2
