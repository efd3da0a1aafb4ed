"""What a user does with a trained adapter: `check-norms`, `export` (GGUF, per-expert), `merge`, `generate`."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import typer

from moe_qlora.cli.common import console, err_console, fail, quiet_libraries, user_errors
from moe_qlora.common.lock import run_lock_for


def check_norms_cmd(
    adapter: str = typer.Argument(..., help="adapter_model.safetensors, or the folder holding it"),
    as_json: bool = typer.Option(False, "--json", help="print JSON (every row) instead of a table"),
    per_expert: bool = typer.Option(False, "--per-expert", help="one row per expert instead of per module"),
    run: str = typer.Option(
        None,
        "--run",
        help="the run's output.dir: cross-check experts with its router load "
        "(default: the adapter's parent folder, when it holds a run)",
    ),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Norms of every LoRA factor, summarised per module and layer over experts (--per-expert: every one);
    with a run's router load, experts never routed or routed but never trained are named. Exit 0 healthy,
    1 problems, 2 unreadable."""
    from moe_qlora.export.norms import AdapterReadError, check_norms, render_summary, render_table, report_json
    from moe_qlora.export.router_check import cross_check_router, run_of

    try:
        report = check_norms(adapter)
        run = run or run_of(adapter)
        steps = cross_check_router(report, run) if run else None
    except AdapterReadError as exc:
        fail(exc, debug)
    if steps is not None and not as_json:
        checked = (
            f"{report.router_rows_checked} expert rows checked"
            if report.router_rows_checked
            else "no expert module of this adapter is among its router layers: not cross-checked"
        )
        console.print(f"router load: {steps} logged steps of {run}; {checked}", highlight=False)
    if as_json:
        sys.stdout.write(report_json(report) + "\n")
    else:
        (render_table if per_expert else render_summary)(report, console)
    raise typer.Exit(0 if report.healthy else 1)


EXPORT_EPILOG = """Examples:

  moe-qlora export runs/demo/adapter --format gguf      # writes runs/demo/adapter.gguf

  moe-qlora export runs/demo/adapter --format vllm --out served/demo-lora --force     # replace what is there
"""
# --out by default: beside the adapter folder, named after it (runs/demo/adapter -> runs/demo/adapter.gguf).
DEFAULT_OUT_SUFFIX = {"gguf": ".gguf", "vllm": "-vllm", "per-expert": "-per-expert"}


def default_export_path(adapter: str, fmt: str) -> Path:
    """Where `export` writes without --out: beside the adapter folder, named after it with the format's suffix."""
    folder = Path(adapter).resolve()
    return folder.with_name(folder.name + DEFAULT_OUT_SUFFIX[fmt])


def check_output_target(adapter: str, out: Path, kind: str, force: bool, *, writer: str) -> None:
    """What export and merge write to `out` (a `kind`: file or folder) replaces what is there only with --force;
    never the adapter itself, a folder holding it, or a target of the other kind, even with it. An empty folder is
    written into as it is. Then `out` is checked writable, before minutes of work."""
    from moe_qlora.common.fileio import check_writable
    from moe_qlora.config.sections import ConfigError

    target, source = out.resolve(), Path(adapter).resolve()
    if target == source:
        raise ConfigError(f"{out} is the adapter folder itself; give --out another path")
    if target in source.parents:
        raise ConfigError(f"{out} holds the adapter {adapter}: writing there would replace it; give --out another path")
    if out.exists() and out.is_dir() != (kind == "folder"):
        raise ConfigError(
            f"{out} is a {'folder' if out.is_dir() else 'file'}, and {writer} writes a {kind}; give --out another path"
        )
    if out.exists() and (out.is_file() or any(out.iterdir())) and not force:
        what = "already exists" if out.is_file() else "is a folder that is not empty"
        raise ConfigError(
            f"{out} {what}; pass --force to replace it (the new one is written beside it, then renamed over it)"
        )
    check_writable(out)


