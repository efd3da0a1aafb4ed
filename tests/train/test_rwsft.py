"""Reward-weighted SFT at the level of the gradient: a weight-0 sample contributes exactly nothing, doubling
every weight doubles the gradient, weights stay with their samples through shuffling, bad rewards are named."""

import json

import pytest
import torch

from moe_qlora.config.sections import DataSection, LoraSection, RewardSection
from moe_qlora.data.examples import (
    DataError,
    Example,
    apply_reward_weights,
    build_examples,
    collate,
    epoch_order,
    micro_batches,
    reward_weights,
)
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer
from moe_qlora.train.sft import accumulate_gradients

TOK = build_byte_tokenizer()


@pytest.fixture(scope="module")
def model(tiny_mixtral_dir):
    m = attach_adapters(
        load_model(LoadOptions(str(tiny_mixtral_dir))), LoraSection(rank=4, target_modules=["q_proj"]), seed=0
    )
    with torch.no_grad():  # non-zero B: every LoRA factor gets a gradient
        for name, p in m.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return m


def sample(i, weight):
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(10, 200, (7 + 2 * i,), generator=g).tolist()
    return Example(ids, [-100] * 3 + ids[3:], f"d.jsonl:{i + 1}", weight)


def grads(model, batches):
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, [collate(b, 0) for b in batches])
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def targets(e):
    return sum(t != -100 for t in e.labels[1:])


def test_a_weight_zero_sample_contributes_exactly_nothing(model):
    a, b = sample(0, 0.0), sample(1, 1.0)
    only_zero = grads(model, [[a]])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in only_zero.values())
    # With B alone the step divides by B's targets; beside A by both: the only difference is that count.
    mixed, alone = grads(model, [[a, b]]), grads(model, [[b]])
    ratio = targets(b) / (targets(a) + targets(b))
    for n in mixed:
        torch.testing.assert_close(mixed[n], alone[n] * ratio, atol=1e-6, rtol=1e-4, msg=n)


def test_doubling_every_weight_doubles_the_gradient(model):
    one = grads(model, [[sample(0, 0.3), sample(1, 1.7)], [sample(2, 0.9)]])
    two = grads(model, [[sample(0, 0.6), sample(1, 3.4)], [sample(2, 1.8)]])
    for n in one:  # a power-of-two scale is exact in floating point
        assert torch.equal(two[n], 2 * one[n]), n


def test_weights_stay_with_their_samples_through_shuffling_and_batching():
    examples = [sample(i, float(i) / 10) for i in range(13)]
    for seed in (0, 1):
        for epoch in (0, 1, 2):
            seen = [
                (e.source, w)
                for mb in micro_batches(examples, epoch_order(13, seed=seed, epoch=epoch), 4)
                for e, w in zip(mb, collate(mb, 0)["weights"].tolist(), strict=True)
            ]
            assert sorted(seen) == sorted((e.source, pytest.approx(e.weight)) for e in examples)


def write_rows(tmp_path, rows):
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "bad,message",
    [
        ({}, "needs a numeric 'reward'"),
        ({"reward": "high"}, "'reward' must be"),
        ({"score": float("nan")}, "'score' must be a finite number"),
    ],
)
def test_a_missing_or_non_numeric_reward_names_the_file_and_line(tmp_path, bad, message):
    path = write_rows(
        tmp_path, [{"prompt": "p", "completion": "c", "reward": 1}, {"prompt": "p", "completion": "c", **bad}]
    )
    with pytest.raises(DataError, match=rf"r.jsonl:2: .*{message}"):
        build_examples(DataSection(train_files=[str(path)]), TOK, rewards=True)


def test_score_rows_as_llama_cpp_writes_them_carry_their_weight(tmp_path):
    path = write_rows(tmp_path, [{"prompt": "p", "response": "r", "score": 0.25}, {"text": "t", "score": 2}])
    examples, _ = build_examples(DataSection(train_files=[str(path)]), TOK, rewards=True)
    assert [e.weight for e in examples] == [0.25, 2.0]


def test_reward_mappings_clipping_and_negative_weights():
    r = [-1.0, 0.0, 1.0, 3.0]
    assert reward_weights(r, RewardSection(mapping="minmax")) == [0.0, 0.25, 0.5, 1.0]
    mean, std = 0.75, (sum((x - 0.75) ** 2 for x in r) / 4) ** 0.5  # population std over the dataset
    z = reward_weights(r, RewardSection(mapping="zscore", allow_negative=True))
    assert z == pytest.approx([(x - mean) / std for x in r])
    assert reward_weights(r, RewardSection(clip_min=0.0, clip_max=2.0)) == [0.0, 0.0, 1.0, 2.0]
    with pytest.raises(DataError, match="get a negative weight .* reward.allow_negative: true"):
        reward_weights(r, RewardSection())
    kept = apply_reward_weights([sample(0, 2.0), sample(1, 4.0)], RewardSection(mapping="minmax"))
    assert [(e.source, e.weight) for e in kept] == [("d.jsonl:1", 0.0), ("d.jsonl:2", 1.0)]


def test_rwsft_trains_from_the_cli_on_llama_cpp_style_rows(tmp_path):
    from typer.testing import CliRunner

    from moe_qlora.cli.app import app

    data = write_rows(
        tmp_path, [{"prompt": f"Add: {i}+1\n", "response": str(i + 1), "score": i % 3} for i in range(12)]
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "model: {name_or_path: 'builtin:tiny-mixtral'}\n"
        f"data: {{train_files: ['{data}'], max_seq_len: 32}}\n"
        "train: {objective: rwsft, max_steps: 4, micro_batch_size: 4, lr: 5.0e-3}\n"
        "reward: {mapping: minmax}\n"
        f"output: {{dir: '{tmp_path / 'run'}'}}\n"
    )
    result = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "rwsft: weights (minmax) from 0 to 1" in result.output
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()
