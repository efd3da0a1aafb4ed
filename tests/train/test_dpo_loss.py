"""Every preference loss against the paper's formula, written out here in plain torch, on the NF4-dequantized fp32
model with the adapter loaded by PEFT: the loss and every LoRA gradient (experts, attention, router).

Setup: the reference is the policy with one adapter (R0, scored by our reference path); the policy under training
has another (R1, every B factor non-zero), so margins are not zero and a reference taken from the current policy
is a different loss. Ours runs the chunked log-prob path (16 tokens a chunk) through the NF4 stacks; the oracle
takes PEFT's full logits. Tolerance: the loss within 1e-5 relative, each gradient within
helpers.oracle.REL_TOL (4e-6) of its largest element, fp32 reordering only; the broken controls (chosen and
rejected swapped, beta wrong, the reference from the current policy) miss by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from moe_qlora.config.preference import DpoSection
from moe_qlora.config.sections import DataSection, LoraSection, TrainSection
from moe_qlora.data.examples import DataStats, collate
from moe_qlora.data.preference import tokenize_pair
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.peft_adapter import adapter_state_dict
from moe_qlora.model.tiny import build_byte_tokenizer
from moe_qlora.train.dpo import StepTotals, micro_batch_loss
from moe_qlora.train.position import StepContext
from moe_qlora.train.preference_loss import PairLogps
from moe_qlora.train.reference import score_pairs

from helpers import trl_oracle
from helpers.oracle import REL_TOL, assert_close_scaled, gradients_by_adapter_key, randomize_lora_b

LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], router=True)
ROWS = [
    {"prompt": "Upper: ticket\n", "chosen": "TICKET", "rejected": "ticket"},
    {"prompt": "Add 2+2\n", "chosen": "4", "rejected": "five, or so"},  # completions of different lengths
    {"prompt": "Lower: JUNGLE and more words\n", "chosen": "jungle", "rejected": "JUNGLE!"},
    {"prompt": "Upper: ticket\n", "chosen": "ticket", "rejected": "TICKET"},  # the first reversed: margin > 0
]
CASES = {
    "sigmoid": {},
    "sigmoid-smoothed": {"label_smoothing": 0.2},
    "sigmoid-rpo": {"sft_weight": 0.7},
    "ipo": {"beta": 0.5},
    "hinge": {"beta": 2.0},  # beta m around 1: both sides of the hinge
    "robust": {"label_smoothing": 0.1},
    "simpo": {"simpo_gamma": 0.8},
    "orpo": {},
}


LD_ALPHA = 0.5  # the reference is scored with it too (setup)


def section(case: str, **changes) -> DpoSection:
    return DpoSection(loss_type=case.split("-")[0], **{**CASES[case], **changes})


# ----------------------------------------------------------------------------------------- the oracle


def sequence_logps(model, pairs, pad_id):
    """(sum log p, token count) of each chosen and each rejected completion from the model's full logits."""
    out = {}
    for side in ("chosen", "rejected"):
        rows = [getattr(p, side) for p in pairs]
        length = max(len(e.input_ids) for e in rows)
        ids = torch.tensor([e.input_ids + [pad_id] * (length - len(e.input_ids)) for e in rows])
        labels = torch.tensor([e.labels + [-100] * (length - len(e.labels)) for e in rows])
        mask = torch.tensor([[1] * len(e.input_ids) + [0] * (length - len(e.input_ids)) for e in rows])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:]
        keep = targets != -100
        logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        out[side] = ((logp * keep).sum(1), keep.sum(1).float())
    return out


