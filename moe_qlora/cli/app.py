"""Command line: `moe-qlora train`, `grpo`, `plan`, `check-norms`, `plot`, `export`, `merge`, `generate`.

A user error (bad config, bad data, missing model, unreadable adapter) prints one sentence and exits 2; an
aborted run, or an adapter that would not load as trained, exits 1. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
console = Console(soft_wrap=not sys.stdout.isatty())  # log files get whole lines, never wrapped paths
err_console = Console(stderr=True)

TRAIN_EPILOG = """Examples:

  moe-qlora train --config configs/demo.yaml

  moe-qlora train --config cfg.yaml --set train.lr=2e-4 --set lora.rank=16

  moe-qlora train --config cfg.yaml --dry-run     # print the resolved config and stop
"""


def _quiet_libraries() -> None:
    """Library chatter that says nothing to a user of this tool (progress bars we replace, hub fallbacks)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def _user_errors() -> tuple[type[Exception], ...]:
    from moe_qlora.config.schema import ConfigError
    from moe_qlora.data.sources import DataError
    from moe_qlora.export.adapter import AdapterMismatchError
    from moe_qlora.export.norms import AdapterReadError
    from moe_qlora.model.distributed import RankFailed
    from moe_qlora.model.loading import ModelLoadError
    from moe_qlora.moe.experts import UnsupportedExpertsError
    from moe_qlora.moe.nf4 import QuantizationLayoutError
    from moe_qlora.train.checkpoint import CheckpointError
    from moe_qlora.train.rewards import RewardError

    return (
        AdapterMismatchError, CheckpointError, ConfigError, DataError, AdapterReadError, ModelLoadError,
        UnsupportedExpertsError, QuantizationLayoutError, RewardError, FileNotFoundError, RankFailed,
    )  # fmt: skip


def _fail(exc: Exception, debug: bool, code: int = 2) -> None:
    if debug:
        raise exc
    err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@app.command(epilog=TRAIN_EPILOG)
