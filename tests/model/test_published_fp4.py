"""DeepSeek-V4-Flash as published: `quant_method: fp8` with `expert_dtype: fp4`. The attention and shared experts'
projections are FP8 e4m3 with 128 x 128 block scales stored as e8m0 (`scale_fmt: ue8m0`, dtype F8_E8M0) under
`<m>.scale`, not `weight_scale_inv`; every routed expert's w1/w2/w3 is int8 holding two e2m1 values a byte, low
nibble first, with one e8m0 exponent byte per 32 values of a row under `<m>.scale`; the compressor, router,
embeddings and norms are bf16.

The oracle is the format's definition written here, block by block (FP8) and group by group (FP4), into a bf16
checkpoint; the comparison is torch.equal on every NF4 byte, absmax and 4-bit linear of the loaded models. Broken
controls: the FP4 nibbles swapped (high first), and each FP8 block given its neighbour's scale.
"""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_qlora.model.checkpoint_files import lazy_state_dict
from moe_qlora.model.loading import LoadOptions, ModelLoadError, load_model
from moe_qlora.model.published import fp8_state
from moe_qlora.model.published_tensors import decode_fp4_rows
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model

from helpers.published import (
    E2M1,
    V4_FLASH_QUANTIZATION,
    is_routed_expert,
    published_in_fp8_by_v4_flash,
    to_fp4_rows,
    to_fp8_e8m0_blocks,
    transformers_dequantized,
    write_variants,
)
from helpers.tiny_configs import tiny_config_any

BLOCK = (128, 128)


def from_fp4_rows(packed: torch.Tensor, exponents: torch.Tensor, *, swapped: bool = False) -> torch.Tensor:
    """The definition: byte k of a row holds value 2k in its low nibble, 2k + 1 in its high one (swapped: the
    other way round), each times 2^(its group's exponent - 127)."""
    b = packed.view(torch.uint8).long()
    low, high = b & 15, b >> 4
    first, second = (high, low) if swapped else (low, high)
    codes = torch.stack([first, second], -1).reshape(b.shape[0], -1)
    factors = torch.tensor([[2.0 ** (int(e) - 127) for e in row] for row in exponents.tolist()])
    return (torch.tensor(E2M1)[codes] * factors.repeat_interleave(32, 1)).to(torch.bfloat16)


def from_fp8_blocks(q: torch.Tensor, grid: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """W[i, j] = q[i, j] * s[i // 128, j // 128], block by block (shift: the next row of blocks' scale)."""
    out = torch.empty(q.shape)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            cells = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            out[cells] = q[cells].float() * float(grid[(i + shift) % grid.shape[0], j].float())
    return out.to(torch.bfloat16)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """(published, its oracle decoding, FP4 nibbles swapped, FP8 scales shifted), and the published state."""
    root = tmp_path_factory.mktemp("v4-flash")
    tok = build_byte_tokenizer()
    source = save_tiny_model(root / "source", tiny_config_any("deepseek_v4", len(tok)), seed=0, tokenizer=tok)
    (weights,) = source.glob("*.safetensors")
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}
    published, oracle, swapped, shifted = dict(state), dict(state), dict(state), dict(state)
    for k in [k for k, v in state.items() if published_in_fp8_by_v4_flash(k, v)]:
        scale_key = k.removesuffix(".weight") + ".scale"
        if is_routed_expert(k):
            packed, exponents = to_fp4_rows(state[k])
            published[k], published[scale_key] = packed, exponents
            oracle[k] = shifted[k] = from_fp4_rows(packed, exponents)
            swapped[k] = from_fp4_rows(packed, exponents, swapped=True)
        else:
            q, grid = to_fp8_e8m0_blocks(state[k].float(), BLOCK)
            published[k], published[scale_key] = q, grid
            oracle[k] = swapped[k] = from_fp8_blocks(q, grid)
            shifted[k] = from_fp8_blocks(q, grid, shift=1)
    variants = {"published": published, "oracle": oracle, "swapped": swapped, "shifted": shifted}
    folders = write_variants(root, source, variants)
    config = json.loads((folders[0] / "config.json").read_text())
    config["quantization_config"] = V4_FLASH_QUANTIZATION
    (folders[0] / "config.json").write_text(json.dumps(config))
    return folders, published


