"""Opt-in (`pytest -m llamacpp`, not in CI): the GGUF adapter run by llama.cpp itself, against PEFT.

Per family: a tiny fp32 base converted by llama.cpp's own convert_hf_to_gguf.py, the adapter exported by
`moe-qlora export --format gguf` (random factors on the experts, router and attention), and the log-probs of a
fixed token sequence from libllama with the adapter against PEFT's on the same base in fp32, for bases
converted plainly and with --fuse-qkv / --fuse-gate-up-exps. Controls: the base without the adapter, and the
adapter with each layer's experts rolled, must both be far off. A second test needs only the llama.cpp tree:
every family's adapter tensors against the names and shapes of the base the converter writes.

Needs libllama through llama-cpp-python and the llama.cpp tree it was built from (docs/export.md):

    pip install sentencepiece      # the converter reads Mixtral's vocabulary with it
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install ./llama_cpp_python-0.3.36.tar.gz      # 10-25 minutes on 2 cores
    LLAMA_CPP_DIR=$PWD/llama_cpp_python-0.3.36/vendor/llama.cpp pytest -m llamacpp tests/export/test_llamacpp.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_qlora.export import family_tables, gguf_archs, gguf_lora, peft_factors
from moe_qlora.inference import libllama_check

pytestmark = pytest.mark.llamacpp
LLAMA_CPP_DIR = os.environ.get("LLAMA_CPP_DIR")
# log-prob tolerance: llama.cpp's f32 matmuls and f32 KV cache against torch fp32 (measured 1.8e-7 to 1.6e-5,
# Qwen3-Next aside; the base without the adapter is 0.28 to 7.3 off); `moe-qlora verify` holds libllama to it
TOL = libllama_check.TOL
# The converter run as libllama_check.CONVERT runs it, or stopped once it has named and shaped every tensor:
# {name: numpy-order shape} and the arch, as JSON
NAMES_ONLY = """
import json
from conversion.base import ModelBase
def names_only(self):
    self.prepare_tensors()
    shapes = {{n: list(t.shape) for shard in self.gguf_writer.tensors for n, t in shard.items()}}
    json.dump({{"arch": self.gguf_writer.arch, "tensors": shapes}}, open({out!r}, "w"))
