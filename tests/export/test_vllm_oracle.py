"""Opt-in (`pytest -m vllm`, not in CI): `--format vllm` loaded by vLLM's own code on the CPU, against PEFT.

Per family: a tiny base, an adapter with random non-zero factors on its experts, attention, shared experts and
router (where vLLM applies router LoRA), the vLLM export, and PEFT's own merge of the adapter into the fp32 base
(the oracle). moe_qlora/export/vllm_runtime_check.py runs under VLLM_PYTHON, one process for every case: vLLM builds the
model, wraps it for LoRA, loads the export (PEFTHelper, LoRAModel.from_local_checkpoint, its MoE-format check),
adds and activates it, and each wrapped module's base weight plus the delta rebuilt from vLLM's stacked LoRA
buffers is compared with vLLM's own load of the merged checkpoint. Asserted per family: every exported tensor
landed in a wrapped module (leftover), no wrapped layer is reachable unwrapped (bypassed), nothing PEFT's merge
changed is left without a vLLM LoRA (uncovered), the delta within 1e-5 of the merge's scale (fp32 products of
O(0.1) factors), and two broken controls far off (experts rolled by one, the first module's delta dropped).
Controls on the export itself: Qwen2-MoE's and Qwen3-Next's shared_expert_gate, and Qwen3-MoE's router, written
past the export's refusals are caught as bypassed; Llama-4's q/k LoRA written without vLLM's rotary row order is
caught as wrong.

One-time setup, its own venv (vLLM pins torch 2.14 and transformers < 5.21, not the test extra's): about 4 min,
2.1 GB downloaded, 9.4 GB installed:

    python3 -m venv /opt/vllm && /opt/vllm/bin/pip install vllm==0.33.0
    VLLM_PYTHON=/opt/vllm/bin/python pytest -m vllm -n 0 tests/export/test_vllm_oracle.py   # about 4 min, 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from moe_qlora.export import family_tables, vllm_lora, vllm_runtime_check
from moe_qlora.inference.verify import peft_fp32_merge

pytestmark = pytest.mark.vllm
VLLM_PYTHON = os.environ.get("VLLM_PYTHON")
CHECKER = Path(vllm_runtime_check.__file__)
TOL = 1e-5
FAR = 0.1  # a control's error on the same scale: measured 1.0 (dropped) and 1.2-1.4 (rolled)

# Fields vLLM's model classes read that the tiny transformers configs lack (not LoRA: the base would not load)
VLLM_CONFIG_FIELDS = {
    "deepseek_v3": {"topk_method": "noaux_tc"},
    "afmoe": {"score_func": "sigmoid", "n_group": 1, "topk_group": 1, "route_norm": True},
    "glm4_moe_lite": {"first_k_dense_replace": 1},
    "glm4v_moe": {"text_config.use_qk_norm": False},
    # the hub checkpoints' spelling: transformers writes PhimoeForCausalLM, which vLLM serves through its
    # Transformers backend, where a per-expert adapter fails vLLM's own assertion (lora_weights.py, pack_moe)
    "phimoe": {"architectures": ["PhiMoEForCausalLM"]},
}
# Fields of the tiny base itself (set before it is built and saved)
BASE_FIELDS = {
    "phimoe": {"attention_bias": True, "lm_head_bias": True},
    "granitemoeshared": {"shared_intermediate_size": 32},
}
# Families vLLM 0.33 loads on the CPU with LoRA; the others: nemotron_h (non-gated MoE: CUDA, XPU, ROCm only),
# deepseek_v32, glm_moe_dsa, hy_v4 (sparse attention), qwen4_exp (no CPU build), deepseek_v4 (no LoRA in its CPU
# class), glm5_next (needs prefix caching), minimax_m2, hy_v3, qwen3_vl_moe (the tiny bases do not load),
# sarvam_moe (vLLM's transformers does not know it)
FAMILIES = [
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "qwen2_moe",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "granitemoe_swa",
    "jamba",
    "ernie4_5_moe",
    "exaone_moe",
    "glm4_moe",
    "lfm2_moe",
    "gemma4",
    "gemma4_text",
    "laguna",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "glm4v_moe",
    "afmoe",
    "phimoe",
    "llama4",
    "llama4_text",
]
# Controls: (case name, family, targets), written past the export's refusal or without its fix
BYPASS_CONTROLS = [("qwen2_moe+shared_expert_gate", "qwen2_moe"), ("qwen3_next+shared_expert_gate", "qwen3_next")]
UNPERMUTED_CONTROL = ("llama4_text-unpermuted", "llama4_text")
ROUTER_CONTROL = ("qwen3_moe+router", "qwen3_moe")  # a router vLLM's fused-MoE runner holds unwrapped


def patch_config(folder: Path, fields: dict) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        head, _, tail = key.partition(".")
        (config[head].__setitem__(tail, value)) if tail else config.__setitem__(key, value)
    path.write_text(json.dumps(config, indent=2))


def make_case(work: Path, name: str, family: str, *, targets=None, router=None, force=False, unpermuted=False) -> dict:
    """The checker's case: the tiny base, the vLLM export and PEFT's merge, vLLM's config fields on both."""
    from test_export_families import family_adapter

    if router is None and family in vllm_lora.VLLM_IGNORED_ROUTER:
        router = False
    adapter = family_adapter(work / name, family, router=router, targets=targets, **BASE_FIELDS.get(family, {}))
    base = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    with pytest.MonkeyPatch.context() as mp:
        if force:
            mp.setattr(vllm_lora, "vllm_refusal", lambda *args: None)
        if unpermuted:
            mp.setattr(vllm_lora, "VLLM_ROTARY_PERMUTED", set())
        lora = vllm_lora.write_vllm(adapter, work / name / "vllm")
    merged = peft_fp32_merge(adapter, base, work / name / "merged")
    for folder in (base, merged):
        patch_config(folder, VLLM_CONFIG_FIELDS.get(family, {}))
    return {"name": name, "base": str(base), "lora": str(lora), "merged": str(merged), "rank": 4}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Every case through vLLM in one process (its import alone is ~7 s): {case name: the checker's result}."""
    if not VLLM_PYTHON:
        pytest.skip("VLLM_PYTHON is not set: a Python with vllm==0.33.0 installed (this file's docstring)")
    work = tmp_path_factory.mktemp("vllm")
    cases = [make_case(work, family, family) for family in FAMILIES]
    cases += [
        make_case(work, name, f, targets=["q_proj", "shared_expert_gate"], force=True) for name, f in BYPASS_CONTROLS
    ]
    cases.append(make_case(work, *UNPERMUTED_CONTROL, unpermuted=True))
    cases.append(make_case(work, *ROUTER_CONTROL, targets=["q_proj"], router=True, force=True))
    job = work / "job.json"
    job.write_text(json.dumps({"cases": cases, "out": str(work / "out.json")}))
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([VLLM_PYTHON, str(CHECKER), str(job)], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["name"]: r for r in json.loads((work / "out.json").read_text())}


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loads_and_applies_every_tensor_of_the_export(results, family):
    r = results[family]
    assert r["error"] is None, r["error"]
    assert r["vllm"] == family_tables.VLLM_VERSION  # the export's tables were read from this version's source
    assert (r["leftover"], r["bypassed"], r["uncovered"]) == ([], [], []), r
    assert r["modules_checked"] > 0 and r["max_err"] <= TOL, (r["max_err"], r["worst"])
    assert r["rolled_err"] > FAR and r["dropped_err"] > FAR, r


@pytest.mark.parametrize("name", [name for name, _ in BYPASS_CONTROLS])
def test_a_shared_expert_gate_lora_written_past_the_refusal_is_caught_as_bypassed(results, name):
    r = results[name]
    assert r["error"] is None and any("shared_expert_gate" in b for b in r["bypassed"]), r


def test_a_router_lora_the_runner_holds_unwrapped_is_caught_as_bypassed(results):
    """The refusal export.vllm_lora.VLLM_IGNORED_ROUTER makes for Qwen3-MoE and the blocks built like it."""
    r = results[ROUTER_CONTROL[0]]
    assert r["error"] is None and any(".mlp.gate (unwrapped at" in b for b in r["bypassed"]), r


def test_llama4_q_and_k_lora_in_transformers_row_order_are_caught(results):
    """The export's rotary reordering is what makes Llama-4's q/k LoRA right in vLLM: without it, far off."""
    r = results[UNPERMUTED_CONTROL[0]]
    assert r["error"] is None and r["max_err"] > FAR and "_proj" in r["worst"], r
    assert results["llama4_text"]["max_err"] <= TOL


def test_verify_runs_vllm_on_the_export_and_names_a_bypassed_lora(results, tmp_path):
    """`moe-qlora verify`'s vLLM row, through the same checker: ok for the Mixtral export, a mismatch naming the
    bypassed gate for the shared_expert_gate LoRA written past the export's refusal."""
    from moe_qlora.inference.verify import vllm_runtime_row

    def row_of(family, **options):
        case = make_case(tmp_path, f"verify-{family}", family, **options)
        adapter = next(p for p in Path(case["lora"]).parent.iterdir() if p.name.endswith("-adapter"))
        return vllm_runtime_row(adapter, Path(case["lora"]), json.loads((adapter / "adapter_config.json").read_text()))

    good = row_of("mixtral")
    assert good.status == "ok" and "loaded by vLLM 0.33.0" in good.detail, good
    bad = row_of("qwen2_moe", targets=["q_proj", "shared_expert_gate"], force=True)
    assert bad.status == "mismatch" and "bypassed: model.layers.0.mlp.shared_expert_gate" in bad.detail, bad
