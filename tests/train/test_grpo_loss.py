"""The GRPO loss against values computed by hand: ratio clipping, the KL estimator, normalisation."""

import math

import pytest
import torch

from moe_qlora.train.grpo_loss import MicroBatchTerms, Objective, grpo_token_loss, token_weights

LN = math.log


def loss_of(logp, old, ref, adv, mask, *, clip=0.2, clip_high=None, kl=0.0, norm="dapo", total_seqs=None):
    weights = token_weights(mask, norm, total_tokens=int(mask.sum()), total_sequences=total_seqs or mask.shape[0])
    objective = Objective.clipped(clip, clip_high or clip, kl_coef=kl)
    return grpo_token_loss(MicroBatchTerms(logp, old, ref, adv, weights), objective)


def test_clipped_ratio_by_hand():
    # Token 1: p 0.5 now, 0.4 when sampled -> ratio 1.25. A = +1: min(1.25, clip to 1.2) = 1.2 -> loss -1.2,
    # clipped (no gradient). Token 2: same ratio, A = -1: min(-1.25, -1.2) = -1.25 -> loss +1.25, not clipped.
    # Token 3: ratio 0.5 / 0.8 = 0.625, A = -1: min(-0.625, -0.8) = -0.8 -> loss 0.8, clipped.
    logp = torch.tensor([[LN(0.5)], [LN(0.5)], [LN(0.5)]], requires_grad=True)
    old = torch.tensor([[LN(0.4)], [LN(0.4)], [LN(0.8)]])
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, stats = loss_of(logp, old, None, adv, mask)
    assert loss.item() == pytest.approx((-1.2 + 1.25 + 0.8) / 3, abs=1e-6)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 3, abs=1e-6)
    loss.backward()
    # d/dlogp of -ratio*A = -ratio*A for the unclipped token; zero where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [1.25 / 3], [0.0]]), rtol=0, atol=1e-6)


def test_clip_higher_bound():
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    old = torch.tensor([[LN(0.4)]])
    loss, _ = loss_of(logp, old, None, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)  # 1.25 < 1.28: not clipped any more


def test_one_pass_is_the_plain_policy_gradient():
    # old_logp None: ratio = 1 in value, and the gradient is A * dlogp (the REINFORCE / rwsft gradient with
    # weight A): loss = -mean(A), grad = -A / N per token.
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([0.7, -0.3])
    loss, stats = loss_of(logp, None, None, adv, torch.ones(2, 2, dtype=torch.bool))
    assert loss.item() == pytest.approx(-(0.7 * 2 - 0.3 * 2) / 4, abs=1e-7)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.7, -0.7], [0.3, 0.3]]) / 4)
    assert stats["clip_fraction"].item() == 0


def test_kl_k3_by_hand():
    # ref - logp = d: KL = e^d - d - 1. d = ln(0.2) - ln(0.5): 0.4 - ln(0.4) - 1 = 0.316291; with A = 0 only KL.
    logp = torch.tensor([[LN(0.5), LN(0.3)]], requires_grad=True)
    ref = torch.tensor([[LN(0.2), LN(0.3)]])
    loss, stats = loss_of(logp, None, ref, torch.tensor([0.0]), torch.ones(1, 2, dtype=torch.bool), kl=0.1)
    k3 = 0.4 - LN(0.4) - 1
    assert stats["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)  # mean over the 2 tokens; the 2nd is 0
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)
    loss.backward()
    # d/dlogp (e^(ref-logp) - (ref-logp) - 1) = 1 - e^(ref-logp) = 1 - 0.4 = 0.6 for token 1, 0 for token 2.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.6 / 2, 0.0]]), rtol=0, atol=1e-7)


def test_dapo_and_grpo_normalisation_by_hand():
    # Completion 1 has 3 tokens, completion 2 has 1 (mask). A = 1 each, ratio 1: per-token loss -1.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, 1.0])
    token_loss, _ = loss_of(logp, None, None, adv, mask, norm="dapo")
    token_loss.backward()
    torch.testing.assert_close(logp.grad, -mask.float() / 4)  # every token 1/4
    logp.grad = None
    seq_loss, _ = loss_of(logp, None, None, adv, mask, norm="grpo")
    seq_loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 2, 0, 0]]))
    assert token_loss.item() == pytest.approx(-1.0) and seq_loss.item() == pytest.approx(-1.0)


