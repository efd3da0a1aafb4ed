"""GGUF, per-expert and vLLM export for every family they write (export.family_tables.FAMILIES), against PEFT.

Per family: a tiny model from its transformers config, LoRA on the experts, the router and the linears llama.cpp
applies a LoRA to, every factor random (non-zero). The oracle is PEFT's own merge of the adapter into the fp32
base (merged - base, per parameter). The GGUF is read back with gguf.GGUFReader; every expert's dense delta
scale * B_e A_e is recomputed from the file and compared with PEFT's, and every other tensor's under the name
gguf's TensorNameMap (llama.cpp's own mapping) gives the base module. Tolerance 1e-5: fp32 products of
O(0.1) factors, summed over rank 4, against PEFT's fp32 merge.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_formats import field_value, merged_minus_base, read_gguf, reference_permute

from moe_qlora.config.sections import LoraSection
from moe_qlora.export import family_tables, gguf_archs, gguf_lora, peft_factors, per_expert_lora, vllm_lora
from moe_qlora.export.adapter import save_adapter
from moe_qlora.model.adapters import attach_adapters
from moe_qlora.model.loading import LoadOptions, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model

from helpers.tiny_configs import tiny_config_any

TOL = 1e-5
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Targets per family: the attention projections llama.cpp applies a LoRA to (DeepSeek's MLA query and latent
# projections it multiplies without one, and the export refuses them: test_formats).
# LFM2's out_proj names its convolution's too; Gemma-4's vision tower has q_proj too, in a wrapper PEFT cannot
# target.
TARGETS = {
    **dict.fromkeys(
        (
            "deepseek_v2",
            "deepseek_v3",
            "glm_moe_dsa",
            "glm4_moe_lite",
            "mistral4",
            "deepseek_v32",
            "dots3_note",
            "dots3_note_text",
            "hy_v4",
        ),
        ["o_proj"],
    ),
    "kimi_linear": [],
    "glm5_next": [],
    "lfm2_moe": ["q_proj", "k_proj", "v_proj"],
    "gemma4": [],
    "laguna": [*DEFAULT_TARGETS, "g_proj"],
    # linear attention: every projection llama.cpp applies a LoRA to, split or regrouped by its converter
    "qwen3_next": [*DEFAULT_TARGETS, "in_proj_qkvz", "in_proj_ba", "out_proj"],
    **dict.fromkeys(
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        [*DEFAULT_TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"],
    ),
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),  # (and its indexer's one q and k projection)
        [*DEFAULT_TARGETS, "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "index_qk_proj"],
    ),
    # DeepSeek-V4: gate_proj also names the KV compressor's gate
    "deepseek_v4": ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj", "down_proj"],
    "minimax_m3_vl": "auto",  # its family's: attention and the shared expert's fused gate_up, kept to the
    # language model (its vision layers have q_proj too)
    "sarvam_moe": [*DEFAULT_TARGETS, "gate_proj", "up_proj", "down_proj"],
}
# routers that are not a weight lora.router can adapt (it refuses them)
NO_ROUTER_LORA = {"afmoe", "hunyuan_v1_moe", "gemma4", "gemma4_text"}


def family_adapter(
    workdir: Path, model_type: str, *, router: bool | None = None, targets: list[str] | None = None, **config_fields
) -> Path:
    """A tiny model of `model_type` with random (non-zero) LoRA on its experts, router (unless `router` is False
    or the family's router takes none) and `targets` (TARGETS by default), saved in PEFT's format."""
    tok = build_byte_tokenizer()
    config = tiny_config_any(model_type, len(tok))
    for key, value in config_fields.items():
        setattr(config, key, value)
    path = save_tiny_model(workdir / model_type, config, tokenizer=tok)
    targets = TARGETS.get(model_type, DEFAULT_TARGETS) if targets is None else targets
    lora = LoraSection(
        rank=4, alpha=8.0, target_modules=targets, router=model_type not in NO_ROUTER_LORA if router is None else router
    )
    model = attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return save_adapter(model, workdir / f"{model_type}-adapter", cfg=lora, base_model_name_or_path=str(path))


@pytest.fixture(scope="module", params=sorted(family_tables.FAMILIES))
def exported(request, tmp_path_factory):
    """(model_type, PEFT's deltas, the base config, the GGUF's tensors, its fields, the PEFT adapter)."""
    workdir = tmp_path_factory.mktemp(request.param)
    adapter = family_adapter(workdir, request.param)
    deltas, config = merged_minus_base(adapter)
    _, fields, tensors = read_gguf(gguf_lora.write_gguf(adapter, workdir / "adapter.gguf"))
    return request.param, deltas, config.get_text_config(), tensors, fields, adapter


def gguf_delta(tensors: dict, name: str, scale: float) -> np.ndarray:
    return scale * (tensors[f"{name}.lora_b"] @ tensors[f"{name}.lora_a"])


def expert_deltas(tensors: dict, layer: int, scale: float) -> dict[str, np.ndarray]:
    kinds = ("gate", "up", "gate_up", "down")
    kinds = [k for k in kinds if f"blk.{layer}.ffn_{k}_exps.weight.lora_a" in tensors]
    return {kind: gguf_delta(tensors, f"blk.{layer}.ffn_{kind}_exps.weight", scale) for kind in kinds}


def gate_up_down(model_type: str, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(gate (E, I, H), up (E, I, H), down (E, H, I)) from PEFT's merged deltas in the family's storage, written
    out from transformers' modeling files: GPT-OSS and Llama-4 store (E, H, 2I) and (E, I, H) (x @ W), GPT-OSS
    alternating gate and up columns and Llama-4 gate's half first; the others (E, 2I, H) and (E, H, I)."""
    if model_type in ("gpt_oss", "llama4", "llama4_text"):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if model_type == "gpt_oss":
        return gate_up[:, 0::2], gate_up[:, 1::2], down
    if model_type == "nemotron_h":  # no gate: the "gate_up" stack is the up projection
        return None, gate_up, down
    inter = gate_up.shape[1] // 2
    return gate_up[:, :inter], gate_up[:, inter:], down


def expert_stacks(deltas: dict) -> list[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(key, layer, first stack's delta, down's) of each experts module PEFT merged: the first stack is gate_up,
    or up for experts without a gate."""
    out = []
    for key, first in deltas.items():
        if m := re.search(r"\.layers\.(\d+)\..*experts\.(gate_up_proj|up_proj)$", key):
            out.append((key, int(m[1]), first, deltas[key.replace(m[2], "down_proj")]))
    return out


def check_experts(model_type: str, deltas: dict, tensors: dict, scale: float) -> list[str]:
    """Layers whose GGUF expert deltas differ from PEFT's (every expert at once); [] when all match."""
    wrong, checked = [], 0
    for key, layer, first, down in expert_stacks(deltas):
        gate, up, down = gate_up_down(model_type, first, down)
        got = expert_deltas(tensors, layer, scale)
        want = {"gate": gate, "up": up, "down": down}
        if "gate_up" in got:  # one fused tensor, gate's rows first (Gemma-4)
            want = {"gate_up": torch.cat([gate, up], dim=1), "down": down}
        want = {k: v.numpy() for k, v in want.items() if v is not None}
        if set(got) != set(want):
            wrong.append(f"{key}: GGUF has {sorted(got)}, PEFT {sorted(want)}")
            continue
        checked += 1
        wrong += [f"{key} {kind}" for kind in want if np.abs(got[kind] - want[kind]).max() > TOL]
    assert checked, "no expert LoRA in PEFT's merge: the oracle saw nothing to compare"
    return wrong


def test_every_experts_delta_matches_peft(exported):
    model_type, deltas, config, tensors, fields, _ = exported
    assert field_value(fields["general.architecture"]) == family_tables.FAMILIES[model_type].gguf_arch
    assert field_value(fields["general.type"]) == "adapter"
    assert check_experts(model_type, deltas, tensors, scale=8.0 / 4) == []


def test_rolled_experts_are_caught(exported):
    """Broken control: expert e's factors under expert e + 1 (np.roll over the expert axis)."""
    model_type, deltas, _, tensors, _, _ = exported
    rolled = {k: np.roll(v, 1, axis=0) if "_exps." in k else v for k, v in tensors.items()}
    assert check_experts(model_type, deltas, rolled, scale=8.0 / 4) != []


# DeepSeek-V4's tensors as llama.cpp's converter names them from the original checkpoint's keys
# (conversion/deepseek.py, _map_dsv4_tensor_name at 0c1e57098): the oracle reaches transformers' module names
# through transformers' own renames of these keys, not through the export's table.
DSV4_CHECKPOINT_NAMES = {
    "attn.wq_a": "attn_q_a",
    "attn.wq_b": "attn_q_b",
    "attn.wkv": "attn_kv",
    "attn.wo_a": "attn_output_a",
    "attn.wo_b": "attn_output_b",
    "attn.compressor.wkv": "attn_compressor_kv",
    "attn.compressor.wgate": "attn_compressor_gate",
    "attn.indexer.wq_b": "indexer.attn_q_b",
    "attn.indexer.weights_proj": "indexer.proj",
    "attn.indexer.compressor.wkv": "indexer_compressor_kv",
    "attn.indexer.compressor.wgate": "indexer_compressor_gate",
    "ffn.gate": "ffn_gate_inp",
    "ffn.shared_experts.w1": "ffn_gate_shexp",
    "ffn.shared_experts.w2": "ffn_down_shexp",
    "ffn.shared_experts.w3": "ffn_up_shexp",
}


def dsv4_names(layer: int) -> dict[str, str]:
    """{transformers module path: blk.N.<kind>} of DeepSeek-V4, through transformers' checkpoint renames."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    out = {}
    for key, kind in DSV4_CHECKPOINT_NAMES.items():
        name = f"layers.{layer}.{key}.weight"
        for rule in get_checkpoint_conversion_mapping("deepseek_v4"):
            if type(rule) is WeightRenaming:
                name, _ = rule.rename_source_key(name)
        out[f"model.{name.removesuffix('.weight')}"] = f"blk.{layer}.{kind}"
    return out


def converter_layout(model_type: str, config, module: str, delta: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """[(transformers module whose llama.cpp tensor it is, delta rows as that tensor's)] for a weight's delta, as
    llama.cpp's converter lays out the base weight (conversion/qwen.py, qwen4exp.py, minimax.py), written out for
    the oracle with views rather than the export's row indices."""
    path, proj = module.rsplit(".", 1)
    if model_type == "qwen3_next" and proj == "in_proj_qkvz":  # per key head: [q | k | v | z]
        nk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
        rdv = config.linear_num_value_heads // nk * dv
        q, k, v, z = np.split(delta.reshape(nk, -1, delta.shape[1]), np.cumsum([dk, dk, rdv]), axis=1)
        flat = [x.reshape(-1, delta.shape[1]) for x in (q, k, v, z)]
        return [(f"{path}.in_proj_qkv", np.concatenate(flat[:3])), (f"{path}.in_proj_z", flat[3])]
    tiled = model_type.startswith(("qwen3_5_moe", "qwen4_exp")) and ".linear_attn." in f".{module}"
    if tiled and config.linear_num_key_heads != config.linear_num_value_heads:  # value head g r + j -> j nk + g
        nk, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads

        def tile(x: np.ndarray) -> np.ndarray:
            return x.reshape(nk, r, -1, x.shape[-1]).swapaxes(0, 1).reshape(x.shape)

        if proj == "in_proj_qkv":
            qk = 2 * nk * config.linear_key_head_dim
            return [(module, np.concatenate([delta[:qk], tile(delta[qk:])]))]
        if proj in ("in_proj_z", "in_proj_a", "in_proj_b"):
            return [(module, tile(delta))]
        if proj == "out_proj":  # its input columns
            return [(module, tile(delta.T).T)]
    if proj == "gate_up_proj":  # MiniMax-M3's fused dense / shared MLP: gate's rows, then up's
        gate, up = np.split(delta, 2)
        return [(f"{path}.gate_proj", gate), (f"{path}.up_proj", up)]
    if proj == "index_qk_proj":  # Qwen4-Exp's indexer: its heads' q rows, then k's (conversion/qwen4exp.py)
        q, k = np.split(delta, [config.indexer_n_heads * config.indexer_head_dim])
        return [(f"{path}.q_proj", q), (f"{path}.k_proj", k)]
    return [(module, delta)]


def llama_cpp_name(model_type: str, config, module: str) -> str | None:
    """llama.cpp's tensor name of a transformers module (model.layers.N...), from the tensor map of llama.cpp's
    architecture (the one whose names agree, for those newer than the gguf package), or DeepSeek-V4's."""
    names = family_tables.FAMILIES[model_type]
    layer = int(module.split(".")[2])
    if names.gguf_arch == "deepseek4":
        return dsv4_names(layer).get(module)
    if module.endswith((".indexer.q_proj", ".indexer.k_proj")):  # llama.cpp's own gguf-py (0c1e57098)
        return f"blk.{layer}.indexer.{module.rsplit('.', 1)[1]}"
    tensor_names = gguf_archs.gguf_name_map(names.gguf_arch, config.num_hidden_layers)
    # Granite's router is router.layer in its checkpoints; Nemotron-H's root is backbone
    candidates = [
        module,
        module.replace("block_sparse_moe.router", "block_sparse_moe.router.layer"),
        module.replace("model.", "backbone.", 1),
    ]
    name = next((n for c in candidates if (n := tensor_names.get_name(c))), None)
    if name is None and names.gguf_arch == "minimax-m3":  # shared experts and dense MLPs, which MiniMax-M2's map
        # lacks: gguf's one table gives them the names DeepSeek-V2's map does
        name = gguf_archs.gguf_name_map("deepseek2", config.num_hidden_layers).get_name(module)
    return name


def test_every_other_tensor_lands_under_llama_cpp_name_with_peft_delta(exported):
    model_type, deltas, config, tensors, _, _ = exported
    names = family_tables.FAMILIES[model_type]
    heads = {
        "attn_q": config.num_attention_heads,
        "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    }
    want_all: dict[str, list[np.ndarray]] = {}
    for key, delta in deltas.items():
        if ".experts." in key:
            continue
        module = "model." + re.sub(r"^.*?\.(layers\.\d+\.)", r"\1", key.removesuffix(".weight"))  # drop language_model.
        for piece, want in converter_layout(model_type, config, module, delta.numpy()):
            name = llama_cpp_name(model_type, config, piece)
            assert name is not None, f"{key}: gguf has no tensor name for {piece}"
            kind = name.split(".", 2)[2]
            if names.permute_qk and kind in heads:  # llama.cpp's converter permutes the base's q/k rows
                want = reference_permute(want, heads[kind])
            want_all.setdefault(name, []).append(want)
    compared = 0
    assert all(len(p) == 1 for p in want_all.values())  # no two modules on one llama.cpp tensor
    written = {k.rsplit(".weight.lora_", 1)[0] for k in tensors if "_exps." not in k}
    fused = {n for n in want_all if n.endswith((".attn_q", ".attn_k", ".attn_v"))}
    fused = fused if names.gguf_arch in gguf_archs.GGUF_ALWAYS_FUSED_QKV else set()
    assert written == set(want_all) - fused | {f"{n.rsplit('.', 1)[0]}.attn_qkv" for n in fused}  # nothing stray
    for name, pieces in want_all.items():
        if names.gguf_arch in gguf_archs.GGUF_ALWAYS_FUSED_QKV and name.endswith((".attn_q", ".attn_k", ".attn_v")):
            continue  # compared as the one attn_qkv below
        got = gguf_delta(tensors, f"{name}.weight", 8.0 / tensors[f"{name}.weight.lora_b"].shape[1])
        assert np.abs(got - pieces[0]).max() <= TOL, name
        compared += 1
    if names.gguf_arch in gguf_archs.GGUF_ALWAYS_FUSED_QKV:  # Sarvam: q's rows, k's, v's, in llama.cpp's attn_qkv
        for layer in range(config.num_hidden_layers):
            want = np.concatenate([want_all[f"blk.{layer}.attn_{p}"][0] for p in "qkv"])
            b = tensors[f"blk.{layer}.attn_qkv.weight.lora_b"]
            assert np.abs(gguf_delta(tensors, f"blk.{layer}.attn_qkv.weight", 8.0 / b.shape[1]) - want).max() <= TOL
            compared += 1
    if model_type not in NO_ROUTER_LORA:
        assert compared >= len(expert_stacks(deltas))  # the router at least, in every MoE layer


@pytest.mark.parametrize("model_type", ["granitemoeshared", "granitemoehybrid", "granitemoe_swa"])
def test_granite_shared_mlp_lands_as_llama_cpps_converter_lays_it_out(model_type, tmp_path):
    """Granite's shared MLP is one input_linear (gate's rows, then up's): GraniteMoeModel's converter (also
    Granite-Hybrid's) splits it into ffn_gate_shexp and ffn_up_shexp, Granite-MoE-SWA's keeps it whole as
    ffn_up_shexp (conversion/granite.py at 0c1e57098); output_linear is ffn_down_shexp."""
    adapter = family_adapter(tmp_path, model_type, shared_intermediate_size=32)
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["shared_mlp.input_linear", "shared_mlp.output_linear"])
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = attach_adapters(load_model(LoadOptions(base)), lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    shared = save_adapter(model, tmp_path / "shared", cfg=lora, base_model_name_or_path=base)
    deltas, _ = merged_minus_base(shared)
    _, _, tensors = read_gguf(gguf_lora.write_gguf(shared, tmp_path / "a.gguf"))
    layers = sorted({int(m[1]) for k in deltas if (m := re.search(r"layers\.(\d+)\.shared_mlp\.input_linear", k))})
    assert layers
    for layer in layers:
        fused = deltas[f"model.layers.{layer}.shared_mlp.input_linear.weight"].numpy()
        want = {"ffn_down_shexp": deltas[f"model.layers.{layer}.shared_mlp.output_linear.weight"].numpy()}
        if model_type == "granitemoe_swa":
            want["ffn_up_shexp"] = fused
        else:
            want["ffn_gate_shexp"], want["ffn_up_shexp"] = np.split(fused, 2)
        got = {k.split(".")[2] for k in tensors if k.startswith(f"blk.{layer}.ffn_") and "shexp" in k}
        assert got == set(want)
        for kind, delta in want.items():
            assert np.abs(gguf_delta(tensors, f"blk.{layer}.{kind}.weight", 8.0 / 4) - delta).max() <= TOL, kind


def test_split_and_regrouped_rows_are_caught():
    """Broken controls of converter_layout's oracle: Qwen3-Next's qkvz rows taken as [q; k; v; z] blocks, and
    Qwen3.5's value heads left grouped, do not give llama.cpp's layout."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=3, linear_value_head_dim=2
    )
    delta = np.random.default_rng(0).normal(size=(2 * (3 + 3 + 4 + 4), 5))
    (_, qkv), (_, z) = converter_layout("qwen3_next", config, "model.layers.0.linear_attn.in_proj_qkvz", delta)
    assert not np.allclose(qkv, delta[: len(qkv)]) and not np.allclose(z, delta[len(qkv) :])
    a = np.random.default_rng(1).normal(size=(4, 5))  # a rank-4 LoRA through the export
    b = np.random.default_rng(2).normal(size=(2 * 2 * 3 + 4 * 2, 4))
    ((_, want),) = converter_layout("qwen3_5_moe_text", config, "model.layers.0.linear_attn.in_proj_qkv", b @ a)
    _, got_b = gguf_lora.value_heads_tiled("in_proj_qkv", torch.tensor(a), torch.tensor(b), config)
    assert np.allclose(got_b.numpy() @ a, want)
    assert not np.allclose(b @ a, want)  # grouped as transformers holds them


def test_the_exports_layouts_match_the_oracles_with_key_and_value_heads_of_other_sizes():
    """The tiny configs' key and value heads are both 16 wide; here 3 and 2 (and 2 key, 4 value heads), so a
    mix-up of the two in the export's row indices cannot pass: Qwen3-Next's qkvz split and Qwen3.5's tiled value
    heads, rows of B and out_proj's columns of A, against converter_layout's views."""
    from types import SimpleNamespace

    config = SimpleNamespace(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=3,
        linear_value_head_dim=2,
        num_attention_heads=1,
    )
    rng = np.random.default_rng(3)
    a_in, a = rng.normal(size=(4, 5)), rng.normal(size=(4, 4 * 2))  # rank 4; out_proj's input is nv * dv
    cases = [
        ("qwen3next", "qwen3_next", "in_proj_qkvz", a_in, rng.normal(size=(2 * (3 + 3 + 4 + 4), 4))),
        ("qwen35moe", "qwen3_5_moe_text", "in_proj_qkv", a_in, rng.normal(size=(2 * 3 * 2 + 4 * 2, 4))),
        ("qwen35moe", "qwen3_5_moe_text", "in_proj_z", a_in, rng.normal(size=(4 * 2, 4))),
        ("qwen35moe", "qwen3_5_moe_text", "in_proj_b", a_in, rng.normal(size=(4, 4))),
        ("qwen35moe", "qwen3_5_moe_text", "out_proj", a, rng.normal(size=(5, 4))),
    ]
    for arch, model_type, proj, lora_a, lora_b in cases:
        pieces = gguf_lora.gguf_pieces(arch, "linear_attn", proj, torch.tensor(lora_a), torch.tensor(lora_b), config)
        want = converter_layout(model_type, config, f"model.layers.0.linear_attn.{proj}", lora_b @ lora_a)
        assert [p[1] for p in pieces] == [m.rsplit(".", 1)[1] for m, _ in want], proj
        for (_, _, pa, pb), (_, delta) in zip(pieces, want, strict=True):
            assert np.allclose(pb.numpy() @ pa.numpy(), delta), proj


FUSABLE = sorted(
    t
    for t, n in family_tables.FAMILIES.items()
    if n.gguf_arch in gguf_archs.GGUF_FUSABLE_GATE_UP and not n.fused_gate_up
)


@pytest.mark.parametrize("model_type", FUSABLE)
def test_gate_up_fused_for_a_base_converted_with_fuse_gate_up_exps(model_type, tmp_path):
    """llama.cpp's --fuse-gate-up-exps turns a base's ffn_gate_exps and ffn_up_exps into one ffn_gate_up_exps,
    gate's rows first: the adapter then has one fused LoRA whose delta is [gate; up] of PEFT's, per expert."""
    adapter = family_adapter(tmp_path, model_type)
    deltas, _ = merged_minus_base(adapter)
    _, _, tensors = read_gguf(gguf_lora.write_gguf(adapter, tmp_path / "fused.gguf", fuse_gate_up_exps=True))
    assert not any(".ffn_gate_exps." in k or ".ffn_up_exps." in k for k in tensors)
    assert check_experts(model_type, deltas, tensors, scale=8.0 / 4) == []
    # broken control: up's rows first
    swapped = {}
    for k, v in tensors.items():
        if ".ffn_gate_up_exps.weight.lora_b" in k:
            v = np.concatenate([v[:, v.shape[1] // 2 :], v[:, : v.shape[1] // 2]], axis=1)
        swapped[k] = v
    assert check_experts(model_type, deltas, swapped, scale=8.0 / 4) != []


def qkv_deltas(deltas: dict, config, permute: bool) -> dict[int, list[np.ndarray]]:
    """{layer: [dq, dk, dv]} of PEFT's merge, rows in llama.cpp's order (q and k permuted where it permutes)."""
    out = {}
    for key in deltas:
        if m := re.search(r"\.layers\.(\d+)\.self_attn\.q_proj\.weight$", key):
            q, k, v = (deltas[key.replace("q_proj", p)].numpy() for p in ("q_proj", "k_proj", "v_proj"))
            if permute:
                q = reference_permute(q, config.num_attention_heads)
                k = reference_permute(k, config.num_key_value_heads or config.num_attention_heads)
            out[int(m[1])] = [q, k, v]
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "granitemoe"])  # Mixtral's, Granite's q/k permuted
def test_qkv_fused_for_a_base_converted_with_fuse_qkv(model_type, tmp_path):
    """llama.cpp's --fuse-qkv writes one attn_qkv per attention layer, q's rows, then k's, then v's: the adapter's
    attn_qkv LoRA has rank 3r, and with llama.cpp's own scale, alpha over that rank, its delta is PEFT's three
    stacked."""
    adapter = family_adapter(tmp_path, model_type)
    deltas, config = merged_minus_base(adapter)
    config = config.get_text_config()
    _, _, tensors = read_gguf(gguf_lora.write_gguf(adapter, tmp_path / "qkv.gguf", fuse_qkv=True))
    assert not any(re.search(r"\.attn_[qkv]\.", k) for k in tensors)
    want = qkv_deltas(deltas, config, family_tables.FAMILIES[model_type].permute_qk)
    assert want, "no q/k/v LoRA in PEFT's merge"

    def errors(lora: dict) -> dict[int, float]:
        got = {}
        for layer in want:
            a, b = lora[f"blk.{layer}.attn_qkv.weight.lora_a"], lora[f"blk.{layer}.attn_qkv.weight.lora_b"]
            got[layer] = float(np.abs(8.0 / b.shape[1] * (b @ a) - np.concatenate(want[layer])).max())  # alpha over
            # llama.cpp's rank
        return got

    assert all(tensors[f"blk.{n}.attn_qkv.weight.lora_b"].shape[1] == 3 * 4 for n in want)
    assert max(errors(tensors).values()) <= TOL
    # broken control: k's and v's rows of B swapped (same size here)
    swapped = dict(tensors)
    for layer in want:
        b = tensors[f"blk.{layer}.attn_qkv.weight.lora_b"].copy()
        q_rows, kv_rows = len(want[layer][0]), len(want[layer][1])
        assert len(want[layer][2]) == kv_rows
        k = b[q_rows : q_rows + kv_rows].copy()
        b[q_rows : q_rows + kv_rows], b[q_rows + kv_rows :] = b[q_rows + kv_rows :], k
        swapped[f"blk.{layer}.attn_qkv.weight.lora_b"] = b
    assert min(errors(swapped).values()) > TOL


def test_check_norms_reads_fused_tensors_at_llama_cpps_own_scale(tmp_path):
    """check-norms on a GGUF scales each tensor as llama.cpp does, alpha over its own rank: the fused attn_qkv
    (rank 3r) row is the stacked q, k and v deltas of the unfused file (Frobenius norms add in squares), and the
    expert stacks are still split by the experts' rank r."""
    from moe_qlora.export.norms import check_norms

    adapter = family_adapter(tmp_path, "qwen3_next")
    plain = check_norms(gguf_lora.write_gguf(adapter, tmp_path / "plain.gguf")).rows
    fused = check_norms(
        gguf_lora.write_gguf(adapter, tmp_path / "fused.gguf", fuse_qkv=True, fuse_gate_up_exps=True)
    ).rows
    by = {(r.module, r.expert): r.norm_delta for r in plain}
    for r in fused:
        if ".attn_qkv." in r.module and (r.module.replace("attn_qkv", "attn_q"), r.expert) in by:  # fused by
            # --fuse-qkv (the linear-attention layers' own attn_qkv is in both files)
            parts = [by[(r.module.replace("attn_qkv", f"attn_{p}"), r.expert)] for p in "qkv"]
            assert r.norm_delta == pytest.approx(math.sqrt(sum(x * x for x in parts)), rel=1e-5)
        elif "_exps." not in r.module:
            assert r.norm_delta == pytest.approx(by[(r.module, r.expert)], rel=1e-6)
    assert any(".attn_qkv." in r.module and (r.module.replace("attn_qkv", "attn_q"), r.expert) in by for r in fused)
    down = [r for r in fused if ".ffn_down_exps." in r.module]
    assert len({r.expert for r in down}) == 8  # one row per expert: the stack split by r, not 3r
    for r in down:
        assert r.norm_delta == pytest.approx(by[(r.module, r.expert)], rel=1e-6)


def test_fuse_qkv_needs_q_k_and_v_and_an_architecture_llama_cpp_fuses(tmp_path):
    adapter = family_adapter(tmp_path, "deepseek_v2")
    with pytest.raises(family_tables.ExportError, match="deepseek_v2: llama.cpp's converter does not fuse q, k and v"):
        gguf_lora.write_gguf(adapter, tmp_path / "a.gguf", fuse_qkv=True)
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "mixtral", tiny_config_any("mixtral", len(tok)), tokenizer=tok)
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj"])
    model = attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)
    partial = save_adapter(model, tmp_path / "qk", cfg=lora, base_model_name_or_path=str(path))
    with pytest.raises(family_tables.ExportError, match="layer 0: no LoRA on attn_v; a base converted with --fuse-qkv"):
        gguf_lora.write_gguf(partial, tmp_path / "b.gguf", fuse_qkv=True)
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b.gguf").exists()


def test_fuse_gate_up_exps_is_refused_where_llama_cpp_cannot_fuse(tmp_path):
    adapter = family_adapter(tmp_path, "mixtral")
    with pytest.raises(
        family_tables.ExportError, match="mixtral: llama.cpp's converter cannot fuse gate and up experts"
    ):
        gguf_lora.write_gguf(adapter, tmp_path / "a.gguf", fuse_gate_up_exps=True)
    assert not (tmp_path / "a.gguf").exists()


def test_fuse_gate_up_exps_goes_with_gguf_only(tmp_path):
    from typer.testing import CliRunner

    from moe_qlora.cli.app import app

    adapter = family_adapter(tmp_path, "qwen3_next")
    result = CliRunner().invoke(
        app, ["export", str(adapter), "--format", "vllm", "--out", str(tmp_path / "v"), "--fuse-gate-up-exps"]
    )
    assert result.exit_code == 2 and "goes with --format gguf" in result.output  # bad input: exit 2
    result = CliRunner().invoke(
        app, ["export", str(adapter), "--format", "gguf", "--out", str(tmp_path / "a.gguf"), "--fuse-gate-up-exps"]
    )
    assert result.exit_code == 0, result.output
    assert any(k.endswith(".ffn_gate_up_exps.weight.lora_b") for k in read_gguf(tmp_path / "a.gguf")[2])


@pytest.mark.parametrize(
    ("arch", "module", "reason"),
    [
        ("deepseek2", "self_attn.q_proj", "graph multiplies blk.0.attn_q without applying LoRA"),
        ("kimi-linear", "self_attn.q_proj", "graph multiplies blk.0.attn_q without applying LoRA"),
        ("glm-dsa", "self_attn.kv_a_proj_with_mqa", "without applying LoRA"),
        ("deepseek4", "self_attn.o_a_proj", "graph multiplies blk.0.attn_output_a without applying LoRA"),
        ("deepseek4", "self_attn.q_proj", "llama.cpp has no tensor for this LoRA target in deepseek4"),
        ("lfm2moe", "conv.in_proj", "shortconv.in_proj .lfm2moe. is not written by this export yet"),
    ],
)
def test_lora_llama_cpp_would_drop_or_misplace_is_refused_by_name(arch, module, reason):
    path, proj = module.rsplit(".", 1)
    with pytest.raises(family_tables.ExportError, match=reason):
        gguf_archs.gguf_linear_name(gguf_archs.gguf_name_map(arch, 2), arch, 0, path, proj)


def test_a_family_without_known_names_is_refused_by_name(tmp_path, monkeypatch):
    import json

    from safetensors.torch import save_file

    for module in (peft_factors, vllm_lora):  # read_run_adapter's lookup, and write_vllm's own
        monkeypatch.setattr(module, "base_model_type", lambda config, where: "switch_transformers")
    save_file(
        {"x.lora_A.weight": torch.zeros(1, 1), "x.lora_B.weight": torch.zeros(1, 1)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x", "r": 1}))
    for write in (gguf_lora.write_gguf, per_expert_lora.write_per_expert, vllm_lora.write_vllm):
        with pytest.raises(family_tables.ExportError, match="switch_transformers: no per-expert / GGUF names known"):
            write(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_family_llama_cpp_cannot_convert_is_refused_with_its_reason(tmp_path, monkeypatch):
    import json

    from safetensors.torch import save_file

    monkeypatch.setattr(peft_factors, "base_model_type", lambda config, where: "sarvam_mla")
    save_file(
        {"x.lora_A.weight": torch.zeros(1, 1), "x.lora_B.weight": torch.zeros(1, 1)},
        str(tmp_path / "adapter_model.safetensors"),
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x", "r": 1}))
    with pytest.raises(
        family_tables.ExportError, match="sarvam_mla: not written as GGUF .llama.cpp 0c1e57098 has no conv"
    ):
        gguf_lora.write_gguf(tmp_path, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_every_trained_family_is_exported_or_refused_with_a_reason():
    """Each model type docs/families.md says trains is in the export's tables: written (directly, or through its
    text model's type, as base_model_type resolves a multimodal base), or refused with its reason."""
    from transformers import AutoConfig

    table = (Path(__file__).resolve().parents[2] / "docs" / "families.md").read_text()
    trained = re.findall(r"^\| `([a-z0-9_]+)` \| supported", table, flags=re.M)
    assert len(trained) > 70, "the family table was not found"
    known = {*family_tables.FAMILIES, *family_tables.NOT_EXPORTED}
    unplaced = [
        t
        for t in trained
        if t not in known and AutoConfig.for_model(t).get_text_config().model_type not in family_tables.FAMILIES
    ]
    assert unplaced == []


def per_expert_deltas(folder: Path, names: family_tables.FamilyNames, scale: float) -> dict[tuple, torch.Tensor]:
    """{(layer, expert, projection): scale * B A} from a per-expert adapter's keys, parsed independently."""
    import re

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    key = re.compile(rf".*\.layers\.(\d+)\.{re.escape(names.experts)}\.(\d+)\.(\w+)\.lora_A\.weight")
    out = {}
    for k, a in tensors.items():
        if m := key.fullmatch(k):
            out[int(m[1]), int(m[2]), m[3]] = scale * tensors[k.replace("lora_A", "lora_B")] @ a
    return out


def test_per_expert_keys_carry_every_experts_delta(exported, tmp_path):
    """The per-expert layout (vLLM's 2D MoE LoRA, SGLang): one LoRA per expert and projection under the
    checkpoint's names; each expert's gate, up and down delta equals PEFT's."""
    model_type, deltas, _, _, _, adapter = exported
    names = family_tables.FAMILIES[model_type]
    if model_type in family_tables.PER_EXPERT_UNREAD:
        with pytest.raises(family_tables.ExportError, match=f"{model_type}: "):
            per_expert_lora.write_per_expert(adapter, tmp_path / "pe")
        return
    got = per_expert_deltas(per_expert_lora.write_per_expert(adapter, tmp_path / "pe"), names, 8.0 / 4)
    assert got, "no per-expert keys"
    for key, layer, first, down in expert_stacks(deltas):
        gate, up, down = gate_up_down(model_type, first, down)
        for e in range(up.shape[0]):
            pairs = [(names.up, up[e]), (names.down, down[e]), *([(names.gate, gate[e])] if gate is not None else [])]
            for proj, want in pairs:
                assert (got[layer, e, proj] - want).abs().max() <= TOL, (key, e, proj)


# DeepSeek-V4 for vLLM: without the compressor's projections (the fixture's gate_proj and kv_proj reach them),
# which vLLM multiplies from their fused weight
VLLM_TARGETS = {
    "deepseek_v4": [
        "q_a_proj",
        "q_b_proj",
        "self_attn.kv_proj",
        "o_b_proj",
        "shared_experts.gate_proj",
        "shared_experts.up_proj",
        "shared_experts.down_proj",
    ]
}


def test_vllm_format_is_the_per_expert_layout_where_vllm_reads_2d(exported, tmp_path):
    import json

    family, *_, adapter = exported
    # the base as saved (a multimodal family's tiny model is its text model: qwen3_5_moe -> qwen3_5_moe_text)
    model_type = family_tables.base_model_type(json.loads((adapter / "adapter_config.json").read_text()), adapter)
    if model_type in family_tables.VLLM_NO_MOE_LORA:
        with pytest.raises(family_tables.ExportError, match=f"{model_type}: vLLM 0.33.0 serves no MoE LoRA for it"):
            vllm_lora.write_vllm(adapter, tmp_path / "v")
        assert not (tmp_path / "v").exists()
        return
    if model_type in vllm_lora.VLLM_IGNORED_ROUTER:  # the fixture trained router LoRA: refused; written without it
        with pytest.raises(family_tables.ExportError, match="does not apply a LoRA to this family's router"):
            vllm_lora.write_vllm(adapter, tmp_path / "v")
        assert not (tmp_path / "v").exists()
        adapter = family_adapter(tmp_path / "no-router", family, router=False)
    if family in VLLM_TARGETS:  # the fixture trained modules vLLM multiplies without their LoRA: refused, by name
        with pytest.raises(family_tables.ExportError, match=f"{model_type}: vLLM 0.33.0 does not apply a LoRA to "):
            vllm_lora.write_vllm(adapter, tmp_path / "v")
        assert not (tmp_path / "v").exists()
        adapter = family_adapter(tmp_path / "vllm-targets", family, router=False, targets=VLLM_TARGETS[family])
    if model_type in family_tables.PER_EXPERT_UNREAD and model_type not in family_tables.VLLM_FUSED_3D:
        with pytest.raises(family_tables.ExportError, match=f"{model_type}: "):
            vllm_lora.write_vllm(adapter, tmp_path / "v")
        return
    vllm = vllm_lora.write_vllm(adapter, tmp_path / "v") / "adapter_model.safetensors"
    if model_type in family_tables.VLLM_FUSED_3D:  # vLLM reads PEFT's fused 3D expert LoRA as written
        assert vllm.read_bytes() == (adapter / "adapter_model.safetensors").read_bytes()
    elif model_type in vllm_lora.VLLM_ROTARY_PERMUTED:  # q's and k's B rows in vLLM's rotary order, all else as is
        per_expert = load_file(
            str(per_expert_lora.write_per_expert(adapter, tmp_path / "pe") / "adapter_model.safetensors")
        )
        got = load_file(str(vllm))
        qk = [k for k in got if ".lora_B." in k and (".q_proj." in k or ".k_proj." in k)]
        assert qk and got.keys() == per_expert.keys()
        assert all(torch.equal(got[k], per_expert[k]) != (k in qk) for k in got)  # exactly q's and k's B moved
        assert all(sorted(got[k].flatten().tolist()) == sorted(per_expert[k].flatten().tolist()) for k in qk)
    elif model_type not in vllm_lora.VLLM_RENAMED:
        per_expert = per_expert_lora.write_per_expert(adapter, tmp_path / "pe") / "adapter_model.safetensors"
        assert vllm.read_bytes() == per_expert.read_bytes()
    else:  # the per-expert layout under vLLM's module names (Granite's router is its block_sparse_moe.gate)
        old, new = vllm_lora.VLLM_RENAMED[model_type]
        per_expert = load_file(
            str(per_expert_lora.write_per_expert(adapter, tmp_path / "pe") / "adapter_model.safetensors")
        )
        got = load_file(str(vllm))
        assert not any(old in k for k in got)
        assert any(new in k for k in got) == any(old in k for k in per_expert)  # Granite's router: trained
        got = {k.replace(new, old): v for k, v in got.items()}
        assert got.keys() == per_expert.keys() and all(torch.equal(got[k], per_expert[k]) for k in got)


def test_vllm_format_refuses_lora_granite_shared_mlp_would_ignore(tmp_path):
    """vLLM's Granite-MoE-Shared class (also serving Granite-MoE-SWA) packs no LoRA for the shared MLP's
    input_linear: refused by name; output_linear is applied, and written."""
    adapter = family_adapter(tmp_path, "granitemoeshared", shared_intermediate_size=32)
    vllm_lora.write_vllm(adapter, tmp_path / "plain")  # the fixture's targets: attention, router, experts
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["shared_mlp.input_linear", "shared_mlp.output_linear"])
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = attach_adapters(load_model(LoadOptions(base)), lora, seed=0)
    shared = save_adapter(model, tmp_path / "shared", cfg=lora, base_model_name_or_path=base)
    with pytest.raises(
        family_tables.ExportError,
        match=r"granitemoeshared: vLLM 0.33.0 does not apply a LoRA to "
        r"shared_mlp.input_linear .its packed_modules_mapping",
    ):
        vllm_lora.write_vllm(shared, tmp_path / "v")
    assert not (tmp_path / "v").exists()
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["shared_mlp.output_linear"])
    model = attach_adapters(load_model(LoadOptions(base)), lora, seed=0)
    output_only = save_adapter(model, tmp_path / "out", cfg=lora, base_model_name_or_path=base)
    keys = load_file(str(vllm_lora.write_vllm(output_only, tmp_path / "v") / "adapter_model.safetensors"))
    assert any(".shared_mlp.output_linear.lora_B." in k for k in keys)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_next"])
def test_vllm_format_refuses_the_shared_expert_gate_vllm_bypasses(tmp_path, family):
    """vLLM wraps mlp.shared_expert_gate with its LoRA layer, but the shared expert multiplies through its own
    expert_gate attribute, the unwrapped layer (found by vLLM's own loading: tests/export/test_vllm_oracle.py): a
    LoRA on it would load and never apply. Refused by name; the same adapter without it is written."""
    adapter = family_adapter(tmp_path / "gate", family, router=False, targets=["q_proj", "shared_expert_gate"])
    with pytest.raises(
        family_tables.ExportError,
        match=rf"{family}: vLLM 0.33.0 does not apply a LoRA to mlp.shared_expert_gate .the shared expert calls",
    ):
        vllm_lora.write_vllm(adapter, tmp_path / "v")
    assert not (tmp_path / "v").exists()
    control = family_adapter(tmp_path / "plain", family, router=False, targets=["q_proj"])
    assert (vllm_lora.write_vllm(control, tmp_path / "v") / "adapter_model.safetensors").is_file()


def test_training_a_target_vllm_would_not_apply_says_so_at_the_start(tmp_path):
    """Said before the first step; refused there when the run is to export for vLLM at its end (before, the
    export at the end failed after the whole training)."""
    from typer.testing import CliRunner

    from moe_qlora.cli.app import app

    def train(*sets):
        args = [
            "train",
            "--config",
            str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"),
            "--set",
            "model.name_or_path=builtin:tiny-qwen2-moe",
        ]
        sets = ("lora.target_modules=[q_proj,shared_expert_gate]", "train.max_steps=1", *sets)
        result = CliRunner().invoke(app, [*args, *(a for s in sets for a in ("--set", s))])
        return result.exit_code, " ".join(result.output.split())

    code, output = train(f"output.dir={tmp_path / 'noted'}")
    assert code == 0, output
    said = "will not export with --format vllm: qwen2_moe: vLLM 0.33.0 does not apply a LoRA to mlp.shared_expert_gate"
    assert said in output and output.index(said) < output.index("adapter:")
    code, output = train(f"output.dir={tmp_path / 'refused'}", "output.export_formats=[vllm]")
    assert code == 2 and "output.export_formats: vllm, and qwen2_moe: vLLM 0.33.0 does not apply" in output, output
    assert not (tmp_path / "refused" / "adapter").exists() and not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_vllm_format_renames_shared_experts_to_vllms_module_names(tmp_path, monkeypatch):
    """Hunyuan-V3's shared expert is mlp.shared_mlp in vLLM (mlp.shared_experts in transformers): a LoRA under
    the transformers name would load and match no module. The per-expert format keeps transformers' name."""
    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "hy_v3", tiny_config_any("hy_v3", len(tok)), tokenizer=tok)
    lora = LoraSection(rank=4, alpha=8.0, target_modules=["shared_experts.gate_proj", "o_proj"])
    model = attach_adapters(load_model(LoadOptions(str(path))), lora, seed=0)
    adapter = save_adapter(model, tmp_path / "adapter", cfg=lora, base_model_name_or_path=str(path))
    vllm = load_file(str(vllm_lora.write_vllm(adapter, tmp_path / "v") / "adapter_model.safetensors"))
    per_expert = load_file(
        str(per_expert_lora.write_per_expert(adapter, tmp_path / "pe") / "adapter_model.safetensors")
    )
    assert any(".mlp.shared_experts.gate_proj." in k for k in per_expert)
    assert not any(".shared_experts." in k for k in vllm)
    assert {
        k.replace(".mlp.shared_mlp.", ".mlp.shared_experts."): v for k, v in vllm.items()
    }.keys() == per_expert.keys()


def test_vllm_format_refuses_router_lora_its_fused_moe_runner_would_ignore(tmp_path):
    adapter = family_adapter(tmp_path, "qwen3_moe")  # router LoRA trained
    with pytest.raises(
        family_tables.ExportError,
        match="qwen3_moe: vLLM 0.33.0 does not apply a LoRA to this family's router .mlp.gate: its fused-MoE runner",
    ):
        vllm_lora.write_vllm(adapter, tmp_path / "v")
    assert not (tmp_path / "v").exists()
    per_expert_lora.write_per_expert(adapter, tmp_path / "pe")  # other runtimes: the per-expert layout is still written


def test_vllm_format_keeps_peft_fused_layout_where_vllm_reads_3d(tmp_path):
    """GPT-OSS: vLLM's GptOssForCausalLM sets is_3d_moe_weight and reads PEFT's fused expert LoRA (its gate and
    up interleaved in B, as trained) as written; the per-expert layout is refused for it."""
    adapter = family_adapter(tmp_path, "gpt_oss")
    out = vllm_lora.write_vllm(adapter, tmp_path / "v")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / name).read_bytes() == (adapter / name).read_bytes()
    with pytest.raises(family_tables.ExportError, match="vLLM reads GPT-OSS's expert LoRA in PEFT's fused layout only"):
        per_expert_lora.write_per_expert(adapter, tmp_path / "pe")


def render_family_table() -> str:
    """docs/export.md's table, from the export's own tables (MOE_QLORA_UPDATE_DOCS=1 writes it there)."""
    rows = [
        "| model type | llama.cpp arch | GGUF: written | GGUF: refused, and why | vLLM (`--format vllm`) |",
        "|---|---|---|---|---|",
    ]
    for mt, n in family_tables.FAMILIES.items():
        refused = []
        if no := sorted(gguf_archs.GGUF_NO_LORA.get(n.gguf_arch, ())):
            refused.append(f"{', '.join(no)}: multiplied without a LoRA hook")
        if (
            n.gguf_arch in gguf_archs.LEGACY_LORA_ARCHS and gguf_archs.gguf_name_map(n.gguf_arch, 1) is not None
        ):  # (not DeepSeek-V4's)
            refused.append("the MLA projections: multiplied without a LoRA hook")
        layout = family_tables.vllm_layout(mt)
        if layout == "refused":
            vllm = "refused: " + (
                family_tables.VLLM_NO_MOE_LORA.get(mt) or family_tables.PER_EXPERT_UNREAD[mt].rsplit(" (", 1)[0]
            )
        elif layout == "fused-3d":
            vllm = "PEFT's fused 3D, as written"
        else:
            vllm = f"per-expert `{n.experts}.M.{'/'.join(p for p in (n.gate, n.up, n.down) if p)}`"
            if mt in vllm_lora.VLLM_RENAMED:
                vllm += f"; `{vllm_lora.VLLM_RENAMED[mt][0]}` renamed `{vllm_lora.VLLM_RENAMED[mt][1]}`"
            if mt in vllm_lora.VLLM_ROTARY_PERMUTED:
                vllm += "; q's and k's `lora_B` rows in the order vLLM's loader gives their weights (rotary)"
            if mt in per_expert_lora.HUB_MODULE_NAMES:
                vllm += "; every module under the checkpoints' own names (`attn.wq_a` ...)"
            if mt in per_expert_lora.HUB_FUSED_ATTENTION:
                vllm += (
                    f"; q, k, v as one `{per_expert_lora.HUB_FUSED_ATTENTION[mt][0]}` LoRA of rank 3r (vLLM's "
                    f"`--max-lora-rank` at least that), o_proj as `{per_expert_lora.HUB_FUSED_ATTENTION[mt][1]}`"
                )
        if mt in vllm_lora.VLLM_IGNORED_MODULE and not vllm.startswith("refused"):
            ignored = ", ".join(f"`{m}`" for m in vllm_lora.VLLM_IGNORED_MODULE[mt])
            vllm += f"; LoRA refused on {ignored} (vLLM does not apply it)"
        if mt in vllm_lora.VLLM_IGNORED_ROUTER and not vllm.startswith("refused"):
            vllm += f"; router LoRA refused (vLLM ignores `{vllm_lora.VLLM_IGNORED_ROUTER[mt][0]}`)"
        extra_kinds = ", ".join(sorted(gguf_archs.GGUF_EXTRA_LORA_KINDS.get(n.gguf_arch, ())))
        laid_out = {
            "qwen3next": "in_proj_qkvz split into attn_qkv and attn_gate per key head",
            "qwen35moe": "linear attention's value heads regrouped as the converter does",
            "qwen4exp": "linear attention's value heads regrouped; index_qk_proj split into indexer.q_proj "
            "and indexer.k_proj",
            "minimax-m3": "fused gate_up_proj split into ffn_gate and ffn_up (and _shexp)",
            "bailingmoe2": "q, k and v fused into the one attn_qkv its converter writes",
        }
        notes = (
            (bool(extra_kinds), extra_kinds),
            (n.gguf_arch in laid_out, laid_out.get(n.gguf_arch)),
            (n.permute_qk, "q/k with rows permuted as the converter permutes the base's"),
            (n.peft_swapped, "transposed back from (E, in, out)"),
            (n.interleaved_gate_up, "gate and up de-interleaved (expert biases untouched)"),
        )
        extra = [text for flag, text in notes if flag]
        experts = (
            "experts (gate_up fused, as llama.cpp's ffn_gate_up_exps, and down)"
            if n.fused_gate_up
            else "experts (gate, up, down)"
            if n.gated
            else "experts (up, down: no gate)"
        )
        written = f"{experts}, router, " + "".join(x + ", " for x in extra) + "attention, shared experts and dense FFN"
        if n.gguf_arch in gguf_archs.GGUF_FUSABLE_GATE_UP and not n.fused_gate_up:
            written += "; ffn_gate_up_exps with `--fuse-gate-up-exps`"
        rows.append(f"| `{mt}` | `{n.gguf_arch}` | {written} | {'; '.join(refused) or '-'} | {vllm} |")
    rows += [
        "",
        "Trained, but not exported (the run's own adapter folder, PEFT's format, serves them all):",
        "",
        "| model type | why |",
        "|---|---|",
    ]
    rows += [f"| `{mt}` | {why} |" for mt, why in sorted(family_tables.NOT_EXPORTED.items())]
    return "\n".join(rows)


def test_the_docs_table_is_the_exports_own():
    import os

    path = Path(__file__).resolve().parents[2] / "docs" / "export.md"
    text, table = path.read_text(), render_family_table()
    start = text.index("| model type | llama.cpp arch |")
    end = text.index("\n\n", text.index("| model type | why |"))  # the end of the second table
    if os.environ.get("MOE_QLORA_UPDATE_DOCS") == "1":
        path.write_text(text[:start] + table + text[end:])
        text = path.read_text()
    assert text[start : text.index("\n\n", text.index("| model type | why |"))] == table, (
        "docs/export.md: MOE_QLORA_UPDATE_DOCS=1 rewrites it"
    )


def test_vision_tower_lora_is_refused_and_auto_keeps_to_the_language_model(tmp_path, caplog):
    """MiniMax-M3-VL's vision layers have q_proj and k_proj too: their LoRA would have landed on the text
    layers of the same index (the same blk.N name). Every format refuses it by name, with or without expert
    LoRA, and `auto` targets every module of the family's defaults in the decoder layers that hold the experts,
    and none elsewhere."""
    from moe_qlora.model import families

    tok = build_byte_tokenizer()
    path = save_tiny_model(tmp_path / "base", tiny_config_any("minimax_m3_vl", len(tok)), tokenizer=tok)
    model = load_model(LoadOptions(str(path)))
    auto = {n for t in families.default_targets(model) for n in families.modules_matching(model, t)}
    wanted = {n for t in families.FAMILY_TARGETS["minimax_m3_vl"] for n in families.modules_matching(model, t)}
    text = {n for n in wanted if ".language_model.layers." in n}
    assert text != wanted and {n.rsplit(".", 1)[1] for n in text} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    assert auto == text
    for experts in (True, False):
        lora = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "k_proj"], experts=experts, router=False)
        model = load_model(LoadOptions(str(path)))
        caplog.clear()
        both = save_adapter(
            attach_adapters(model, lora, seed=0),
            tmp_path / f"both-{experts}",
            cfg=lora,
            base_model_name_or_path=str(path),
        )
        assert "also name modules outside the language model's decoder layers" in caplog.text
        stray = r"^LoRA (outside the experts'|in several).*vision_tower\.layers\.0\.self_attn\.k_proj\.lora_A\.weight"
        with pytest.raises(family_tables.ExportError, match=stray):
            gguf_lora.write_gguf(both, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        tensors, config, _, names = peft_factors.read_run_adapter(both)  # (MiniMax-M3 has no per-expert layout: the
        with pytest.raises(family_tables.ExportError, match=stray):  # step every per-expert and vLLM writer takes)
            per_expert_lora.per_expert_tensors(tensors, 4, names)


def test_deepseek_v4_is_written_under_its_hub_checkpoints_names(tmp_path):
    """DeepSeek-V4's checkpoints (and vLLM) name its modules layers.N.attn.wq_a, ffn.shared_experts.w1 ...:
    each non-expert LoRA of the per-expert layout, taken back through transformers' own renames of those
    names, is the PEFT delta of the module it names; the experts are ffn.experts.M.w1/w3/w2 (the generic
    per-expert test). Broken control: wq_a's and wkv's names exchanged."""
    from safetensors.torch import load_file
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    adapter = family_adapter(tmp_path, "deepseek_v4")
    deltas, _ = merged_minus_base(adapter)
    out = load_file(str(per_expert_lora.write_per_expert(adapter, tmp_path / "pe") / "adapter_model.safetensors"))
    renames = [r for r in get_checkpoint_conversion_mapping("deepseek_v4") if type(r) is WeightRenaming]

    def wrong(tensors: dict) -> list[str]:
        bad, seen = [], 0
        for key in tensors:
            if ".experts." in key or not key.endswith("lora_A.weight"):
                continue
            assert key.startswith("base_model.model.layers.")  # the checkpoints' root: no model.
            name = key.removeprefix("base_model.model.").replace(".lora_A", "")
            for rule in renames:
                name, _ = rule.rename_source_key(name)
            got = 8.0 / 4 * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            want = deltas.get(f"model.{name}")
            seen += 1
            if want is None or want.shape != got.shape or (got - want).abs().max() > TOL:
                bad.append(key)
        assert seen >= 6  # q_a, q_b, kv, o_b, the compressor's, the shared experts', the router
        return bad

    assert wrong(out) == []
    swap = {".attn.wq_a.": ".attn.wkv.", ".attn.wkv.": ".attn.wq_a."}
    swapped = {next((k.replace(a, b) for a, b in swap.items() if a in k), k): v for k, v in out.items()}
    assert wrong(swapped) != []


def test_an_adapter_without_linear_targets_gets_none_when_peft_loads_it(tmp_path):
    """Experts-only LoRA (Gemma-4's fixture) is saved with target_modules [], not None: given None, PEFT adds
    zero LoRA on its own default targets for the family (q_proj, v_proj) and warns of missing keys."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = family_adapter(tmp_path, "gemma4")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_modules"] == [] and config["target_parameters"]
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter))
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    assert not [n for n, _ in model.named_modules() if n.endswith(("q_proj.lora_A", "v_proj.lora_A"))]
