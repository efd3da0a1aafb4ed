"""Where rows come from: data files, folders (written by `datasets`' save_to_disk, or of data files), and
Hugging Face dataset ids (read from the `datasets` cache when offline); and the common column layouts mapped
to the row formats examples.py tokenizes.

A `data.train_files` entry is a string (a path, or a hub id when it is not a path) or a mapping
{path, name, split, revision, columns}. Layouts recognised in every row:
- ShareGPT: `conversations: [{from: human | gpt | system | tool, value}]` -> `messages`;
- Alpaca: `instruction`, optional `input`, `output` -> prompt (the Alpaca template) and completion;
- `columns: {prompt: question, completion: answer}` renames the dataset's columns to ours first.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_qlora.common.hub import DATA_SUFFIXES, looks_local

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task{context}. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)


class DataError(ValueError):
    """A dataset row or file that cannot be trained on; names the file and row."""


ROW_NEEDS = (
    "a row needs 'text', or 'prompt' with 'completion', or 'messages' (a list of role/content turns); "
    "docs/configs.md shows each"
)


def first_bad_json_line(path: Path) -> str | None:
    """The first line of a JSONL file datasets cannot make a row of, said with its number; None when all can."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line.strip())
                    if not isinstance(row, dict):  # (a torn last line: "Unterminated")
                        return f"{path}:{n}: expected a JSON object per line"
                    if not row:  # datasets: 'Instruction "train" corresponds to no data!'
                        return f"{path}:{n}: an empty row ({{}}); {ROW_NEEDS}"
                except json.JSONDecodeError as exc:
                    return f"{path}:{n}: not valid JSON ({exc.msg})"
    return None


def first_non_utf8_line(path: Path) -> str | None:
    """The first line of a JSON / JSONL file that is not UTF-8, named with the offending byte; None when all are.
    (pyarrow builds the table from such bytes and fails only when a row is read, far from the file.)"""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = f"byte 0x{line[exc.start]:02x} at column {exc.start + 1}"
                return f"{path}:{n}: not UTF-8 text ({byte}); save the file as UTF-8"
    return None


def entry_path(entry) -> str:
    return entry if isinstance(entry, str) else entry.path


def load_rows(entries: list) -> list[tuple[str, dict]]:
    """All rows of all entries in order, each with its 'where:row' (1-based) source, columns mapped."""
    from moe_qlora.config.sections import DataSource

    rows = []
    for entry in entries:
        source = DataSource(path=entry) if isinstance(entry, str) else entry
        dataset, label = open_dataset(source)
        for i, row in enumerate(dataset):
            where = f"{label}:{i + 1}"
            rows.append((where, standard_columns(rename_columns(dict(row), source.columns, where), where)))
    return rows


def open_dataset(source) -> tuple[object, str]:
    """(an iterable of rows, the label its rows are named by)."""
    path = Path(source.path).expanduser()
    if path.is_file():
        return read_file(path), str(source.path)
    if path.is_dir():
        return read_folder(path, source), str(source.path)
    if looks_local(source.path):
        raise DataError(f"{os.path.abspath(path)}: data file not found")
    return read_hub(source), f"{source.path}[{source.split}]"


def check_data_file(path: Path) -> str:
    """The reader of a data file (json or parquet), after what can be told without parsing it: its type, that it
    holds something, and (JSON, JSONL) that it is UTF-8 text. Cheap and torch-free: the CLI runs it before the
    heavy imports, so a bad file is named in seconds, not after a minute of loading."""
    reader = DATA_SUFFIXES.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (expected .jsonl, .json or .parquet)")
    if is_empty(path, text=reader == "json"):
        raise DataError(f"{path}: the file is empty: it holds no rows")
    if reader == "json" and (bad := first_non_utf8_line(path)):
        raise DataError(bad)
    return reader


def read_file(path: Path):
    from datasets import load_dataset

    reader = check_data_file(path)
    try:
        with library_errors_silenced():
            return load_dataset(reader, data_files=str(path), split="train")
    except Exception as exc:  # datasets wraps parse errors in several types; find the line ourselves
        bad = first_bad_json_line(path) if path.suffix.lower() == ".jsonl" else None
        raise DataError(bad or f"{path}: cannot be read as {reader}: {exc}") from None


