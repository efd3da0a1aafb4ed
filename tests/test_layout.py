"""The package's architecture, read from its imports (ast: imports inside functions count too).

Subpackages are layered in LAYERS, lowest first: a module may import its own subpackage and those below it,
never one above; and no chain of module imports comes back to where it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "moe_qlora"
# Lowest first: data flows up from the MoE layer to the model, the loops and the command line.
LAYERS = ["common", "moe", "config", "data", "model", "export", "inference", "train", "cli"]


def module_name(path: Path) -> str:
    parts = ["moe_qlora", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The moe_qlora modules `path` imports: `from a.b import c` counts a.b.c when it is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the package imports by absolute name)"
            module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) - {name} for name, path in paths.items()}


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the subpackage holding `module`; None for the root package and __main__."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if here is not None and there is not None and there > here:
                wrong.append(f"{module} imports {target}: {LAYERS[there]} is above {LAYERS[here]}")
    return wrong


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colouring nodes on the stack)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*stack, nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_every_subpackage_is_a_declared_layer():
    subpackages = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert subpackages == set(LAYERS)
    stray = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not stray, f"modules outside the subpackages: {stray}"


def test_no_import_reaches_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_each_subpackage_says_what_it_holds_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = [line for line in doc.splitlines() if line.strip()]
        assert 2 <= len(lines) <= 4, f"{init}: a docstring of 2 to 4 lines, got {len(lines)}"
        assert "import" in doc, f"{init}: the docstring says what the package may import"


@pytest.mark.parametrize(
    ("graph", "expect"),
    [
        # broken controls: the checks must see an upward import and a cycle when there is one
        ({"moe_qlora.moe.experts": {"moe_qlora.train.recipe"}, "moe_qlora.train.recipe": set()}, "upward"),
        ({"moe_qlora.train.a": {"moe_qlora.train.b"}, "moe_qlora.train.b": {"moe_qlora.train.a"}}, "cycle"),
        ({"moe_qlora.train.a": {"moe_qlora.moe.b"}, "moe_qlora.moe.b": set()}, "clean"),
    ],
)
def test_the_checks_fail_on_a_broken_graph(graph, expect):
    assert bool(upward_imports(graph)) == (expect == "upward")
    assert (find_cycle(graph) is not None) == (expect == "cycle")


def test_the_docs_module_table_names_every_package_and_module():
    page = (PACKAGE.parent / "docs" / "moe-layer.md").read_text()
    table = page[page.index("| package / module |") :].split("\n\n")[0]
    for layer in LAYERS:
        assert f"**`{layer}/`**" in table, layer
    modules = {p.name for p in PACKAGE.glob("*/*.py") if p.name != "__init__.py"}
    missing = sorted(m for m in modules if f"`{m}`" not in table)
    assert not missing, f"modules the table of docs/moe-layer.md does not name: {missing}"


def fmt_skip_markers(root: Path) -> list[str]:
    """Every `# fmt: skip` line under root's Python files, as path:line."""
    return [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if not {".venv", "build", ".git"} & set(path.relative_to(root).parts)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.rstrip().endswith("# fmt: skip")
    ]


def test_the_formatter_is_used_not_fought(tmp_path):
    """`ruff format` is the style (CI checks it); `# fmt: skip` only where a table's alignment means something."""
    markers = fmt_skip_markers(PACKAGE.parent)
    assert len(markers) <= 20, f"{len(markers)} `# fmt: skip` markers (at most 20): {markers[:10]}"
    (tmp_path / "a.py").write_text("x = [1,  2]  # fmt: skip\n")  # broken control: the count sees a marker
    assert fmt_skip_markers(tmp_path) == ["a.py:1"]


def wide_functions(source: str, limit: int = 7) -> list[str]:
    """Functions of `source` taking more than `limit` parameters (self and cls not counted)."""
    wide = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
            count = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            if count > limit:
                wide.append(f"{node.name} ({count})")
    return wide


def test_no_function_of_the_training_methods_takes_more_than_seven_parameters():
    """train/ is where new methods land: state travels on the recipe and in small records, not in long lists."""
    wide = {
        str(p.relative_to(PACKAGE)): w for p in (PACKAGE / "train").glob("*.py") if (w := wide_functions(p.read_text()))
    }
    assert wide == {}
    assert wide_functions("def f(a, b, c, d, e, f, g, *, h): pass") == ["f (8)"]  # broken control


def test_the_tests_are_laid_out_like_the_package():
    """tests/<package>/test_<module>.py for what one package does, project-wide checks at the top, and what test
    modules share in tests/helpers/ (or a conftest.py), never a helper module beside the tests."""
    tests = PACKAGE.parent / "tests"
    folders = {d.name for d in tests.iterdir() if d.is_dir() and not d.name.startswith((".", "__"))}
    assert folders - {"helpers"} <= set(LAYERS), folders
    strays = sorted(
        str(p.relative_to(tests))
        for p in tests.rglob("*.py")
        if p.parent.name != "helpers" and not p.name.startswith("test_") and p.name != "conftest.py"
    )
    assert strays == [], f"helper modules outside tests/helpers/: {strays}"


def test_the_export_modules_are_split_by_format():
    """export/ is one module per format and concern, each under 450 lines (it was one file of 996)."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "export").glob("*.py")}
    assert {name: n for name, n in sizes.items() if n >= 450} == {}
