"""`moe-qlora plan` (will a run fit, before it starts) and `plot` (a run's metrics as PNGs)."""

from __future__ import annotations

import dataclasses
import sys

import typer

from moe_qlora.cli.common import console, fail, quiet_libraries, user_errors

PLAN_EPILOG = """Examples:

  moe-qlora plan --model configs/models/qwen3-30b-a3b --set data.max_seq_len=4096 --set lora.rank=16

  moe-qlora plan --config cfg.yaml --device cpu

  moe-qlora plan --model configs/models/deepseek-v2 --gpus 8 --parallel fsdp   # per GPU, and traffic per step
"""


def plan(
    config: str | None = typer.Option(None, "--config", "-c", help="YAML run configuration"),
    model: str | None = typer.Option(
        None, "--model", help="a folder with config.json, or a hub id (overrides the config's)"
    ),
    set_: list[str] = typer.Option([], "--set", help="override a key, e.g. --set data.max_seq_len=4096"),
    device: str = typer.Option("cuda", "--device", help="cuda or cpu (on cpu some linears stay unquantized)"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs the run is spread over; the table shows one GPU's bytes"),
    parallel: str | None = typer.Option(
        None, "--parallel", help="auto, ddp or fsdp (default: train.parallel); auto: ddp if the run fits one GPU"
    ),
    gpu_gb: float = typer.Option(80.0, "--gpu-gb", min=0.0, help="memory of one GPU in GiB (2^30 bytes)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Memory a run needs, by kind, from the model's config.json alone (no weights are read); with --gpus, one
    GPU's share under ddp or fsdp and the bytes each GPU sends per optimizer step."""
    quiet_libraries()
    from moe_qlora.config.load import deep_merge, load_config, parse_overrides, validate_config
    from moe_qlora.config.sections import ConfigError
    from moe_qlora.model.plan import PARALLEL_MODES, plan_run
    from moe_qlora.model.tiny import resolve_model_path

    try:
        if parallel is not None and parallel not in PARALLEL_MODES:
            raise ConfigError(f"--parallel {parallel}: give one of {', '.join(PARALLEL_MODES)}")
        if config:
            cfg = load_config(config, set_)
        elif model:
            raw = {"model": {"name_or_path": model}, "data": {"train_files": ["(not read by plan)"]}}
            cfg = validate_config(deep_merge(raw, parse_overrides(set_)))
        else:
            raise ConfigError("give --config or --model")
        result = plan_run(cfg, name_or_path=resolve_model_path(model or cfg.model.name_or_path), device=device,
                          gpus=gpus, parallel=parallel, gpu_gib=gpu_gb)  # fmt: skip
    except (*user_errors(), OSError) as exc:
        fail(exc, debug)
    if as_json:
        import json

        sys.stdout.write(json.dumps({"model_type": result.model_type, "params": result.params, "bytes": result.bytes,
                                     "total": result.total, "notes": result.notes, "gpus": result.gpus,
                                     "parallel": result.parallel, "per_gpu_total": result.total, "fits": result.fits,
                                     "communication_bytes_per_step": result.communication_bytes_per_step,
                                     "offload": dataclasses.asdict(result.offload) if result.offload else None})
                         + "\n")  # fmt: skip
    else:
        render_plan(result, console)


def render_plan(plan, console) -> None:
    from rich.table import Table

    title = f"{plan.model_type}: {plan.params / 1e9:.2f}B parameters"
    if plan.gpus > 1 or plan.parallel == "fsdp":
        title += f", per GPU ({plan.parallel} over {plan.gpus} GPU{'s' if plan.gpus > 1 else ''})"
    table = Table(title=title)
    table.add_column("kind")
    table.add_column("MiB", justify="right")
    table.add_column("GiB", justify="right")
    for kind, n in [*plan.bytes.items(), ("total", plan.total)]:
        table.add_row(kind, f"{n / 2**20:,.1f}", f"{n / 2**30:,.2f}")
    console.print(table)
    for note in plan.notes:
        console.print(note, highlight=False)


def plot_cmd(
    run: str = typer.Argument(..., help="a run's output.dir (or its metrics.jsonl)"),
    out: str = typer.Option(None, "--out", "-o", help="folder for the PNGs (default: RUN/plots)"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """PNGs of a run's metrics: loss and eval loss, lr, grad norm, router load per layer; reward, KL and
    completion length for GRPO."""
    from moe_qlora.cli.plots import PlotError, plot_run

    try:
        written = plot_run(run, out)
    except PlotError as exc:
        fail(exc, debug)
    for path in written:
        console.print(str(path), highlight=False)