def is_empty(path: Path, *, text: bool) -> bool:
    """No bytes, or (`text`: JSON and JSONL) only whitespace, read no further than the first other character."""
    if path.stat().st_size == 0:
        return True
    if not text:
        return False
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


@contextmanager
def library_errors_silenced() -> Iterator[None]:
    """`datasets` logs a parse failure itself (pyarrow's message, its row counted from 0) before raising; the
    DataError read_file raises names the line instead, so that log is held back while it reads."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def read_folder(path: Path, source):
    """A folder written by save_to_disk (a Dataset, or a DatasetDict whose `split` is taken), else a folder of
    data files as `datasets` reads one."""
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise DataError(f"{path}: no split {source.split!r} (it has {', '.join(sorted(loaded))})")
            return loaded[source.split]
        return loaded
    try:
        return datasets.load_dataset(str(path), source.name, split=source.split)
    except Exception as exc:
        raise DataError(f"{path}: not a dataset folder datasets can read ({type(exc).__name__}: {exc})") from None


def read_hub(source):
    """A hub dataset through `datasets` (its cache first; only the cache when HF_HUB_OFFLINE is set), failing
    at once in one sentence when it is neither cached nor reachable."""
    import datasets
    from huggingface_hub import constants

    how = (
        f"download it where there is a network (datasets.load_dataset({source.path!r}) fills the cache) or point "
        "data.train_files at a local file or save_to_disk folder"
    )
    if not constants.HF_HUB_OFFLINE:
        check_hub_dataset(source, how)
    try:
        return datasets.load_dataset(source.path, source.name, split=source.split, revision=source.revision)
    except (ConnectionError, FileNotFoundError) as exc:
        if constants.HF_HUB_OFFLINE:
            raise DataError(
                f"dataset {source.path!r} is not in the datasets cache and HF_HUB_OFFLINE is set: {how}"
            ) from None
        raise DataError(f"dataset {source.path!r}: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:  # a split or config the dataset does not have
        raise DataError(f"dataset {source.path!r}: {exc}") from None


def check_hub_dataset(source, how: str) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().dataset_info(source.path, revision=source.revision, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise DataError(
            f"dataset {source.path!r}: not a local path, and the hub says {type(exc).__name__} (a typo, "
            "or a private or gated dataset: log in with `hf auth login`)"
        ) from None
    except Exception as exc:  # network errors come from several libraries; all mean the same here
        raise DataError(
            f"dataset {source.path!r}: not a local path and the hub cannot be reached "
            f"({type(exc).__name__}); with a cached copy set HF_HUB_OFFLINE=1, or "
            f"{how}"
        ) from None


def rename_columns(row: dict, columns: dict[str, str], where: str) -> dict:
    """`columns` maps our field names to the dataset's; the other columns stay as they are."""
    if not columns:
        return row
    missing = [theirs for theirs in columns.values() if theirs not in row]
    if missing:
        raise DataError(f"{where}: data columns {missing} not in the row (it has {sorted(row)})")
    renamed = {k: v for k, v in row.items() if k not in columns.values()}
    renamed.update({ours: row[theirs] for ours, theirs in columns.items()})
    return renamed


def standard_columns(row: dict, where: str) -> dict:
    """ShareGPT conversations to messages, Alpaca instruction/input/output to prompt/completion."""
    if row.get("messages") is None and isinstance(row.get("conversations"), list):
        return {**row, "messages": [sharegpt_turn(t, where, i) for i, t in enumerate(row["conversations"])]}
    if row.get("prompt") is None and isinstance(row.get("instruction"), str) and isinstance(row.get("output"), str):
        extra = row.get("input") or ""
        prompt = ALPACA_PREAMBLE.format(
            context=", paired with an input that provides further context" if extra else "",
            instruction=row["instruction"],
            input=f"### Input:\n{extra}\n\n" if extra else "",
        )
        return {**row, "prompt": prompt, "completion": row["output"]}
    return row


def sharegpt_turn(turn, where: str, i: int) -> dict:
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise DataError(f"{where}: conversations[{i}] must be {{from, value}}, got {turn!r}")
    role = SHAREGPT_ROLES.get(turn.get("from"))
    if role is None:
        raise DataError(
            f"{where}: conversations[{i}] from {turn.get('from')!r}: expected one of {', '.join(SHAREGPT_ROLES)}"
        )
    return {"role": role, "content": turn["value"]}
