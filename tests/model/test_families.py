"""Every MoE family, through the same code path: parity with its own eager experts, the whole sparse block
(its router, shared experts and scaling) against the block with eager experts, PEFT export parity, and a
short training run that lowers the loss. Tolerances as in test_moe_parity (fp32 reordering only).
"""

import pytest
import torch
from peft import PeftModel
from rich.console import Console
from torch.func import functional_call
from transformers import AutoModelForCausalLM

from moe_qlora.config.load import validate_config
from moe_qlora.config.sections import LoraSection
from moe_qlora.export.adapter import dequantized_base_state_dict, save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import TINY_FAMILIES, build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import set_moe_kernels
from moe_qlora.moe.layer_state import layer_state
from moe_qlora.train.sft import train

from helpers.oracle import (
    assert_all_close,
    assert_close_scaled,
    eager_reference_experts,
    leaves,
    ragged_routing,
    randomize_lora_b,
    run_experts_pair,
)

FAMILIES = list(TINY_FAMILIES)
LORA = LoraSection(rank=4, alpha=8.0, target_modules="auto")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint dir, 4-bit model with every LoRA factor non-zero) for each family."""
    name = request.param
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path_factory.mktemp(name), tiny_config(name, len(tok)), seed=0, tokenizer=tok)
    model = attach_adapters(load_model(LoadOptions(str(path))), LORA, seed=0)
    randomize_lora_b(model)
    return name, path, model


def first_experts(model):
    return experts_modules(model)[0]


@pytest.mark.parametrize("padded", [False, True], ids=["rows", "rows_padded"])
def test_experts_match_the_familys_eager_experts(family, padded, monkeypatch):
    """padded: each expert's rows padded with zero rows as for oneDNN in bf16 (forced here in fp32), on every
    family's layout (transposed, biases, gates other than silu(gate) * up, non-gated)."""
    if padded:
        from moe_qlora.moe import reference_layer

        monkeypatch.setattr(reference_layer, "matmul_rows", lambda n, x: reference_layer.row_grid(n))
    name, _, model = family
    _, experts = first_experts(model)
    idx, weights = ragged_routing(13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    assert_all_close(*run_experts_pair(experts, model.config, x, idx, weights))


@pytest.mark.parametrize("kernels", ["torch-grouped", "grouped_mm", "triton"])
def test_grouped_layer_matches_the_familys_eager_experts(family, kernels, wide_triton_blocks):
    """The GPU formulation (whole-batch grouped ops; Triton in the interpreter on a CPU) on every family's
    layout: transposed (GPT-OSS), biases, non-gated (Nemotron-H), hybrids. At 64-wide blocks, 3x faster in the
    interpreter than 16-wide ones (the layer's N and K still span tiles; the parity tests run the small blocks on
    Mixtral's and GPT-OSS's layouts)."""
    _, _, model = family
    _, experts = first_experts(model)
    idx, weights = ragged_routing(13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    set_moe_kernels(model, kernels)
    try:
        assert_all_close(*run_experts_pair(experts, model.config, x, idx, weights))
    finally:
        set_moe_kernels(model, "torch")


@pytest.mark.parametrize(
    "broken",
    [lambda idx, w: ((idx + 1) % 8, w), lambda idx, w: (idx, torch.ones_like(w))],
    ids=["experts_rolled", "routing_weights_dropped"],
)
def test_broken_routing_fails_the_same_comparison(family, broken):
    _, _, model = family
    _, experts = first_experts(model)
    idx, weights = ragged_routing(13, 8, 2)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    with pytest.raises(AssertionError):
        assert_all_close(*run_experts_pair(experts, model.config, x, idx, weights, mutate=broken))


def _block_of(model, experts_name):
    parent = model.get_submodule(experts_name.rsplit(".", 1)[0])
    return Gemma4MoEPart(parent) if hasattr(parent, "self_attn") and hasattr(parent, "router") else parent


class Gemma4MoEPart(torch.nn.Module):
    """Gemma-4's experts sit in the decoder layer itself, beside its dense MLP: the layer's own router, norms and
    experts, composed as Gemma4TextDecoderLayer.forward composes them (modeling_gemma4.py, transformers 5.24)."""

    def __init__(self, layer):
        super().__init__()
        self.router, self.experts = layer.router, layer.experts
        self.pre_norm, self.post_norm = layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_2

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, top_k_weights, top_k_index = self.router(flat)
        return self.post_norm(self.experts(self.pre_norm(flat), top_k_index, top_k_weights).reshape(x.shape))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_sparse_block_with_router_and_shared_experts_matches(family):
    """The family's own block: routing (grouped top-k, sigmoid scores, scaling...), shared experts, ours vs eager."""
    _, _, model = family
    experts_name, experts = first_experts(model)
    block = _block_of(model, experts_name)
    router = {
        n: p
        for n, p in block.named_parameters()
        if not n.startswith(("experts.", "shared_expert")) and "lora" not in n and p.is_floating_point()
    }
    assert router, "the block should own its router parameters"
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(9))
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(10))

    x1, *r1 = leaves(x, *router.values())
    out = _first(functional_call(block, dict(zip(router, r1, strict=True)), (x1,)))
    out.backward(upstream.view(out.shape))

    eager, weights = eager_reference_experts(experts, model.config)
    x2, *r2 = leaves(x, *router.values())
    f2 = leaves(*experts.moe_lora.factors())
    block.experts = eager
    try:
        params = {**dict(zip(router, r2, strict=True)), **{f"experts.{k}": v for k, v in weights(*f2).items()}}
        ref = _first(functional_call(block, params, (x2,)))
    finally:
        block.experts = experts
    ref.backward(upstream.view(ref.shape))
    assert_close_scaled("block output", out.detach(), ref.detach())
    assert_close_scaled("grad x", x1.grad, x2.grad)
    for n, a, b in zip(router, r1, r2, strict=True):
        if a.grad is None and b.grad is None:  # used only to select experts (Laguna's score-correction bias)
            continue
        assert_close_scaled(f"grad {n}", a.grad, b.grad)


