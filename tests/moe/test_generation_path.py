"""The MoE layer's path while a model generates (experts.generation_kernels: a GRPO rollout, `moe-qlora generate`)
against the path the training forward takes.

On the CPU, a layer with small NF4 stacks generates through the grouped formulation (one decode of each stack a
call, torch._grouped_mm) instead of the per-expert reference; elsewhere the path is unchanged. What is checked,
on the tiny Mixtral with every LoRA factor non-zero, for each configured path (torch, grouped_mm, and Triton in
its interpreter): greedy completions are token for token the same with and without the generation path, and each
token is the argmax of the training forward (grad mode, the configured path, teacher-forced over the prompt and
the completion so far); sampled completions are the same for the same seed, with and without it. The broken
control: the same greedy generation with the adapters off gives other tokens, so the comparison can fail.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import adapters_disabled, attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import GROUPED_GENERATION_BYTES, generation_kernels, generation_path, set_moe_kernels
from moe_qlora.moe.layer_state import read_state

TOK = build_byte_tokenizer()
PROMPTS = ["Odd? 7\n", "Reverse: stone\n"]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def policy(tiny_mixtral_dir):
    model = attach_adapters(
        load_model(LoadOptions(str(tiny_mixtral_dir))), LoraSection(rank=4, target_modules=["q_proj", "v_proj"]), seed=0
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or name.endswith("_b")):
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def greedy(model, prompt: str, *, fast: bool, new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = TOK(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode(), generation_kernels(model) if fast else torch.enable_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            pad_token_id=TOK.pad_token_id,
            eos_token_id=None,
        )
    return out[0, ids.shape[1] :].tolist()


def training_argmax(model, prompt: str, completion: list[int]) -> list[int]:
    """The token the training forward (grad mode) ranks first after the prompt and each prefix of the completion."""
    ids = torch.tensor([TOK(prompt)["input_ids"] + completion])
    with torch.enable_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.detach()
    start = ids.shape[1] - len(completion) - 1
    return logits[0, start : start + len(completion)].argmax(-1).tolist()


def test_the_path_choice():
    """CPU reference with small NF4 stacks -> grouped; large stacks, and every other configured path, unchanged."""
    from types import SimpleNamespace

    from moe_qlora.moe.nf4 import NF4Stack

    def frozen(experts, rows, cols):
        stack = NF4Stack(torch.empty(0, dtype=torch.uint8), torch.empty(0), None, (experts, rows, cols))
        return SimpleNamespace(gate_up=stack)

    small, large = frozen(8, 256, 64), frozen(32, 1024, 1024)
    assert 8 * 256 * 64 * 4 <= GROUPED_GENERATION_BYTES < 32 * 1024 * 1024 * 4
    assert generation_path("torch", small, torch.float32) == "grouped_mm"
    assert generation_path("torch", large, torch.float32) == "torch"
    for kernels in ("triton", "grouped_mm", "auto"):
        assert generation_path(kernels, small, torch.float32) == kernels
    mxfp4 = SimpleNamespace(gate_up=SimpleNamespace(shape=(8, 256, 64)))  # not an NF4 stack
    assert generation_path("torch", mxfp4, torch.float32) == "torch"


def test_the_generation_path_is_scoped_to_the_block(policy):
    with generation_kernels(policy):
        states = [read_state(m) for _, m in experts_modules(policy)]
        assert states and all(s.generating for s in states)
    assert not any(s.generating for s in states)
    with pytest.raises(RuntimeError), generation_kernels(policy):
        raise RuntimeError("a failing generate")
    assert not any(s.generating for s in states)  # restored on the way out of a failure too


@pytest.mark.parametrize("kernels", ["torch", "grouped_mm", "triton"])
def test_greedy_completions_are_the_training_forwards_on_every_path(policy, kernels):
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton path runs here only in its interpreter (TRITON_INTERPRET=1, the CPU default)")
    set_moe_kernels(policy, kernels)
    # The interpreter runs each Triton launch in Python: one prompt and 2 tokens there (about 10 s).
    prompts, new_tokens = (PROMPTS[:1], 2) if kernels == "triton" else (PROMPTS, NEW_TOKENS)
    try:
        for prompt in prompts:
            fast = greedy(policy, prompt, fast=True, new_tokens=new_tokens)
            plain = greedy(policy, prompt, fast=False, new_tokens=new_tokens)
            assert fast == plain, (kernels, prompt)
            assert training_argmax(policy, prompt, fast) == fast, (kernels, prompt)
            with adapters_disabled(policy):  # control: a model without its adapters ranks other tokens first
                assert training_argmax(policy, prompt, fast) != fast
    finally:
        set_moe_kernels(policy, "torch")


def test_sampled_rollouts_are_the_same_for_a_seed_with_and_without_the_generation_path(policy):
    from moe_qlora.config.grpo import GrpoSection
    from moe_qlora.train.rollout import PromptRow, generation_config, left_pad, sample_rollouts

    prompts = [PromptRow(f"p:{i}", TOK(p)["input_ids"], p) for i, p in enumerate(PROMPTS)]
    cfg = GrpoSection(group_size=4, max_new_tokens=12, rewards=[{"function": "exact_match"}])

    def plain_generate(seed):
        """sample_rollouts' generate call without the generation path."""
        torch.manual_seed(seed)
        ids, mask = left_pad([p.ids for p in prompts], TOK.pad_token_id)
        with torch.inference_mode():
            out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=generation_config(cfg, TOK))
        return [row[: len(r.completion_ids)] for row, r in zip(out[:, ids.shape[1] :].tolist(), first, strict=True)]

    torch.manual_seed(5)
    first = sample_rollouts(policy, TOK, prompts, cfg)
    torch.manual_seed(5)
    again = sample_rollouts(policy, TOK, prompts, cfg)
    assert [r.completion_ids for r in first] == [r.completion_ids for r in again]
    assert plain_generate(5) == [r.completion_ids for r in first]
    assert plain_generate(6) != [r.completion_ids for r in first]  # control: another seed samples otherwise


def test_a_wrong_generation_path_is_caught(policy):
    """The broken control of the comparison above: the grouped path made wrong (its output off by half) while
    generating changes the greedy completion, which then is no longer the training forward's."""
    from moe_qlora.common.injection import injected

    prompt = PROMPTS[0]
    plain = greedy(policy, prompt, fast=False)
    with injected(kernel_fault="grouped_mm:wrong"):
        broken = greedy(policy, prompt, fast=True)
        assert greedy(policy, prompt, fast=False) == plain  # the training path does not take it
    assert broken != plain and training_argmax(policy, prompt, broken) != broken