@pytest.mark.parametrize("norm", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_sum_to_the_whole_batch(norm):
    torch.manual_seed(0)
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    logp = -torch.rand(6, 5) * mask
    old, ref = logp + 0.1 * torch.randn(6, 5), logp + 0.1 * torch.randn(6, 5)
    adv = torch.randn(6)
    tokens = int(mask.sum())

    def part(rows):
        w = token_weights(mask[rows], norm, total_tokens=tokens, total_sequences=6, max_new_tokens=5)
        terms = MicroBatchTerms(logp[rows], old[rows], ref[rows], adv[rows], w)
        return grpo_token_loss(terms, Objective.clipped(0.2, 0.2, kl_coef=0.05))[0]

    whole = part(slice(0, 6))
    split = part(slice(0, 2)) + part(slice(2, 5)) + part(slice(5, 6))
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)


def loss_typed(logp, adv, mask, loss_type, *, max_new_tokens=0, micro_batches=1, total_tokens=None, total_seqs=None):
    weights = token_weights(
        mask,
        loss_type,
        total_tokens=total_tokens or int(mask.sum()),
        total_sequences=total_seqs or mask.shape[0],
        max_new_tokens=max_new_tokens,
        micro_batches=micro_batches,
    )
    return grpo_token_loss(MicroBatchTerms(logp, None, None, adv, weights), Objective.clipped(0.2, 0.2, kl_coef=0.0))[0]


def test_dr_grpo_divides_by_completions_times_max_new_tokens():
    # Completions of 3 and 1 tokens, A = 1, ratio 1, max_new_tokens 4: every token 1 / (2 * 4), whatever its length.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    logp = torch.zeros(2, 3, requires_grad=True)
    loss = loss_typed(logp, torch.tensor([1.0, 1.0]), mask, "dr_grpo", max_new_tokens=4)
    loss.backward()
    assert loss.item() == pytest.approx(-4 / 8)
    torch.testing.assert_close(logp.grad, -mask.float() / 8)


def test_bnpo_divides_by_the_tokens_of_each_micro_batch():
    # Micro-batch 1: 3 tokens, micro-batch 2: 1 token, 2 micro-batches: tokens weigh 1/(3*2) and 1/(1*2).
    mask1, mask2 = torch.tensor([[1, 1, 1]], dtype=torch.bool), torch.tensor([[1, 0, 0]], dtype=torch.bool)
    lp1, lp2 = torch.zeros(1, 3, requires_grad=True), torch.zeros(1, 3, requires_grad=True)
    one = torch.tensor([1.0])
    loss = loss_typed(lp1, one, mask1, "bnpo", micro_batches=2) + loss_typed(lp2, one, mask2, "bnpo", micro_batches=2)
    loss.backward()
    assert loss.item() == pytest.approx(-(3 / 6 + 1 / 2))
    torch.testing.assert_close(lp1.grad, -torch.full((1, 3), 1 / 6))
    torch.testing.assert_close(lp2.grad, -torch.tensor([[1 / 2, 0.0, 0.0]]))


def test_bnpo_keeps_every_row_in_its_place_of_the_split_as_trl():
    """12 rows in micro-batches of 3, rows 1, 4 and 5 without targets (masked truncated completions): TRL still
    forms 4 micro-batches, each row where it was, so a token of the 3-token row 6 weighs 1 / (5 * 4): its
    micro-batch (rows 6-8) holds 5 target tokens, and there are 4 micro-batches. The old selection dropped the
    3 rows: 3 micro-batches, row 6 moved into the second, a weight of 1 / (5 * 3)."""
    from moe_qlora.data.examples import IGNORE, Example
    from moe_qlora.train.grpo import micro_batch_indices, rows_to_run

    masked = {1, 4, 5}
    labels = {
        i: [IGNORE] * 4 if i in masked else [IGNORE, 5, 6, 7] if i == 6 else [IGNORE, IGNORE, IGNORE, 7]
        for i in range(12)
    }
    examples = [Example([1, 2, 3, 4], labels[i], f"r:{i}", weight=1.5 if i == 6 else 0.5) for i in range(12)]
    groups = micro_batch_indices(rows_to_run(examples, "bnpo", 0.0), 3)
    assert groups == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    third = torch.tensor([[labels[i][j + 1] != IGNORE for j in range(3)] for i in groups[2]])  # 3 + 1 + 1 tokens
    weights = token_weights(third, "bnpo", total_tokens=0, total_sequences=12, micro_batches=len(groups))
    assert weights[0, 0].item() == pytest.approx(1 / (5 * 4))
    # control: the loss types without a split-dependent normaliser still leave zero-gradient rows out
    assert micro_batch_indices(rows_to_run(examples, "dapo", 0.0), 3) == [[0, 2, 3], [6, 7, 8], [9, 10, 11]]


def test_dapo_and_grpo_are_the_token_and_sequence_means():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5])
    # dapo: (3 * -1 + 1 * 0.5) / 4 tokens; grpo: mean over completions of their own token means: (-1 + 0.5) / 2.
    assert loss_typed(torch.zeros(2, 3), adv, mask, "dapo").item() == pytest.approx(-2.5 / 4)
    assert loss_typed(torch.zeros(2, 3), adv, mask, "grpo").item() == pytest.approx(-0.5 / 2)


