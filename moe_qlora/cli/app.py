"""Command line: `moe-qlora train`, `grpo`, `dpo`, `plan`, `check-norms`, `plot`, `export`, `merge`, `generate`,
`verify`.

A user error (bad config, bad data, missing model, unreadable adapter) prints one sentence and exits 2; an
aborted run, or an adapter that would not load as trained, exits 1. `--debug` shows the traceback too.
"""

from __future__ import annotations

import sys

import typer

from moe_qlora.cli import adapter, generate, plan_plot, run, verify
from moe_qlora.cli.common import console, err_console, show_traceback

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
app.command(epilog=run.TRAIN_EPILOG)(run.train)
app.command(epilog=run.GRPO_EPILOG)(run.grpo)
app.command(epilog=run.DPO_EPILOG)(run.dpo)
app.command(epilog=plan_plot.PLAN_EPILOG)(plan_plot.plan)
app.command("check-norms")(adapter.check_norms_cmd)
app.command("plot")(plan_plot.plot_cmd)
app.command(epilog=adapter.EXPORT_EPILOG)(adapter.export)
app.command(epilog=adapter.MERGE_EPILOG)(adapter.merge)
app.command("generate", epilog=generate.GENERATE_EPILOG)(generate.generate_cmd)
app.command("verify", epilog=verify.VERIFY_EPILOG)(verify.verify_cmd)


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


def entry_point() -> None:
    """`moe-qlora` and `python -m moe_qlora`: main(), then the process ends without the interpreter's
    finalization, having done what an exit observably does (common/process_exit.py: a gloo rank could abort in
    it, and it costs about a second)."""
    from moe_qlora.common.process_exit import exit_without_finalizing

    try:
        main()
    except SystemExit as exc:
        exit_without_finalizing(exit_status(exc.code))
    exit_without_finalizing(0)


def main() -> None:
    """The command line, run in this interpreter (SystemExit carries its status). A full disk in any command
    (export, merge, plot, ...; train and grpo also name their last checkpoint) is one sentence and exit code 1; a
    folder the filesystem will not let it write (no permission, read-only, a file in the way) one sentence and
    exit code 2; tracebacks only with --debug."""
    from moe_qlora.common.cpu_threads import choose_cpu_threads
    from moe_qlora.common.cuda_allocator import choose_cuda_allocator
    from moe_qlora.common.fileio import DiskFullError, UnwritableError

    choose_cuda_allocator()  # before CUDA allocates: expandable segments, unless the user set the allocator
    chosen = choose_cpu_threads()  # before torch is imported: OpenMP reads it once
    if chosen is not None and chosen.passive:
        err_console.print(
            f"note: this machine is busy (load {chosen.busy:.1f} on {chosen.cores} cores): torch computes with "
            f"{chosen.threads} thread{'s' * (chosen.threads > 1)} (set OMP_NUM_THREADS to choose)",
            highlight=False,
        )
    try:
        app(args=with_resume_path(sys.argv[1:]), prog_name="moe-qlora")
    except (DiskFullError, UnwritableError) as exc:
        show_traceback(exc, "--debug" in sys.argv)
        from rich.markup import escape

        err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(1 if isinstance(exc, DiskFullError) else 2)


def exit_status(code: object) -> int:
    """The status the interpreter would exit with for SystemExit(code): None is 0, an int itself, anything else
    printed to stderr and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
