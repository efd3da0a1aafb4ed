"""`moe-qlora plan` (will a run fit, before it starts) and `plot` (a run's metrics as PNGs)."""

from __future__ import annotations

import dataclasses
import math
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
        None,
        "--parallel",
        help="auto, ddp, fsdp or ep (default: train.parallel); auto: ddp if the run fits one GPU, else fsdp or ep, "
        "whichever fits and sends fewer bytes",
    ),
    gpu_gb: float = typer.Option(
        80.0,
        "--gpu-gb",
        min=0.0,
        help="memory of one GPU in GiB (2^30 bytes); exit 1 when the run does not fit it. From 80 the GPU is planned "
        "as an H100 (MoE kernels: grouped_mm), below as a 24-48 GB card (Triton)",
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    longest: bool = typer.Option(
        False, "--longest", help="the longest data.max_seq_len that fits --gpu-gb, the rest of the config as it is"
    ),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Memory a run needs, by kind, from the model's config.json alone (no weights are read); with --gpus, one
    GPU's share under ddp or fsdp and the bytes each GPU sends per optimizer step. Says whether it fits one GPU of
    --gpu-gb GiB and, when not, the settings of largest planned saving that make it fit (exit code 1)."""
    from moe_qlora.config.sections import ConfigError

    try:
        cfg = plan_config(config, model, set_)
        check_hub_config(model or cfg.model.name_or_path)
    except ConfigError as exc:  # before the heavy imports of plan and of user_errors(): at once
        fail(exc, debug)
    quiet_libraries()
    try:
        from moe_qlora.model.budget import capability_for_memory
        from moe_qlora.model.model_path import resolve_model_path
        from moe_qlora.model.plan import PARALLEL_MODES, plan_run

        if parallel is not None and parallel not in PARALLEL_MODES:
            raise ConfigError(f"--parallel {parallel}: give one of {', '.join(PARALLEL_MODES)}")
        name_or_path = resolve_model_path(model or cfg.model.name_or_path)
        if longest:
            return print_longest(cfg, name_or_path, device, gpu_gb, gpus=gpus, parallel=parallel)
        result = plan_run(
            cfg,
            name_or_path=name_or_path,
            device=device,
            gpus=gpus,
            parallel=parallel,
            gpu_gib=gpu_gb,
            capability=capability_for_memory(gpu_gb),
        )
    except (*user_errors(), OSError) as exc:
        fail(exc, debug)
    to_fit = None
    if not result.fits:
        from moe_qlora.model.fitting import settings_to_fit

        to_fit = settings_to_fit(cfg, name_or_path, device, gpu_gib=gpu_gb, gpus=gpus, parallel=parallel)
    if as_json:
        print_plan_json(result, gpu_gb, to_fit)
    else:
        render_plan(result, console)
        console.print(fit_verdict(result, gpu_gb, to_fit), highlight=False)
    if not result.fits:
        raise typer.Exit(1)


def print_longest(cfg, name_or_path: str, device: str, gpu_gb: float, **plan_args) -> None:
    """plan --longest: the longest data.max_seq_len that fits (exit 0), or that none does (exit 1); a length past
    the model's positions said too."""
    from moe_qlora.model.attention import position_limit_note
    from moe_qlora.model.budget import meta_model
    from moe_qlora.model.fitting import LONGEST_STEP, longest_seq_len

    found = longest_seq_len(cfg, name_or_path, device, gpu_gib=gpu_gb, **plan_args)
    if found is None:
        console.print(f"not even data.max_seq_len={LONGEST_STEP} fits a {gpu_gb:g} GiB GPU with this config")
        raise typer.Exit(1)
    seq_len, total = found
    console.print(
        f"longest data.max_seq_len that fits a {gpu_gb:g} GiB GPU: {seq_len:,} tokens ({total:,.2f} GiB planned, "
        f"micro-batch {cfg.train.micro_batch_size}; --set data.max_seq_len={seq_len})",
        highlight=False,
    )
    model = meta_model(name_or_path, cfg.model.trust_remote_code)
    if helped := autos_taken(cfg, seq_len, name_or_path, device, model, gpu_gb, **plan_args):
        console.print(f"note: {helped}", highlight=False)
    if note := position_limit_note(model.config, seq_len):
        console.print(f"note: {note}", highlight=False)


def autos_taken(cfg, seq_len: int, name_or_path: str, device: str, model, gpu_gb: float, **plan_args) -> str | None:
    """What train.mlp_chunk_tokens and train.offload_activations come to at `seq_len` (plan.plan_with_autos), with
    the host memory an offload takes; None when neither is on."""
    from moe_qlora.model.plan import plan_run

    longest = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_seq_len": seq_len})})
    plan = plan_run(longest, name_or_path=name_or_path, device=device, model=model, gpu_gib=gpu_gb, **plan_args)
    said = []
    if plan.mlp_chunk_tokens:
        said.append(f"the MoE rows {plan.mlp_chunk_tokens:,} tokens at a time (train.mlp_chunk_tokens)")
    if plan.offload_activations:
        host = plan.host_activation_bytes / 2**30
        said.append(f"the layer inputs in {host:,.2f} GiB of host memory (train.offload_activations)")
    return "at this length " + " and ".join(said) if said else None


def plan_config(config: str | None, model: str | None, overrides: list[str]):
    """The run config plan reads: --config with --set, or --model alone with --set."""
    from moe_qlora.config.load import deep_merge, load_config, parse_overrides, validate_config
    from moe_qlora.config.sections import ConfigError

    if config:
        return load_config(config, overrides)
    if model:
        raw = {"model": {"name_or_path": model}, "data": {"train_files": ["(not read by plan)"]}}
        return validate_config(deep_merge(raw, parse_overrides(overrides)))
    raise ConfigError("give --config or --model")


def check_hub_config(name: str) -> None:
    """A hub id must be cached or answered for: asked once, briefly; offline, one sentence (ConfigError) naming the
    model and the configs/models/ copy to give --model instead of transformers' retries and its own message."""
    from moe_qlora.common.hub import check_hub_model, config_only_advice, is_hub_model
    from moe_qlora.config.sections import ConfigError

    if is_hub_model(name):
        check_hub_model(name, ConfigError, config_only_advice(name, "plan"))


def print_plan_json(result, gpu_gb: float, to_fit: tuple[list[str], float] | None) -> None:
    import json

    fit = None if to_fit is None else {"settings": to_fit[0], "total_gib": to_fit[1]}
    sys.stdout.write(
        json.dumps(
            {
                "model_type": result.model_type,
                "params": result.params,
                "bytes": result.bytes,
                "total": result.total,
                "not_at_once": result.phases_apart,
                "notes": result.notes,
                "gpus": result.gpus,
                "parallel": result.parallel,
                "per_gpu_total": result.total,
                "gpu_gib": gpu_gb,
                "fits": result.fits,
                "to_fit": fit,
                "communication_bytes_per_step": result.communication_bytes_per_step,
                "mlp_chunk_tokens": result.mlp_chunk_tokens,
                "offload": dataclasses.asdict(result.offload) if result.offload else None,
            }
        )
        + "\n"
    )


def fit_verdict(result, gpu_gb: float, to_fit: tuple[list[str], float] | None) -> str:
    """'fits' with the room left, or 'does not fit' with the settings that would make it (settings_to_fit)."""
    total = result.total / 2**30
    per_gpu = " per GPU" if result.gpus > 1 or result.parallel != "ddp" else ""
    if result.fits:
        return f"fits: {total:,.2f} GiB{per_gpu} in a {gpu_gb:g} GiB GPU ({gpu_gb - total:,.2f} GiB to spare)"
    verdict = f"does not fit: {total:,.2f} GiB{per_gpu} is {total - gpu_gb:,.2f} GiB over a {gpu_gb:g} GiB GPU"
    if eager := result.bytes.get("eager_attention", 0):  # only where nothing better runs: the CPU, for sinks
        verdict += (
            f"\neager attention's score matrices are {eager / 2**30:,.2f} GiB of it: on a CUDA GPU this family "
            "runs flex attention, which builds none (moe-qlora plan --device cuda)"
        )
    settings, planned = to_fit or ([], float("nan"))
    flags = " ".join(f"--set {s}" for s in settings)
    if len(settings) == 1:
        return f"{verdict}\nto fit: {flags} (plan: {planned:,.2f} GiB), the largest planned saving that fits alone"
    if settings:
        return f"{verdict}\nto fit, together: {flags} (plan: {planned:,.2f} GiB), the largest planned savings"
    together = "" if math.isnan(planned) else f" (with all of them: {planned:,.2f} GiB)"
    return (
        f"{verdict}\nno setting plan knows of makes it fit{together}: a larger GPU, or more GPUs "
        "(--gpus N --parallel fsdp)"
    )


def render_plan(plan, console) -> None:
    from rich.table import Table

    title = f"{plan.model_type}: {plan.params / 1e9:.2f}B parameters"
    if plan.gpus > 1 or plan.parallel == "fsdp":
        title += f", per GPU ({plan.parallel} over {plan.gpus} GPU{'s' if plan.gpus > 1 else ''})"
    table = Table(title=title)
    table.add_column("kind")
    table.add_column("MiB", justify="right")
    table.add_column("GiB", justify="right")
    apart = [("not_at_once", -plan.phases_apart)] if plan.phases_apart else []
    for kind, n in [*plan.bytes.items(), *apart, ("total", plan.total)]:
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