def test_exported_adapter_reproduces_logits_in_peft(family, tmp_path):
    name, path, model = family
    model.eval()
    ids = torch.randint(3, 263, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    adapter = save_adapter(model, tmp_path / "adapter", cfg=LORA, base_model_name_or_path=str(path))
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    missing, unexpected = base.load_state_dict(dequantized_base_state_dict(model), strict=False)
    buffers = {n for n, _ in base.named_buffers()}
    tied = {"lm_head.weight"} if getattr(base.config.get_text_config(), "tie_word_embeddings", False) else set()
    assert not unexpected and set(missing) <= buffers | tied, (unexpected, missing)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits
    model.train()
    assert (ref - ours).abs().max() <= 1e-4, f"{name}: {(ref - ours).abs().max():.3g}"
    assert ours.abs().max() > 0.5


# Qwen3-Next's tiny config is mostly gated-DeltaNet layers, which learn slower at this width: 0.72 of the
# first loss after 30 steps at 5e-3 (measured), 0.61 at 1e-2.
LR = {"qwen3_next": 1e-2}


def test_short_training_run_lowers_the_loss(family, tmp_path):
    name, _, _ = family
    cfg = validate_config(
        {
            "model": {"name_or_path": f"builtin:tiny-{name.replace('_', '-')}"},
            "lora": {"rank": 8, "alpha": 16},
            "data": {"train_files": ["data/demo_sft.jsonl"], "max_seq_len": 48},
            "train": {
                "max_steps": 30,
                "epochs": 10,
                "micro_batch_size": 8,
                "lr": LR.get(name, 5e-3),
                "warmup_steps": 3,
                "seed": 0,
            },
            "output": {"dir": str(tmp_path / "run")},
        }
    )
    losses = train(cfg, Console(quiet=True)).losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, (name, first, last)


def test_every_4bit_linear_computes_with_its_dequantized_weight(family):
    """bitsandbytes' CPU Linear4bit mis-decodes in_features % 64 != 0 (DeepSeek's kv_b_proj here): such
    linears must have been kept unquantized, and every 4-bit one must match F.linear on its weight."""
    import bitsandbytes as bnb

    from moe_qlora.moe.nf4 import dequantize_param

    _, _, model = family
    checked = 0
    for name, layer in model.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit):  # the 4-bit base layer itself (PEFT wraps it, not subclasses it)
            x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                y = layer(x)
            torch.testing.assert_close(y, x @ dequantize_param(layer.weight).T, atol=1e-5, rtol=1e-5, msg=name)
            checked += 1
    assert checked > 0


def test_a_dense_model_trains_as_plain_qlora_with_a_warning(tmp_path, caplog):
    from transformers import LlamaConfig

    tok = build_byte_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.15,
    )
    path = save_tiny_model(tmp_path / "llama", cfg, tokenizer=tok)
    with caplog.at_level("WARNING"):
        model = attach_adapters(load_model(LoadOptions(str(path))), LORA, seed=0)
    assert "no MoE experts found" in caplog.text
    assert not experts_modules(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("gate_proj" in n for n in trainable)  # a dense model keeps its MLP targets


@pytest.mark.parametrize("attribute", ["has_post_expert_norm"])  # non-gated experts are supported (nemotron_h)
def test_unsupported_expert_layouts_are_refused_by_name(tiny_mixtral_dir, attribute):
    from moe_qlora.moe.expert_lora import attach_expert_lora
    from moe_qlora.moe.expert_stacks import UnsupportedExpertsError

    model = load_model(LoadOptions(str(tiny_mixtral_dir)))
    experts = model.model.layers[1].mlp.experts
    setattr(experts, attribute, attribute == "has_post_expert_norm")
    with pytest.raises(UnsupportedExpertsError, match=r"model.layers.0.mlp.experts|model.layers.1.mlp.experts"):
        attach_expert_lora(model, rank=4, alpha=8, seed=0)


def test_llama4_picked_rows_are_bounded_by_the_blocks_top_k_and_never_dropped(tmp_path):
    """Llama-4's experts get every token for every expert; the rows with a non-zero input (the picked ones) are
    found with a static size, the block's top_k per token, so no host sync counts them. An input feeding more
    experts than that per token fails loudly instead of losing rows."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "llama4", tiny_config("llama4_text", len(tok)), tokenizer=tok)
    model = attach_adapters(
        load_model(LoadOptions(str(path))), LoraSection(rank=4, alpha=8.0, target_modules=[]), seed=0
    )
    _, experts = first_experts(model)
    assert layer_state(experts).top_k == model.config.num_experts_per_tok == 1
    e, t = experts.num_experts, 5
    two_per_token = torch.zeros(e, t, 1)
    two_per_token[0], two_per_token[3] = 0.7, 0.2  # experts 0 and 3 for every token
    routed_in = (torch.randn(1, t, 64) * two_per_token).reshape(e * t, 64)
    with pytest.raises(RuntimeError, match="more than top_k = 1 experts fed per token"):
        experts(routed_in)
