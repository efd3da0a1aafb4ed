"""Checkpoints as published: an FP8 block-scaled checkpoint (DeepSeek-V3's layout: per-expert keys, fp8 e4m3
weights with `weight_scale_inv` grids, bf16 norms, embeddings and router) and a gpt-oss checkpoint with MXFP4
experts (`*_blocks` and `*_scales` in the hub's layout, here with model.expert_format nf4: kept as MXFP4 in
test_mxfp4_experts.py) load to exactly the model their bf16 dequantization loads to, partial blocks included;
every other quantized format is refused by name.

The oracle is each format's definition written here: each element times its own block's scale, block by block in
Python loops (FP8); each nibble's e2m1 value times 2^(its group's exponent - 127), value by value (MXFP4). The
comparison is torch.equal on every NF4 byte, absmax and 4-bit linear (both sides are quantized from the same bf16
values); the broken controls take each block's scale from its neighbour (FP8), or swap the nibbles (MXFP4).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from moe_qlora.model.loading import LoadOptions, ModelLoadError, load_model
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config

from helpers.published import E2M1, quantized_names, to_fp8_blocks, to_mxfp4, write_variants

BLOCK = (32, 16)  # not square (b0, b1 swapped would be caught); q_a_proj (48 rows) and kv_a_proj_with_mqa (40) end in
# partial row blocks, and no column is partial at 16: the row blocks are what DeepSeek-V3's 576 rows test


def from_fp8_blocks(q: torch.Tensor, grid: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """The format's definition: W[i, j] = q[i, j] * s[i // b0, j // b1] (shift: the neighbour block's scale)."""
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            bi = (i // BLOCK[0] + shift) % grid.shape[0]
            out[i, j] = float(q[i, j].float()) * float(grid[bi, j // BLOCK[1]])
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp8 checkpoint, its bf16 dequantization by the oracle, the same with neighbour scales)."""
    root = tmp_path_factory.mktemp("published")
    tok = build_byte_tokenizer()
    source = save_tiny_model(root / "source", tiny_config("deepseek_v3", len(tok)), seed=0, tokenizer=tok)
    (weights,) = source.glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    names = quantized_names(state)
    assert any(state[k].shape[0] % BLOCK[0] for k in names), "a partial block must be among them"
    assert {state[k].shape[0] % BLOCK[0] for k in names} >= {0, 8, 16}
    fp8, oracle, shifted = dict(state), dict(state), dict(state)
    for k in names:
        q, grid = to_fp8_blocks(state[k].float(), BLOCK)
        fp8[k], fp8[k + "_scale_inv"] = q, grid
        oracle[k], shifted[k] = from_fp8_blocks(q, grid), from_fp8_blocks(q, grid, shift=1)
    folders = write_variants(root, source, {"fp8": fp8, "oracle": oracle, "shifted": shifted})
    config = json.loads((folders[0] / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders


def test_each_decoded_weight_is_the_formats_definition_exactly(checkpoints):
    """Before NF4: every decoded weight equals the oracle's bf16, bit for bit (an ulp off would pass the NF4
    comparison below unseen)."""
    from moe_qlora.model.checkpoint_files import lazy_state_dict
    from moe_qlora.model.published import fp8_state

    fp8, oracle, _ = checkpoints
    expected = load_file(str(oracle / "model.safetensors"))
    with lazy_state_dict([fp8 / "model.safetensors"]) as state:
        decoded = fp8_state(state, BLOCK, fp8)
        names = [k for k, v in decoded.items() if type(v).__name__ == "Fp8BlockTensor"]
        assert len(names) > 20
        for k in names:
            assert torch.equal(decoded[k][...], expected[k]), k


def test_per_expert_fp8_weights_are_read_as_fused_stacks(checkpoints):
    """Each MoE layer's per-expert FP8 weights are read as the model's fused stacks, one expert at a time into one
    bf16 buffer (transformers' merge holds about two copies); the byte-for-byte test above holds them to the
    definition. A layer missing one expert's weight is left to transformers whole."""
    from moe_qlora.model.checkpoint_files import lazy_state_dict
    from moe_qlora.model.published import dequantized_as_read
    from moe_qlora.model.published_experts import FusedExpertsTensor

    fp8, _, _ = checkpoints
    with lazy_state_dict([fp8 / "model.safetensors"]) as state:
        config = AutoConfig.from_pretrained(str(fp8))
        fused = {k: v.get_shape() for k, v in dequantized_as_read(state, config, fp8).items()}
        fused = {k: shape for k, shape in fused.items() if ".experts." in k}
        assert fused == {
            f"model.layers.{i}.mlp.experts.{name}": shape
            for i in (1, 2)
            for name, shape in (("gate_up_proj", [8, 128, 64]), ("down_proj", [8, 64, 64]))
        }
        partial = {k: v for k, v in state.items() if not k.startswith("model.layers.1.mlp.experts.7.up_proj")}
        kept = dequantized_as_read(partial, AutoConfig.from_pretrained(str(fp8)), fp8)
        assert "model.layers.1.mlp.experts.gate_up_proj" not in kept
        assert isinstance(kept["model.layers.2.mlp.experts.gate_up_proj"], FusedExpertsTensor)
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in kept


def test_fused_stacks_are_quantized_an_expert_at_a_time_under_the_models_names(checkpoints):
    """The loader quantizes every fused stack itself as each expert is decoded (the load above is that path), under
    the name the model gives it: DeepSeek-V3's keep their checkpoint names; under a name transformers renames
    (MiniMax-M2's block_sparse_moe -> mlp) a stack is claimed under the renamed one."""
    from moe_qlora.model.checkpoint_files import lazy_state_dict
    from moe_qlora.model.published import dequantized_as_read
    from moe_qlora.model.published_experts import stacks_read_by_expert

    fp8, _, _ = checkpoints
    with lazy_state_dict([fp8 / "model.safetensors"]) as state:
        decoded = dequantized_as_read(state, AutoConfig.from_pretrained(str(fp8)), fp8)
        claimed = stacks_read_by_expert(decoded, "deepseek_v3")
        assert sorted(claimed) == sorted(
            k for k in decoded if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
        )
        assert all(fused.name == k for k, fused in claimed.items())
        renamed = {k.replace(".mlp.", ".block_sparse_moe."): v for k, v in claimed.items()}
        assert stacks_read_by_expert(renamed, "minimax_m2") == claimed
        # a layer whose down_proj is not fused (one expert missing, say) keeps both stacks with transformers
        partial = {k: v for k, v in decoded.items() if k != "model.layers.1.mlp.experts.down_proj"}
        assert sorted(stacks_read_by_expert(partial, "deepseek_v3")) == sorted(k for k in claimed if ".layers.2." in k)


def test_renamed_stacks_load_as_transformers_dequantizes_them(tmp_path):
    """MiniMax-M2's FP8 release: per-expert w1/w2/w3 under block_sparse_moe, which transformers renames to mlp.
    The loader quantizes those stacks itself under the renamed names, an expert at a time, and the model is
    transformers' own dequantization (FineGrainedFP8Config(dequantize=True), saved in bf16), byte for byte."""
    from moe_qlora.model.checkpoint_files import lazy_state_dict
    from moe_qlora.model.published import dequantized_as_read
    from moe_qlora.model.published_experts import stacks_read_by_expert

    from helpers.published import publish_fp8, transformers_dequantized
    from helpers.tiny_configs import tiny_config_any

    tok = build_byte_tokenizer()
    source = save_tiny_model(tmp_path / "source", tiny_config_any("minimax_m2", len(tok)), seed=0, tokenizer=tok)
    fp8 = publish_fp8(source, tmp_path / "fp8", (16, 16))
    with lazy_state_dict([fp8 / "model.safetensors"]) as state:
        decoded = dequantized_as_read(state, AutoConfig.from_pretrained(str(fp8)), fp8)
        claimed = stacks_read_by_expert(decoded, "minimax_m2")
    assert sorted(claimed) == [
        f"model.layers.{i}.mlp.experts.{s}" for i in (0, 1) for s in ("down_proj", "gate_up_proj")
    ]
    ours, expected = loaded_state(fp8), loaded_state(transformers_dequantized(fp8, tmp_path / "theirs"))
    assert ours.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(ours[k], expected[k])] == []


def test_the_multi_token_prediction_layer_is_left_unread(checkpoints, tmp_path):
    """DeepSeek-V3's release holds layer 61, its multi-token-prediction module, with FP8 experts; the model has no
    such layer and transformers ignores its keys (`_keys_to_ignore_on_load_unexpected`). Its fused stacks are left
    unread too (the loader quantizing them itself once failed: no such parameter); the model is the one without."""
    source = load_file(str(checkpoints[0] / "model.safetensors"))
    layer = "model.layers.1.mlp.experts."
    mtp = {
        "model.layers.61.mlp.experts." + k.removeprefix(layer): v.clone()
        for k, v in source.items()
        if k.startswith(layer)
    }
    (folder,) = write_variants(tmp_path, checkpoints[0], {"with-mtp": {**source, **mtp}})
    ours, expected = loaded_state(folder), loaded_state(checkpoints[0])
    assert ours.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(ours[k], expected[k])] == []


