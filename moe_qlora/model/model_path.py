"""What `model.name_or_path` names: `builtin:tiny-<family>` becomes the path of that tiny model, generated (tiny.py)
on first use into the cache and found there by a hash of its recipe; a hub id or a local folder passes through.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from moe_qlora.config.sections import ConfigError
from moe_qlora.model.tiny import build_byte_tokenizer, save_tiny_model, tiny_config
from moe_qlora.model.tiny_families import BUILTIN_FAMILIES, unknown_builtin_model


def cache_dir() -> Path:
    """Where generated models are kept: $MOE_QLORA_CACHE, else ~/.cache/moe-qlora."""
    return Path(os.environ.get("MOE_QLORA_CACHE", Path.home() / ".cache" / "moe-qlora"))


def ensure_tiny(family: str = "mixtral", *, seed: int = 0, **overrides) -> Path:
    """Path of the generated tiny model of a family for this recipe, building it on first use (atomically)."""
    tokenizer = build_byte_tokenizer()
    config = tiny_config(family, len(tokenizer), **overrides)
    recipe = json.dumps({"config": config.to_dict(), "seed": seed, "v": 1}, sort_keys=True, default=str)
    target = cache_dir() / f"tiny-{family}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".building-") as tmp:
        save_tiny_model(tmp, config, seed=seed, tokenizer=tokenizer)
        try:
            os.rename(tmp, target)
        except OSError:  # another process built it first
            if not (target / "config.json").exists():
                raise
        os.makedirs(tmp, exist_ok=True)  # TemporaryDirectory cleans up the (now moved) path
    return target


# builtin:tiny-mixtral is the demo's model; builtin:tiny-<family> for every family in TINY_FAMILIES.
BUILTIN_MODELS = {name: functools.partial(ensure_tiny, family) for name, family in BUILTIN_FAMILIES.items()}


def resolve_model_path(name_or_path: str) -> str:
    """Turn `builtin:<name>` into the path of the generated model; pass anything else through."""
    if problem := unknown_builtin_model(name_or_path):
        raise ConfigError(problem)
    if name_or_path.startswith("builtin:"):
        return str(BUILTIN_MODELS[name_or_path]())
    return name_or_path
