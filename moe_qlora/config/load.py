"""Reading the run configuration: one YAML file, validated strictly, with `--set a.b=value` overrides and paths
resolved against the config's folder. Errors name the file, the key path, its line in the YAML, what was
expected and, for an unknown key, the nearest valid one.
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from moe_qlora.config.sections import ConfigError, RunConfig, Section

SectionT = TypeVar("SectionT", bound=Section)


def _section_at(path: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the key at `path` (for suggesting the nearest valid key)."""
    cls: Any = RunConfig
    for part in path[:-1]:
        if isinstance(part, int):  # an item of a list of sections (grpo.rewards[0]): same model
            continue
        field = cls.model_fields.get(part)
        cls = _model_in(field.annotation) if field is not None else None
        if cls is None:
            return None
    return cls


def _model_in(annotation) -> type[BaseModel] | None:
    """The section model inside an annotation: X, X | None, list[X]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


def _yaml_line(text: str | None, path: tuple) -> int | None:
    """1-based line of the key at `path` in the YAML text, if it is there."""
    if not text:
        return None
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in path:
        if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
            continue
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


# What users of TRL, PEFT, axolotl and torchtune type for our keys.
KEY_ALIASES = {
    "learning_rate": "lr",
    "learning_rat": "lr",
    "lr_scheduler_type": "schedule",
    "lr_scheduler": "schedule",
    "num_epochs": "epochs",
    "num_train_epochs": "epochs",
    "batch_size": "micro_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm_": "max_grad_norm",
    "warmup": "warmup_steps",
    "r": "rank",
    "lora_r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "max_length": "max_seq_len",
    "sequence_len": "max_seq_len",
    "max_seq_length": "max_seq_len",
    "output_dir": "dir",
    "optim": "optimizer",
    "save_steps": "save_every",
    "logging_steps": "log_every",
    "model_name_or_path": "name_or_path",
    "base_model": "name_or_path",
}


def nearest_key(key: str, valid: list[str]) -> str | None:
    """The valid key a user most likely meant: a known alias, else the closest spelling."""
    alias = KEY_ALIASES.get(key.lower())
    if alias in valid:
        return alias
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return near[0] if near else None


def _where(path: tuple, source: str, text: str | None, sets: dict[tuple, str]) -> str:
    """What a bad key is blamed on: the `--set KEY=VALUE` that gave it (or a section holding it), else its line
    in the config file."""
    given = [k for k in sets if tuple(map(str, path[: len(k)])) == k]
    if given:
        return f"--set {sets[max(given, key=len)]}"
    line = _yaml_line(text, path)
    where = f"{source}:{line}" if line else source
    # A check of a whole section (several keys together): the --set values inside it are part of the story.
    within = [pair for k, pair in sets.items() if k[: len(path)] == tuple(map(str, path)) and len(k) > len(path)]
    return where + "".join(f" with --set {pair}" for pair in within)


def _describe(err: dict, source: str, text: str | None, sets: dict[tuple, str]) -> str:
    path = tuple(err["loc"])
    key = ".".join(str(p) for p in path)
    where = _where(path, source, text, sets)
    if err["type"] == "extra_forbidden":
        section = _section_at(path)
        valid = list(section.model_fields) if section else []
        near = nearest_key(str(path[-1]), valid)
        if near:
            return f"{where}: unknown key {key!r}; did you mean {'.'.join([*map(str, path[:-1]), near])!r}?"
        return f"{where}: unknown key {key!r} (valid here: {', '.join(valid)})"
    if err["type"] == "missing":
        return f"{where}: missing required key {key!r}"
    got = err.get("input")
    if isinstance(got, BaseModel | dict):  # a section's own check: the section's keys are the story, not its repr
        return f"{where}: {key}: {err['msg']}"
    return f"{where}: {key}: {err['msg']} (got {got!r})" if path else f"{where}: {err['msg']}"


def parse_overrides(pairs: list[str]) -> dict:
    """['train.lr=2e-4', 'lora.rank=16'] -> nested dict; values parsed as YAML scalars/lists."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY.PATH=VALUE, e.g. --set train.lr=2e-4")
        node = out
        *parents, leaf = key.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {pair!r}: value is not valid YAML: {exc}") from None
        # YAML 1.1 reads "2e-4" as a string; a number was clearly meant.
        node[leaf] = _number_or(value)
    return out