def test_sequence_level_importance_sampling_by_hand():
    # GSPO: one ratio per completion, exp(mean of its tokens' log-ratios). Tokens p 0.5 / 0.5 now, 0.4 / 0.5 when
    # sampled: ratio sqrt(1.25) = 1.1180 < 1.2, not clipped (per token, token 1's 1.25 would be clipped).
    logp = torch.tensor([[LN(0.5), LN(0.5)]], requires_grad=True)
    old = torch.tensor([[LN(0.4), LN(0.5)]])
    weights = token_weights(torch.ones(1, 2, dtype=torch.bool), "dapo", total_tokens=2, total_sequences=1)

    def loss_at(level):
        return grpo_token_loss(MicroBatchTerms(logp, old, None, torch.tensor([1.0]), weights), objective(level))

    def objective(level):
        return Objective.clipped(0.2, 0.2, kl_coef=0.0, level=level)

    loss, stats = loss_at("sequence")
    ratio = math.sqrt(1.25)
    assert loss.item() == pytest.approx(-ratio, abs=1e-6) and stats["clip_fraction"].item() == 0
    loss.backward()
    # d/dlogp_t of -ratio * A * (1/2 + 1/2): ratio * d(mean log-ratio)/dlogp_t = ratio / 2, per token.
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -ratio / 2), rtol=0, atol=1e-6)
    token_loss, token_stats = loss_at("token")
    assert token_loss.item() == pytest.approx(-(1.2 + 1.0) / 2, abs=1e-6) and token_stats["clip_fraction"] == 0.5
    # Sampled at 0.25 / 0.5: ratio sqrt(2) = 1.414, clipped to 1.2 for A > 0: no gradient to either token.
    logp.grad = None
    old = torch.tensor([[LN(0.25), LN(0.5)]])
    loss, stats = loss_at("sequence")
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, abs=1e-6) and stats["clip_fraction"].item() == pytest.approx(1.0)
    torch.testing.assert_close(logp.grad, torch.zeros(1, 2))


def test_truncated_completions_are_masked_out_of_loss_and_counts():
    from moe_qlora.data.examples import IGNORE
    from moe_qlora.train.grpo import rollout_examples
    from moe_qlora.train.rollout import PromptRow, Rollout

    prompt = PromptRow("p.jsonl:1", [5, 6], "q", {})
    rollouts = [Rollout(prompt, 0, [7, 8, 9], "a", truncated=True), Rollout(prompt, 0, [7, 2], "b")]
    kept = rollout_examples(rollouts, torch.tensor([1.0, -1.0]), mask_truncated=False)
    masked = rollout_examples(rollouts, torch.tensor([1.0, -1.0]), mask_truncated=True)
    assert kept[0].labels == [IGNORE, IGNORE, 7, 8, 9] and kept[0].weight == 1.0
    assert masked[0].labels == [IGNORE] * 5 and masked[0].weight == 0.0
    assert masked[1].labels == kept[1].labels == [IGNORE, IGNORE, 7, 2] and masked[1].weight == -1.0


def test_truncation_is_read_from_eos_stop_strings_and_length():
    from moe_qlora.model.tiny import build_byte_tokenizer
    from moe_qlora.train.rollout import is_truncated

    tok = build_byte_tokenizer()
    ids = tok("12345", add_special_tokens=False).input_ids
    assert is_truncated(ids, tok, max_new_tokens=len(ids), stop=[])
    assert not is_truncated(ids, tok, max_new_tokens=len(ids) + 1, stop=[])  # ended before the limit
    assert not is_truncated(ids[:-1] + [tok.eos_token_id], tok, max_new_tokens=len(ids), stop=[])
    assert not is_truncated(ids, tok, max_new_tokens=len(ids), stop=["45"])


def test_loss_type_defaults_and_the_renamed_key():
    from moe_qlora.config.load import validate_config
    from moe_qlora.config.sections import ConfigError

    def grpo(**fields):
        return validate_config(
            {
                "model": {"name_or_path": "builtin:tiny-mixtral"},
                "data": {"train_files": ["x"]},
                "grpo": {"rewards": [{"function": "length"}], **fields},
            }
        ).grpo

    assert grpo().loss_type == "dapo" and grpo().clip_eps_high == 0.28  # DAPO's clip-higher
    assert grpo(loss_type="grpo").clip_eps_high is None  # then clip_eps, symmetric
    assert grpo(loss_type="dapo", clip_eps_high=0.3).clip_eps_high == 0.3
    with pytest.raises(ConfigError, match="grpo.loss_normalization is now grpo.loss_type"):
        grpo(loss_normalization="token")
