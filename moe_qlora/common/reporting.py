"""Where a run's metrics go: metrics.jsonl always (the record of the run, read by resume, plot and check-norms),
and TensorBoard event files and Weights & Biases when `output.report_to` names them.

TensorBoard and W&B get the numeric scalars of each step's record, nested ones by path (`advantage/mean`,
`reward/exact_match/mean`); lists such as the router load stay in metrics.jsonl (see `moe-qlora plot`).
A resumed run continues the same W&B run: its id is kept in the output dir.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import secrets
from pathlib import Path

from moe_qlora.common.fileio import disk_full_named

log = logging.getLogger(__name__)

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
WANDB_ID_FILE = "wandb_run_id"


class MetricsError(ValueError):
    """A JSONL log torn somewhere other than its last line: not something a crash leaves."""


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log (metrics.jsonl, rollouts.jsonl); none for a missing or empty file. A torn last
    line, what a crash or a full disk leaves mid-append, is dropped with a warning naming the file and line; a
    torn line anywhere else raises MetricsError naming them."""
    return [record for _, record in jsonl_lines(path)]


def jsonl_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each whole record of a JSONL log, as read_jsonl reads them."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            if number == last:
                log.warning("%s, line %d: torn (%s), dropped: the run stopped while writing it", path, number, why)
                break
            raise MetricsError(
                f"{path}, line {number}: not a JSON object ({why}); only the last line of a log can "
                "be torn by a crash, so this file was changed by hand or is corrupt"
            ) from None
        records.append((line, record))
    return records


class MetricsLog:
    """Append-only JSONL of metrics, one object a line, each written whole by one unbuffered write (a crash
    tears at most the line being written). Opening drops a torn last line left by an earlier crash, so the next
    record starts on a line of its own."""

    def __init__(self, path: Path):
        self.path = path
        drop_torn_tail(path)
        self._file = path.open("ab", buffering=0)

    def write(self, record: dict) -> None:
        line = (json.dumps(record, allow_nan=True) + "\n").encode("utf-8")
        with disk_full_named(self.path, len(line)):
            self._file.write(line)

    def close(self) -> None:
        self._file.close()


def drop_torn_tail(path: Path) -> None:
    """Cut a file back to its last newline when what follows it is a torn line (a crash mid-append)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    log.warning("%s, line %d: torn, dropped: the run stopped while writing it", path, data[:keep].count(b"\n") + 1)
    with path.open("r+b") as f:
        f.truncate(keep)


def missing_reporters(report_to: list[str]) -> list[str]:
    """The install hints for reporters whose package is not installed (checked before any model loads)."""
    return [
        f"output.report_to: {name} needs the {PACKAGES[name]} package (pip install {PACKAGES[name]})"
        for name in report_to
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None
    ]


def flatten_scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """Finite numbers of a record (bools and lists left out), nested dicts joined with '/'."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


class Reporters:
    """metrics.jsonl plus the reporters a run asked for; `write` takes one step's record."""

    def __init__(self, out: Path, report_to: list[str], *, project: str, config: dict | None = None):
        self.jsonl = MetricsLog(out / "metrics.jsonl")
        self.path = self.jsonl.path
        self.tensorboard = self.wandb = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(out / "tensorboard"))
        if "wandb" in report_to:
            self.wandb = start_wandb(out, project, config)

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        step = record.get("step")
        scalars = {k: v for k, v in flatten_scalars(record).items() if k not in ("step", "epoch")}
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


class NoReporters:
    """What ranks other than 0 log to: nothing (they read metrics.jsonl, never write it)."""

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def start_wandb(out: Path, project: str, config: dict | None):
    """A W&B run named after the output dir; the same run again on resume (its id is kept in `out`).
    WANDB_MODE=offline (or `wandb offline`) keeps it on disk, under out/wandb."""
    import wandb

    id_file = out / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(project=project, name=out.name, id=run_id, resume="allow", dir=str(out), config=config)