def train(
    config: str = typer.Option(..., "--config", "-c", help="YAML run configuration"),
    set_: list[str] = typer.Option([], "--set", help="override a key, e.g. --set train.lr=2e-4 (repeatable)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved configuration and exit"),
    resume: bool = typer.Option(
        False, "--resume", help="continue from the newest valid checkpoint in output.dir (--resume PATH: from that one)"
    ),
    resume_from: str = typer.Option(None, "--resume-from", hidden=True),
    resume_anyway: bool = typer.Option(
        False, "--resume-anyway", help="resume even if the config or the dataset changed since the checkpoint"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="output.dir holds another run: move it aside to <dir>.old-<time> and start over"
    ),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Fine-tune a MoE model with QLoRA (experts frozen in NF4, per-expert LoRA)."""
    _run("train", config, set_, dry_run=dry_run, resume=resume, resume_from=resume_from, resume_anyway=resume_anyway,
         overwrite=overwrite, debug=debug)  # fmt: skip


def check_paths_before_loading(cfg) -> None:
    """What would otherwise fail after seconds of imports or minutes of loading: a hub id neither cached nor
    reachable, data files that are not there, an output.dir that is a file or cannot be written. Raises
    ConfigError naming the model or the absolute path."""
    from moe_qlora.common.hub import check_hub_model
    from moe_qlora.config.schema import ConfigError

    name = cfg.model.name_or_path
    local = os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)
    if not local and not name.startswith("builtin:"):
        check_hub_model(name, ConfigError)
    from moe_qlora.common.hub import looks_local
    from moe_qlora.data.sources import entry_path

    for key in ("train_files", "eval_files"):
        for f in map(entry_path, getattr(cfg.data, key)):
            if looks_local(f) and not Path(f).exists():
                raise ConfigError(f"data.{key}: {f}: no such file (relative paths are relative to the config)")
    from moe_qlora.common.reporting import missing_reporters

    if missing := missing_reporters(cfg.output.report_to):
        raise ConfigError(missing[0])
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file, not a folder")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output.dir: {out} cannot be written ({existing} is not writable by this user)")


def _run(command: str, config: str, overrides: list[str], *, dry_run, resume, resume_from, resume_anyway, overwrite,
         debug) -> None:  # fmt: skip
    """Load and validate the config, then print it (--dry-run) or run `train` or `grpo` on it, turning
    user errors into one sentence and exit code 2, an aborted run into exit code 1, and a run stopped by
    SIGINT / SIGTERM into 130 / 143 with the command that resumes it."""
    from moe_qlora.config.schema import (  # light: config errors come back before torch is imported
        ConfigError,
        check_shardable,
        load_config,
    )

    resumes = []
    if resume_from:
        resumes = [f"train.resume={os.path.abspath(resume_from)}"]
    elif resume or resume_anyway:
        resumes = ["train.resume=auto"]
    try:
        cfg = load_config(config, [*overrides, *resumes])
        if command == "grpo" and cfg.grpo is None:
            raise ConfigError(f"{config}: no `grpo:` section; moe-qlora grpo needs at least grpo.rewards")
        if cfg.train.parallel == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            check_shardable(cfg, generates=command == "grpo")
        check_paths_before_loading(cfg)
    except ConfigError as exc:  # (its subclasses too) before the heavy imports _user_errors makes
        _fail(exc, debug)
    _quiet_libraries()
    if dry_run:
        import yaml

        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), highlight=False)
        return
    from moe_qlora.common.fileio import DiskFullError
    from moe_qlora.export.adapter import AdapterVerificationError
    from moe_qlora.train.faults import StepFailed
    from moe_qlora.train.runs import RunInterrupted
    from moe_qlora.train.session import TrainingAborted

    if command == "grpo":
        from moe_qlora.train.grpo import grpo as run
    else:
        from moe_qlora.train.sft import train as run
    try:
        run(cfg, console, allow_mismatch=resume_anyway, overwrite=overwrite)
    except _user_errors() as exc:
        _fail(exc, debug)
    except (TrainingAborted, AdapterVerificationError) as exc:
        _fail(exc, debug, code=1)
    except StepFailed as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {exc}\nresume with: {resume_command(command, config, overrides)}",
                          highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(1) from None
    except DiskFullError as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {exc}. {last_good_checkpoint(cfg)}; free some space, then resume "
                          f"with: {resume_command(command, config, overrides)}", highlight=False,
                          soft_wrap=True)  # fmt: skip
        raise typer.Exit(1) from None
    except RunInterrupted as exc:
        again = resume_command(command, config, overrides)
        saved = f"checkpoint written; resume with: {again}" if exc.step else "no step was done yet; nothing to save"
        err_console.print(f"interrupted at step {exc.step}; {saved}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("stopped at once (second signal): nothing written since the last checkpoint",
                          highlight=False)  # fmt: skip
        raise typer.Exit(130) from None


def resume_command(command: str, config: str, overrides: list[str]) -> str:
    return " ".join(["moe-qlora", command, "--config", config, *(f"--set {o}" for o in overrides), "--resume"])


def last_good_checkpoint(cfg) -> str:
    """Where a run that stopped on a fault can resume from: its newest valid checkpoint, said in a sentence."""
    from moe_qlora.train.checkpoint import latest_valid_checkpoint

    found = latest_valid_checkpoint(Path(cfg.output.dir))
    if found is None:
        return "No checkpoint was written yet (the run starts over)"
    return f"The last good checkpoint, {found}, is intact"


GRPO_EPILOG = """Examples:

  moe-qlora grpo --config configs/grpo-demo.yaml

  moe-qlora grpo --config cfg.yaml --set grpo.group_size=8 --set grpo.kl_coef=0.04

  moe-qlora grpo --config cfg.yaml --set grpo.offline_file=scored.jsonl   # completions generated elsewhere
"""


@app.command(epilog=GRPO_EPILOG)
def grpo(
    config: str = typer.Option(..., "--config", "-c", help="YAML run configuration with a grpo: section"),
    set_: list[str] = typer.Option([], "--set", help="override a key, e.g. --set grpo.group_size=8 (repeatable)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved configuration and exit"),
    resume: bool = typer.Option(
        False, "--resume", help="continue from the newest valid checkpoint in output.dir (--resume PATH: from that one)"
    ),
    resume_from: str = typer.Option(None, "--resume-from", hidden=True),
    resume_anyway: bool = typer.Option(
        False, "--resume-anyway", help="resume even if the config or the prompts changed since the checkpoint"
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="output.dir holds another run: move it aside to <dir>.old-<time> and start over"
    ),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Online GRPO on the 4-bit model: sample groups, score them with reward functions, train on advantages."""
    _run("grpo", config, set_, dry_run=dry_run, resume=resume, resume_from=resume_from, resume_anyway=resume_anyway,
         overwrite=overwrite, debug=debug)  # fmt: skip


PLAN_EPILOG = """Examples:

  moe-qlora plan --model configs/models/qwen3-30b-a3b --set data.max_seq_len=4096 --set lora.rank=16

  moe-qlora plan --config cfg.yaml --device cpu

  moe-qlora plan --model configs/models/deepseek-v2 --gpus 8 --parallel fsdp   # per GPU, and traffic per step
"""


@app.command(epilog=PLAN_EPILOG)
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
    _quiet_libraries()
    from moe_qlora.config.schema import ConfigError, deep_merge, load_config, parse_overrides, validate_config
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
    except (*_user_errors(), OSError) as exc:
        _fail(exc, debug)
    if as_json:
        import json

        sys.stdout.write(json.dumps({"model_type": result.model_type, "params": result.params, "bytes": result.bytes,
                                     "total": result.total, "notes": result.notes, "gpus": result.gpus,
                                     "parallel": result.parallel, "per_gpu_total": result.total, "fits": result.fits,
                                     "communication_bytes_per_step": result.communication_bytes_per_step})
                         + "\n")  # fmt: skip
    else:
        render_plan(result, console)


@app.command("check-norms")
def check_norms_cmd(
    adapter: str = typer.Argument(..., help="adapter_model.safetensors, or the folder holding it"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (every row) instead of a table"),
    per_expert: bool = typer.Option(False, "--per-expert", help="one row per expert instead of per module"),
    run: str = typer.Option(
        None,
        "--run",
        help="the run's output.dir: cross-check experts with its router load "
        "(default: the adapter's parent folder, when it holds a run)",
    ),  # fmt: skip
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Norms of every LoRA factor, summarised per module and layer over experts (--per-expert: every one);
    with a run's router load, experts never routed or routed but never trained are named. Exit 0 healthy,
    1 problems, 2 unreadable."""
    from moe_qlora.export.norms import (
        ROUTER_LAYERS,
        AdapterReadError,
        check_norms,
        cross_check_router,
        render_summary,
        render_table,
        report_json,
    )

    try:
        report = check_norms(adapter)
        parent = Path(adapter).resolve().parent if Path(adapter).is_dir() else Path(adapter).resolve().parent.parent
        run = run or (str(parent) if (parent / ROUTER_LAYERS).is_file() else None)
        steps = cross_check_router(report, run) if run else None
    except AdapterReadError as exc:
        _fail(exc, debug)
    if steps is not None and not as_json:
        console.print(f"router load: {steps} logged steps of {run}", highlight=False)
    if as_json:
        sys.stdout.write(report_json(report) + "\n")
    else:
        (render_table if per_expert else render_summary)(report, console)
    raise typer.Exit(0 if report.healthy else 1)


@app.command("plot")
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
        _fail(exc, debug)
    for path in written:
        console.print(str(path), highlight=False)


EXPORT_EPILOG = """Examples:

  moe-qlora export runs/demo/adapter --format gguf --out runs/demo/adapter.gguf

  moe-qlora export runs/demo/adapter --format per-expert --out runs/demo/adapter-per-expert
"""


@app.command(epilog=EXPORT_EPILOG)
def export(
    adapter: str = typer.Argument(..., help="the adapter folder a run wrote (PEFT format)"),
    fmt: str = typer.Option(..., "--format", "-f", help="per-expert (vLLM, SGLang) | gguf (llama.cpp)"),
    out: str = typer.Option(..., "--out", "-o", help="folder (per-expert) or .gguf file to write"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """The adapter in the layout another runtime reads: per-expert PEFT keys, or a llama.cpp LoRA GGUF."""
    _quiet_libraries()
    from moe_qlora.export.formats import write_gguf, write_per_expert

    writers = {"per-expert": write_per_expert, "gguf": write_gguf}
    try:
        if fmt not in writers:
            from moe_qlora.config.schema import ConfigError

            raise ConfigError(
                f"--format {fmt!r}: expected one of {', '.join(writers)} (the run's adapter is already PEFT)"
            )
        path = writers[fmt](adapter, out)
    except _user_errors() as exc:
        _fail(exc, debug)
    console.print(f"{fmt}: {path}", highlight=False)


MERGE_EPILOG = """Examples:

  moe-qlora merge runs/demo/adapter --out runs/demo/merged

  moe-qlora merge runs/demo/adapter --out merged --dtype float32 --max-shard-size 2GB
"""


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / bytes -> bytes."""
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "kb": 10**3, "b": 1}
    low = text.strip().lower()
    for unit, factor in units.items():
        if low.endswith(unit) and low[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(low[: -len(unit)]) * factor)
    if low.isdigit():
        return int(low)
    from moe_qlora.config.schema import ConfigError

    raise ConfigError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@app.command(epilog=MERGE_EPILOG)
def merge(
    adapter: str = typer.Argument(..., help="the adapter folder a run wrote (PEFT format)"),
    out: str = typer.Option(..., "--out", "-o", help="folder to write the merged checkpoint to"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors shard"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (where the 4-bit model is decoded)"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """A full Hugging Face checkpoint: every 4-bit weight dequantized plus its LoRA update (never into 4-bit)."""
    _quiet_libraries()
    from moe_qlora.inference.merge import MergeError, merge_adapter

    try:
        report = merge_adapter(adapter, out, dtype=dtype, max_shard_bytes=parse_size(max_shard_size),
                               device=device, console=err_console)  # fmt: skip
    except (*_user_errors(), MergeError) as exc:
        _fail(exc, debug)
    experts = sum(len(v) for v in report.delta_norms.values() if len(v) > 1)
    console.print(
        f"merged {len(report.delta_norms)} adapted weights ({experts} expert deltas) into {report.tensors} tensors: "
        f"{report.out} ({report.shards} shard{'s' * (report.shards > 1)}, {human_bytes(report.bytes)}, {dtype})",
        highlight=False,
    )


GENERATE_EPILOG = """Examples:

  moe-qlora generate --adapter runs/demo/adapter "Add: 3+5"

  moe-qlora generate --adapter runs/demo/adapter --no-adapter "Add: 3+5"     # the base model, to compare

  moe-qlora generate --adapter runs/chat/adapter --chat --temperature 0.7 "Hello"
"""


@app.command("generate", epilog=GENERATE_EPILOG)
def generate_cmd(
    prompt: str = typer.Argument(..., help="the prompt (with --chat: the user message)"),
    adapter: str = typer.Option(..., "--adapter", "-a", help="the adapter folder a run wrote"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0: greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0, help="0: off"),
    seed: int = typer.Option(0, "--seed"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the tokenizer's chat template"),
    no_adapter: bool = typer.Option(False, "--no-adapter", help="generate with the base model (adapters off)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Generate with the 4-bit model and a run's adapter (as trained), streaming the tokens."""
    _quiet_libraries()
    from moe_qlora.inference.generate import Sampling, generate, load_for_generation

    try:
        model, tokenizer = load_for_generation(adapter, err_console, device=device)
    except _user_errors() as exc:
        _fail(exc, debug)
    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    generate(model, tokenizer, prompt, sampling, chat=chat, adapter=not no_adapter)
    console.print()


def _version(value: bool) -> None:
    if value:
        from moe_qlora import __version__

        console.print(f"moe-qlora {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
):
    """QLoRA fine-tuning of Mixture-of-Experts LLMs with every expert frozen in NF4."""


def with_resume_path(argv: list[str]) -> list[str]:
    """`--resume PATH` (a value that is not an option) becomes `--resume-from PATH`; `--resume` alone stays
    the flag: newest valid checkpoint."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--resume" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            out += ["--resume-from", argv[i + 1]]
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main() -> None:
    """The console entry point. A full disk in any command (export, merge, plot, ...; train and grpo also name
    their last checkpoint) is one sentence and exit code 1, its traceback only with --debug."""
    from moe_qlora.common.fileio import DiskFullError

    try:
        app(args=with_resume_path(sys.argv[1:]), prog_name="moe-qlora")
    except DiskFullError as exc:
        if "--debug" in sys.argv:
            raise
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()


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