def test_fp8_layouts_not_read_are_named(checkpoints, tmp_path):
    """A weight without its scale, a scale without an FP8 weight, a 3D FP8 stack: ModelLoadError naming the key,
    before loading."""
    source = load_file(str(checkpoints[0] / "model.safetensors"))
    weight = "model.layers.1.mlp.experts.3.up_proj.weight"
    stack = "model.layers.1.mlp.experts.down_proj"  # as transformers' FP8Experts saves a stack: 3D, `_scale_inv`
    saved_stack = {**source, stack: torch.zeros(8, 64, 64).to(torch.float8_e4m3fn), stack + "_scale_inv": torch.ones(8)}
    cases = {
        "no-scale": ({k: v for k, v in source.items() if k != weight + "_scale_inv"}, "without its"),
        "orphan": ({**source, weight: source[weight].float()}, "scales a F32 weight, not an FP8 one"),
        "stack": (saved_stack, r"down_proj: an FP8 tensor of shape \[8, 64, 64\]; only 2D weights are read"),
    }
    for name, (tensors, expected) in cases.items():
        (folder,) = write_variants(tmp_path, checkpoints[0], {name: tensors})
        with pytest.raises(ModelLoadError, match=expected):
            load_model(LoadOptions(str(folder)))


def test_e8m0_scales_and_activation_scales(checkpoints, tmp_path):
    """uint8 scales are exponents (2^(b - 127), `scale_fmt: ue8m0`); FP8 activation scales are dropped (the
    weights compute in bf16). Scales that are powers of two read as bytes give the model of the float scales."""
    source = load_file(str(checkpoints[0] / "model.safetensors"))
    pow2, as_bytes = dict(source), dict(source)
    for k in [k for k in source if k.endswith("_scale_inv")]:
        exponent = torch.round(torch.log2(source[k]))
        pow2[k], as_bytes[k] = torch.exp2(exponent), (exponent + 127).to(torch.uint8)
        as_bytes[k.removesuffix("_scale_inv") + "_input_scale"] = torch.ones(())
    a, b = map(loaded_state, write_variants(tmp_path, checkpoints[0], {"pow2": pow2, "bytes": as_bytes}))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def loaded_state(folder) -> dict[str, torch.Tensor]:
    """The state of the model loaded with NF4 experts (MXFP4 experts decoded then quantized: expert_format nf4)."""
    model = load_model(LoadOptions(str(folder), expert_format="nf4"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fp8_block_scaled_weights_load_as_their_dequantization(checkpoints):
    fp8, oracle, shifted = map(loaded_state, checkpoints)
    assert fp8.keys() == oracle.keys()
    assert not any("scale_inv" in k for k in fp8)
    differing = [k for k in oracle if not torch.equal(fp8[k], oracle[k])]
    assert differing == []
    moved = [k for k in oracle if not torch.equal(shifted[k], oracle[k])]
    assert any("experts" in k for k in moved) and any("kv_a_proj_with_mqa" in k for k in moved), moved[:5]


def test_a_scale_grid_that_does_not_match_the_block_size_is_named(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints[0], tmp_path / "bad")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = list(reversed(BLOCK))  # b0 and b1 swapped
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"weight_scale_inv: a F32 grid of \[\d+, \d+\], expected \[\d+, \d+\]"):
        load_model(LoadOptions(str(folder)))


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors", "bitsandbytes", "hqq"])
def test_other_quantized_formats_are_refused_by_name(checkpoints, tmp_path, method):
    folder = shutil.copytree(checkpoints[1], tmp_path / method)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"quant_method is '{method}'"):
        load_model(LoadOptions(str(folder)))


