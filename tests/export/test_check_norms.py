"""check-norms on synthetic adapters in PEFT's layout: per-expert split, flags, exit codes."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.export.norms import check_norms
from moe_qlora.export.router_check import cross_check_router

E, R, H, INTER = 4, 2, 16, 8
PREFIX = "base_model.model.model.layers"


def make_adapter(tmp_path, *, layers=2, mutate=None, config=True):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        experts = f"{PREFIX}.{layer}.mlp.experts"
        shapes = {
            f"{experts}.base_layer.lora_A.weight": (R * E, H),
            f"{experts}.base_layer.lora_B.weight": (2 * INTER, R * E),
            f"{experts}.lora_A.weight": (R * E, INTER),
            f"{experts}.lora_B.weight": (H, R * E),
            f"{PREFIX}.{layer}.self_attn.q_proj.lora_A.weight": (R, H),
            f"{PREFIX}.{layer}.self_attn.q_proj.lora_B.weight": (H, R),
        }
        tensors.update({k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()})
    if mutate:
        mutate(tensors)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    if config:
        cfg = {"r": R, "lora_alpha": 4, "target_parameters": ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]}
        (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    return tmp_path


def run(*args):
    return CliRunner().invoke(app, ["check-norms", *map(str, args)])


def test_rows_per_expert_with_exact_norms(tmp_path):
    adapter = make_adapter(tmp_path)
    report = check_norms(adapter)
    gate_up = [r for r in report.rows if r.module == "model.layers.0.mlp.experts.gate_up_proj"]
    assert [r.expert for r in gate_up] == list(range(E))
    t = {k: v.double() for k, v in load_file(str(adapter / "adapter_model.safetensors")).items()}
    a = t[f"{PREFIX}.0.mlp.experts.base_layer.lora_A.weight"][2 * R : 3 * R]  # expert 2: rows e*r..
    b = t[f"{PREFIX}.0.mlp.experts.base_layer.lora_B.weight"].view(2 * INTER, R, E)[:, :, 2]  # columns j*E + e
    assert gate_up[2].norm_delta == pytest.approx(2.0 * float((b @ a).norm()), rel=1e-9)  # scale 4/2
    modules = {r.module for r in report.rows}
    assert modules >= {"model.layers.1.mlp.experts.down_proj", "model.layers.1.self_attn.q_proj"}


def test_healthy_adapter_exits_0_and_json_is_parseable(tmp_path):
    adapter = make_adapter(tmp_path)
    assert run(adapter).exit_code == 0
    result = run(adapter / "adapter_model.safetensors", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["healthy"] is True


@pytest.mark.parametrize(
    "name,mutate,problem",
    [
        ("nan", lambda t: t[f"{PREFIX}.1.self_attn.q_proj.lora_A.weight"].__setitem__((0, 3), math.nan), "NaN/Inf"),
        ("zero_b", lambda t: t[f"{PREFIX}.0.mlp.experts.lora_B.weight"].view(H, R, E)[:, :, 1].zero_(), "all zero"),
        ("zero_a", lambda t: t[f"{PREFIX}.0.mlp.experts.lora_A.weight"][2 * R : 3 * R].zero_(), "lora_A is all zero"),
        ("outlier", lambda t: t[f"{PREFIX}.1.mlp.experts.lora_B.weight"].view(H, R, E)[:, :, 3].mul_(100), "median"),
    ],
)
def test_problems_exit_1_and_name_the_expert(tmp_path, name, mutate, problem):
    adapter = make_adapter(tmp_path, mutate=mutate)
    result = run(adapter, "--json")
    assert result.exit_code == 1
    problems = json.loads(result.stdout)["problems"]
    assert len(problems) == 1 and problem in problems[0]
    if name == "zero_b":
        assert problems[0].startswith("model.layers.0.mlp.experts.down_proj expert 1")
    if name == "zero_a":
        assert problems[0].startswith("model.layers.0.mlp.experts.down_proj expert 2")


def test_unreadable_or_non_adapter_files_exit_2(tmp_path):
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    result = run(tmp_path / "garbage.safetensors")
    assert result.exit_code == 2 and "not a readable safetensors file" in result.output
    save_file({"model.embed.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    result = run(tmp_path / "model.safetensors")
    assert result.exit_code == 2 and "not a LoRA adapter" in result.output
    assert run(tmp_path / "missing.safetensors").exit_code == 2


def test_the_default_view_is_one_row_per_module_and_layer_naming_the_bad_expert(tmp_path):
    """At MoE scale the per-expert table is unreadable: the default summarises each expert stack of each layer
    (min / median / max over its experts) and names the experts with problems; --per-expert shows all."""
    from moe_qlora.export.norms import summarize

    adapter = make_adapter(
        tmp_path, mutate=lambda t: t[f"{PREFIX}.1.mlp.experts.lora_B.weight"].view(H, R, E)[:, :, 3].zero_()
    )
    report = check_norms(adapter)
    summary = {m.module: m for m in summarize(report)}
    assert len(summary) == 6  # 2 layers x (gate_up, down, q_proj)
    down = summary["model.layers.1.mlp.experts.down_proj"]
    assert down.experts == E and down.problems == ["expert 3: lora_B is all zero (never trained)"]
    rows = [r for r in report.rows if r.module == down.module]
    assert down.norm_b == (0.0, sorted(r.norm_b for r in rows)[E // 2], max(r.norm_b for r in rows))
    short, full = run(adapter), run(adapter, "--per-expert")
    assert short.exit_code == full.exit_code == 1
    assert short.output.count("expert 3") == 1 and "the median over experts, min-max below" in short.output
    assert len(full.output.splitlines()) > len(short.output.splitlines())


def test_reads_an_adapter_made_by_peft_itself(tiny_mixtral_dir, tmp_path):
    """PEFT's own get_peft_model + save_pretrained (fused target_parameters and a linear): one row per expert,
    each norm equal to PEFT's own get_delta_weight for that expert."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_mixtral_dir), dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = get_peft_model(base, config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(tmp_path / "peft-adapter")
    report = check_norms(tmp_path / "peft-adapter")
    experts = model.base_model.model.model.layers[1].mlp.experts  # the down_proj wrapper, gate_up_proj inside
    expected = {
        "model.layers.1.mlp.experts.down_proj": experts.get_delta_weight("default"),
        "model.layers.1.mlp.experts.gate_up_proj": experts.base_layer.get_delta_weight("default"),
    }
    for module, delta in expected.items():
        rows = [r for r in report.rows if r.module == module]
        assert [r.expert for r in rows] == list(range(8))
        got = torch.tensor([r.norm_delta for r in rows])
        torch.testing.assert_close(got, delta.detach().flatten(1).norm(dim=1).double().float(), rtol=1e-5, atol=0)
    q = [r for r in report.rows if r.module == "model.layers.0.self_attn.q_proj"]
    assert len(q) == 1 and q[0].expert is None and report.healthy


