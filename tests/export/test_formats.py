"""Export for other runtimes: per-expert PEFT keys (vLLM / SGLang layout) and a llama.cpp LoRA GGUF.

Oracle: PEFT itself. The run's fused adapter is merged by PEFT into the fp32 base (merge_and_unload), and
merged minus base is each expert's and each projection's delta as PEFT applies it. The per-expert export is
loaded by PEFT into a model built with the legacy per-expert modules (zero weights, so merging gives the
delta), and the GGUF is read back with gguf.GGUFReader and multiplied out in numpy. Tolerance 1e-6: the same
fp32 products in another order."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from rich.console import Console
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from moe_qlora.config.load import validate_config
from moe_qlora.export import family_tables, gguf_archs, gguf_lora, peft_factors, per_expert_lora, vllm_lora
from moe_qlora.model.model_path import resolve_model_path
from moe_qlora.train import sft as trainer

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-6


def trained_adapter(out: Path, model: str, targets: list[str], steps: int, **output) -> Path:
    """The adapter of a short run at a high LR (rank 4, alpha 8, router LoRA too): every factor non-zero."""
    cfg = validate_config(
        {
            "model": {"name_or_path": model},
            "lora": {"rank": 4, "alpha": 8, "target_modules": targets, "router": True},
            "data": {"train_files": [str(ROOT / "data" / "demo_sft.jsonl")], "max_seq_len": 48},
            "train": {"max_steps": steps, "lr": 2e-2, "warmup_steps": 0},
            "output": {"dir": str(out), **output},
        }
    )
    trainer.train(cfg, Console(quiet=True))
    return out / "adapter"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Mixtral adapter: experts, router, q/k/v/o, 3 steps."""
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    out = tmp_path_factory.mktemp("run")
    return trained_adapter(out, "builtin:tiny-mixtral", attention, 3, export_formats=["per-expert", "gguf"])


def test_a_run_writes_the_export_formats_it_asks_for(run, tmp_path):
    """output.export_formats: the same files `moe-qlora export` writes, at the end of training."""
    assert (run.parent / "adapter.gguf").read_bytes() == gguf_lora.write_gguf(run, tmp_path / "a.gguf").read_bytes()
    ours = run.parent / "adapter-per-expert" / "adapter_model.safetensors"
    again = per_expert_lora.write_per_expert(run, tmp_path / "pe") / "adapter_model.safetensors"
    assert ours.read_bytes() == again.read_bytes()


