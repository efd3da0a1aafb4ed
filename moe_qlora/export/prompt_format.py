"""The run's prompt format (data.prompt_format) recorded beside its adapter, in moe_qlora.json under "prompt_format",
and read back for `generate`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from moe_qlora.common.fileio import atomic_write_text
from moe_qlora.config.sections import DataSection
from moe_qlora.data.prompt_format import PromptFormat, prompt_format_of

KEY = "prompt_format"


def write_prompt_format(adapter_dir: str | Path, data: DataSection) -> PromptFormat:
    """Add the run's prompt format to the adapter's moe_qlora.json (written with the adapter; replaced atomically)."""
    from moe_qlora.model.peft_roundtrip import TRAINED_ON

    path = Path(adapter_dir) / TRAINED_ON
    fmt = prompt_format_of(data)
    trained_on = json.loads(path.read_text()) if path.exists() else {}
    atomic_write_text(path, json.dumps({**trained_on, KEY: asdict(fmt)}, indent=2))
    return fmt


def read_prompt_format(adapter_dir: str | Path) -> PromptFormat | None:
    """The prompt format the adapter's run recorded; None for adapters that do not say (written elsewhere, or by
    a version before the record). Raises AdapterReadError when the record is there but unreadable."""
    from moe_qlora.export.norms import AdapterReadError
    from moe_qlora.model.peft_roundtrip import TRAINED_ON

    path = Path(adapter_dir) / TRAINED_ON
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text()).get(KEY)
        fmt = None if record is None else PromptFormat(**record)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise AdapterReadError(f"{path}: not readable ({exc})") from None
    if fmt is not None and not (isinstance(fmt.prefix, str) and isinstance(fmt.suffix, str)):
        raise AdapterReadError(f"{path}: {KEY} is not a prompt format ({record!r})")
    return fmt
