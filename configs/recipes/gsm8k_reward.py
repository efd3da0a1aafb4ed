"""GSM8K's correctness reward for qwen3-30b-a3b-grpo.yaml: 1.0 where the completion's last number equals the
reference answer (the number after `####` in GSM8K's `answer` column; a bare answer such as "42" is used as is).

Named in the recipe as `gsm8k_reward.py:final_number_matches` (the path is relative to the recipe).
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def number(text: str) -> float | None:
    """The last number in `text` ("1,234.50" -> 1234.5), or None when it has none."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def final_number_matches(prompts, completions, *, answer, **columns) -> list[float]:
    """One reward per completion: 1.0 if its last number is the reference's final number, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = number(str(reference).rpartition("####")[2])
        got = number(completion)
        rewards.append(float(expected is not None and got is not None and abs(got - expected) < 1e-6))
    return rewards
