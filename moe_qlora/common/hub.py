"""Local path or hub id, and is a hub model id usable here, asked at once (light: only huggingface_hub), before
any model code loads.

The hub is asked once, with a short timeout and no retry. When it cannot be reached the process goes offline
(huggingface_hub's HF_HUB_OFFLINE, which transformers and datasets read per call): what is cached is read, and
nothing after waits on the hub again (hf_hub_download would otherwise retry a missing file for over 20 s).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PROBE_TIMEOUT_S = 5.0  # one model_info call: an answer takes well under a second where the hub is reachable
# configs/models/<name>/config.json: the hub's config.json of the models the recipes train, without weights.
SHIPPED_MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def looks_local(path: str) -> bool:
    """A path rather than a hub id: absolute, ./ or ~, present on disk, or named like a data file."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or os.path.exists(path)
        or Path(path).suffix.lower() in DATA_SUFFIXES
    )


def is_hub_model(name: str) -> bool:
    """model.name_or_path names a hub repository: neither a local folder nor a builtin model."""
    return not name.startswith("builtin:") and not looks_local(name)


def shipped_config(repo_id: str, models: Path = SHIPPED_MODELS) -> Path | None:
    """The configs/models/ folder holding this model's config.json: the longest folder name that the repository's
    name is, or starts with before a '-' (Qwen/Qwen3-30B-A3B -> qwen3-30b-a3b, mistralai/Mixtral-8x7B-v0.1 ->
    mixtral-8x7b); None when none is shipped (or the package is installed without configs/)."""
    name = repo_id.rsplit("/", 1)[-1].lower()
    folders = list(models.glob("*/config.json")) if models.is_dir() else []
    matches = [p.parent for p in folders if name == p.parent.name or name.startswith(p.parent.name + "-")]
    return max(matches, key=lambda p: len(p.name), default=None)


def shown_path(path: Path) -> str:
    """`path` as a user at the current directory types it: relative below it, absolute elsewhere."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def config_only_advice(repo_id: str, command: str) -> str:
    """What to do when `command` (which reads config.json alone) cannot get the model's: the shipped copy when
    configs/models/ has one, else downloading that one file."""
    shipped = shipped_config(repo_id)
    if shipped is not None:
        folder = shown_path(shipped)
        return f"{command} reads only its config.json, which ships in {folder}: add --model {folder}"
    return (
        f"{command} reads only its config.json: download it where there is a network "
        f"(hf download {repo_id} config.json) or give --model a folder holding it"
    )


def offline_reason() -> str:
    """Why huggingface_hub is offline: the user's HF_HUB_OFFLINE, or an earlier probe that found no hub."""
    said = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return "HF_HUB_OFFLINE is set" if said.upper() in ("1", "ON", "YES", "TRUE") else "the hub could not be reached"


def go_offline() -> None:
    """The rest of this process reads the caches only: huggingface_hub's flag, which transformers and its
    `get_session` read per request, and datasets' copy of it when datasets is already imported."""
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = True


def check_hub_model(repo_id: str, error: type[Exception], how: str | None = None) -> None:
    """A hub id must be in the local cache (its config.json), or the hub must answer for it, at once: transformers
    would otherwise retry for over 20 s and end in its own connection message. Asks the hub once (PROBE_TIMEOUT_S,
    no retry) and goes offline when it cannot be reached. Raises `error` in one sentence naming the model and
    `how` to get it (default: download it, or a local folder)."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise error(
            f"model {repo_id!r}: no such folder ({os.path.abspath(repo_id)}), and not a hub id (owner/name) either"
        ) from None
    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    how = how or f"download it first (hf download {repo_id}) or set model.name_or_path to a local folder"
    if constants.HF_HUB_OFFLINE:
        if cached:
            return
        raise error(f"model {repo_id!r} is not in the Hugging Face cache and {offline_reason()}: {how}")
    try:
        HfApi().model_info(repo_id, timeout=PROBE_TIMEOUT_S)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        if cached:
            return
        raise error(
            f"model {repo_id!r}: not a local folder, and the hub says: {type(exc).__name__} "
            "(a typo, a private or gated repo: log in with `hf auth login`)"
        ) from None
    except Exception as exc:  # network errors come from several libraries; all mean the same here
        go_offline()
        if cached:
            return
        raise error(
            f"model {repo_id!r}: not a local folder, not in the Hugging Face cache, and the hub cannot be "
            f"reached ({type(exc).__name__}): {how}"
        ) from None


class ModelUnavailable(Exception):
    """A hub model this process cannot read (not cached, the hub unreachable, or it refuses the id)."""


def dry_run_note(name: str) -> str | None:
    """For `--dry-run`, which reads no weights and prints the config offline too: why the hub model `name` cannot
    be read here, with what to do for training and for plan; None for a local or builtin model or a readable one."""
    if not is_hub_model(name):
        return None
    how = f"training needs it (hf download {name}); {config_only_advice(name, 'moe-qlora plan')}"
    try:
        check_hub_model(name, ModelUnavailable, how)
    except ModelUnavailable as exc:
        return str(exc)
    return None
