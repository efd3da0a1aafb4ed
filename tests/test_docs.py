"""README.md and docs/ as a user reads them. Every fenced shell command that runs the CLI (`moe-qlora`, `python -m
moe_qlora`, `torchrun ... -m moe_qlora`) parses as the CLI would parse it: a real subcommand, real options, their
values, the arguments it requires (the typer app itself is asked, nothing is listed here), and the configs it
names exist. The README stays a front door (at most 200 lines); every link resolves, anchors included; every docs
page opens with its commands. Generated text matches what renders now (MOE_QLORA_UPDATE_DOCS=1 rewrites it): the
key list of docs/configs.md from the pydantic schema, and the README's main families from the family sweep's table
(docs/families.md) and the exporter's own tables.
"""

from __future__ import annotations

import re
import shlex
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
import typer
import typer.main
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from moe_qlora.cli.app import app, with_resume_path
from moe_qlora.config.sections import RunConfig, Section
from moe_qlora.export import family_tables, gguf_archs

from helpers.generated import ROOT, keep_generated

DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console", "zsh"}
OPERATORS = set("&|;()<>")
README_MAX_LINES = 200
OPENING_LINES = 15  # a docs page's first fenced command block starts within this many lines
# click's usage error (a bad option, value or argument count), as the installed typer has it: recent typer vendors
# click as typer._click, older ones use click itself
USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


# ------------------------------------------------------------------------------------------ commands


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the opening fence, body) of every fenced block of a markdown text."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        if m := re.match(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)", lines[i]):
            fence, lang, start = m.group(1), m.group(2).lower(), i
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                i += 1
            blocks.append((lang, start + 1, "\n".join(lines[start + 1 : i])))
        i += 1
    return blocks


def shell_commands(body: str) -> list[list[str]]:
    """Each simple command of a shell block as its argv: continuation lines joined, `# comments` dropped, and
    `&&`, `||`, `;`, `|` splitting a line into its commands (a `$ ` prompt is dropped)."""
    commands = []
    for line in body.replace("\\\n", " ").split("\n"):
        lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        for token in lexer:
            if set(token) <= OPERATORS:
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def cli_args(argv: list[str]) -> list[str] | None:
    """The arguments the CLI gets when `argv` runs it, else None: `moe-qlora ARGS` (after VAR=value assignments),
    or `python -m moe_qlora ARGS` and launchers' `-m moe_qlora ARGS`."""
    words = argv[next((i for i, w in enumerate(argv) if not re.match(r"^\w+=", w)), len(argv)) :]
    if words and Path(words[0]).name == "moe-qlora":
        return words[1:]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] == "moe_qlora":
            return words[i + 2 :]
    return None


