"""`moe-qlora verify ADAPTER` (issue 69, item 4): each export beside an adapter read as its runtime reads it and
compared with what the adapter gives. Every check here has its broken control: a GGUF with one expert tensor
dropped, an export of an older adapter (stale values), a merged checkpoint with one expert's delta dropped, a
vLLM export of another base; each is a mismatch (exit 1) or one sentence (exit 2), never "ok"."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.config.sections import LoraSection

from helpers.adapters import random_adapter


def invoke(*args) -> tuple[int, str]:
    """(exit code, stdout alone with --json, else stdout and stderr)."""
    result = CliRunner().invoke(app, [*map(str, args)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout if "--json" in args else result.output


def make_adapter(base: Path, out: Path, seed: int) -> Path:
    """An adapter of the tiny Mixtral (experts, q and v), every factor random and non-zero."""
    return random_adapter(base, out, LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]), seed=seed)[1]


@pytest.fixture(scope="module")
def exported(tiny_mixtral_dir, tmp_path_factory):
    """An adapter with its GGUF, vLLM and per-expert exports beside it and a bf16 merge."""
    adapter = make_adapter(tiny_mixtral_dir, tmp_path_factory.mktemp("run") / "adapter", seed=0)
    for fmt in ("gguf", "vllm", "per-expert"):
        assert invoke("export", adapter, "--format", fmt)[0] == 0
    assert invoke("merge", adapter, "--out", adapter.parent / "merged")[0] == 0
    return adapter


def rows(output: str) -> dict[str, dict]:
    return {r["format"]: r for r in json.loads(output)}


def test_every_export_of_the_adapter_agrees(exported, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)  # libllama's row: tests/inference/test_verify_libllama.py
    code, output = invoke("verify", exported, "--merged", exported.parent / "merged", "--json")
    assert code == 0, output
    found = rows(output)
    assert {f: r["status"] for f, r in found.items()} == {
        "peft": "ok",
        "gguf": "ok",
        "gguf (libllama)": "not checked",
        "vllm": "ok",
        "vllm (runtime)": "not checked",
        "per-expert": "ok",
        "merged": "ok",
    }
    assert "VLLM_PYTHON is not set" in found["vllm (runtime)"]["detail"]
    assert found["merged"]["detail"].startswith("read with safetensors (bfloat16)")
    code, output = invoke("verify", exported)  # the table
    assert code == 0 and "gguf" in output and "mismatch" not in output


def test_a_gguf_with_an_expert_tensor_dropped_is_a_mismatch(exported, tmp_path):
    """The worst bug of the field: expert LoRA silently missing from an export."""
    import gguf

    from moe_qlora.inference.verify import gguf_tensors_of

    run = tmp_path / "run"
    shutil.copytree(exported.parent, run)
    tensors = gguf_tensors_of(run / "adapter.gguf")
    writer = gguf.GGUFWriter(str(run / "adapter.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_float32("adapter.lora.alpha", 8.0)
    dropped = "blk.1.ffn_down_exps.weight.lora_b"
    for name, t in tensors.items():
        if name != dropped:
            writer.add_tensor(name, t.numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    code, output = invoke("verify", run / "adapter", "--format", "gguf", "--json")
    assert code == 1, output
    assert rows(output)["gguf"]["detail"] == f"1 tensor(s) the adapter has are missing: {dropped}"


def test_an_export_of_an_older_adapter_is_a_mismatch(exported, tmp_path, tiny_mixtral_dir):
    """The per-expert export of another adapter of the same base: same names, other values (a stale export)."""
    run = tmp_path / "run"
    shutil.copytree(exported.parent, run)
    other = make_adapter(tiny_mixtral_dir, tmp_path / "other" / "adapter", seed=1)
    assert invoke("export", other, "--format", "per-expert", "--out", run / "adapter-per-expert", "--force")[0] == 0
    code, output = invoke("verify", run / "adapter", "--format", "per-expert", "--json")
    assert code == 1 and "differ from the adapter's" in rows(output)["per-expert"]["detail"], output


def test_a_merge_with_one_experts_delta_dropped_is_a_mismatch(exported, tmp_path, tiny_mixtral_dir):
    """Expert 3's down projection of layer 0 put back to the base's weight in the merged checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(exported.parent, run)
    merged = load_file(run / "merged" / "model.safetensors")
    base = load_file(tiny_mixtral_dir / "model.safetensors")
    key = next(k for k in merged if "layers.0" in k and "experts" in k and ("down" in k or "w2" in k))
    assert key in base, key
    merged[key] = base[key].to(merged[key].dtype) if merged[key].dim() == 2 else merged[key]
    if merged[key].dim() == 3:  # fused stacks: one expert of the stack
        merged[key][3] = base[key][3].to(merged[key].dtype)
    save_file(merged, run / "merged" / "model.safetensors", metadata={"format": "pt"})
    code, output = invoke("verify", run / "adapter", "--merged", run / "merged", "--format", "gguf", "--json")
    assert code == 1, output
    assert f"{key} differs from the merge of this adapter" in rows(output)["merged"]["detail"]