def merged_minus_base(adapter: Path) -> tuple[dict[str, torch.Tensor], object]:
    """({parameter name: merged - base} of the parameters PEFT's merge changed, the base's config), with PEFT
    merging the fused adapter into the fp32 base. Only changed tensors are kept, so a name present in it had a
    non-zero LoRA: a dropped one cannot match its delta."""
    base_path = resolve_model_path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except ValueError:  # a multimodal family's text model (Qwen3-VL-MoE's): the class transformers generates with
        from moe_qlora.model.classes import text_generation_class

        config = AutoConfig.from_pretrained(base_path)
        base = text_generation_class(config).from_pretrained(base_path, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().state_dict()
    return {k: merged[k] - before[k] for k in before if not torch.equal(merged[k], before[k])}, base.config


@pytest.fixture(scope="module")
def peft_deltas(run):
    return merged_minus_base(run)


class Expert(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.w1, self.w3, self.w2 = (
            nn.Linear(hidden, inter, bias=False),
            nn.Linear(hidden, inter, bias=False),
            nn.Linear(inter, hidden, bias=False),
        )


class LegacyModel(nn.Module):
    def prepare_inputs_for_generation(self, *args, **kwargs):  # PEFT's causal-LM wrapper asks for it
        return {}


def legacy_mixtral(config) -> nn.Module:
    """The hub checkpoints' per-expert module layout (block_sparse_moe.experts.M.w1/w3/w2), zero weights."""
    head = config.head_dim or config.hidden_size // config.num_attention_heads
    model = LegacyModel()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList()
    for _ in range(config.num_hidden_layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        for name, (i, o) in {
            "q_proj": (config.hidden_size, config.num_attention_heads * head),
            "k_proj": (config.hidden_size, config.num_key_value_heads * head),
            "v_proj": (config.hidden_size, config.num_key_value_heads * head),
            "o_proj": (config.num_attention_heads * head, config.hidden_size),
        }.items():
            setattr(layer.self_attn, name, nn.Linear(i, o, bias=False))
        layer.block_sparse_moe = nn.Module()
        layer.block_sparse_moe.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        layer.block_sparse_moe.experts = nn.ModuleList(
            Expert(config.hidden_size, config.intermediate_size) for _ in range(config.num_local_experts)
        )
        model.model.layers.append(layer)
    for p in model.parameters():
        nn.init.zeros_(p)
    return model


def per_expert_deltas(export_dir: Path, config) -> dict[str, torch.Tensor]:
    model = legacy_mixtral(config)
    merged = PeftModel.from_pretrained(model, str(export_dir)).merge_and_unload()
    return {k: v for k, v in merged.state_dict().items()}


def assert_per_expert_matches(got: dict, deltas: dict, config, *, expect_equal: bool = True):
    inter, ok = config.intermediate_size, True
    for n in range(config.num_hidden_layers):
        gate_up, down = (
            deltas[f"model.layers.{n}.mlp.experts.gate_up_proj"],
            deltas[f"model.layers.{n}.mlp.experts.down_proj"],
        )
        for e in range(config.num_local_experts):
            pre = f"model.layers.{n}.block_sparse_moe.experts.{e}"
            pairs = [
                (got[f"{pre}.w1.weight"], gate_up[e, :inter]),
                (got[f"{pre}.w3.weight"], gate_up[e, inter:]),
                (got[f"{pre}.w2.weight"], down[e]),
            ]
            for mine, theirs in pairs:
                ok &= bool((mine - theirs).abs().max() <= TOL)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"model.layers.{n}.self_attn.{proj}.weight"
            ok &= bool((got[name] - deltas[name]).abs().max() <= TOL)
        # the router: transformers v5's mlp.gate is the checkpoints' (and vLLM's) block_sparse_moe.gate
        ok &= bool(
            (got[f"model.layers.{n}.block_sparse_moe.gate.weight"] - deltas[f"model.layers.{n}.mlp.gate.weight"])
            .abs()
            .max()
            <= TOL
        )
    assert ok == expect_equal


def test_per_expert_export_loads_in_peft_with_the_same_deltas(run, peft_deltas, tmp_path):
    deltas, config = peft_deltas
    trained = {f"model.layers.0.mlp.{p}" for p in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")}
    assert trained <= set(deltas)
    out = per_expert_lora.write_per_expert(run, tmp_path / "per-expert")
    saved = json.loads((out / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == ["gate", "k_proj", "o_proj", "q_proj", "v_proj", "w1", "w2", "w3"]
    assert saved["target_parameters"] is None
    assert_per_expert_matches(per_expert_deltas(out, config), deltas, config)


def test_per_expert_control_gate_and_up_swapped_fails(run, peft_deltas, tmp_path, monkeypatch):
    deltas, config = peft_deltas
    swapped = family_tables.FamilyNames("llama", "block_sparse_moe.experts", "w3", "w1", "w2", permute_qk=True)
    monkeypatch.setitem(family_tables.FAMILIES, "mixtral", swapped)
    out = per_expert_lora.write_per_expert(run, tmp_path / "swapped")
    assert_per_expert_matches(per_expert_deltas(out, config), deltas, config, expect_equal=False)


def read_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items()}
    tensors = {t.name: np.asarray(t.data).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    return reader, fields, tensors


def field_value(field):
    value = field.parts[field.data[0]]
    return bytes(value).decode() if value.dtype == np.uint8 else value.item()


def gguf_deltas(tensors: dict, config, *, scale: float) -> dict:
    """Per llama.cpp tensor, scale * B A (3D for experts), in llama.cpp's row order."""
    out = {}
    for name in tensors:
        if name.endswith(".lora_a"):
            base = name.removesuffix(".lora_a")
            out[base] = scale * (tensors[base + ".lora_b"] @ tensors[name])
    return out


@pytest.mark.parametrize("permute", [True, False])
def test_gguf_reads_back_with_llama_cpp_names_shapes_alpha_and_deltas(run, peft_deltas, tmp_path, monkeypatch, permute):
    """permute=False is the broken control: without llama.cpp's RoPE row order the q/k deltas differ."""
    deltas, config = peft_deltas
    if not permute:
        monkeypatch.setattr(gguf_lora, "permute_rows_for_rope", lambda b, n_head: b)
    path = gguf_lora.write_gguf(run, tmp_path / "adapter.gguf")
    _, fields, tensors = read_gguf(path)
    assert field_value(fields["general.type"]) == "adapter" and field_value(fields["adapter.type"]) == "lora"
    assert field_value(fields["general.architecture"]) == "llama"
    assert field_value(fields["adapter.lora.alpha"]) == 8.0
    e, inter, h, r = config.num_local_experts, config.intermediate_size, config.hidden_size, 4
    assert tensors["blk.0.ffn_gate_exps.weight.lora_a"].shape == (e, r, h)
    assert tensors["blk.0.ffn_up_exps.weight.lora_b"].shape == (e, inter, r)
    assert tensors["blk.1.ffn_down_exps.weight.lora_b"].shape == (e, h, r)
    got = gguf_deltas(tensors, config, scale=8.0 / r)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    ok = True
    for n in range(config.num_hidden_layers):
        gate_up = deltas[f"model.layers.{n}.mlp.experts.gate_up_proj"].numpy()
        ok &= np.abs(got[f"blk.{n}.ffn_gate_exps.weight"] - gate_up[:, :inter]).max() <= TOL
        ok &= np.abs(got[f"blk.{n}.ffn_up_exps.weight"] - gate_up[:, inter:]).max() <= TOL
        ok &= (
            np.abs(
                got[f"blk.{n}.ffn_down_exps.weight"] - deltas[f"model.layers.{n}.mlp.experts.down_proj"].numpy()
            ).max()
            <= TOL
        )
        for module, name in LLAMA_CPP_NAMES.items():
            d = deltas[f"model.layers.{n}.{module}.weight"]
            if name in heads:  # llama.cpp's converter permutes the base's q/k rows: ours must match it
                d = torch.from_numpy(np.ascontiguousarray(reference_permute(d.numpy(), heads[name])))
            ok &= np.abs(got[f"blk.{n}.{name}.weight"] - d.numpy()).max() <= TOL
    assert bool(ok) == permute


# transformers v5 module -> llama.cpp tensor of the llama architecture, written out for the oracle
LLAMA_CPP_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate": "ffn_gate_inp",
}


def reference_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out for the oracle."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unknown_families_and_unwritten_layouts_are_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setattr(peft_factors, "base_model_type", lambda config, where: "switch_transformers")
    (tmp_path / "a").mkdir()
    from safetensors.torch import save_file

    save_file(
        {"x.lora_A.weight": torch.zeros(1, 1), "x.lora_B.weight": torch.zeros(1, 1)},
        str(tmp_path / "a" / "adapter_model.safetensors"),
    )
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "x", "r": 1}))
    with pytest.raises(family_tables.ExportError, match="switch_transformers: no per-expert / GGUF names known"):
        gguf_lora.write_gguf(tmp_path / "a", tmp_path / "a.gguf")
    monkeypatch.setattr(peft_factors, "base_model_type", lambda config, where: "switch_transformers")
    with pytest.raises(family_tables.ExportError, match="switch_transformers: no per-expert"):
        per_expert_lora.write_per_expert(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "a.gguf").exists() and not (tmp_path / "b").exists()


def test_export_from_the_cli(run, tmp_path):
    from typer.testing import CliRunner

    from moe_qlora.cli.app import app

    result = CliRunner().invoke(app, ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "a.gguf")])
    assert result.exit_code == 0, result.output
    _, fields, _ = read_gguf(tmp_path / "a.gguf")
    assert field_value(fields["general.type"]) == "adapter"
    result = CliRunner().invoke(app, ["export", str(run), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "vllm, per-expert, gguf" in result.output
    result = CliRunner().invoke(app, ["export", str(tmp_path / "missing"), "--format", "gguf", "--out", "x.gguf"])
    assert result.exit_code == 2 and "no such adapter" in result.output


def test_one_writer_table_names_the_formats_the_config_accepts():
    """writers.WRITERS, which `export --format` reads, names exactly output.export_formats' choices, in order."""
    from typing import get_args

    from moe_qlora.config.sections import OutputSection
    from moe_qlora.export.writers import WRITERS

    (choices,) = get_args(OutputSection.model_fields["export_formats"].annotation)
    assert list(WRITERS) == list(get_args(choices)) == ["vllm", "per-expert", "gguf"]
    assert WRITERS["gguf"] is gguf_lora.write_gguf and WRITERS["vllm"] is vllm_lora.write_vllm


def test_check_norms_reads_the_gguf_and_the_per_expert_export_with_the_same_norms(run, tmp_path):
    """Every expert's ||scale B A|| read from the GGUF and from the per-expert export equals the one read
    from the run's PEFT adapter (same scale, every expert a row)."""
    from moe_qlora.export.norms import check_norms

    def deltas(report, key):
        return sorted(round(r.norm_delta, 5) for r in report.rows if key(r.module))

    peft = check_norms(run)
    gguf_report = check_norms(gguf_lora.write_gguf(run, tmp_path / "a.gguf"))
    per_expert = check_norms(per_expert_lora.write_per_expert(run, tmp_path / "pe"))
    assert gguf_report.scale == peft.scale == per_expert.scale == 2.0
    experts = deltas(peft, lambda m: ".experts" in m)
    # gate and up share A: their deltas split gate_up's rows, so compare the down projections exactly
    down_peft = deltas(peft, lambda m: m.endswith("experts.down_proj"))
    assert len(down_peft) == 16 and len(experts) == 32
    assert deltas(gguf_report, lambda m: "ffn_down_exps" in m) == down_peft
    assert deltas(per_expert, lambda m: m.endswith(".w2")) == down_peft
    assert len([r for r in gguf_report.rows if "ffn_gate_exps" in r.module]) == 16


@pytest.fixture(scope="module")
def qwen2_moe_run(tmp_path_factory):
    """A tiny Qwen2-MoE adapter with LoRA on every kind of module a GGUF can carry besides the experts:
    attention, the router, the shared expert's MLP and its one-output gate."""
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"]
    return trained_adapter(tmp_path_factory.mktemp("qwen2_moe"), "builtin:tiny-qwen2-moe", targets, 2)


# transformers v5 module of Qwen2-MoE -> llama.cpp tensor of qwen2moe, written out for the oracle
QWEN2MOE_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


def test_gguf_carries_router_shared_expert_and_its_gate_lora_with_peft_deltas(qwen2_moe_run, tmp_path):
    """Before, a Qwen2-MoE run with its default targets (shared_expert.*) could not be exported to GGUF at all.
    Every non-expert LoRA lands under the name llama.cpp gives the base tensor, with PEFT's merged delta."""
    deltas, config = merged_minus_base(qwen2_moe_run)
    _, fields, tensors = read_gguf(gguf_lora.write_gguf(qwen2_moe_run, tmp_path / "q.gguf"))
    assert field_value(fields["general.architecture"]) == "qwen2moe"
    got = gguf_deltas(tensors, config, scale=8.0 / 4)
    for n in range(config.num_hidden_layers):
        for module, name in QWEN2MOE_NAMES.items():
            delta = deltas[f"model.layers.{n}.{module}.weight"].numpy()
            assert np.abs(got[f"blk.{n}.{name}.weight"] - delta).max() <= TOL, module


def test_gguf_refuses_lora_llama_cpp_would_ignore_or_cannot_place():
    """DeepSeek's graph multiplies the query and the MLA projections with a plain ggml_mul_mat (no LoRA), so
    their LoRA is refused instead of being written and silently ignored; its output projection and shared
    experts go through build_lora_mm."""
    names = gguf_archs.gguf_name_map("deepseek2", 2)
    assert gguf_archs.gguf_linear_name(names, "deepseek2", 1, "self_attn", "o_proj") == "blk.1.attn_output"
    assert gguf_archs.gguf_linear_name(names, "deepseek2", 1, "mlp.shared_experts", "up_proj") == "blk.1.ffn_up_shexp"
    assert gguf_archs.gguf_linear_name(names, "deepseek2", 0, "mlp", "down_proj") == "blk.0.ffn_down"
    for proj in ("q_proj", "q_a_proj", "kv_b_proj", "kv_a_proj_with_mqa"):
        with pytest.raises(family_tables.ExportError, match="without applying LoRA"):
            gguf_archs.gguf_linear_name(names, "deepseek2", 1, "self_attn", proj)
    assert (
        gguf_archs.gguf_linear_name(gguf_archs.gguf_name_map("qwen2moe", 2), "qwen2moe", 1, "self_attn", "q_proj")
        == "blk.1.attn_q"
    )
    with pytest.raises(family_tables.ExportError, match="no tensor"):
        gguf_archs.gguf_linear_name(names, "deepseek2", 1, "self_attn", "rotary_proj")


def test_check_norms_on_a_runs_gguf_finds_the_run_and_cross_checks_the_router(run, tmp_path, monkeypatch):
    """RUN/adapter.gguf (where output.export_formats and `export` put it): check-norms finds RUN without --run
    and matches each blk.N.ffn_*_exps row to layer N's router load. With the most-routed expert's lora_B
    zeroed, the GGUF names it as the PEFT folder does; the broken control (GGUF rows matched by module name, as
    for PEFT) finds nothing to check."""
    import shutil

    from typer.testing import CliRunner

    from moe_qlora.cli.app import app
    from moe_qlora.export import norms, router_check

    result = CliRunner().invoke(app, ["check-norms", str(run.parent / "adapter.gguf")])
    experts = 3 * 8 * 2  # gate, up and down rows of 8 experts in 2 layers
    assert f"router load: 3 logged steps of {run.parent}; {experts} expert rows checked" in result.output

    fake = tmp_path / "run"  # the same run, its adapter with one routed expert untrained
    shutil.copytree(run.parent, fake, ignore=shutil.ignore_patterns("checkpoints", "adapter*"))
    shutil.copytree(run, fake / "adapter")
    shares, _ = router_check.routed_shares(fake)
    layer0 = next(v for k, v in shares.items() if ".layers.0." in k)
    expert = max(range(len(layer0)), key=layer0.__getitem__)
    weights = fake / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if ".layers.0." in k and k.endswith("experts.lora_B.weight"))  # down_proj's B
    tensors[key].view(tensors[key].shape[0], -1, 8)[:, :, expert] = 0  # columns j*E + e are expert e's
    save_file(tensors, str(weights))
    gguf_path = gguf_lora.write_gguf(fake / "adapter", fake / "adapter.gguf")
    for path in (fake / "adapter", gguf_path):  # found without --run, and the adapter flagged: exit 1
        result = CliRunner().invoke(app, ["check-norms", str(path)])
        assert result.exit_code == 1 and f"router load: 3 logged steps of {fake};" in result.output
    routed = f"routed {layer0[expert] / 3:.2%} of rows on average, yet lora_B is all zero"
    peft_report, gguf_report = (norms.check_norms(path) for path in (fake / "adapter", gguf_path))
    for report in (peft_report, gguf_report):
        router_check.cross_check_router(report, fake)
    assert any(f"layers.0.mlp.experts.down_proj expert {expert}: {routed}" in p for p in peft_report.problems)
    assert any(f"blk.0.ffn_down_exps.weight expert {expert}: {routed}" in p for p in gguf_report.problems)
    monkeypatch.setattr(router_check, "router_load_of", lambda module, totals: totals.get(module.rsplit(".", 1)[0]))
    broken = norms.check_norms(gguf_path)
    router_check.cross_check_router(broken, fake)
    assert broken.router_rows_checked == 0 and not any("routed" in p for p in broken.problems)