def paper_loss(policy, reference, d: DpoSection) -> torch.Tensor:
    """The objective as its paper writes it, averaged over the pairs (plus the chosen NLL when asked)."""
    (pc, nc), (pr, nr) = policy["chosen"], policy["rejected"]
    b, e = d.beta, d.label_smoothing
    if d.loss_type in ("ipo", "simpo", "orpo"):  # per-token means
        lc, lr = pc / nc, pr / nr
    else:
        lc, lr = pc, pr
    if reference is not None:
        (rc, _), (rr, _) = reference["chosen"], reference["rejected"]
        rc, rr = (rc / nc, rr / nr) if d.loss_type == "ipo" else (rc, rr)
        h = (lc - rc) - (lr - rr)  # the log-ratio difference
    if d.loss_type == "sigmoid":  # DPO, with cDPO's label smoothing
        loss = -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h)
    elif d.loss_type == "robust":  # Chowdhury et al., eq. (8)
        loss = ((1 - e) * -F.logsigmoid(b * h) - e * -F.logsigmoid(-b * h)) / (1 - 2 * e)
    elif d.loss_type == "hinge":
        loss = torch.clamp(1 - b * h, min=0)
    elif d.loss_type == "ipo":  # Azar et al., eq. (17)
        loss = (h - 1 / (2 * b)) ** 2
    elif d.loss_type == "simpo":  # Meng et al., eq. (6)
        loss = -F.logsigmoid(b * lc - b * lr - d.simpo_gamma)
    else:  # ORPO, Hong et al. eq. (6)-(7): odds = p / (1 - p) on the per-token mean
        odds_c, odds_r = lc - torch.log1p(-torch.exp(lc)), lr - torch.log1p(-torch.exp(lr))
        loss = -b * F.logsigmoid(odds_c - odds_r)
    total = loss.mean()
    if d.nll_weight:
        total = total + d.nll_weight * -pc.sum() / nc.sum()
    return total


def token_tables(model, pairs, pad_id):
    """What TRL's fused LM head gives for the [chosen; rejected] rows of `pairs`, from the model's full logits:
    TokenTables of the token log-probabilities (0 off the completions) and log sum_v p_v^2; the completion mask."""
    batch = collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    keep = targets != -100
    q = torch.log_softmax(logits, -1)
    logp = q.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1) * keep
    tables = trl_oracle.TokenTables(logp, torch.logsumexp(2 * q, dim=-1).detach())
    return tables, (batch["labels"] != -100).long()


# ----------------------------------------------------------------------------------------- the setup


@pytest.fixture(scope="module")
def setup(tiny_mixtral_dir, tmp_path_factory):
    """(our model at R1, its reference scores at R0, the pairs, PEFT's R1 model, PEFT's R0 scores)."""
    tok = build_byte_tokenizer()
    stats, cfg = DataStats(), DataSection(train_files=["x.jsonl"], max_seq_len=64)
    pairs = [tokenize_pair(row, tok, cfg, f"rows:{i + 1}", stats, i) for i, row in enumerate(ROWS)]
    model = attach_adapters(load_model(LoadOptions(str(tiny_mixtral_dir))), LORA, seed=0)
    model.eval()  # no dropout anywhere: the two sides must compute the same function
    randomize_lora_b(model, seed=1)
    rows = score_pairs(model, pairs, tok.pad_token_id, 2, 16, lambda n: None)
    reference = {k: torch.tensor([r[i] for r in rows]) for i, k in enumerate(("c", "r", "nc", "nr"), start=1)}
    ld_rows = score_pairs(model, pairs, tok.pad_token_id, 2, 16, lambda n: None, ld_alpha=LD_ALPHA)
    reference["ld"] = PairLogps(*(torch.tensor(column) for column in list(zip(*ld_rows, strict=True))[1:]))
    folder = tmp_path_factory.mktemp("adapters")
    r0 = save_adapter(model, folder / "r0", cfg=LORA, base_model_name_or_path=str(tiny_mixtral_dir))
    randomize_lora_b(model, seed=2)
    r1 = save_adapter(model, folder / "r1", cfg=LORA, base_model_name_or_path=str(tiny_mixtral_dir))
    base_state = dequantized_base_state_dict(model)

    def peft(adapter):
        base = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir), dtype=torch.float32)
        base.load_state_dict(base_state, strict=False)
        return PeftModel.from_pretrained(base, str(adapter), is_trainable=True).eval()

    with torch.no_grad():
        peft_r0 = peft(r0)
        peft_reference = sequence_logps(peft_r0, pairs, tok.pad_token_id)
        reference["tables"] = token_tables(peft_r0, pairs, tok.pad_token_id)
    return model, reference, pairs, peft(r1), peft_reference, tok.pad_token_id


