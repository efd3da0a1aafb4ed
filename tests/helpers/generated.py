"""Text in README.md and docs/ that a test renders (the family table, the config keys, the README's main families):
what a file holds between two markers must be what the test renders now. `MOE_QLORA_UPDATE_DOCS=1` writes it
there first, so the check passes and `git diff` shows what changed."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPDATE_ENV = "MOE_QLORA_UPDATE_DOCS"


def keep_generated(path: Path, start: str, end: str, block: str, *, rerun: str) -> None:
    """Assert that `path` holds `block` (which begins with `start` and ends with `end`) in place of its text from
    `start` to `end`; with MOE_QLORA_UPDATE_DOCS=1, write it there first. `rerun`: the test command to name."""
    assert block.startswith(start) and block.endswith(end), "the rendered block carries its own markers"
    text = path.read_text()
    i, j = text.index(start), text.index(end) + len(end)
    if os.environ.get(UPDATE_ENV) == "1":
        text = text[:i] + block + text[j:]
        path.write_text(text)
        j = i + len(block)
    assert text[i:j] == block, (
        f"{path.relative_to(ROOT)}: the generated text from {start!r} on differs from what renders now; "
        f"{UPDATE_ENV}=1 python -m pytest {rerun} rewrites it:\n{block}"
    )