ModelBase.write = names_only
"""
# The runs of the libllama test: (family, how its base is converted). The tiny configs llama.cpp converts and
# runs whole, with the config fields it needs (below: OLMoE's graph takes no grouped-query attention, and
# CONVERTIBLE). Not these (llama.cpp 0c1e57098): dots1 (libllama aborts in build_moe_ffn building the tiny base's
# graph, before any adapter), mellum and qwen4_exp_text (likewise abort), minimax_m2 (wants rotary_dim),
# hunyuan_v1_moe (wants moe_intermediate_size), glm4_moe, glm4_moe_lite and solar_open (want GLM's special
# tokens), deepseek_v32 (wants add_bos_token), glm5_next (wants linear_attn_config), ernie4_5_moe (wants a
# sentencepiece tokenizer.model), exaone_moe (writes no expert_gating_func); laguna converts, but its bare base
# already differs from transformers by 2.0 in log-prob (as GPT-OSS's by 0.68), so the check says nothing there.
LIBLLAMA_RUNS = [
    ("mixtral", "split"),
    ("mixtral", "fuse-qkv"),
    ("qwen2_moe", "split"),
    ("qwen2_moe", "fuse-qkv"),
    ("olmoe", "split"),
    ("olmoe", "fuse-qkv"),
    ("qwen3_moe", "split"),
    ("qwen3_moe", "fuse-qkv"),
    ("qwen3_next", "split"),
    ("qwen3_next", "fuse-gate-up-exps"),
    ("granitemoe", "split"),
    ("granitemoe", "fuse-qkv"),
    ("granitemoe_swa", "split"),
    ("hy_v3", "split"),
    ("cohere2_moe", "split"),
    ("qwen3_5_moe_text", "split"),
    ("sarvam_moe", "split"),
    ("granitemoeshared", "split"),
]
# (Also not these: minimax_m3_vl, whose converter reads hub-only config keys that transformers' config consumes
# on load (sparse_attention_config, moe_layer_freq) or lacks (n_shared_experts); granitemoehybrid, whose tiny
# base loads in libllama without the Mamba layers' ssm_in. Their adapters' names and shapes are checked below.)
LIBLLAMA_FIELDS = {
    "olmoe": {"num_key_value_heads": 4},
    "granitemoeshared": {"shared_intermediate_size": 32},
    "granitemoehybrid": {"vocab_size": 264},  # its Mamba-2 converter pads the vocabulary to 8
    # room for the special tokens Qwen's tokenizer adds; MRoPE sections within the tiny rotary
    # dims (4; llama.cpp's default [11, 11, 10] asserts), the same for text-only positions
    "qwen3_5_moe_text": {
        "vocab_size": 512,
        "rope_parameters": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1e4,
            "rope_type": "default",
            "mrope_section": [1, 1, 0],
        },
    },
}
# targets beyond the fixture's: Granite's shared MLP (its input_linear split into ffn_gate/up_shexp)
LIBLLAMA_TARGETS = dict.fromkeys(
    ("granitemoeshared", "granitemoehybrid"),
    ["q_proj", "k_proj", "v_proj", "o_proj", "shared_mlp.input_linear", "shared_mlp.output_linear"],
)
# Qwen3-Next: its bare base already differs from transformers by 6.9e-5 (the gated delta net in f32), the adapter
# run by 1.04e-4
LIBLLAMA_TOL = {"qwen3_next": 2e-4}


def requirements() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (see this module's docstring)"
    if not LLAMA_CPP_DIR or not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file():
        return "LLAMA_CPP_DIR does not point at a llama.cpp tree with convert_hf_to_gguf.py"
    return None


# Families whose config.json the converter must read as it is: with transformers 5.24 installed, the converter's
# AutoConfig turns Sarvam's num_experts into n_routed_experts, and its bailingmoe2 code then finds no expert count
# (so a real Sarvam checkpoint fails to convert beside transformers 5.24 too)
RAW_CONFIG = {"sarvam_moe"}
NO_AUTOCONFIG = "import conversion.base; conversion.base.AutoConfig = None  # from_pretrained fails: config.json"


def convert_base(model_dir: Path, out: Path, *, names_only: bool = False, extra: tuple[str, ...] = ()) -> Path:
    """The base as llama.cpp's converter writes it; `names_only`: its tensors' names and shapes (JSON in `out`)."""
    patch = NAMES_ONLY.format(out=str(out)) if names_only else ""
    if model_dir.name in RAW_CONFIG:  # (the tests save a family's tiny base in a folder named after it)
        patch += "\n" + NO_AUTOCONFIG
    proc = libllama_check.convert_base(model_dir, out.with_suffix(".gguf"), LLAMA_CPP_DIR, extra=extra, patch=patch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def llama_logprobs(base: Path, lora: Path | None, ids: list[int]) -> np.ndarray:
    logprobs = libllama_check.llama_logprobs(base, lora, ids)
    assert not isinstance(logprobs, str), logprobs
    return logprobs


def peft_logprobs(base_dir: Path, adapter: Path, ids: list[int]) -> np.ndarray:
    return libllama_check.peft_logprobs(base_dir, adapter, ids)[0]


@pytest.mark.parametrize(("model_type", "conversion"), LIBLLAMA_RUNS)
def test_llama_cpp_with_our_gguf_adapter_matches_peft(model_type, conversion, tmp_path, monkeypatch):
    if (missing := requirements()) is not None:
        pytest.skip(missing)
    from test_export_families import family_adapter

    flags, export = CONVERSIONS[conversion]
    fields = {**LIBLLAMA_FIELDS.get(model_type, {}), **CONVERTIBLE.get(model_type, {})}
    adapter = family_adapter(tmp_path, model_type, targets=LIBLLAMA_TARGETS.get(model_type), **fields)
    base_dir = tmp_path / model_type
    hub_layout(base_dir, model_type)
    base = convert_base(base_dir, tmp_path / "base.gguf", extra=CONVERT_FLAGS.get(model_type, ()) + flags)
    lora = gguf_lora.write_gguf(adapter, tmp_path / "adapter.gguf", **export)
    ids = list(range(10, 42))
    ours = llama_logprobs(base, lora, ids)
    reference = peft_logprobs(base_dir, adapter, ids)
    err, tol = float(np.abs(ours - reference).max()), LIBLLAMA_TOL.get(model_type, TOL)
    assert err <= tol, f"{model_type} ({conversion}): llama.cpp with the adapter differs from PEFT by {err:.2e}"
    # controls: the base alone, and the adapter with each layer's experts rolled by one, are far from PEFT
    assert float(np.abs(llama_logprobs(base, None, ids) - reference).max()) > 10 * tol
    real = gguf_lora.expert_layers

    def rolled(tensors, rank, names=None):
        layers = real(tensors, rank, names).items()
        return {n: peft_factors.ExpertLayer(*(t.roll(1, 0) for t in vars(x).values())) for n, x in layers}

    monkeypatch.setattr(gguf_lora, "expert_layers", rolled)
    broken = gguf_lora.write_gguf(adapter, tmp_path / "rolled.gguf", **export)
    assert float(np.abs(llama_logprobs(base, broken, ids) - reference).max()) > 10 * tol
    if model_type in LAYOUT_CONTROLS:  # ...and the linear attention's LoRA rows left as transformers holds them
        monkeypatch.setattr(gguf_lora, "expert_layers", real)
        monkeypatch.setattr(gguf_lora, *LAYOUT_CONTROLS[model_type])
        broken = gguf_lora.write_gguf(adapter, tmp_path / "as-trained.gguf", **export)
        assert float(np.abs(llama_logprobs(base, broken, ids) - reference).max()) > 10 * tol


def qkvz_as_blocks(base) -> tuple[torch.Tensor, ...]:
    """A broken reading of Qwen3-Next's in_proj_qkvz: all q rows, then all k, v and z (not per key head)."""
    nk, dk, dv = base.linear_num_key_heads, base.linear_key_head_dim, base.linear_value_head_dim
    sizes = [nk * dk, nk * dk, base.linear_num_value_heads * dv, base.linear_num_value_heads * dv]
    return tuple(torch.arange(sum(sizes)).split(sizes))


