"""How a run's rows render their prompts, read from the rows themselves (export.prompt_format records it beside
the adapter, so that `generate` renders a typed prompt the same way): the text every prompt row opens and ends with
(the demo's prompts end in a newline), the system turn every messages row opens with, and how many rows of each kind
there were.

The first SAMPLE_ROWS rows of each data entry decide: a template shows in every one of them. The shared text is cut at
line breaks (a prefix ends with one, a suffix starts with one), so that a template's fixed lines are kept and a word
the sampled prompts happen to share is not.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

from moe_qlora.config.sections import DataSection, DataSource
from moe_qlora.data.sources import open_dataset, rename_columns, standard_columns

SAMPLE_ROWS = 1000
# Row kinds, as generate renders them: a prompt string (prompt_completion rows, GRPO prompt rows), messages through
# the chat template, plain text (continued, no prompt).
KIND_OF_FORMAT = {"prompt_completion": "prompt", "messages": "chat", "text": "text"}


@dataclass(frozen=True)
class PromptFormat:
    """rows: sampled rows by kind (prompt, chat, text). prefix, suffix: what every prompt row opens and ends with.
    system: the system turn every messages row opens with (None when they differ or have none)."""

    rows: dict[str, int] = field(default_factory=dict)
    prefix: str = ""
    suffix: str = ""
    system: str | None = None

    @property
    def kind(self) -> str:
        """The kind most rows were (prompt on a tie): how generate renders a prompt unless told otherwise."""
        return max(("prompt", "chat", "text"), key=lambda k: self.rows.get(k, 0))


def row_kind(row: dict, requested: str) -> str:
    """prompt, chat or text: data.format when set, else the row's keys (as the data loaders read them)."""
    if requested != "auto":
        return KIND_OF_FORMAT[requested]
    conversational = (row.get(k) for k in ("prompt", "chosen"))  # preference rows: TRL's conversational format
    if row.get("messages") is not None or any(isinstance(v, list) for v in conversational):
        return "chat"
    return "prompt" if isinstance(row.get("prompt"), str) else "text"


def sampled_rows(entries: list, limit: int = SAMPLE_ROWS) -> Iterator[dict]:
    """The first `limit` rows of each data entry, with its column mapping applied (as training reads them)."""
    for entry in entries:
        source = DataSource(path=entry) if isinstance(entry, str) else entry
        dataset, label = open_dataset(source)
        for i, row in enumerate(islice(dataset, limit)):
            where = f"{label}:{i + 1}"
            yield standard_columns(rename_columns(dict(row), source.columns, where), where)


def shared_prefix(texts: list[str]) -> str:
    """The text every one of `texts` opens with, up to its last line break ("" for fewer than two distinct texts)."""
    if len(set(texts)) < 2:
        return ""
    common = os.path.commonprefix(texts)
    return common[: common.rfind("\n") + 1]


def shared_suffix(texts: list[str]) -> str:
    """The text every one of `texts` ends with, from its first line break ("" for fewer than two distinct texts)."""
    reversed_prefix = shared_prefix([t[::-1] for t in texts])
    return reversed_prefix[::-1]


def shared_system(conversations: Iterable[list]) -> str | None:
    """The content of the system turn every conversation opens with; None when one has none or they differ."""
    systems = {
        m[0].get("content") if m and isinstance(m[0], dict) and m[0].get("role") == "system" else None
        for m in conversations
    }
    (system,) = systems if len(systems) == 1 else (None,)
    return system if isinstance(system, str) else None


def prompt_format_of(data: DataSection) -> PromptFormat:
    """The prompt format of the run's training rows (a sample of each entry, see SAMPLE_ROWS)."""
    rows: dict[str, int] = {}
    prompts, conversations = [], []
    for row in sampled_rows(data.train_files):
        kind = row_kind(row, data.format)
        rows[kind] = rows.get(kind, 0) + 1
        if kind == "prompt" and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif kind == "chat":
            conversation = next(
                (row[k] for k in ("messages", "prompt", "chosen") if isinstance(row.get(k), list)), None
            )
            conversations += [conversation] if conversation is not None else []
    return PromptFormat(rows, shared_prefix(prompts), shared_suffix(prompts), shared_system(conversations))