def test_a_missing_export_asked_for_and_an_export_of_another_base_are_one_sentence(exported, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(exported.parent, run)
    shutil.rmtree(run / "adapter-vllm")
    code, output = invoke("verify", run / "adapter", "--format", "vllm")
    assert code == 2 and "adapter-vllm: no vllm export beside" in " ".join(output.split()), output
    shutil.copytree(exported.parent / "adapter-vllm", run / "adapter-vllm")
    config = json.loads((run / "adapter-vllm" / "adapter_config.json").read_text())
    (run / "adapter-vllm" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "x"}))
    code, output = invoke("verify", run / "adapter", "--format", "vllm")
    said = " ".join(output.split())
    assert code == 2 and "has base_model_name_or_path 'x'" in said and "the vllm export of another adapter" in said


def test_the_vllm_row_says_why_vllm_did_not_run(exported, monkeypatch):
    """Without VLLM_PYTHON, and with one that has no vLLM (this Python): 'not checked' and why, never 'ok'."""
    import sys

    from moe_qlora.inference.verify import vllm_runtime_row, vllm_verdict

    config = json.loads((exported / "adapter_config.json").read_text())
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    row = vllm_runtime_row(exported, exported.parent / "adapter-vllm", config)
    assert (row.status, row.detail.startswith("VLLM_PYTHON is not set")) == ("not checked", True)
    monkeypatch.setenv("VLLM_PYTHON", sys.executable)
    row = vllm_runtime_row(exported, exported.parent / "adapter-vllm", config)
    assert row.status == "not checked" and "could not run vLLM" in row.detail and "vllm" in row.detail, row
    result = {"vllm": "0.33.0", "error": None, "leftover": [], "bypassed": [], "uncovered": [], "max_err": 0.0}
    result |= {"worst": "w", "modules_checked": 6, "loaded_tensors": 112}
    assert vllm_verdict(result, exported).status == "ok"
    for broken in ({"bypassed": ["model.layers.0.mlp.gate"]}, {"leftover": ["x"]}, {"max_err": 0.5}):
        assert vllm_verdict(result | broken, exported).status == "mismatch", broken  # each check can fail
    assert vllm_verdict(result | {"error": "ValueError: no"}, exported).status == "not checked"


def test_the_libllama_row_says_why_libllama_did_not_run(exported, monkeypatch, tmp_path):
    """Without llama-cpp-python; with it but no base GGUF and no LLAMA_CPP_DIR; with a base GGUF that is not f32;
    with --gguf-base naming nothing: 'not checked' and why, or one sentence, never 'ok'."""
    import sys
    import types

    import gguf
    import numpy as np

    from moe_qlora.inference.verify import libllama_row

    config = json.loads((exported / "adapter_config.json").read_text())
    lora = exported.parent / "adapter.gguf"
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    row = libllama_row(exported, lora, config, None)
    assert (row.status, row.detail.startswith("llama-cpp-python (libllama) is not installed")) == ("not checked", True)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="0.3.36"))
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))  # a folder without convert_hf_to_gguf.py
    row = libllama_row(exported, lora, config, None)
    assert row.status == "not checked" and row.detail.startswith("no f32 base GGUF: give --gguf-base"), row
    half = tmp_path / "base-f16.gguf"
    writer = gguf.GGUFWriter(str(half), "mixtral")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float16))
    writer.add_tensor("output_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    row = libllama_row(exported, lora, config, half)
    assert row.status == "not checked" and f"{half} holds F16 tensors" in row.detail, row
    code, output = invoke("verify", exported, "--format", "gguf", "--gguf-base", tmp_path / "none.gguf")
    assert code == 2 and "--gguf-base" in output and "no such file" in " ".join(output.split()), output