LAYOUT_CONTROLS = {
    "qwen3_next": ("qwen3_next_qkvz_rows", qkvz_as_blocks),
    "qwen3_5_moe_text": ("value_heads_tiled", lambda proj, a, b, base: (a, b)),
}


# Config fields that let llama.cpp's converter take a family's tiny config: every layer sparse where the tiny
# config has a dense first layer its arch's tensor map lacks; Phi-MoE's converter reads the rope's original
# context length
CONVERTIBLE = {
    "qwen3_moe": {"mlp_only_layers": []},
    "qwen3_next": {"mlp_only_layers": []},
    "kimi_linear": {"mlp_layer_types": ["sparse", "sparse"]},
    "phimoe": {"rope_parameters": {"rope_theta": 1e6, "rope_type": "default", "original_max_position_embeddings": 512}},
}
# Families whose tiny base llama.cpp's converter does not take, and why
NOT_CONVERTIBLE = {
    "hy_v4": "transformers saves the tiny base's hyper-connection weights under names the converter does not map "
    "(the checkpoints' are renamed on load)",
    **dict.fromkeys(
        ("dots3_note", "dots3_note_text"),
        "its converter asks for fields of the released checkpoint "
        "the tiny config does not set (sigmoid gating, swa_qk_nope_head_dim, use_dsa)",
    ),
}
# converter flags (the Qwen3-Next family's --no-mtp: the tiny configs have no multi-token-prediction layers)
CONVERT_FLAGS = libllama_check.CONVERT_FLAGS
# the hub checkpoints' class name, where the converter registers that rather than transformers' own
HUB_ARCHITECTURES = {
    "phimoe": "PhiMoEForCausalLM",
    "mistral4": "Mistral3ForConditionalGeneration",
    "sarvam_moe": "SarvamMoEForCausalLM",
}  # (transformers saves Sarvam as GLM-4-MoE's class)
# ...and config keys its hub config.json has under another name than transformers saves (Sarvam's, read by the
# bailingmoe2 converter)
HUB_CONFIG_KEYS = {"sarvam_moe": {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}}
# ...and values it states that transformers implies: Sarvam's router is GLM-4-MoE's, a sigmoid
HUB_CONFIG_VALUES = {"sarvam_moe": {"score_function": "sigmoid"}}