def cli_problem(args: list[str]) -> str | None:
    """Why the CLI would refuse `args` before running anything (None: it parses), asking the typer app itself:
    the subcommand, each option and its value, the arguments it requires, no extra ones."""
    group = typer.main.get_command(app)
    args = with_resume_path(args)  # what main() does first: `--resume PATH`
    if not args or args[0].startswith("-"):  # options of the app itself (--version, --help)
        known = {o for p in group.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        unknown = [a for a in args if a.split("=")[0] not in known]
        return f"moe-qlora: unknown {unknown}" if unknown or not args else None
    command = group.commands.get(args[0])
    if command is None:
        return f"no subcommand {args[0]!r}; the app has {sorted(group.commands)}"
    try:
        command.make_context(args[0], args[1:])
    except typer.Exit:  # --help
        return None
    except USAGE_ERROR as exc:  # no such option, a bad value, a missing or an extra argument
        return f"{args[0]}: {exc.format_message()}"
    return None


def missing_configs(args: list[str]) -> list[str]:
    """The shipped files a command names (`--config configs/...`, `--model configs/models/...`) that are not there."""
    named = [b for a, b in zip(args, args[1:], strict=False) if a in ("--config", "-c", "--model")]
    named += [a.split("=", 1)[1] for a in args if a.startswith(("--config=", "--model="))]
    return [n for n in named if n.startswith("configs/") and not (ROOT / n).exists()]


def page_cli_commands(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line of its block's fence, the command, its CLI arguments) for every CLI command in the page's shell blocks."""
    out = []
    for lang, line, body in fenced_blocks(path.read_text()):
        if lang in SHELL:
            runs = [(argv, cli_args(argv)) for argv in shell_commands(body)]
            out += [(line, shlex.join(argv), args) for argv, args in runs if args is not None]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cli_command_in_the_docs_parses(page):
    bad = []
    for line, cmd, args in page_cli_commands(page):
        where = f"{page.name}, the block at line {line}: {cmd}\n    "
        if problem := cli_problem(args):
            bad.append(where + problem)
        if missing := missing_configs(args):
            bad.append(where + f"names {missing}, which is not there")
    assert not bad, "\n".join(bad)


def test_the_pages_hold_commands_to_check():
    """The checker sees the commands (a parser that found none would pass everything)."""
    found = {page.name: len(page_cli_commands(page)) for page in PAGES}
    assert found["README.md"] >= 15, found
    assert sum(found.values()) >= 50, found


BROKEN = """\
```bash
pip install -e . && moe-qlora train --config configs/demo.yaml --learning-rate 1e-4   # --bogus in a comment is fine
moe-qlora fine-tune --config configs/demo.yaml
python -m moe_qlora merge runs/demo/adapter --dtype float32        # no --out
moe-qlora plan --config configs/demo.yaml \\
    --gpu 2 --set data.max_seq_len=4096
moe-qlora generate --adapter runs/demo/adapter "a prompt" "another prompt"
moe-qlora plan --config configs/recipes/no-such-recipe.yaml
torchrun --nproc-per-node 2 -m moe_qlora train --config configs/demo.yaml --resume runs/demo/checkpoints/step-00000002
moe-qlora --version
```
"""


def test_the_checker_reports_made_up_commands_and_options():
    """Broken control: a made-up option, subcommand, a missing and an extra argument are each reported, and only
    those; continuation lines, && chains, comments and `--resume PATH` are read as a shell reads them."""
    (block,) = [body for lang, _, body in fenced_blocks(BROKEN) if lang == "bash"]
    runs = [args for argv in shell_commands(block) if (args := cli_args(argv)) is not None]
    assert len(runs) == 8, runs
    problems = [cli_problem(args) for args in runs]
    assert "--learning-rate" in problems[0] and "--bogus" not in problems[0]
    assert "no subcommand 'fine-tune'" in problems[1]
    assert "--out" in problems[2]
    assert "--gpu" in problems[3]  # the continuation line belongs to the plan command
    assert "unexpected extra argument" in problems[4]
    assert problems[5:] == [None, None, None]
    assert missing_configs(runs[5]) == ["configs/recipes/no-such-recipe.yaml"] and not missing_configs(runs[0])


# ------------------------------------------------------------------------------------------ pages and links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    for _, _, body in fenced_blocks(text):  # a `# comment` in a block is no heading
        text = text.replace(body, "")
    return {slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M)}


def broken_links(path: Path) -> list[str]:
    text = path.read_text()
    for _, _, body in fenced_blocks(text):
        text = text.replace(body, "")
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        if not where.exists():
            bad.append(f"{target}: no such file")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            bad.append(f"{target}: no heading #{anchor} in {where.name}")
    return bad


def test_the_readme_is_a_front_door():
    lines = README.read_text().split("\n")
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", README.read_text()))
    assert linked == {p.name for p in DOCS.glob("*.md")}, "the README links every guide, and only pages there are"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert not broken_links(page), broken_links(page)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    """Broken control."""
    (tmp_path / "a.md").write_text("# Title\n\n## Merging\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#merging) [gone](a.md#serving) [none](c.md) [web](https://x.org/y)\n")
    assert broken_links(page) == ["a.md#serving: no heading #serving in a.md", "c.md: no such file"]


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_every_docs_page_opens_with_its_commands(page):
    lang, line, body = fenced_blocks(page.read_text())[0]
    assert lang in SHELL and line <= OPENING_LINES and shell_commands(body), (
        f"{page.name}: the first fenced block (line {line}, {lang or 'no language'}) should be the page's commands, "
        f"within its first {OPENING_LINES} lines"
    )


# ------------------------------------------------------------------------------------------ config keys

KEYS_START = "<!-- config-keys:start (generated by tests/test_docs.py from moe_qlora/config/sections.py) -->"
KEYS_END = "<!-- config-keys:end -->"
# Keys whose field has no description in the schema. A note for a key that has one (or no longer exists) fails
# the test: the schema's own words win.
NOTES = {
    "train.epochs": "passes over the training rows (train.max_steps stops earlier)",
    "train.micro_batch_size": "rows per forward and backward",
    "train.lr": "peak learning rate",
    "train.weight_decay": "AdamW's decoupled weight decay",
    "train.betas": "AdamW's moment decay rates",
    "train.eps": "AdamW's epsilon",
    "train.schedule": "the learning rate after warmup",
    "train.warmup_steps": "optimizer steps of linear warmup (a run shorter than it warms up over its whole length)",
    "train.seed": "LoRA initialisation, the data order, the eval split and GRPO's sampling",
    "train.log_every": "a metrics.jsonl record and, off a terminal, a progress line every N optimizer steps",
    "grpo.max_new_tokens": "most tokens sampled per completion",
    "grpo.top_p": "nucleus sampling (1: off)",
}
BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}  # annotated_types' Ge(ge=...), Gt(gt=...), ...


def type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if origin is list:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return "mapping"
    if origin is tuple:
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"
    return "any" if annotation is Any else annotation.__name__


def bounds_text(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in BOUNDS.items():
            if isinstance(meta, annotated_types.BaseMetadata) and hasattr(meta, attr):
                parts.append(f"{sign} {getattr(meta, attr):g}")
        if isinstance(meta, annotated_types.MinLen):
            parts.append(f"at least {meta.min_length}")
    return ", " + ", ".join(parts) if parts else ""


def yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(a mapping)" if isinstance(value, BaseModel) else f"`{yaml_text(value)}`"
    return "required" if field.default is PydanticUndefined else f"`{yaml_text(field.default)}`"


def nested_sections(annotation: Any) -> list[type[Section]]:
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [annotation]
    return [s for a in get_args(annotation) for s in nested_sections(a)]


def key_tables(model: type[Section], prefix: str, notes: dict[str, str], seen: dict | None = None) -> list[str]:
    """One markdown table of `model`'s keys under `prefix`, then one per kind of mapping its keys may hold (a kind
    already listed is named, not repeated)."""
    seen = {} if seen is None else seen
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    below = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        description = field.description or notes.pop(key, "")
        rows.append(
            f"| `{key}` | {type_text(field.annotation)}{bounds_text(field)} | {default_text(field)} | "
            f"{description.replace('|', '/')} |"
        )
        for section in nested_sections(field.annotation):
            if section in seen:
                below += ["", f"Each mapping in `{key}` has the keys of `{seen[section]}`."]
                continue
            seen[section] = f"{key}[]"
            doc = (section.__doc__ or "").strip().split("\n")[0]
            below += ["", f"Each mapping in `{key}`: {doc[:1].lower() + doc[1:]}", ""]
            below += key_tables(section, f"{key}[]", notes, seen)
    return rows + below


def render_config_keys() -> str:
    notes, seen, lines = dict(NOTES), {}, [KEYS_START]
    for name, field in RunConfig.model_fields.items():
        (section,) = nested_sections(field.annotation)
        required = "required" if field.is_required() else "optional"
        what = f": {field.description}" if field.description else ""
        lines += ["", f"### {name}", "", f"The `{name}:` section, {required}{what}.", ""]
        lines += key_tables(section, name, notes, seen)
    assert not notes, f"NOTES for keys the schema describes itself, or no longer has: {sorted(notes)}"
    return "\n".join([*lines, "", KEYS_END])


def test_the_config_key_list_is_the_schemas():
    keep_generated(DOCS / "configs.md", KEYS_START, KEYS_END, render_config_keys(), rerun="tests/test_docs.py")


def test_the_key_list_names_every_key():
    """Each key of each section (nested mappings too) has a row, and a key added to the schema shows up."""
    text = render_config_keys()
    for name, field in RunConfig.model_fields.items():
        for key in nested_sections(field.annotation)[0].model_fields:
            assert f"| `{name}.{key}` |" in text
    assert "| `data.train_files[].columns` |" in text and "| `grpo.rewards[].function` |" in text

    class Extra(Section):
        new_knob: int = 3

    assert "| `x.new_knob` | int | `3` |" in "\n".join(key_tables(Extra, "x", {}))


# ------------------------------------------------------------------------------------------ README: main families

FAMILIES_START = "<!-- main-families:start (generated by tests/test_docs.py) -->"
FAMILIES_END = "<!-- main-families:end -->"
MAIN_FAMILIES = {
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3-MoE",
    "qwen3_next": "Qwen3-Next",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "olmoe": "OLMoE",
    "gpt_oss": "GPT-OSS",
    "glm4_moe": "GLM-4-MoE",
    "llama4": "Llama-4",
    "nemotron_h": "Nemotron-H",
    "gemma4": "Gemma-4",
}


def sweep_status() -> dict[str, str]:
    """model type -> status, from the family sweep's table in docs/families.md (tests/model/test_family_sweep.py)."""
    return dict(re.findall(r"^\| `(\w+)` \| ([\w ]+) \|", (DOCS / "families.md").read_text(), flags=re.M))


def vllm_text(model_type: str) -> str:
    """What `export --format vllm` writes for the family (write_vllm's own decision)."""
    layout = family_tables.vllm_layout(model_type)
    if layout == "refused":
        known = model_type in family_tables.FAMILIES or model_type in family_tables.VLLM_NO_MOE_LORA
        return "refused, with the reason" if known else "not written"
    return {"fused-3d": "PEFT's fused 3D", "per-expert": "per-expert keys"}[layout]


def gguf_text(model_type: str) -> str:
    if model_type not in family_tables.FAMILIES:
        return "not written"
    arch = family_tables.FAMILIES[model_type].gguf_arch
    if gguf_archs.GGUF_NO_LORA.get(arch) or arch in gguf_archs.LEGACY_LORA_ARCHS:
        return "yes; some linears' LoRA refused, with the reason"
    return "yes"


def render_main_families() -> str:
    status = sweep_status()
    rows = ["| family | `model_type` | trains (family sweep) | llama.cpp GGUF | vLLM |", "|---|---|---|---|---|"]
    for model_type, name in MAIN_FAMILIES.items():
        trains = status.get(model_type, "not in the sweep")
        rows.append(f"| {name} | `{model_type}` | {trains} | {gguf_text(model_type)} | {vllm_text(model_type)} |")
    return "\n".join([FAMILIES_START, *rows, FAMILIES_END])


def test_the_readmes_main_families_are_the_sweeps_and_the_exporters():
    keep_generated(README, FAMILIES_START, FAMILIES_END, render_main_families(), rerun="tests/test_docs.py")
