"""`moe-qlora train`, `grpo` and `dpo`: the config loaded and checked before any heavy import, the run, and what each
way it can stop prints (a user error, an aborted run, a failed step, a full disk, a signal) with its exit code."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from moe_qlora.cli.common import console, err_console, fail, quiet_libraries, show_traceback, user_errors

TRAIN_EPILOG = """Examples:

  moe-qlora train --config configs/demo.yaml

  moe-qlora train --config cfg.yaml --set train.lr=2e-4 --set lora.rank=16

  moe-qlora train --config cfg.yaml --dry-run     # print the resolved config and stop
"""


def run_command(command: str, summary: str, *, config_help: str, set_help: str, changed: str):
    """The typer command `moe-qlora <command>`: every training method takes the same options."""

    def run(
        config: str = typer.Option(..., "--config", "-c", help=config_help),
        set_: list[str] = typer.Option([], "--set", help=set_help),
        dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved configuration and exit"),
        resume: bool = typer.Option(
            False,
            "--resume",
            help="continue from the newest valid checkpoint in output.dir (--resume PATH: from that one)",
        ),
        resume_from: str = typer.Option(None, "--resume-from", hidden=True),
        resume_anyway: bool = typer.Option(
            False, "--resume-anyway", help=f"resume even if the config or {changed} changed since the checkpoint"
        ),
        overwrite: bool = typer.Option(
            False,
            "--overwrite",
            help="output.dir holds another run: move it aside to <dir>.old-<time> and start over",
        ),
        debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
    ):
        _run(
            command,
            config,
            set_,
            dry_run=dry_run,
            resume=resume,
            resume_from=resume_from,
            resume_anyway=resume_anyway,
            overwrite=overwrite,
            debug=debug,
        )

    run.__doc__, run.__name__ = summary, command
    return run


train = run_command(
    "train",
    "Fine-tune a MoE model with QLoRA (experts frozen in NF4, per-expert LoRA).",
    config_help="YAML run configuration",
    set_help="override a key, e.g. --set train.lr=2e-4 (repeatable)",
    changed="the dataset",
)


def check_paths_before_loading(cfg, *, hub: bool = True) -> None:
    """What would otherwise fail after seconds of imports or minutes of loading: a builtin model that does not
    exist, model.device cuda where torch has none, a hub id neither cached nor reachable (unless not `hub`:
    --dry-run reads no weights), data files that are not there, an output.dir that is a file or cannot be
    written. Raises ConfigError naming the model or the absolute path."""
    from moe_qlora.common.hub import check_hub_model
    from moe_qlora.config.sections import ConfigError
    from moe_qlora.model.tiny_families import unknown_builtin_model

    name = cfg.model.name_or_path
    if problem := unknown_builtin_model(name):
        raise ConfigError(problem)
    local = os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)
    if hub and not local and not name.startswith("builtin:"):
        check_hub_model(name, ConfigError)
    from moe_qlora.common.hub import looks_local
    from moe_qlora.data.sources import DataError, check_data_file, entry_path

    for key in ("train_files", "eval_files"):
        for f in map(entry_path, getattr(cfg.data, key)):
            if looks_local(f) and not Path(f).exists():
                raise ConfigError(f"data.{key}: {f}: no such file (relative paths are relative to the config)")
            try:
                if Path(f).is_file():
                    check_data_file(Path(f))
            except DataError as exc:
                raise ConfigError(f"data.{key}: {exc}") from None
    check_router_aux_loss(cfg, name if local else None)
    if cfg.model.device == "cuda":  # torch alone (about 2 s), not the seconds of the rest
        from moe_qlora.model.device_choice import policy_device

        policy_device(cfg.model)
    from moe_qlora.common.reporting import missing_reporters

    if missing := missing_reporters(cfg.output.report_to):
        raise ConfigError(missing[0])
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file, not a folder")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"output.dir: {out} cannot be written ({existing} is not writable by this user)")


def check_resume_before_loading(cfg, *, anyway: bool) -> None:
    """A resume from checkpoints all trained with another config (the run would refuse it once the model is
    loaded: minutes for a big one) is refused before any heavy import, with the keys that changed; --resume-anyway
    (and --dry-run, which resumes nothing) skips it."""
    from moe_qlora.config.sections import ConfigError
    from moe_qlora.train.run_identity import refused_config

    if anyway:
        return
    if problem := refused_config(Path(cfg.output.dir), cfg.train.resume, cfg.model_dump(mode="json")):
        refuse_if_in_use(Path(cfg.output.dir))  # a live run in the folder is said first, as the run would
        raise ConfigError(problem)


def refuse_if_in_use(out: Path) -> None:
    """ConfigError with the run lock's sentence when another live process holds `out` (nothing in it is changed);
    nothing where it is free or its filesystem cannot lock."""
    from moe_qlora.common.lock import LockUnsupported, RunDirLocked, RunLock
    from moe_qlora.config.sections import ConfigError

    try:
        RunLock.acquire(out).release()
    except RunDirLocked as exc:
        raise ConfigError(str(exc)) from None
    except LockUnsupported:
        pass


def check_router_aux_loss(cfg, folder: str | None) -> None:
    """train.router_aux_loss_coef on a family without an auxiliary loss, seen from the checkpoint's config.json
    (a local folder, or the hub cache's copy) before minutes of loading; the recipe checks it again on the model."""

    setting = cfg.train.router_aux_loss_coef
    name = cfg.model.name_or_path
    if setting == 0 or name.startswith("builtin:"):
        return
    from huggingface_hub import try_to_load_from_cache

    from moe_qlora.config.sections import ConfigError

    path = Path(folder) / "config.json" if folder else try_to_load_from_cache(name, "config.json")
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        return
    from transformers import AutoConfig  # its config classes' defaults, as the model will have them

    config = AutoConfig.from_pretrained(str(Path(path).parent), trust_remote_code=cfg.model.trust_remote_code)
    if not hasattr(config, "router_aux_loss_coef"):
        raise ConfigError(
            f"train.router_aux_loss_coef: {setting}, but {config.model_type} defines no router auxiliary "
            "(load-balancing) loss to train on; set it to 0"
        )


def _run(
    command: str, config: str, overrides: list[str], *, dry_run, resume, resume_from, resume_anyway, overwrite, debug
) -> None:
    """Load and validate the config, then print it (--dry-run) or run `train` or `grpo` on it, turning
    user errors into one sentence and exit code 2, an aborted run into exit code 1, and a run stopped by
    SIGINT / SIGTERM into 130 / 143 with the command that resumes it."""
    from moe_qlora.config.load import load_config
    from moe_qlora.config.methods import check_method
    from moe_qlora.config.sections import ConfigError

    resumes = []
    if resume_from:
        resumes = [f"train.resume={os.path.abspath(resume_from)}"]
    elif resume or resume_anyway:
        resumes = ["train.resume=auto"]
    try:
        cfg = load_config(config, [*overrides, *resumes])
        check_method(command, cfg, world=int(os.environ.get("WORLD_SIZE", "1")), source=config)
        check_paths_before_loading(cfg, hub=not dry_run)
        check_resume_before_loading(cfg, anyway=resume_anyway or dry_run)
    except ConfigError as exc:  # (its subclasses too) before the heavy imports _user_errors makes
        fail(exc, debug)
    quiet_libraries()
    if dry_run:
        import yaml

        console.print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), highlight=False)
        from moe_qlora.common.hub import dry_run_note

        if note := dry_run_note(cfg.model.name_or_path):
            err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
        return
    from rich.markup import escape

    from moe_qlora.common.fileio import DiskFullError
    from moe_qlora.export.adapter import AdapterVerificationError
    from moe_qlora.train.faults import StepFailed
    from moe_qlora.train.runs import RunInterrupted
    from moe_qlora.train.update import TrainingAborted

    if command == "grpo":
        from moe_qlora.train.grpo import GrpoRecipe as Method
    elif command == "dpo":
        from moe_qlora.train.dpo import DpoRecipe as Method
    else:
        from moe_qlora.train.sft import SftRecipe as Method
    from moe_qlora.common.fileio import removed_if_left_unused  # a run refused at its start leaves no empty folder

    try:
        recipe = Method(cfg, console, allow_mismatch=resume_anyway, overwrite=overwrite, source=config)
        with removed_if_left_unused(cfg.output.dir):
            recipe.run()
    except user_errors() as exc:
        fail(exc, debug)
    except (TrainingAborted, AdapterVerificationError) as exc:
        fail(exc, debug, code=1)
    except StepFailed as exc:
        show_traceback(exc, debug)
        err_console.print(
            "[red]error:[/red] " + escape(f"{exc}\nresume with: {resume_command(command, config, overrides)}"),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None
    except DiskFullError as exc:
        show_traceback(exc, debug)
        err_console.print(
            "[red]error:[/red] "
            + escape(
                f"{exc}. {last_good_checkpoint(cfg)}; {room_advice(cfg, exc)}, then resume "
                f"with: {resume_command(command, config, overrides)}"
            ),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None
    except RunInterrupted as exc:
        again = resume_command(command, config, overrides)
        saved = f"checkpoint written; resume with: {again}" if exc.step else "no step was done yet; nothing to save"
        err_console.print(f"interrupted at step {exc.step}; {saved}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("stopped at once (second signal): nothing written since the last checkpoint", highlight=False)
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


def room_advice(cfg, exc) -> str:
    """What frees the room the next checkpoint needs: the older checkpoints when there are some (a resume with
    train.keep_checkpoints=1 removes them before it writes), else space freed by hand. The newest checkpoint stays
    until the next one is complete, so with one kept there is nothing the run itself can give back."""
    from moe_qlora.common.fileio import human_bytes
    from moe_qlora.train.checkpoint import checkpoint_dirs

    kept = checkpoint_dirs(Path(cfg.output.dir))
    short = max(exc.needed - exc.free, 0) if exc.needed is not None and exc.free is not None else None
    older = sum(f.stat().st_size for d in kept[1:] for f in d.rglob("*") if f.is_file())
    if len(kept) > 1 and (short is None or older >= short):
        return (
            f"add --set train.keep_checkpoints=1 to the resume, which removes the {len(kept) - 1} older "
            f"checkpoint(s) ({human_bytes(older)}) before it writes the next, or free some space"
        )
    amount = f"at least {human_bytes(short)}" if short else "some space"
    if kept:
        return (
            f"free {amount} on that disk (the newest checkpoint stays until the next one is complete, so a lower "
            "train.keep_checkpoints frees nothing)"
        )
    return f"free {amount} on that disk"


GRPO_EPILOG = """Examples:

  moe-qlora grpo --config configs/grpo-demo.yaml

  moe-qlora grpo --config cfg.yaml --set grpo.group_size=8 --set grpo.kl_coef=0.04

  moe-qlora grpo --config cfg.yaml --set grpo.offline_file=scored.jsonl   # completions generated elsewhere
"""


grpo = run_command(
    "grpo",
    "Online GRPO on the 4-bit model: sample groups, score them with reward functions, train on advantages.",
    config_help="YAML run configuration with a grpo: section",
    set_help="override a key, e.g. --set grpo.group_size=8 (repeatable)",
    changed="the prompts",
)

DPO_EPILOG = """Examples:

  moe-qlora dpo --config configs/dpo-demo.yaml

  moe-qlora dpo --config cfg.yaml --set dpo.loss_type=ipo --set dpo.beta=0.5

  moe-qlora dpo --config cfg.yaml --set lora.init_from=runs/sft/adapter   # SFT, then DPO from its adapter
"""

dpo = run_command(
    "dpo",
    "Preference training (DPO, IPO, hinge, robust, SimPO, ORPO) on chosen/rejected pairs; the reference is "
    "the step-0 policy, scored once.",
    config_help="YAML run configuration with a dpo: section",
    set_help="override a key, e.g. --set dpo.beta=0.2 (repeatable)",
    changed="the pairs",
)
