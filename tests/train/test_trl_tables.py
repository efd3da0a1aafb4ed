"""docs/training.md's GRPOConfig and DPOConfig tables name every option of the installed TRL (1.16.0, the test
extra's pin): its config's own fields and the TrainingArguments whose defaults it changes. A TRL release that adds
an option fails here until the table says whether moe-qlora supports it (and by which key), refuses it, or has no
use for it. Names in the table that TRL does not have fail too (a renamed option)."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from pathlib import Path

import pytest

TRAINING_MD = Path(__file__).parents[2] / "docs" / "training.md"


def table_names(heading: str) -> set[str]:
    """The backticked names in the first column of the table under `heading`."""
    text = TRAINING_MD.read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n#", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def trl_options(cls) -> set[str]:
    """The config's own fields, and the TrainingArguments fields whose default it changes."""
    from transformers import TrainingArguments

    shared = TrainingArguments.__dataclass_fields__
    fields = dataclasses.fields(cls)
    return {f.name for f in fields if f.name not in shared or f.default != shared[f.name].default}


def named(option: str, names: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(option, pattern) for pattern in names)


@pytest.mark.parametrize(("config", "heading"), [("GRPOConfig", "### GRPO options"), ("DPOConfig", "### DPO options")])
def test_every_trl_option_is_in_the_table(config, heading):
    import trl

    cls = getattr(trl, config)
    names = table_names(heading)
    missing = sorted(option for option in trl_options(cls) if not named(option, names))
    assert not missing, f"docs/training.md's {config} table does not name {missing}"
    known = set(cls.__dataclass_fields__) | {"use_liger_kernel"}  # TrainingArguments', named where it matters
    if config == "DPOConfig":
        with warnings.catch_warnings():  # TRL 1.16 keeps CPO and ORPO in trl.experimental, and says so
            warnings.simplefilter("ignore")
            from trl.experimental.cpo import CPOConfig
            from trl.experimental.orpo import ORPOConfig

        known |= set(CPOConfig.__dataclass_fields__) | set(ORPOConfig.__dataclass_fields__)
    unknown = sorted(n for n in names if not any(fnmatch.fnmatchcase(k, n) for k in known))
    assert not unknown, f"docs/training.md's {config} table names {unknown}, which TRL {trl.__version__} lacks"


def test_the_tables_fail_on_an_option_they_do_not_name():
    """The control: an option the table lacks is found."""
    names = table_names("### GRPO options")
    assert named("vllm_server_port", names) and not named("vllm2_server_port", names)
    assert not named("use_adaptive_entropy_v2", names)
