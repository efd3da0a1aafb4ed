"""Every MoE model type of the installed transformers through the whole tool (see family_sweep.py): each one
is supported (trains, its export loads whole in PEFT, its experts match the family's eager experts) or
refused/skipped with a one-sentence reason; none fails with a traceback. The family table of docs/families.md is
this test's output and must match it: regenerate with `MOE_QLORA_UPDATE_DOCS=1 python -m pytest
tests/model/test_family_sweep.py`."""

import functools

import transformers

from helpers import family_sweep
from helpers.family_sweep import TABLE_END, TABLE_START, render_table, sweep
from helpers.generated import ROOT, keep_generated
from helpers.oracle import run_experts_pair

FAMILIES_PAGE = ROOT / "docs" / "families.md"
# The families this tool is named for, and the hybrids that were once refused for the wrong reason.
MUST_BE_SUPPORTED = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "gpt_oss",
    "glm4_moe",
    "nemotron_h",
    "jamba",
    "granitemoehybrid",
    "lfm2_moe",
    "kimi_linear",
    "bailing_hybrid",
    "laguna",
}


def test_every_moe_family_is_supported_or_refused_with_a_reason(tmp_path):
    rows = sweep(tmp_path)
    assert len(rows) >= 40, [r.model_type for r in rows]
    errors = [f"{r.model_type}: {r.detail}" for r in rows if r.status == "error"]
    assert not errors, errors
    supported = {r.model_type for r in rows if r.status == "supported"}
    assert MUST_BE_SUPPORTED <= supported, MUST_BE_SUPPORTED - supported
    table = render_table(rows, transformers.__version__)
    # another transformers? its model types differ: regenerate the table with the pins in pyproject.toml
    keep_generated(FAMILIES_PAGE, TABLE_START, TABLE_END, table, rerun="tests/model/test_family_sweep.py")


def test_the_sweeps_parity_check_fails_on_rolled_experts(tmp_path, monkeypatch):
    """Broken control: with the experts rolled on our side the sweep must report an error, not support."""
    rolled = functools.partial(run_experts_pair, mutate=lambda idx, w: ((idx + 1) % 8, w))
    monkeypatch.setattr(family_sweep, "run_experts_pair", rolled)
    (row,) = sweep(tmp_path, ["mixtral"])
    assert row.status == "error" and "AssertionError" in row.detail, row