def hub_layout(model_dir: Path, model_type: str) -> None:
    """The tiny base as the hub stores it, where transformers saves its own layout instead: Qwen3-VL-MoE's
    experts are (E, H, 2I) and (E, I, H) on the hub, which llama.cpp's converter transposes (qwen3vl.py)."""
    import json

    from safetensors.torch import load_file, save_file

    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    if model_type in HUB_ARCHITECTURES:
        config["architectures"] = [HUB_ARCHITECTURES[model_type]]
        for hub_key, key in HUB_CONFIG_KEYS.get(model_type, {}).items():
            config[hub_key] = config[key]
        config.update(HUB_CONFIG_VALUES.get(model_type, {}))
        config_file.write_text(json.dumps(config))
    if model_type == "qwen3_vl_moe":
        for f in model_dir.glob("*.safetensors"):
            t = load_file(str(f))
            save_file(
                {
                    k: v.transpose(1, 2).contiguous()
                    if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                    else v
                    for k, v in t.items()
                },
                str(f),
                metadata={"format": "pt"},
            )


# DeepSeek-V4's converter repacks the experts from the released checkpoint's MXFP4 blocks and scales, which a
# tiny fp32 base has not: its base tensors' names come from the converter's own name function instead, applied
# to the tiny base's keys (the checkpoint's names: transformers saves them so), the experts stacked per layer
DSV4_NAMES = """
import json, re, sys
sys.path[:0] = [{root!r}, {root!r} + "/gguf-py"]
import gguf
from safetensors import safe_open
from conversion.deepseek import DeepseekV4Model
T, out = gguf.MODEL_TENSOR, {{}}
with safe_open({weights!r}, "pt") as f:
    for key in f.keys():
        shape, name = list(f.get_slice(key).get_shape()), key.removeprefix("model.")
        if m := re.fullmatch(r"layers\\.(\\d+)\\.ffn\\.experts\\.\\d+\\.(w[123])\\.weight", name):
            kind = {{"w1": T.FFN_GATE_EXP, "w2": T.FFN_DOWN_EXP, "w3": T.FFN_UP_EXP}}[m[2]]
            out.setdefault(gguf.TENSOR_NAMES[kind].format(bid=int(m[1])) + ".weight", [0, *shape])[0] += 1
        elif (m := re.match(r"layers\\.(\\d+)\\.", name)) and not name.endswith("norm.weight"):  # (transformers
            # saves attn.kv_norm as attn.norm, undoing a rename meant for the compressor's; no LoRA target)
            kind, suffix = DeepseekV4Model._map_dsv4_tensor_name(None, name, int(m[1]))
            out[gguf.TENSOR_NAMES[kind].format(bid=int(m[1])) + suffix] = shape
json.dump({{"arch": gguf.MODEL_ARCH_NAMES[DeepseekV4Model.model_arch], "tensors": out}}, open({out!r}, "w"))
"""


def dsv4_base_names(model_dir: Path, out: Path) -> Path:
    code = DSV4_NAMES.format(root=LLAMA_CPP_DIR, weights=str(next(model_dir.glob("*.safetensors"))), out=str(out))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_LOCAL_GGUF": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def lora_tensors_llama_cpp_would_reject(lora: dict, base: dict) -> list[str]:
    """What llama_adapter_lora_init (src/llama-adapter.cpp) throws on, per LoRA pair: a base tensor of that name
    missing, or shapes that do not fit it (numpy order: A (.., r, in), B (.., out, r), base (.., out, in))."""
    wrong = []
    for name in sorted({k.rsplit(".weight.lora_", 1)[0] for k in lora}):
        a, b, shape = lora[f"{name}.weight.lora_a"], lora[f"{name}.weight.lora_b"], base.get(f"{name}.weight")
        if shape is None:
            wrong.append(f"{name}: no such tensor in the base")
        elif shape[-1] != a.shape[-1] or shape[-2] != b.shape[-2] or a.shape[-2] != b.shape[-1]:
            wrong.append(f"{name}: base {tuple(shape)}, lora_a {a.shape}, lora_b {b.shape}")
    return wrong


