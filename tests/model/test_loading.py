"""Loading in 4-bit: what is quantized, what is not, and the fp32 guarantee of the 4-bit linears."""

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_qlora.model.loaded_model import assert_experts_quantized
from moe_qlora.model.loading import LoadOptions, ModelLoadError, load_model
from moe_qlora.moe.experts import EXPERTS_IMPLEMENTATION
from moe_qlora.moe.nf4 import dequantize_param


@pytest.fixture(scope="module")
def model(tiny_mixtral_dir):
    return load_model(LoadOptions(str(tiny_mixtral_dir)))


def test_experts_nf4_linears_4bit_router_norms_embeddings_full(model):
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts.gate_up_proj, bnb.nn.Params4bit)
    assert layer.mlp.experts.gate_up_proj.quant_state.shape == (8, 256, 64)
    assert layer.mlp.experts.down_proj.quant_state.quant_type == "nf4"
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit)
    unquantized = (
        layer.mlp.gate.weight,
        layer.input_layernorm.weight,
        model.model.embed_tokens.weight,
        model.lm_head.weight,
    )
    for p in unquantized:
        assert p.dtype == torch.float32 and not isinstance(p, bnb.nn.Params4bit)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION


def test_quantized_weights_are_close_to_the_checkpoint(model, tiny_mixtral_dir):
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir), dtype=torch.float32)
    w = dense.model.layers[1].mlp.experts.down_proj
    err = (dequantize_param(model.model.layers[1].mlp.experts.down_proj) - w).abs().max()
    assert 0 < err <= 0.1521 * w.abs().max()  # NF4: at most half the widest level gap times the block scale


def test_linears_stay_fp32_in_eval_mode(model):
    """bitsandbytes would switch an eval-mode Linear4bit to bf16 on AVX512-BF16 CPUs; we keep fp32 exact."""
    q = model.model.layers[0].self_attn.q_proj
    model.eval()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = q(x)
    torch.testing.assert_close(y, x @ dequantize_param(q.weight).T, atol=1e-6, rtol=1e-6)
    model.train()


def test_strict_check_names_high_precision_expert_stacks(tiny_mixtral_dir):
    dense = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir), dtype=torch.float32)
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.experts.gate_up_proj \(8, 256, 64\)"):
        assert_experts_quantized(dense)


def test_missing_model_path_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(LoadOptions(str(tmp_path / "nothing")))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no weight files"):
        load_model(LoadOptions(str(tmp_path)))


def test_strict_check_names_experts_off_the_interface_and_ignores_convolutions():
    """Experts are found by what they are: a 3D short-convolution weight (hybrid layers) is not one; a module
    holding expert stacks off transformers' experts interface is named, with why."""
    import pytest
    from torch import nn

    from moe_qlora.model.loaded_model import assert_experts_quantized
    from moe_qlora.model.loading import ModelLoadError

    class DbrxLikeExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(4, 8, 16))

    model = nn.Module()
    model.conv1d = nn.Conv1d(16, 16, 4, groups=16)  # weight (16, 1, 4)
    assert_experts_quantized(model)
    model.experts = DbrxLikeExperts()
    with pytest.raises(
        ModelLoadError, match=r"DbrxLikeExperts is not on transformers' experts interface.*experts\.w1 \(4, 8, 16\)"
    ):
        assert_experts_quantized(model)


def test_a_multimodal_moe_trains_its_text_model_with_the_vision_tower_frozen_unquantized(tmp_path):
    """Qwen3-VL-MoE has no causal-LM class: it loads through its image-text-to-text class, the language
    model's experts in NF4 and linears in 4-bit, the vision tower's linears kept in the compute dtype."""
    import bitsandbytes as bnb

    from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model
    from moe_qlora.moe.expert_stacks import experts_modules

    from helpers.tiny_configs import tiny_config_any

    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "vl", tiny_config_any("qwen3_vl_moe", len(tok)), tokenizer=tok)
    from moe_qlora.config.sections import LoraSection
    from moe_qlora.model.adapters import attach_adapters

    model = load_model(LoadOptions(str(path)))
    assert type(model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    assert experts_modules(model) and all(n.startswith("model.language_model.") for n, _ in experts_modules(model))
    vision = [
        (n, m) for n, m in model.named_modules() if n.startswith("model.visual.") and isinstance(m, torch.nn.Linear)
    ]
    text = [
        n
        for n, m in model.named_modules()
        if n.startswith("model.language_model.") and isinstance(m, bnb.nn.Linear4bit)
    ]
    assert vision and text
    assert not any(isinstance(m, bnb.nn.Linear4bit) for _, m in vision)
    assert all(m.weight.dtype == torch.float32 for _, m in vision)
    trainable = [n for n, p in attach_adapters(model, LoraSection(), seed=0).named_parameters() if p.requires_grad]
    assert trainable and not [n for n in trainable if ".visual." in n]


def _lora_grads_of_one_step(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _eval_forward(model, ids) -> None:
    """What the chunked-loss check, an eval or a GRPO rollout does between two training steps."""
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()


@pytest.fixture(scope="module")
def bf16_lora_model(tiny_mixtral_dir):
    from moe_qlora.config.sections import LoraSection
    from moe_qlora.model.adapters import attach_adapters

    model = load_model(LoadOptions(str(tiny_mixtral_dir), compute_dtype=torch.bfloat16))
    return attach_adapters(model, LoraSection(rank=4, alpha=8, experts=True, target_modules=[]), seed=0)


def test_an_eval_forward_leaves_bf16_training_gradients_as_they_were(bf16_lora_model):
    """bitsandbytes repacks an eval-mode bf16 Linear4bit on AVX512-BF16 CPUs for a kernel without autograd, which
    would drop the gradient through every attention projection from then on. The LoRA gradients of a step after
    an eval forward are those of the step before it, bit for bit (the same computation, so equal, not close)."""
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    before = _lora_grads_of_one_step(bf16_lora_model, ids)
    _eval_forward(bf16_lora_model, ids)
    after = _lora_grads_of_one_step(bf16_lora_model, ids)
    linears = [m for m in bf16_lora_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert linears and not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears)
    assert before.keys() == after.keys() and len(before) > 0
    for name, grad in before.items():
        assert torch.equal(grad, after[name]), name


def test_bitsandbytes_packed_cpu_kernel_drops_gradients_the_control(tiny_mixtral_dir):
    """The broken control: bitsandbytes' default (the packed kernel allowed) changes the gradients after an eval
    forward, so the test above can fail. Only where bitsandbytes has the kernel (an AVX512-BF16 CPU)."""
    from bitsandbytes.functional import has_avx512bf16

    from moe_qlora.config.sections import LoraSection
    from moe_qlora.model.adapters import attach_adapters

    if not has_avx512bf16():
        pytest.skip("the packed bf16 kernel exists only on AVX512-BF16 CPUs; this one has none")
    model = load_model(LoadOptions(str(tiny_mixtral_dir), compute_dtype=torch.bfloat16))
    model = attach_adapters(model, LoraSection(rank=4, alpha=8, experts=True, target_modules=[]), seed=0)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = True
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    before = _lora_grads_of_one_step(model, ids)
    _eval_forward(model, ids)
    after = _lora_grads_of_one_step(model, ids)
    layer0 = [n for n in before if "layers.0." in n]
    change = sum(float((before[n].float() - after[n].float()).norm() ** 2) for n in layer0) ** 0.5
    size = sum(float(before[n].float().norm() ** 2) for n in layer0) ** 0.5
    assert size > 0 and change > 0.01 * size
