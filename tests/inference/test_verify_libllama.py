"""Opt-in (`pytest -m llamacpp`, not in CI): `moe-qlora verify`'s `gguf (libllama)` row with libllama itself.

The tiny Mixtral's adapter exported as a GGUF, run by libllama on the base converted by llama.cpp's own converter,
against PEFT on the same base (libllama_check.TOL). Controls: the GGUF with each layer's experts rolled is a
mismatch; a base GGUF of another model, and an adapter that does not move the log-probs (B = 0, as training
starts), are "not checked" with the reason, never "ok". Needs llama-cpp-python and LLAMA_CPP_DIR, set up as
tests/export/test_llamacpp.py's docstring says.
"""

import json
import shutil
from pathlib import Path

import pytest

from moe_qlora.config.sections import LoraSection
from moe_qlora.export import gguf_lora, peft_factors
from moe_qlora.inference import libllama_check
from moe_qlora.inference.verify import verify_all
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model

from helpers.adapters import random_adapter
from helpers.tiny_configs import tiny_mixtral_config

pytestmark = pytest.mark.llamacpp
LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


def requirements() -> str | None:
    import os

    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (tests/export/test_llamacpp.py's docstring)"
    if libllama_check.converter_of(os.environ.get("LLAMA_CPP_DIR")) is None:
        return "LLAMA_CPP_DIR does not point at a llama.cpp tree with convert_hf_to_gguf.py"
    return None


@pytest.fixture(scope="module")
def run(tiny_mixtral_dir, tmp_path_factory):
    """An adapter with random non-zero factors and its GGUF beside it, and the base as an f32 GGUF."""
    if (missing := requirements()) is not None:
        pytest.skip(missing)
    import os

    folder = tmp_path_factory.mktemp("run")
    adapter = random_adapter(tiny_mixtral_dir, folder / "adapter", LORA)[1]
    gguf_lora.write_gguf(adapter, folder / "adapter.gguf")
    base = folder / "base.gguf"
    proc = libllama_check.convert_base(tiny_mixtral_dir, base, os.environ["LLAMA_CPP_DIR"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return adapter, base


def libllama(adapter: Path, gguf_base: Path | None = None):
    rows = verify_all(adapter, merged=None, formats=["gguf"], console=None, gguf_base=gguf_base)
    return next(r for r in rows if r.format == "gguf (libllama)")


def test_libllama_runs_the_gguf_as_peft_runs_the_adapter(run):
    """Through the CLI with the base converted by LLAMA_CPP_DIR's converter, and with --gguf-base."""
    from test_verify import invoke, rows

    adapter, base = run
    for extra in ([], ["--gguf-base", base]):
        code, output = invoke("verify", adapter, "--format", "gguf", "--json", *extra)
        assert code == 0, output
        row = rows(output)["gguf (libllama)"]
        assert row["status"] == "ok", row
        assert "within" in row["detail"] and f"tolerance {libllama_check.TOL:g}" in row["detail"]


def test_a_gguf_with_its_experts_rolled_is_a_mismatch_in_libllama(run, tmp_path, monkeypatch):
    adapter, base = run
    folder = tmp_path / "run"
    shutil.copytree(adapter, folder / "adapter")
    real = gguf_lora.expert_layers

    def rolled(tensors, rank, names=None):
        layers = real(tensors, rank, names).items()
        return {n: peft_factors.ExpertLayer(*(t.roll(1, 0) for t in vars(x).values())) for n, x in layers}

    monkeypatch.setattr(gguf_lora, "expert_layers", rolled)
    gguf_lora.write_gguf(folder / "adapter", folder / "adapter.gguf")
    monkeypatch.setattr(gguf_lora, "expert_layers", real)
    row = libllama(folder / "adapter", base)
    assert row.status == "mismatch" and "from PEFT's with the adapter" in row.detail, row


def test_another_models_base_and_an_adapter_that_moves_nothing_are_not_checked(run, tmp_path):
    import os

    from moe_qlora.export.adapter import save_adapter
    from moe_qlora.model.adapters import attach_adapters
    from moe_qlora.model.loading import LoadOptions, load_model

    adapter, _ = run
    tok = build_byte_tokenizer()
    other = save_tiny_model(tmp_path / "other", tiny_mixtral_config(len(tok)), seed=1, tokenizer=tok)
    other_base = tmp_path / "other.gguf"
    assert libllama_check.convert_base(other, other_base, os.environ["LLAMA_CPP_DIR"]).returncode == 0
    row = libllama(adapter, other_base)
    assert row.status == "not checked" and "not this adapter's base" in row.detail, row

    base_dir = Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    fresh = attach_adapters(load_model(LoadOptions(str(base_dir))), LORA, seed=0)  # B = 0
    still = save_adapter(fresh, tmp_path / "fresh" / "adapter", cfg=LORA, base_model_name_or_path=str(base_dir))
    gguf_lora.write_gguf(still, tmp_path / "fresh" / "adapter.gguf")
    row = libllama(still, run[1])
    assert row.status == "not checked" and "too little to tell it applied" in row.detail, row
