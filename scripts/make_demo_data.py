"""Regenerate data/demo_*.jsonl: small tasks a tiny byte-level MoE can learn in minutes on a CPU.

python scripts/make_demo_data.py
"""

import json
import random
from pathlib import Path

WORDS = (
    "apple river stone cloud tiger piano orange garden silver rocket candle forest "
    "window spider marble pencil dragon violet summer winter yellow basket castle dolphin"
).split()


def sft_rows(rng):
    rows = []
    for w in WORDS:
        rows.append({"prompt": f"Reverse: {w}\n", "completion": f"{w[::-1]}"})
        rows.append({"prompt": f"Upper: {w}\n", "completion": f"{w.upper()}"})
    for _ in range(40):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"Add: {a}+{b}\n", "response": f"{a + b}"})  # llama.cpp's qlora sample key
    rng.shuffle(rows)
    return rows


def chat_rows(rng):
    rows = []
    for w in rng.sample(WORDS, 16):
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": f"First letter of {w}?"},
                    {"role": "assistant", "content": w[0]},
                ]
            }
        )
    return rows


def rwsft_rows(rng):
    """Additions with a right and a wrong answer each, scored 1 and 0 (llama.cpp's `score` key)."""
    rows = []
    for _ in range(40):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"Add: {a}+{b}\n", "response": f"{a + b}", "score": 1.0})
        rows.append({"prompt": f"Add: {a}+{b}\n", "response": f"{a + b + rng.randint(1, 3)}", "score": 0.0})
    rng.shuffle(rows)
    return rows


def grpo_rows(rng):
    """Prompts for GRPO: additions with their `answer` (passed to the reward functions as a column)."""
    rows = []
    for _ in range(32):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"Add: {a}+{b}\n", "answer": f"{a + b}"})
    return rows


def grpo_parity_rows(rng):
    """The GRPO demo's task: is the number odd (1) or even (0)? One token to learn per prompt, from the number's
    last digit: a tiny random model samples it by chance often enough to learn it in a minute of RL."""
    rows = [{"prompt": f"Odd? {d}", "answer": str(d % 2)} for d in range(10)]
    rng.shuffle(rows)
    return rows


def grpo_offline_rows(rng):
    """Offline GRPO: each prompt with completions generated elsewhere and their rewards."""
    rows = []
    for _ in range(16):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = [str(a + b + d) for d in rng.sample([-2, -1, 1, 2, 3], 3)]
        completions = [str(a + b), *wrong]
        rows.append({"prompt": f"Add: {a}+{b}\n", "completions": completions, "rewards": [1.0, 0.0, 0.0, 0.0]})
    return rows


def main():
    rng = random.Random(0)
    out = Path(__file__).resolve().parent.parent / "data"
    sets = (
        ("demo_sft.jsonl", sft_rows(rng)),
        ("demo_chat.jsonl", chat_rows(rng)),
        ("demo_rwsft.jsonl", rwsft_rows(rng)),
        ("demo_grpo.jsonl", grpo_rows(random.Random(1))),
        ("demo_grpo_offline.jsonl", grpo_offline_rows(random.Random(2))),
        ("demo_grpo_parity.jsonl", grpo_parity_rows(random.Random(1))),
    )
    for name, rows in sets:
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