def loaded_state(folder) -> dict[str, torch.Tensor]:
    """The model loaded with NF4 experts (auto keeps V4-Flash's FP4 experts as MXFP4: test_mxfp4_experts.py)."""
    model = load_model(LoadOptions(str(folder), expert_format="nf4"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_flash_layout_covers_both_formats(flash):
    """The fixture publishes what it claims: FP4 experts, FP8 elsewhere, with partial FP8 blocks (wo_a has 8
    columns) and more than one FP4 group a row."""
    _, published = flash
    dtypes = {str(v.dtype) for k, v in published.items() if ".experts.0.w" in k and k.endswith(".weight")}
    assert dtypes == {"torch.int8"}
    assert any(v.dtype == torch.float8_e4m3fn and v.shape[1] % BLOCK[1] for v in published.values())
    assert all(v.shape[1] >= 2 for k, v in published.items() if ".experts." in k and k.endswith(".scale"))


def test_v4_flash_loads_as_its_definition(flash):
    (published, oracle, swapped, shifted), _ = flash
    loaded, expected = loaded_state(published), loaded_state(oracle)
    assert loaded.keys() == expected.keys()  # no scale left over as a parameter
    assert [k for k in expected if not torch.equal(loaded[k], expected[k])] == []
    for control, kind in ((swapped, ".experts."), (shifted, ".self_attn.")):
        moved = [k for k, v in loaded_state(control).items() if not torch.equal(v, expected[k])]
        assert any(kind in k for k in moved), (control.name, moved[:5])


def test_each_fp4_weight_decodes_to_the_definition_and_to_transformers_own(flash):
    """Before NF4: every decoded FP4 expert weight equals the oracle bit for bit, and equals transformers'
    own FP4 dequantization (Fp8Dequantize, which reads the block from the scale grid: [1, 32] here)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    (published, oracle, *_), raw = flash
    expected = load_file(str(oracle / "model.safetensors"))
    with lazy_state_dict([published / "model.safetensors"]) as state:
        decoded = fp8_state(state, BLOCK, published, fp4=True)
        fp4 = [k for k, v in decoded.items() if type(v).__name__ == "Fp4RowTensor"]
        assert len(fp4) == 2 * 8 * 3  # layers x experts x (w1, w2, w3)
        for k in fp4:
            ours = decoded[k][...]
            assert torch.equal(ours, expected[k]), k
            scale = raw[k.removesuffix(".weight") + ".scale"]
            theirs = Fp8Dequantize(None)._dequantize_one(raw[k], scale, output_dtype=torch.bfloat16)
            assert torch.equal(ours, theirs), k


def test_fp4_with_float_scales(flash):
    """Scales stored as fp32 (`scale_fmt` not ue8m0) multiply the e2m1 values."""
    (published, *_), raw = flash
    k = "model.layers.1.ffn.experts.5.w2.weight"
    scale = torch.exp2(raw[k.removesuffix(".weight") + ".scale"].float() - 127) * 1.5
    codes = from_fp4_rows(raw[k], torch.full(scale.shape, 127)).float()
    expected = (codes * scale.repeat_interleave(32, 1)).to(torch.bfloat16)
    assert torch.equal(decode_fp4_rows(raw[k], scale), expected)


def test_a_scale_named_beside_an_unquantized_weight_is_a_parameter(flash):
    """`<m>.scale` is a scale only beside a quantized weight (Inkling2's norms are named `.scale`)."""
    (published, *_), _ = flash
    bf16 = "model.layers.0.attn.compressor.wkv.weight"
    with lazy_state_dict([published / "model.safetensors"]) as state:
        state = {**state, "model.layers.0.attn.compressor.wkv.scale": state["model.norm.weight"]}
        decoded = fp8_state(state, BLOCK, published, fp4=True)
        assert "model.layers.0.attn.compressor.wkv.scale" in decoded and bf16 in decoded
        assert "model.layers.0.attn.wq_a.scale" not in decoded


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("not-fp4", r"is int8 with scales .*expert_dtype is not 'fp4'"),
        ("two-scales", r"has scales under \[.*weight_scale_inv.*scale.*\]: one is expected"),
        ("bad-grid", r"experts.3.w1.weight: FP4 weight \[128, 32\] with scales U8 \[128, 4\]"),
        ("no-scale", r"wq_a.weight is stored in F8_E4M3 without its scales \(looked for .*wq_a.weight_scale_inv"),
        ("fp4-no-scale", r"experts.3.w1.weight is stored in I8 without its scales"),  # never read as raw codes
    ],
)
def test_flash_layouts_not_read_are_named(flash, tmp_path, case, expected):
    (published, *_), raw = flash
    folder = shutil.copytree(published, tmp_path / case)
    config = json.loads((folder / "config.json").read_text())
    tensors = dict(raw)
    if case == "not-fp4":
        del config["quantization_config"]["expert_dtype"]
    elif case == "two-scales":
        tensors["model.layers.0.attn.wq_a.weight_scale_inv"] = tensors["model.layers.0.attn.wq_a.scale"].float()
    elif case == "bad-grid":
        key = "model.layers.0.ffn.experts.3.w1.scale"
        tensors[key] = torch.cat([tensors[key], tensors[key]], 1)
    elif case == "fp4-no-scale":
        del tensors["model.layers.0.ffn.experts.3.w1.scale"]
    else:
        del tensors["model.layers.0.attn.wq_a.scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=expected):
        load_model(LoadOptions(str(folder)))


def test_transformers_dequantization_is_the_same_model(flash, tmp_path):
    """A third oracle: transformers' own load of the release (FineGrainedFP8Config(dequantize=True): its scale
    renames, FP4 unpacking and block grids), saved in bf16, loads to our model of the release byte for byte."""
    (published, *_), _ = flash
    ours = loaded_state(published)
    expected = loaded_state(transformers_dequantized(published, tmp_path / "theirs"))
    assert ours.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(ours[k], expected[k])] == []


def test_per_expert_fp4_weights_are_read_as_fused_stacks(flash):
    """DeepSeek-V4's converter patterns (`\\.experts.*.w1.weight`) group the per-expert FP4 keys into the model's
    stacks under the checkpoint's module path (transformers renames ffn to mlp as it loads them), not through
    transformers' merge; test_v4_flash_loads_as_its_definition shows the stacks are right (gate before up)."""
    from moe_qlora.model.published_experts import FusedExpertsTensor, fused_expert_stacks, stacks_read_by_expert

    (published, *_), _ = flash
    with lazy_state_dict([published / "model.safetensors"]) as state:
        fused = fused_expert_stacks(fp8_state(state, BLOCK, published, fp4=True), "deepseek_v4")
    stacks = {k: v.get_shape() for k, v in fused.items() if isinstance(v, FusedExpertsTensor)}
    assert stacks == {
        f"model.layers.{i}.ffn.experts.{name}": shape
        for i in range(2)
        for name, shape in (("gate_up_proj", [8, 256, 64]), ("down_proj", [8, 64, 128]))
    }
    assert not any(re.search(r"\.experts\.\d+\.", k) for k in fused)
    claimed = stacks_read_by_expert(fused, "deepseek_v4")  # quantized by the loader an expert at a time (nf4)
    assert {k: v.name for k, v in claimed.items()} == {k.replace(".ffn.", ".mlp."): k for k in stacks}


def test_mxfp4_is_kept_only_for_fp4_experts_with_e8m0_scales(flash, tmp_path):
    """FP4 experts are MXFP4's values only with e8m0 scales (scale_fmt ue8m0): with float scales auto quantizes
    them to NF4, and mxfp4 asked is refused, naming why."""
    (published, *_), raw = flash
    folder = shutil.copytree(published, tmp_path / "float-scales")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "float"
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {k: v.float() if v.dtype == torch.float8_e8m0fnu else v for k, v in raw.items()}
    for k in [k for k in raw if k.endswith(".scale") and raw[k].dtype == torch.uint8]:
        tensors[k] = torch.exp2(raw[k].float() - 127)
    save_file(tensors, str(folder / "model.safetensors"))
    assert load_model(LoadOptions(str(folder))).expert_format == "nf4"
    with pytest.raises(ModelLoadError, match=r"FP4 experts whose scales are not e8m0 \(scale_fmt 'float'\)"):
        load_model(LoadOptions(str(folder), expert_format="mxfp4"))
    assert load_model(LoadOptions(str(published))).expert_format == "mxfp4"


def test_the_release_layout_loads_the_same_model(flash, tmp_path):
    """As DeepSeek-V4-Flash is released: keys without the base model's `model.` prefix, and expert_dtype at the
    config's top level (DeepseekV4Config moves it into quantization_config). The same model loads, with NF4
    experts (quantized by the loader an expert at a time) and with MXFP4 ones."""
    (published, *_), raw = flash
    folder = shutil.copytree(published, tmp_path / "release")
    save_file({k.removeprefix("model."): v for k, v in raw.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["expert_dtype"] = config["quantization_config"].pop("expert_dtype")
    (folder / "config.json").write_text(json.dumps(config))
    for expert_format in ("nf4", "mxfp4"):
        expected = load_model(LoadOptions(str(published), expert_format=expert_format)).state_dict()
        got = load_model(LoadOptions(str(folder), expert_format=expert_format)).state_dict()
        assert got.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == [], expert_format


def test_a_multi_token_prediction_layer_is_left_unread(flash, tmp_path):
    """V4-Flash ships a multi-token-prediction layer (`mtp.0...`, its experts FP4 too) that the model has no module
    for and transformers ignores (`_keys_to_ignore_on_load_unexpected`): its stacks are fused like any layer's, and
    then left unread, in both formats; the model is the one loaded without it."""
    (published, *_), raw = flash
    folder = shutil.copytree(published, tmp_path / "mtp")
    layer = "model.layers.0.ffn.experts."
    mtp = {"mtp.0.ffn.experts." + k.removeprefix(layer): v.clone() for k, v in raw.items() if k.startswith(layer)}
    assert len(mtp) == 8 * 3 * 2
    save_file({**raw, **mtp}, str(folder / "model.safetensors"))
    for expert_format in ("nf4", "mxfp4"):
        expected = load_model(LoadOptions(str(published), expert_format=expert_format)).state_dict()
        got = load_model(LoadOptions(str(folder), expert_format=expert_format)).state_dict()
        assert got.keys() == expected.keys()
        assert [k for k in expected if not torch.equal(got[k], expected[k])] == [], expert_format