def write_run(run_dir, loads):
    """A run folder as train writes it: router_layers.json and metrics.jsonl with one router_load per step."""
    run_dir.mkdir(exist_ok=True)
    (run_dir / "router_layers.json").write_text(
        json.dumps([f"base_model.model.model.layers.{i}.mlp.experts" for i in range(len(loads[0]))])
    )
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s + 1, "loss": 1.0, "router_load": load}) + "\n" for s, load in enumerate(loads))
    )


def test_router_load_cross_check_names_dead_and_unreached_experts(tmp_path):
    """Layer 0 expert 1: never routed and B zero (a dead expert); layer 1 expert 2: routed 30% of rows yet B
    zero (its gradient never arrived); layer 1 expert 0: never routed yet trained (another run's adapter)."""

    def zero_b(layer, expert):
        def mutate(t):
            key = f"{PREFIX}.{layer}.mlp.experts.lora_B.weight"  # down_proj; columns j*E + e
            t[key].view(H, R, E)[:, :, expert] = 0
            t[f"{PREFIX}.{layer}.mlp.experts.base_layer.lora_B.weight"].view(2 * INTER, R, E)[:, :, expert] = 0

        return mutate

    def both(t):
        zero_b(0, 1)(t)
        zero_b(1, 2)(t)

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    adapter = make_adapter(run / "adapter", mutate=both)
    step = [[0.4, 0.0, 0.3, 0.3], [0.0, 0.4, 0.3, 0.3]]
    write_run(run, [step, step])
    report = check_norms(adapter)
    steps = cross_check_router(report, run)
    assert steps == 2
    problems = report.problems
    assert (
        "model.layers.0.mlp.experts.down_proj expert 1: never routed a token in the 2 logged steps: the router "
        "never chose it"
    ) in problems
    assert (
        "model.layers.1.mlp.experts.down_proj expert 2: routed 30.00% of rows on average, yet lora_B is all "
        "zero: its gradient never reached it"
    ) in problems
    assert any(
        p.startswith("model.layers.1.mlp.experts.gate_up_proj expert 0: never routed a token")
        and "yet its LoRA is not zero" in p
        for p in problems
    )
    # The CLI finds the run beside the adapter by itself and says so.
    result = run_cli(adapter)
    assert result.exit_code == 1 and f"router load: 2 logged steps of {run}" in result.output
    # Broken control: a router load naming every expert as routed hides the dead expert.
    write_run(run, [[[0.25] * 4, [0.25] * 4]])
    report = check_norms(adapter)
    cross_check_router(report, run)
    assert not any("never routed" in p for p in report.problems)


def run_cli(*args):
    return CliRunner().invoke(app, ["check-norms", *map(str, args)])