def our_loss_and_gradients(setup, d: DpoSection):
    model, ref, pairs, *_, pad_id = setup
    model.zero_grad(set_to_none=True)
    reference = PairLogps(ref["c"], ref["r"], ref["nc"], ref["nr"])
    chosen = sum(sum(t != -100 for t in p.chosen.labels[1:]) for p in pairs)
    totals = StepTotals(len(pairs), chosen, 1)
    ctx = StepContext(TrainSection(loss_chunk_tokens=16))
    loss, _ = micro_batch_loss(model, pairs, reference if d.uses_reference else None, d, totals, ctx, pad_id)
    loss.backward()
    return float(loss.detach()), gradients_by_adapter_key(model, adapter_state_dict)


def oracle_loss_and_gradients(setup, d: DpoSection, *, reference_from_policy=False, swapped=False):
    _, _, pairs, peft_model, peft_reference, pad_id = setup
    peft_model.zero_grad(set_to_none=True)
    policy = sequence_logps(peft_model, pairs, pad_id)
    if swapped:
        policy = {"chosen": policy["rejected"], "rejected": policy["chosen"]}
        peft_reference = {"chosen": peft_reference["rejected"], "rejected": peft_reference["chosen"]}
    reference = None
    if d.uses_reference:
        reference = {k: (v[0].detach(), v[1]) for k, v in policy.items()} if reference_from_policy else peft_reference
    loss = paper_loss(policy, reference, d)
    loss.backward()
    return float(loss.detach()), gradients_by_adapter_key(peft_model, lambda m: get_peft_model_state_dict(m))


def assert_matches(ours, oracle, rel_tol: float = REL_TOL):
    (loss, grads), (ref_loss, ref_grads) = ours, oracle
    assert abs(loss - ref_loss) <= 1e-5 * max(abs(ref_loss), 1e-3), (loss, ref_loss)
    assert sorted(grads) == sorted(ref_grads)
    for key in ref_grads:
        assert_close_scaled(key, grads[key], ref_grads[key], rel_tol)


