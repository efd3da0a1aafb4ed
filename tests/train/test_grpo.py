"""`moe-qlora grpo` end to end on the tiny model: the demo's reward rises, rollouts and metrics are logged,
generation with the KV cache agrees with the training forward, the reference policy is the base model,
offline scored completions train the same way, and user errors are named."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.grpo import GrpoSection
from moe_qlora.config.sections import LoraSection
from moe_qlora.data.examples import collate
from moe_qlora.model.adapters import adapters_disabled, attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer
from moe_qlora.moe.experts import generation_kernels
from moe_qlora.train.grpo import grpo, rollout_examples
from moe_qlora.train.losses import completion_logprobs
from moe_qlora.train.rollout import PromptRow, completion_end, sample_rollouts

from helpers.runs import offline_config

ROOT = Path(__file__).resolve().parents[2]
TOK = build_byte_tokenizer()


@pytest.fixture(scope="module")
def policy(tiny_mixtral_dir):
    """Experts and attention with LoRA, B non-zero so the adapters change the model."""
    model = attach_adapters(
        load_model(LoadOptions(str(tiny_mixtral_dir))), LoraSection(rank=4, target_modules=["q_proj", "v_proj"]), seed=0
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_demo_reward_rises_from_the_cli(tmp_path):
    """The GRPO demo of docs/training.md as a user runs it: the reward it trains on, exact_match, goes from ~0 to
    well over what any constant reply scores (0.5: half the numbers are odd), so the answer depends on the prompt."""
    env = {**os.environ, "MOE_QLORA_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "moe_qlora",
        "grpo",
        "--config",
        "configs/grpo-demo.yaml",
        "--set",
        f"output.dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    exact = [r["reward/exact_match"]["mean"] for r in records]
    assert [r["step"] for r in records] == list(range(1, 61))
    first, last = sum(exact[:5]) / 5, sum(exact[-5:]) / 5
    assert first < 0.2 and last > 0.65, (first, last)  # measured: 0.00 -> 0.82
    assert [r["reward_mean"] for r in records] == exact  # the format reward has weight 0: logged, not trained on
    step = records[0]
    assert {
        "reward_std",
        "reward/regex",
        "reward/exact_match",
        "advantage",
        "completion_tokens",
        "flat_groups",
        "generation_s",
        "rollout_tokens_per_s",
        "training_s",
        "grad_norm",
        "lr",
        "router_load",
    } <= set(step)
    assert all("clip_fraction" in r for r in records if r["sequences_trained"])  # (none while every group is flat)
    # the rollout speed: the step's completion tokens over the time in generate, a part of generation_s
    assert all(r["rollout_tokens_per_s"] >= r["completion_tokens_total"] / r["generation_s"] > 0 for r in records)
    assert "tok/s" in proc.stdout + proc.stderr
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 60 * 10 * 16  # steps x prompts x group size
    assert {"step", "prompt", "completion", "reward", "rewards", "advantage", "completion_tokens"} <= set(rollouts[0])
    # The logged advantages are the group-normalised logged rewards (a group: 16 consecutive rollouts of a step).
    for start in range(0, 10 * 16, 16):
        group = torch.tensor([r["reward"] for r in rollouts[start : start + 16]], dtype=torch.float64)
        expected = (group - group.mean()) / (group.std() + 1e-4) if group.std() > 0 else torch.zeros_like(group)
        torch.testing.assert_close(
            torch.tensor([r["advantage"] for r in rollouts[start : start + 16]], dtype=torch.float64),
            expected,
            rtol=1e-5,
            atol=1e-6,
        )
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("fast", [False, True], ids=["plain", "generation-path"])
def test_generation_with_the_kv_cache_matches_the_training_forward(policy, fast):
    """The log-probs generate() computes step by step (KV cache, MoE layer in inference mode, and with the
    rollout's generation path: experts.generation_kernels) equal the teacher-forced log-probs of the same tokens
    in one forward, within fp32 accumulation-order noise (1e-4)."""
    prompts = [
        PromptRow("p:1", TOK("Add: 2+3\n")["input_ids"], "Add: 2+3\n"),
        PromptRow("p:2", TOK("Reverse: stone, please\n")["input_ids"], "Reverse: stone, please\n"),
    ]
    cfg = GrpoSection(group_size=3, max_new_tokens=8, rewards=[{"function": "exact_match"}])
    torch.manual_seed(0)
    policy.eval()
    from moe_qlora.train.rollout import generation_config, left_pad

    ids, mask = left_pad([p.ids for p in prompts], TOK.pad_token_id)
    gen = generation_config(cfg, TOK)
    gen.return_dict_in_generate, gen.output_logits = True, True
    with torch.inference_mode(), generation_kernels(policy) if fast else contextlib.nullcontext():
        out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    steps = torch.stack(out.logits, dim=1).log_softmax(-1)  # (B, new, V)
    new = out.sequences[:, ids.shape[1] :]
    generated_logp = steps.gather(-1, new[..., None])[..., 0]
    for i in range(new.shape[0]):
        prompt = prompts[i // 3].ids
        n = completion_end(new[i].tolist(), TOK, TOK.eos_token_id, [])
        ex = rollout_examples([_rollout(prompts[i // 3], new[i, :n].tolist())], torch.zeros(1))
        with torch.no_grad():
            logp, m = completion_logprobs(policy, collate(ex, TOK.pad_token_id), temperature=1.0)
            with adapters_disabled(policy):  # control: a generation that skipped the adapters would be caught
                base_logp, _ = completion_logprobs(policy, collate(ex, TOK.pad_token_id), temperature=1.0)
        forced = logp[0][m[0]]
        assert len(forced) == n and len(prompt) > 0
        torch.testing.assert_close(forced, generated_logp[i, :n].float(), rtol=0, atol=1e-4)
        assert (base_logp[0][m[0]] - generated_logp[i, :n]).abs().max() > 1e-2


def _rollout(prompt, completion_ids):
    from moe_qlora.train.rollout import Rollout

    return Rollout(prompt, 0, completion_ids, TOK.decode(completion_ids))


def test_sample_rollouts_are_grouped_and_end_at_eos_or_stop(policy):
    prompts = [
        PromptRow("p:1", TOK("Add: 1+1\n")["input_ids"], "Add: 1+1\n", {"answer": "2"}),
        PromptRow("p:2", TOK("Add: 2+2\n")["input_ids"], "Add: 2+2\n", {"answer": "4"}),
    ]
    cfg = GrpoSection(group_size=4, max_new_tokens=5, rewards=[{"function": "exact_match"}])
    torch.manual_seed(1)
    policy.train()
    rollouts = sample_rollouts(policy, TOK, prompts, cfg)
    assert policy.training  # sampled in eval mode (no dropout), then the training mode is back
    assert [r.group for r in rollouts] == [0] * 4 + [1] * 4
    assert [r.prompt.source for r in rollouts] == ["p:1"] * 4 + ["p:2"] * 4
    assert all(1 <= len(r.completion_ids) <= 5 for r in rollouts)
    torch.manual_seed(1)
    again = sample_rollouts(policy, TOK, prompts, cfg)
    assert [r.completion_ids for r in again] == [r.completion_ids for r in rollouts]  # seeded: reproducible


def test_completion_end_by_hand():
    eos = TOK.eos_token_id
    ids = TOK("ab. cd")["input_ids"]
    assert completion_end([*ids, eos, 0, 0], TOK, eos, []) == len(ids) + 1  # through the EOS
    assert completion_end(ids, TOK, eos, []) == len(ids)  # max_new_tokens reached
    assert completion_end([*ids, eos], TOK, eos, ["."]) == 3  # "ab." : the token completing the stop string
    assert completion_end([*ids, eos], TOK, eos, [" c", "zz"]) == 5


def test_reference_policy_is_the_base_model_and_adapters_come_back(policy, tiny_mixtral_dir):
    ids = torch.tensor([TOK("Upper: castle\nCASTLE")["input_ids"]])
    base = load_model(LoadOptions(str(tiny_mixtral_dir)))
    policy.eval()
    with torch.no_grad():
        expected = base(input_ids=ids).logits
        adapted = policy(input_ids=ids).logits
        with adapters_disabled(policy):
            disabled = policy(input_ids=ids).logits
        restored = policy(input_ids=ids).logits
    assert (adapted - expected).abs().max() > 1e-2  # the adapters do change the model (control)
    torch.testing.assert_close(disabled, expected, rtol=0, atol=1e-5)  # same NF4 weights, same kernels
    assert torch.equal(restored, adapted)


def test_offline_scored_completions_train_towards_the_better_ones(tmp_path):
    result = grpo(offline_config(tmp_path, epochs=6), Console(quiet=True))
    rollouts = [json.loads(line) for line in result.rollouts_path.read_text().splitlines()]
    # Rewards 1, 0, 0, 0: mean 0.25, unbiased std 0.5 -> advantages 1.5, -0.5, -0.5, -0.5 (std_eps 1e-4).
    assert [round(r["advantage"], 3) for r in rollouts[:4]] == [1.5, -0.5, -0.5, -0.5]
    assert len(rollouts) == 6 * 16 * 4 and result.steps == 6 * 4
    # The trained adapter prefers the right answers: log p(right) - log p(wrong) grows against the base model.
    margins = {}
    for name, init in (("base", None), ("trained", str(result.adapter_dir))):
        cfg = offline_config(tmp_path, epochs=1).model_copy(deep=True)
        cfg.lora.init_from = init
        margins[name] = _right_minus_wrong(cfg)
    assert margins["trained"] > margins["base"] + 1.0, margins


def _right_minus_wrong(cfg) -> float:
    from moe_qlora.model.build import load_policy
    from moe_qlora.train.rollout import load_offline_groups, offline_rollouts

    model, _, _ = load_policy(cfg, _tiny(), Console(quiet=True))
    model.eval()
    groups = load_offline_groups(cfg.grpo.offline_file, cfg.data, TOK)
    rollouts = offline_rollouts(groups, TOK, 32)
    ex = rollout_examples(rollouts, torch.zeros(len(rollouts)))
    with torch.no_grad():
        logp, _ = completion_logprobs(model, collate(ex, TOK.pad_token_id), 1.0)
    seq = logp.sum(dim=1).view(-1, 4)
    return float((seq[:, 0] - seq[:, 1:].mean(dim=1)).mean())


def _tiny():
    from moe_qlora.model.model_path import resolve_model_path

    return resolve_model_path("builtin:tiny-mixtral")


def test_cli_grpo_user_errors_exit_2(tmp_path):
    data = ROOT / "data" / "demo_grpo.jsonl"
    no_section = tmp_path / "a.yaml"
    no_section.write_text(f"model: {{name_or_path: builtin:tiny-mixtral}}\ndata: {{train_files: [{data}]}}\n")
    result = CliRunner().invoke(app, ["grpo", "--config", str(no_section)])
    assert result.exit_code == 2 and "no `grpo:` section" in result.output
    bad_fn = tmp_path / "b.yaml"
    rewards = "grpo:\n  rewards:\n    - function: exact_match\n    - function: nowhere_module:fn\n"
    bad_fn.write_text(f"model: {{name_or_path: builtin:tiny-mixtral}}\ndata: {{train_files: [{data}]}}\n{rewards}")
    result = CliRunner().invoke(app, ["grpo", "--config", str(bad_fn), "--set", f"output.dir={tmp_path / 'o'}"])
    assert result.exit_code == 2 and "grpo.rewards.1.function" in result.output, result.output
    assert "Traceback" not in result.output
    missing_answer = tmp_path / "rows.jsonl"
    missing_answer.write_text('{"prompt": "Add: 1+1\\n", "solution": "2"}\n')
    result = CliRunner().invoke(
        app,
        [
            "grpo",
            "--config",
            str(bad_fn),
            "--set",
            f"data.train_files=[{missing_answer}]",
            "--set",
            "grpo.rewards=[{function: exact_match}]",
            "--set",
            f"output.dir={tmp_path / 'o2'}",
        ],
    )
    assert result.exit_code == 2 and "needs a 'answer' field" in result.output, result.output


def test_prompt_rows_strings_messages_and_overlength(tmp_path):
    from moe_qlora.config.sections import DataSection
    from moe_qlora.data.sources import DataError
    from moe_qlora.train.rollout import load_prompts

    rows = tmp_path / "p.jsonl"
    rows.write_text(
        '{"prompt": "Add: 1+1\\n", "answer": "2"}\n'
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ref"}], "answer": "x"}\n'
        '{"prompt": "' + "long " * 20 + '"}\n'
    )
    cfg = DataSection(train_files=[str(rows)], max_seq_len=40, overlength="drop")
    prompts, dropped = load_prompts(cfg, TOK, max_new_tokens=8)
    assert dropped == 1 and [p.source for p in prompts] == [f"{rows}:1", f"{rows}:2"]
    assert prompts[0].columns == {"answer": "2"} and prompts[0].ids == TOK("Add: 1+1\n")["input_ids"]
    # messages: the trailing reference answer is not part of the prompt; the template's generation prompt is.
    expected = TOK.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)["input_ids"]
    assert prompts[1].ids == expected and TOK.decode(expected) == "<|user|>Hi<|end|><|assistant|>"
    truncated, _ = load_prompts(cfg.model_copy(update={"overlength": "truncate"}), TOK, max_new_tokens=8)
    assert len(truncated[2].ids) == 32 and truncated[2].ids[-1] == TOK("long " * 20)["input_ids"][-1]  # keeps the end
    with pytest.raises(DataError, match=rf"{rows}:3: prompt of \d+ tokens"):
        load_prompts(cfg.model_copy(update={"overlength": "error"}), TOK, max_new_tokens=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"question": "no prompt"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: a GRPO prompt row needs 'prompt'"):
        load_prompts(DataSection(train_files=[str(bad)]), TOK, max_new_tokens=8)


def test_stop_strings_end_sampled_completions(policy):
    prompts = [PromptRow("p:1", TOK("Add: 1+1\n")["input_ids"], "Add: 1+1\n")]
    cfg = GrpoSection(group_size=16, max_new_tokens=12, stop=["a", "e", "o"], rewards=[{"function": "exact_match"}])
    torch.manual_seed(0)
    rollouts = sample_rollouts(policy, TOK, prompts, cfg)
    stopped = [r for r in rollouts if any(s in r.text for s in cfg.stop)]
    assert stopped, "with 3 common letters as stop strings some of 16 completions must hit one (control)"
    for r in stopped:  # nothing is kept after the first stop string
        assert any(r.text.endswith(s) for s in cfg.stop), r.text
