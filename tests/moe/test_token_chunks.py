"""The MLP half of each decoder layer over its tokens in chunks (moe/token_chunks.py, train.mlp_chunk_tokens).

Oracle: the same model unchunked. Whole-model next-token loss and every LoRA gradient (attention, dense MLPs,
shared experts, routed experts) of tiny Mixtral, Qwen3-MoE, Qwen2-MoE (shared experts), DeepSeek-V3 (dense first
layer, shared experts) and gpt-oss, in fp32 on the CPU, with the decoder layers checkpointed (the chunks nest in
their recompute) and without. Tolerance: max |a - b| <= 4e-6 * max |b| (helpers.oracle.REL_TOL). Not bitwise: the
LoRA weight gradients are sums over tokens that chunks add a chunk at a time, and even a token's own output comes
out of a GEMM whose blocking depends on its row count (measured: 1e-6 to 2e-6 of the scale, none bit-identical).
Control: chunks that slice the hidden states but not the routing (every chunk routed as the first) fail it.
"""

import pytest
import torch

from moe_qlora.config.sections import LoraSection
from moe_qlora.model.adapters import attach_adapters, configure_checkpointing
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.moe import experts as experts_impl
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import set_moe_kernels, set_token_chunks
from moe_qlora.moe.token_chunks import over_token_chunks

from helpers.oracle import assert_close_scaled, randomize_lora_b

CHUNK = 7  # divides none of the micro-batch's 2 x 24 tokens: a short last chunk
# (family, MoE layers, other MLPs chunked): shared experts and dense MLPs besides the routed experts
FAMILIES = [
    ("mixtral", 2, 0),
    ("qwen3_moe", 2, 1),
    ("qwen2_moe", 2, 2),
    ("deepseek_v3", 2, 3),
    ("gpt_oss", 2, 0),
]
_models: dict[str, torch.nn.Module] = {}


def tiny_with_lora(family: str):
    """The family's tiny model in 4-bit, LoRA (rank 4) on its default linears and experts, B factors non-zero."""
    if family not in _models:
        model = load_model(LoadOptions(str(ensure_tiny(family))))
        model = attach_adapters(model, LoraSection(rank=4, alpha=8.0), seed=0)
        randomize_lora_b(model)
        model.train()
        _models[family] = model
    return _models[family]


def loss_and_grads(model, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    set_token_chunks(model, chunk)
    try:
        model.zero_grad(set_to_none=True)
        ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        set_token_chunks(model, 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return out.loss.detach(), grads


def assert_same_training(model, chunk: int) -> None:
    loss, grads = loss_and_grads(model, 0)
    chunked_loss, chunked = loss_and_grads(model, chunk)
    assert_close_scaled("loss", chunked_loss, loss)
    assert chunked.keys() == grads.keys() and any("moe_lora" in n for n in grads)
    for name, grad in grads.items():
        assert_close_scaled(name, chunked[name], grad)


@pytest.mark.parametrize("checkpointed", [True, False], ids=["layers-checkpointed", "layers-kept"])
@pytest.mark.parametrize("kernels", ["torch", "torch-grouped"])
@pytest.mark.parametrize(("family", "moe_layers", "other_mlps"), FAMILIES)
def test_chunked_tokens_train_as_unchunked(family, moe_layers, other_mlps, kernels, checkpointed):
    model = tiny_with_lora(family)
    assert set_token_chunks(model, 0) == (moe_layers, other_mlps)
    configure_checkpointing(model, enabled=checkpointed, interval=1)
    set_moe_kernels(model, kernels)
    try:
        assert_same_training(model, CHUNK)
    finally:
        set_moe_kernels(model, "torch")


def routed_as_first_chunk(fn, chunk, hidden, index, weights):
    """A broken chunking: the hidden states sliced, the routing of the first chunk reused for every chunk."""
    tokens = hidden.shape[0]
    parts = [
        fn(hidden[s : s + chunk], index[: min(chunk, tokens - s)], weights[: min(chunk, tokens - s)])
        for s in range(0, tokens, chunk)
    ]
    return torch.cat(parts)


def test_routing_not_chunked_with_the_tokens_fails_the_comparison(monkeypatch):
    model = tiny_with_lora("qwen3_moe")
    configure_checkpointing(model, enabled=True, interval=1)
    monkeypatch.setattr(experts_impl, "over_token_chunks", routed_as_first_chunk)
    with pytest.raises(AssertionError):
        assert_same_training(model, CHUNK)


def test_a_chunked_layer_keeps_only_its_input_for_its_backward():
    """What autograd saves for one MoE layer's backward on 48 tokens: the grouped layer's rows unchunked
    (at least tokens x top-k x the intermediate size of fp32); chunked, the chunks' inputs only (each chunk is
    checkpointed: its input is a slice of the layer's, its rows are recomputed in its own backward)."""
    model = tiny_with_lora("qwen3_moe")
    name, module = experts_modules(model)[0]
    set_moe_kernels(model, "torch-grouped")
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(48, model.config.hidden_size, generator=g, requires_grad=True)
    index = torch.randint(0, model.config.num_experts, (48, model.config.num_experts_per_tok), generator=g)
    weights = torch.rand(index.shape, generator=g)

    def saved_bytes(chunk: int) -> int:
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        set_token_chunks(model, chunk)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                module(hidden, index, weights).sum().backward()
        finally:
            set_token_chunks(model, 0)
            set_moe_kernels(model, "torch")
        return sum(saved)

    rows = 48 * model.config.num_experts_per_tok * model.config.moe_intermediate_size * 4
    assert saved_bytes(0) >= rows
    assert saved_bytes(CHUNK) == sum(t.numel() * t.element_size() for t in (hidden, index, weights))


def test_no_gradient_means_one_call():
    """Generation and scoring record no gradient: nothing to save, so the tokens go through in one call."""
    calls = []

    def layer(x):
        calls.append(x.shape[0])
        return x * 2

    x = torch.randn(20, 3)
    with torch.no_grad():
        assert torch.equal(over_token_chunks(layer, 6, x), x * 2)
    assert calls == [20]
    over_token_chunks(layer, 6, x.requires_grad_())
    assert calls[1:] == [6, 6, 6, 2]
