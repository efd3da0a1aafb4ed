"""The MoE layer's state on an experts module (moe/layer_state.py): one MoELayerState, `module.moe_state`, attached
once; set_moe_kernels, the layout adoptions, offload, make_stacks_shardable and deferred_lora_gradients all write
that same object, reading attaches nothing, and it adds no parameter (the LoRA stays `moe_lora`'s)."""

from __future__ import annotations

import pytest

from moe_qlora.common.streams import CheckedStreams
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.model_path import ensure_tiny
from moe_qlora.moe.expert_lora import attach_expert_lora
from moe_qlora.moe.expert_stacks import experts_modules
from moe_qlora.moe.experts import deferred_lora_gradients, kernel_self_check, set_moe_kernels
from moe_qlora.moe.kernels.grouped_mm import dequant_budget_bytes
from moe_qlora.moe.layer_state import NEVER_SET, MoELayerState, layer_state, read_state
from moe_qlora.moe.offload import offload_experts
from moe_qlora.moe.stack_surgery import make_stacks_shardable


@pytest.fixture
def model(tiny_mixtral_dir):
    return load_model(LoadOptions(str(tiny_mixtral_dir)))


def states_on(module) -> list[MoELayerState]:
    """Every MoELayerState the module holds as an attribute (one, once attached)."""
    return [v for v in vars(module).values() if isinstance(v, MoELayerState)]


def moe_attributes(module) -> set[str]:
    """The module's own `moe_*` attributes (submodules such as moe_lora live in _modules, not here)."""
    return {name for name in vars(module) if name.startswith("moe_")}


def test_reading_attaches_nothing_and_the_accessor_attaches_one_object(model):
    _, module = experts_modules(model)[0]
    assert read_state(module) is NEVER_SET and states_on(module) == []
    state = layer_state(module)
    assert layer_state(module) is state and read_state(module) is state
    assert states_on(module) == [state] and NEVER_SET == MoELayerState()  # the defaults were not written


def test_kernels_offload_and_deferred_gradients_land_in_the_same_object(model):
    modules = [m for _, m in experts_modules(model)]
    before = [layer_state(m) for m in modules]
    set_moe_kernels(model, "auto", fused_below_rows=4, dequant_buffer_mb=1.5, self_check=True)
    offloader = offload_experts(modules, "cpu", streams=CheckedStreams(max_buffers=2))
    checker = kernel_self_check(model)
    assert checker is not None
    for layer, (module, state) in enumerate(zip(modules, before, strict=True)):
        assert layer_state(module) is state and states_on(module) == [state]
        assert (state.kernels, state.fused_below_rows) == ("auto", 4)
        assert state.dequant_budget == dequant_budget_bytes(1.5) and state.gate_is_silu_mul is True
        assert state.self_check is checker  # one check for the whole model
        assert state.offload == (offloader, layer)
        assert moe_attributes(module) == {"moe_state"}
    with deferred_lora_gradients(model) as store:
        assert all(state.deferred_grads is store for state in before)
    assert all(state.deferred_grads is None for state in before)


def test_shardable_stacks_are_recorded_in_the_state_and_it_holds_no_parameter(model):
    attach_expert_lora(model, rank=4, alpha=8, seed=0)
    _, module = experts_modules(model)[0]
    state = layer_state(module)
    shapes = {n: getattr(module, n).quant_state.shape for n in ("gate_up_proj", "down_proj")}
    assert make_stacks_shardable(model) > 0
    assert layer_state(module) is state and state.shardable_shapes == shapes and state.nested_scales is not None
    assert [module] == [m for _, m in experts_modules(model) if m is module]  # still found as an experts module
    keys = model.state_dict().keys()
    assert any(".moe_lora." in k for k in keys) and not any("moe_state" in k for k in keys)


@pytest.mark.parametrize(
    ("family", "flags"),
    [
        ("llama4_text", {"adopted": True, "split_gate_up": False}),  # dense-input experts, given our forward
        # marked split before loading, adopted once its gate and up were fused: two writers, one object
        ("inkling_text", {"adopted": True, "split_gate_up": True}),
    ],
)
def test_layout_flags_and_kernel_settings_share_one_object(family, flags):
    model = load_model(LoadOptions(str(ensure_tiny(family))))
    module = next(m for m in model.modules() if read_state(m).adopted)
    state = layer_state(module)
    assert {name: getattr(state, name) for name in flags} == flags
    if family == "llama4_text":
        assert state.top_k == model.config.num_experts_per_tok
    set_moe_kernels(model, "torch-grouped")
    assert layer_state(module) is state and states_on(module) == [state]
    assert state.kernels == "torch-grouped" and {name: getattr(state, name) for name in flags} == flags