# how the base was converted: llama.cpp's flag, and the export's matching keyword
CONVERSIONS = {
    "split": ((), {}),
    "fuse-gate-up-exps": (("--fuse-gate-up-exps",), {"fuse_gate_up_exps": True}),
    "fuse-qkv": (("--fuse-qkv",), {"fuse_qkv": True}),
}


@pytest.mark.parametrize("conversion", CONVERSIONS)
@pytest.mark.parametrize("model_type", sorted(family_tables.FAMILIES))
def test_every_lora_tensor_names_a_base_tensor_of_its_shape(model_type, conversion, tmp_path):
    """Needs only llama.cpp's tree (LLAMA_CPP_DIR), not libllama: the tiny base converted by llama.cpp's own
    converter (stopped once it has named every tensor), and our GGUF adapter's tensors checked as libllama
    checks them when it loads an adapter, with the same general.architecture."""
    import json

    from test_export_families import family_adapter
    from test_formats import field_value, read_gguf

    if not LLAMA_CPP_DIR or not (Path(LLAMA_CPP_DIR) / "convert_hf_to_gguf.py").is_file():
        pytest.skip("LLAMA_CPP_DIR does not point at a llama.cpp tree with convert_hf_to_gguf.py")
    if model_type in NOT_CONVERTIBLE:
        pytest.skip(f"{model_type}: {NOT_CONVERTIBLE[model_type]}")
    names = family_tables.FAMILIES[model_type]
    fusable = {"fuse-gate-up-exps": gguf_archs.GGUF_FUSABLE_GATE_UP, "fuse-qkv": gguf_archs.GGUF_FUSABLE_QKV}
    if conversion in fusable and names.gguf_arch not in fusable[conversion]:
        pytest.skip(f"{model_type}: llama.cpp's converter does not {conversion} {names.gguf_arch} (export refuses it)")
    flags, export = CONVERSIONS[conversion]
    adapter = family_adapter(tmp_path, model_type, **CONVERTIBLE.get(model_type, {}))
    hub_layout(tmp_path / model_type, model_type)
    if model_type == "deepseek_v4":
        base = json.loads(dsv4_base_names(tmp_path / model_type, tmp_path / "base.json").read_text())
    else:
        base = json.loads(
            convert_base(
                tmp_path / model_type,
                tmp_path / "base.json",
                names_only=True,
                extra=CONVERT_FLAGS.get(model_type, ()) + flags,
            ).read_text()
        )
    _, fields, lora = read_gguf(gguf_lora.write_gguf(adapter, tmp_path / "a.gguf", **export))
    assert field_value(fields["general.architecture"]) == base["arch"]
    assert lora_tensors_llama_cpp_would_reject(lora, base["tensors"]) == []
    # broken controls: each expert's factors transposed (Llama-4's storage not undone), where that changes a
    # shape; the adapter written for the plain conversion, where this one renamed any of its tensors
    transposed = {
        k: np.ascontiguousarray(
            np.swapaxes(
                lora[k.replace("lora_a", "lora_b") if k.endswith("lora_a") else k.replace("lora_b", "lora_a")], 1, 2
            )
        )
        if "_exps." in k
        else v
        for k, v in lora.items()
    }
    if any(t.shape != lora[k].shape for k, t in transposed.items()):
        assert lora_tensors_llama_cpp_would_reject(transposed, base["tensors"]) != []
    _, _, plain = read_gguf(gguf_lora.write_gguf(adapter, tmp_path / "b.gguf"))
    if plain.keys() != lora.keys():
        assert lora_tensors_llama_cpp_would_reject(plain, base["tensors"]) != []