def differs(ours, oracle) -> bool:
    (loss, grads), (ref_loss, ref_grads) = ours, oracle
    worst = max(float((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max()) for k in ref_grads)
    return abs(loss - ref_loss) > 1e-2 * abs(ref_loss) or worst > 1e-2


# ----------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_every_lora_gradient_match_the_papers_formula_in_peft(setup, case):
    d = section(case)
    ours, oracle = our_loss_and_gradients(setup, d), oracle_loss_and_gradients(setup, d)
    assert_matches(ours, oracle)
    grads = ours[1]
    assert any("experts" in k for k in grads) and any("router" in k or "gate" in k for k in grads)
    assert all(float(g.abs().max()) > 0 for g in grads.values()), "every LoRA tensor must get a gradient"


@pytest.mark.parametrize("case", list(CASES))
def test_chosen_and_rejected_swapped_is_caught(setup, case):
    d = section(case)
    assert differs(our_loss_and_gradients(setup, d), oracle_loss_and_gradients(setup, d, swapped=True))


@pytest.mark.parametrize("case", list(CASES))
def test_a_wrong_beta_is_caught(setup, case):
    d = section(case)
    assert differs(our_loss_and_gradients(setup, d), oracle_loss_and_gradients(setup, section(case, beta=d.beta * 2)))


@pytest.mark.parametrize("case", [c for c in CASES if section(c).uses_reference])
def test_the_reference_taken_from_the_current_policy_is_caught(setup, case):
    d = section(case)
    assert differs(our_loss_and_gradients(setup, d), oracle_loss_and_gradients(setup, d, reference_from_policy=True))


def test_the_setup_exercises_every_branch(setup):
    """The margins are away from zero (R0 != R1), the hinge is active for some pairs and not others, and
    the completions differ in length (so per-token means differ from sums)."""
    _, _, pairs, peft_model, peft_reference, pad_id = setup
    with torch.no_grad():
        policy = sequence_logps(peft_model, pairs, pad_id)
    h = (policy["chosen"][0] - peft_reference["chosen"][0]) - (policy["rejected"][0] - peft_reference["rejected"][0])
    assert float(h.abs().min()) > 1e-3
    assert len({int(n) for n in policy["chosen"][1]} | {int(n) for n in policy["rejected"][1]}) > 2
    beta_h = section("hinge").beta * h
    assert bool((beta_h < 1).any()) and bool((beta_h > 1).any()), beta_h


@pytest.mark.parametrize("case", ["sigmoid-rpo", "orpo", "ipo"])
def test_micro_batches_of_a_step_give_the_whole_steps_gradient(setup, case):
    """The pair mean and the NLL's token mean are the step's, whatever its split: 2 + 2 pairs accumulate to the
    gradient of 4 at once (fp32 reordering). The broken control normalises each micro-batch by its own counts."""
    model, ref, pairs, *_, pad_id = setup
    d, ctx = section(case), StepContext(TrainSection(loss_chunk_tokens=16))
    reference = PairLogps(ref["c"], ref["r"], ref["nc"], ref["nr"]) if section(case).uses_reference else None
    chosen = lambda group: sum(sum(t != -100 for t in p.chosen.labels[1:]) for p in group)  # noqa: E731
    totals = StepTotals(len(pairs), chosen(pairs), 1)

    def grads(groups, own_totals=False):
        model.zero_grad(set_to_none=True)
        for group in groups:
            t = StepTotals(len(group), chosen(group), 1) if own_totals else totals
            micro_batch_loss(model, group, reference, d, t, ctx, pad_id)[0].backward()
        return gradients_by_adapter_key(model, adapter_state_dict)

    whole, split = grads([pairs]), grads([pairs[:2], pairs[2:]])
    for key in whole:
        assert_close_scaled(key, split[key], whole[key])
    wrong = grads([pairs[:2], pairs[2:]], own_totals=True)
    assert max(float((wrong[k] - whole[k]).abs().max() / whole[k].abs().max()) for k in whole) > 0.1


TRL_CASES = {  # TRL 1.16's options through the model: (DPOConfig options, the broken control's change on our side)
    "mpo-ld": (
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0], "ld_alpha": LD_ALPHA},
        {"loss_weights": [0.8, 0.2, 0.0]},
    ),
    "wpo": ({"use_weighting": True, "beta": 0.5}, {"use_weighting": False}),
    "js-ipo-wpo": ({"loss_type": "ipo", "f_divergence_type": "js_divergence", "use_weighting": True}, {"beta": 0.2}),
}


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_trls_options_through_the_model_match_trls_loss_on_peft(setup, case):
    """The whole path for LD-DPO, WPO and a weighted list: ours through the NF4 stacks and the chunked head
    (log sum p^2 chunked too), against TRL 1.16's _compute_loss on PEFT's full logits with the same adapters;
    loss within 1e-5 relative, every LoRA gradient within REL_TOL of its largest element (2.5 x REL_TOL with WPO:
    each pair's weight, exp of a mean of ~10 token log-ratios computed in each model's own fp32 order, scales
    every term of its gradient, so its rounding adds to theirs; measured 4.2e-6)."""
    options, broken = TRL_CASES[case]
    model, ref, pairs, peft_model, _, pad_id = setup
    d = DpoSection(**options)
    reference = ref["ld"] if d.ld_alpha is not None else PairLogps(ref["c"], ref["r"], ref["nc"], ref["nr"])
    chosen = sum(sum(t != -100 for t in p.chosen.labels[1:]) for p in pairs)
    ctx = StepContext(TrainSection(loss_chunk_tokens=16))

    def ours(section):
        model.zero_grad(set_to_none=True)
        loss, _ = micro_batch_loss(model, pairs, reference, section, StepTotals(len(pairs), chosen, 1), ctx, pad_id)
        loss.backward()
        return float(loss.detach()), gradients_by_adapter_key(model, adapter_state_dict)

    peft_model.zero_grad(set_to_none=True)
    policy, mask = token_tables(peft_model, pairs, pad_id)
    trl_loss = trl_oracle.dpo_loss(trl_oracle.dpo_trainer(**options), policy, ref["tables"][0], mask)
    trl_loss.backward()
    oracle = float(trl_loss.detach()), gradients_by_adapter_key(peft_model, lambda m: get_peft_model_state_dict(m))
    assert_matches(ours(d), oracle, rel_tol=REL_TOL * (2.5 if d.use_weighting else 1))
    assert differs(ours(DpoSection(**{**options, **broken})), oracle)