def _number_or(value):
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = deep_merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def _numbers_in(obj):
    """YAML 1.1 leaves 2e-4 (no dot) as a string: read such scalars as numbers before validation."""
    if isinstance(obj, dict):
        return {k: _numbers_in(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numbers_in(v) for v in obj]
    if isinstance(obj, str) and obj[:1].isdigit() and "e" in obj.lower():
        return _number_or(obj)
    return obj


def validate_config(
    raw: dict, *, source: str = "<config>", text: str | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Validate a raw mapping; all problems are reported at once, one line each, a key `overrides` (--set
    KEY=VALUE) gave blamed on that --set."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (model, lora, data, train, output)")
    try:
        return RunConfig.model_validate(_numbers_in(raw))
    except ValidationError as exc:
        sets = {tuple(pair.partition("=")[0].strip().split(".")): pair for pair in overrides or ()}
        lines = [_describe(e, source, text, sets) for e in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def validate_section(section: type[SectionT], name: str, raw: dict, *, source: str) -> SectionT:
    """One section (`name`: model, lora...) validated on its own, for a command that needs no whole run (generate,
    merge); its problems said as validate_config says them, keys named `name.key`."""
    try:
        return section.model_validate(_numbers_in(raw))
    except ValidationError as exc:
        lines = [_describe({**e, "loc": (name, *e["loc"])}, source, None, {}) for e in exc.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read, merge overrides into, and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    raw = resolve_paths(raw, path.resolve().parent)
    if overrides:
        raw = deep_merge(raw, resolve_paths(parse_overrides(overrides), Path.cwd()))
    return validate_config(raw, source=str(path), text=text, overrides=overrides)


# Keys that name files or folders: relative ones are relative to the config file (as in torchtune and
# axolotl), or to the current directory for --set values.
PATH_KEYS = (
    ("model", "chat_template"),
    ("data", "train_files"),
    ("data", "eval_files"),
    ("output", "dir"),
    ("lora", "init_from"),
    ("grpo", "offline_file"),
    ("train", "resume"),
)
NOT_PATHS = {("train", "resume"): ("never", "auto")}


def resolve_paths(raw, base: Path):
    """`raw` with the relative paths at PATH_KEYS (and reward functions given as `file.py:function`) made
    absolute against `base`. Anything not shaped as expected is left for validation to report."""
    if not isinstance(raw, dict):
        return raw
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for section, key in PATH_KEYS:
        holder = out.get(section)
        if isinstance(holder, dict) and key in holder and holder[key] not in NOT_PATHS.get((section, key), ()):
            value, hub_ids = holder[key], section == "data"
            holder[key] = (
                [_absolute(v, base, hub_ids=hub_ids) for v in value]
                if isinstance(value, list)
                else _absolute(value, base, hub_ids=hub_ids)
            )
    grpo = out.get("grpo")
    if isinstance(grpo, dict) and isinstance(grpo.get("rewards"), list):
        grpo["rewards"] = [_absolute_reward_file(r, base) for r in grpo["rewards"]]
    return out


def _absolute(value, base: Path, *, hub_ids: bool = False):
    """A relative path made absolute against `base`. With `hub_ids` (data entries), a value that is no path
    there and not named like a data file is a hub dataset id, left as it is; a mapping's `path` likewise."""
    if isinstance(value, dict) and hub_ids:
        return {**value, "path": _absolute(value.get("path"), base, hub_ids=True)}
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if hub_ids and not path.is_absolute() and not value.startswith((".", "~")):
        from moe_qlora.common.hub import looks_local

        if not (base / path).exists() and not looks_local(value):
            return value
    return os.path.normpath(path if path.is_absolute() else base / path)


def _absolute_reward_file(spec, base: Path):
    if isinstance(spec, dict) and isinstance(spec.get("function"), str):
        file, sep, fn = spec["function"].rpartition(":")
        if sep and file.endswith(".py"):
            return {**spec, "function": f"{_absolute(file, base)}:{fn}"}
    return spec
