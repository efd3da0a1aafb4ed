"""Metrics where people look: TensorBoard event files and an offline W&B run read back against metrics.jsonl,
and `moe-qlora plot` drawing what the records hold."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moe_qlora.cli.app import app
from moe_qlora.cli.plots import mean_router_load, plot_run, series
from moe_qlora.common.reporting import flatten_scalars

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reported_run(tmp_path_factory):
    """The demo for 6 steps with eval every 3 steps, reporting to jsonl, TensorBoard and W&B (offline)."""
    tmp = tmp_path_factory.mktemp("reported")
    out = tmp / "run"
    cmd = [
        sys.executable,
        "-m",
        "moe_qlora",
        "train",
        "--config",
        str(ROOT / "configs" / "demo.yaml"),
        "--set",
        "train.max_steps=6",
        "--set",
        "train.eval_every=3",
        "--set",
        "data.eval_fraction=0.1",
        "--set",
        "output.report_to=[jsonl, tensorboard, wandb]",
        "--set",
        f"output.dir={out}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "MOE_QLORA_CACHE": str(tmp / "cache")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, [r for r in records if "step" in r]


def test_flatten_keeps_finite_numbers_by_path():
    record = {
        "step": 3,
        "loss": 1.5,
        "skipped": False,
        "advantage": {"mean": 0.1, "std": float("nan")},
        "reward/regex": {"mean": 0.5},
        "router_load": [[0.5, 0.5]],
        "sources": ["a"],
    }
    assert flatten_scalars(record) == {"step": 3.0, "loss": 1.5, "advantage/mean": 0.1, "reward/regex/mean": 0.5}


def test_tensorboard_events_hold_the_logged_scalars(reported_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records = reported_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    eval_loss = [(e.step, e.value) for e in events.Scalars("eval_loss")]
    assert eval_loss == [(r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in records if "eval_loss" in r]
    assert [s for s, _ in eval_loss] == [3, 6]
    assert {"lr", "grad_norm", "tokens"} <= set(events.Tags()["scalars"])


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline .wandb file: wandb's LevelDB-style log (a 7-byte file header, 32 KiB
    blocks of chunks with a 7-byte header: crc32, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4) of
    protobuf Records."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_wandb_offline_run_holds_every_step(reported_run):
    out, records = reported_run
    run_id = (out / "wandb_run_id").read_text().strip()
    (run_file,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = wandb_history(run_file)
    assert [h["_step"] for h in history] == [r["step"] for r in records]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in records], rel=1e-9)
    assert [h["eval_loss"] for h in history if "eval_loss" in h] == pytest.approx(
        [r["eval_loss"] for r in records if "eval_loss" in r], rel=1e-9
    )


def test_plot_writes_the_run_pngs_from_its_records(reported_run, tmp_path):
    import matplotlib.image

    out, records = reported_run
    result = CliRunner().invoke(app, ["plot", str(out), "--out", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert names == ["grad_norm.png", "loss.png", "lr.png", "router_load.png"]
    assert matplotlib.image.imread(str(tmp_path / "plots" / "router_load.png")).shape[2] in (3, 4)
    assert series(records, "eval_loss") == ([3, 6], [records[2]["eval_loss"], records[5]["eval_loss"]])
    load = mean_router_load(records)
    layer0 = [sum(r["router_load"][0][e] for r in records) / len(records) for e in range(8)]
    assert len(load) == 2 and load[0] == pytest.approx(layer0) and sum(load[1]) == pytest.approx(1.0, abs=1e-3)


def test_plot_of_a_grpo_run_and_bad_input(tmp_path):
    records = [
        {
            "step": s,
            "lr": 1e-3,
            "grad_norm": 0.5,
            "reward_mean": s / 10,
            "kl": 0.01 * s,
            "reward/exact_match": {"mean": s / 20, "std": 0.1},
            "completion_tokens": {"mean": 5.0 + s},
            "router_load": [[0.25, 0.75]],
        }
        for s in range(1, 4)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = sorted(p.name for p in plot_run(tmp_path))
    assert written == ["completion_length.png", "grad_norm.png", "kl.png", "lr.png", "reward.png", "router_load.png"]
    assert series(records, "reward/exact_match/mean") == ([1, 2, 3], [0.05, 0.1, 0.15])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # torn mid-file: refused
    result = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2 and "metrics.jsonl, line 2: not a JSON object" in result.output


def test_a_reporter_whose_package_is_missing_is_named_before_loading(monkeypatch):
    import importlib.util

    from moe_qlora.common.reporting import missing_reporters

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_reporters(["jsonl", "tensorboard", "wandb"]) == [
        "output.report_to: wandb needs the wandb package (pip install wandb)"
    ]
