"""Local path or hub id, and is a hub model id usable here, asked at once (light: only huggingface_hub), before
any model code loads."""

from __future__ import annotations

import os
from pathlib import Path

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def looks_local(path: str) -> bool:
    """A path rather than a hub id: absolute, ./ or ~, present on disk, or named like a data file."""
    return (os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
            or Path(path).suffix.lower() in DATA_SUFFIXES)  # fmt: skip


def check_hub_model(repo_id: str, error: type[Exception]) -> None:
    """A hub id must be in the local cache, or the hub must answer for it, at once: transformers would
    otherwise retry for over a minute and end in a traceback. Raises `error` in one sentence."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    how = f"download it first (hf download {repo_id}) or set model.name_or_path to a local folder"
    if constants.HF_HUB_OFFLINE:
        raise error(f"model {repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {how}")
    try:
        HfApi().model_info(repo_id, timeout=10)
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise error(f"model {repo_id!r}: not a local folder, and the hub says: {type(exc).__name__} "
                             "(a typo, a private or gated repo: log in with `hf auth login`)") from None  # fmt: skip
    except Exception as exc:  # network errors come from several libraries; all mean the same here
        raise error(f"model {repo_id!r}: not a local folder, not in the cache, and the hub cannot be "
                             f"reached ({type(exc).__name__}): {how}") from None  # fmt: skip
