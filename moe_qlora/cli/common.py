"""What every command shares: the consoles, library chatter silenced, the user errors that print one sentence."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import typer
from rich.console import Console

console = Console(soft_wrap=not sys.stdout.isatty())  # log files get whole lines, never wrapped paths
err_console = Console(stderr=True)


def quiet_libraries() -> None:
    """Library chatter that says nothing to a user of this tool (progress bars we replace, hub fallbacks)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # `datasets` reads these when it is imported, which only the commands that read rows do (plan, export and
    # merge never pay its import: 0.4 s after torch's)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
        sys.modules["datasets"].logging.set_verbosity_error()


def user_errors() -> tuple[type[Exception], ...]:
    from moe_qlora.common.fileio import UnwritableError
    from moe_qlora.common.lock import RunDirLocked
    from moe_qlora.config.sections import ConfigError
    from moe_qlora.data.sources import DataError
    from moe_qlora.export.norms import AdapterReadError
    from moe_qlora.model.distributed import RankFailed
    from moe_qlora.model.loading import ModelLoadError
    from moe_qlora.model.peft_adapter import AdapterMismatchError
    from moe_qlora.moe.expert_stacks import UnsupportedExpertsError
    from moe_qlora.moe.nf4 import QuantizationLayoutError
    from moe_qlora.train.checkpoint import CheckpointError
    from moe_qlora.train.rewards import RewardError

    return (
        AdapterMismatchError,
        CheckpointError,
        ConfigError,
        DataError,
        AdapterReadError,
        ModelLoadError,
        UnsupportedExpertsError,
        QuantizationLayoutError,
        RewardError,
        FileNotFoundError,
        RankFailed,
        RunDirLocked,
        UnwritableError,
    )


def show_traceback(exc: BaseException, debug: bool) -> None:
    """With --debug, the traceback of `exc` on stderr, before its one sentence: the exit code stays the one the
    error has (2 for a user's error, 1 for a failed run), so a script that checks it reads the same with or
    without --debug."""
    if debug:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)


def fail(exc: Exception, debug: bool, code: int = 2) -> None:
    """Print `exc` as one red sentence (after its traceback with --debug) and exit with `code`."""
    show_traceback(exc, debug)
    from rich.markup import escape  # a message may hold [a,b] (a --set list), which rich would read as a style

    err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