# ------------------------------------------------------------------------------------------ MXFP4 (gpt-oss)


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, swapped: bool = False) -> torch.Tensor:
    """The format's definition, value by value: byte b holds element 2k in its low nibble and 2k + 1 in its high
    one (swapped: the other way round, the broken control); times 2^(scale - 127); back to (E, in, out)."""
    experts, out, groups, _ = blocks.shape
    w = torch.empty(experts, out, groups * 32)
    for e in range(experts):
        for o in range(out):
            for g in range(groups):
                factor = 2.0 ** (int(scales[e, o, g]) - 127)
                for k, byte in enumerate(blocks[e, o, g].tolist()):
                    first, second = (byte >> 4, byte & 15) if swapped else (byte & 15, byte >> 4)
                    w[e, o, g * 32 + 2 * k] = E2M1[first] * factor
                    w[e, o, g * 32 + 2 * k + 1] = E2M1[second] * factor
    return w.transpose(1, 2).contiguous().to(torch.bfloat16)


@pytest.fixture(scope="module")
def gpt_oss_checkpoints(tmp_path_factory):
    """(MXFP4 checkpoint, its bf16 decoding by the oracle, the same with the nibbles swapped)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    tok = build_byte_tokenizer()
    source = save_tiny_model(root / "source", tiny_config("gpt_oss", len(tok)), seed=0, tokenizer=tok)
    (weights,) = source.glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    stacks = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    mxfp4, oracle, swapped = dict(state), dict(state), dict(state)
    for k in stacks:
        blocks, scales = to_mxfp4(state[k])
        del mxfp4[k]
        mxfp4[k + "_blocks"], mxfp4[k + "_scales"] = blocks, scales
        oracle[k], swapped[k] = from_mxfp4(blocks, scales), from_mxfp4(blocks, scales, swapped=True)
    folders = write_variants(root, source, {"mxfp4": mxfp4, "oracle": oracle, "swapped": swapped})
    config = json.loads((folders[0] / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders, stacks


def test_mxfp4_experts_load_as_their_decoding(gpt_oss_checkpoints):
    folders, stacks = gpt_oss_checkpoints
    mxfp4, oracle, swapped = map(loaded_state, folders)
    assert mxfp4.keys() == oracle.keys() and not any(k.endswith(("_blocks", "_scales")) for k in mxfp4)
    assert [k for k in oracle if not torch.equal(mxfp4[k], oracle[k])] == []
    moved = {k for k in oracle if not torch.equal(swapped[k], oracle[k])}
    assert moved and all("experts" in k for k in moved), sorted(moved)[:5]


def test_the_mxfp4_decode_is_transformers_own(gpt_oss_checkpoints):
    """A second oracle: transformers' dequantization of gpt-oss (integrations.mxfp4.convert_moe_packed_tensors)
    gives the same bf16 stacks as ours, bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from moe_qlora.model.checkpoint_files import lazy_state_dict
    from moe_qlora.model.published import mxfp4_state

    (folder, *_), stacks = gpt_oss_checkpoints
    with lazy_state_dict(sorted(folder.glob("*.safetensors"))) as state:
        ours = mxfp4_state(state, folder)
        for k in stacks:
            theirs = convert_moe_packed_tensors(state[k + "_blocks"][...], state[k + "_scales"][...])
            assert torch.equal(ours[k][...], theirs), k