def export(
    adapter: str = typer.Argument(..., help="the adapter folder a run wrote (PEFT format)"),
    fmt: str = typer.Option(
        ..., "--format", "-f", help="vllm (the layout vLLM loads for the family) | per-expert | gguf (llama.cpp)"
    ),
    out: str = typer.Option(
        None,
        "--out",
        "-o",
        help="folder (vllm, per-expert) or .gguf file to write (default: beside ADAPTER, named ADAPTER.gguf, "
        "ADAPTER-vllm or ADAPTER-per-expert)",
    ),
    force: bool = typer.Option(False, "--force", help="replace what --out names (atomically: written, then renamed)"),
    fuse_gate_up_exps: bool = typer.Option(
        False, "--fuse-gate-up-exps", help="gguf: for a base converted with llama.cpp's --fuse-gate-up-exps"
    ),
    fuse_qkv: bool = typer.Option(False, "--fuse-qkv", help="gguf: for a base converted with llama.cpp's --fuse-qkv"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """The adapter in the layout another runtime reads: per-expert PEFT keys, or a llama.cpp LoRA GGUF."""
    quiet_libraries()
    from functools import partial

    from moe_qlora.config.sections import ConfigError
    from moe_qlora.export.writers import WRITERS

    writers = {**WRITERS, "gguf": partial(WRITERS["gguf"], fuse_gate_up_exps=fuse_gate_up_exps, fuse_qkv=fuse_qkv)}
    try:
        if fmt not in writers:
            raise ConfigError(
                f"--format {fmt!r}: expected one of {', '.join(writers)} (the run's adapter is already PEFT)"
            )
        for flag, on in (("--fuse-gate-up-exps", fuse_gate_up_exps), ("--fuse-qkv", fuse_qkv)):
            if on and fmt != "gguf":
                raise ConfigError(f"{flag} names llama.cpp's tensors: it goes with --format gguf, not {fmt}")
        target = Path(out) if out else default_export_path(adapter, fmt)
        check_output_target(adapter, target, "file" if fmt == "gguf" else "folder", force, writer=f"--format {fmt}")
        with run_lock_for(target) or nullcontext():  # beside a live run's adapter: refused, nothing written
            path = writers[fmt](adapter, target)
    except user_errors() as exc:
        fail(exc, debug)
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
    from moe_qlora.config.sections import ConfigError

    raise ConfigError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")


def human_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def merge(
    adapter: str = typer.Argument(..., help="the adapter folder a run wrote (PEFT format)"),
    out: str = typer.Option(..., "--out", "-o", help="folder to write the merged checkpoint to"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors shard"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (where the 4-bit model is decoded)"),
    force: bool = typer.Option(False, "--force", help="replace what --out holds (atomically: written, then renamed)"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """A full Hugging Face checkpoint: every 4-bit weight dequantized plus its LoRA update (never into 4-bit)."""
    quiet_libraries()
    from moe_qlora.inference.merge import MergeError, merge_adapter

    try:
        check_output_target(
            adapter, Path(out), "folder", force, writer="merge"
        )  # before minutes of loading and merging
        with run_lock_for(out) or nullcontext():  # into a live run's folder: refused before any loading
            report = merge_adapter(
                adapter,
                out,
                dtype=dtype,
                max_shard_bytes=parse_size(max_shard_size),
                device=device,
                console=err_console,
            )
    except (*user_errors(), MergeError) as exc:
        fail(exc, debug)
    experts = sum(len(v) for v in report.delta_norms.values() if len(v) > 1)
    console.print(
        f"merged {len(report.delta_norms)} adapted weights ({experts} expert deltas) into {report.tensors} tensors: "
        f"{report.out} ({report.shards} shard{'s' * (report.shards > 1)}, {human_bytes(report.bytes)}, {dtype})",
        highlight=False,
    )
