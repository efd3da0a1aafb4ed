"""`moe-qlora plot RUN_DIR`: PNGs from a run's metrics.jsonl (train, grpo or dpo), written atomically.

- loss.png: training loss per step, and the eval loss where it was measured;
- lr.png, grad_norm.png;
- router_load.png: per MoE layer, each expert's share of the routed rows, averaged over the run (a heatmap:
  a dead expert is a dark column, a collapsed router a single bright one);
- GRPO runs: reward.png (total and per reward function), kl.png (a note instead of a line when the run had
  no KL term: grpo.kl_coef 0 logs none), completion_length.png;
- DPO runs: rewards.png (chosen, rejected, margins; the eval margin), accuracy.png, logps.png.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from moe_qlora.common.fileio import unwritable_named
from moe_qlora.common.reporting import MetricsError, read_jsonl


class PlotError(ValueError):
    """No metrics to plot (exit code 2)."""


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise PlotError(f"{path}: no metrics.jsonl (give the run's output.dir)")
    try:
        records = read_jsonl(path)
    except MetricsError as exc:
        raise PlotError(str(exc)) from None
    steps = [r for r in records if "step" in r]
    if not steps:
        raise PlotError(f"{path}: no step records to plot")
    return steps


def lookup(record: dict, key: str):
    """record[key], or a nested value given as 'a/b' (keys may hold '/' themselves: 'reward/regex/mean')."""
    if key in record:
        return record[key]
    parent, _, child = key.rpartition("/")
    value = lookup(record, parent) if parent else None
    return value.get(child) if isinstance(value, dict) else None


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a scalar over the steps that logged it."""
    xs, ys = [], []
    for r in records:
        value = lookup(r, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(r["step"])
            ys.append(float(value))
    return xs, ys


def mean_router_load(records: list[dict]) -> list[list[float]] | None:
    """(layers, experts): each expert's share of routed rows, averaged over the steps that logged it."""
    loads = [r["router_load"] for r in records if r.get("router_load")]
    if not loads:
        return None
    layers, experts = len(loads[0]), len(loads[0][0])
    return [[sum(load[i][e] for load in loads) / len(loads) for e in range(experts)] for i in range(layers)]


NOT_LOGGED = "not logged by this run"
KL_NOT_LOGGED = "KL not computed: grpo.kl_coef is 0 (no KL term), so the run logged none"


def line_plot(
    path: Path,
    title: str,
    lines: dict[str, tuple[list, list]],
    ylabel: str,
    *,
    log: bool = False,
    empty_note: str = NOT_LOGGED,
) -> None:
    """One line per series against the step; `empty_note` written across the axes when no series has a point
    (an empty frame would look like a plotting bug)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (xs, ys) in lines.items():
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if not any(xs for xs, _ in lines.values()):
        ax.text(0.5, 0.5, empty_note, transform=ax.transAxes, ha="center", va="center", wrap=True, color="0.35")
    elif log:
        ax.set_yscale("log")
    if len([v for v in lines.values() if v[0]]) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    save(fig, path)


def heatmap(path: Path, load: list[list[float]]) -> None:
    """Layers down, experts across; ticks on whole layers and experts only (counts, never 0.5)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(max(6, len(load[0]) * 0.25 + 2), max(3, len(load) * 0.3 + 1.5)))
    image = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set(title="router load: share of routed rows per expert (mean over steps)", xlabel="expert", ylabel="MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax)
    save(fig, path)


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    from moe_qlora.common.fileio import current_umask, disk_full_named

    with unwritable_named(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600
    try:
        with disk_full_named(path):
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
            os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNGs into `out_dir` (default RUN_DIR/plots); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else (run_dir if run_dir.is_dir() else run_dir.parent) / "plots"
    with unwritable_named(out):
        out.mkdir(parents=True, exist_ok=True)
    written = []

    def plot(name: str, *args, **kwargs) -> None:
        line_plot(out / name, *args, **kwargs)
        written.append(out / name)

    grpo = any("reward_mean" in r for r in records)
    if not grpo:
        plot("loss.png", "loss", {"train": series(records, "loss"), "eval": series(records, "eval_loss")}, "loss")
    plot("lr.png", "learning rate", {"lr": series(records, "lr")}, "lr")
    plot("grad_norm.png", "gradient norm (before clipping)", {"grad norm": series(records, "grad_norm")}, "norm")
    if grpo:
        functions = sorted({k for r in records for k in r if k.startswith("reward/")})
        rewards = {"total": series(records, "reward_mean")} | {k[7:]: series(records, f"{k}/mean") for k in functions}
        plot("reward.png", "reward (mean over completions)", rewards, "reward")
        plot("kl.png", "KL to the base model", {"kl": series(records, "kl")}, "kl", empty_note=KL_NOT_LOGGED)
        plot(
            "completion_length.png", "completion length", {"mean": series(records, "completion_tokens/mean")}, "tokens"
        )
    if any("rewards/margins" in r for r in records):  # dpo
        plot_preferences(plot, records)
    if (load := mean_router_load(records)) is not None:
        heatmap(out / "router_load.png", load)
        written.append(out / "router_load.png")
    return written


def plot_preferences(plot, records: list[dict]) -> None:
    """A dpo run's TRL metrics: the implicit rewards and their margin, the accuracy, the completions' log-probs."""
    rewards = {side: series(records, f"rewards/{side}") for side in ("chosen", "rejected", "margins")}
    rewards["eval margins"] = series(records, "eval_rewards/margins")
    plot("rewards.png", "implicit rewards (beta x log-ratio to the reference)", rewards, "reward")
    accuracy = {"train": series(records, "rewards/accuracies"), "eval": series(records, "eval_rewards/accuracies")}
    plot("accuracy.png", "preference accuracy (chosen reward above the rejected one)", accuracy, "share of pairs")
    logps = {side: series(records, f"logps/{side}") for side in ("chosen", "rejected")}
    plot("logps.png", "log-probability of the completions (summed over tokens)", logps, "log p")
