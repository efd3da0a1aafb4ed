"""The package's architecture, read from its imports (ast: imports inside functions count too).

Subpackages are layered in LAYERS, lowest first: a module may import its own subpackage and those below it,
never one above; each subpackage declares in its __init__ (MAY_IMPORT) the ones it may import, and imports no
other; no chain of module imports comes back to where it started. docs/architecture.md shows the declarations.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.generated import ROOT, keep_generated

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


def declared_imports() -> dict[str, tuple[str, ...]]:
    """{subpackage: its MAY_IMPORT}, read from each __init__ without importing it: package names ("common") or
    single modules of a package ("moe.kernel_names")."""
    declared = {}
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [
                "MAY_IMPORT"
            ]:
                declared[init.parent.name] = ast.literal_eval(node.value)
    return declared


def undeclared_imports(graph: dict[str, set[str]], declared: dict[str, tuple[str, ...]]) -> list[str]:
    """Every import of a module of another subpackage that its own subpackage does not declare."""
    wrong = []
    for module, targets in sorted(graph.items()):
        here = module.split(".")[1] if module.count(".") >= 2 else None
        for target in sorted(targets):
            there = target.removeprefix("moe_qlora.")  # "moe.experts"; the root package stays "moe_qlora"
            if here is None or there.split(".")[0] in (here, "moe_qlora"):
                continue
            allowed = declared.get(here, ())
            if not any(there == entry or there.startswith(f"{entry}.") for entry in allowed):
                wrong.append(f"{module} imports {target}: moe_qlora/{here}/__init__.py's MAY_IMPORT is {allowed}")
    return wrong


def test_every_subpackage_is_a_declared_layer():
    subpackages = {p.parent.relative_to(PACKAGE).parts[0] for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert subpackages == set(LAYERS)
    stray = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert not stray, f"modules outside the subpackages: {stray}"


def test_no_import_reaches_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_each_subpackage_declares_what_it_may_import_and_imports_nothing_else():
    declared = declared_imports()
    assert set(declared) == set(LAYERS), "every subpackage's __init__ sets MAY_IMPORT"
    for package, allowed in declared.items():
        below = LAYERS[: LAYERS.index(package)]
        assert all(entry.split(".")[0] in below for entry in allowed), f"{package} declares a layer above it: {allowed}"
    assert undeclared_imports(import_graph(), declared) == []
    # broken control: data does not declare moe, so an import of moe's experts from data is named
    broken = {"moe_qlora.data.examples": {"moe_qlora.moe.experts", "moe_qlora.config.sections"}}
    assert undeclared_imports(broken, declared) == [
        "moe_qlora.data.examples imports moe_qlora.moe.experts: moe_qlora/data/__init__.py's MAY_IMPORT is "
        "('common', 'config')"
    ]
    # a single module declared (config may import moe.kernel_names, and no other module of moe)
    assert undeclared_imports({"moe_qlora.config.sections": {"moe_qlora.moe.kernel_names"}}, declared) == []
    assert undeclared_imports({"moe_qlora.config.sections": {"moe_qlora.moe.experts"}}, declared) != []


ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.md"
MAP_START = "<!-- package-map:start (generated by tests/test_layout.py from each package's __init__) -->"
MAP_END = "<!-- package-map:end -->"


def package_summary(package: str) -> str:
    """What a package holds: its __init__ docstring up to the sentence that says what it may import, on one line."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    return " ".join(doc.split("May import")[0].split())


def render_package_map(declared: dict[str, tuple[str, ...]]) -> str:
    """The packages lowest first, what each holds, what it may import and which packages may import it."""
    rows = [MAP_START, "| package | what it holds | may import | imported by |", "| --- | --- | --- | --- |"]
    for package in LAYERS:
        allowed = ", ".join(f"`{entry}`" for entry in declared[package]) or "nothing"
        users = [p for p in LAYERS if any(entry.split(".")[0] == package for entry in declared[p])]
        used_by = ", ".join(f"`{p}`" for p in users) or "nothing (the entry point)"
        rows.append(f"| **`{package}/`** | {package_summary(package)} | {allowed} | {used_by} |")
    return "\n".join([*rows, MAP_END])


def test_the_architecture_page_shows_each_package_and_what_it_may_import():
    """docs/architecture.md's map is the declarations as they are (MOE_QLORA_UPDATE_DOCS=1 writes it there)."""
    block = render_package_map(declared_imports())
    keep_generated(ARCHITECTURE_PAGE, MAP_START, MAP_END, block, rerun="tests/test_layout.py")
    assert "| **`cli/`** |" in block and "`moe.kernel_names`" in block  # the map names the single-module rule too


def test_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_each_subpackage_says_what_it_holds_and_may_import():
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        lines = [line for line in doc.splitlines() if line.strip()]
        assert 2 <= len(lines) <= 4, f"{init}: a docstring of 2 to 4 lines, got {len(lines)}"
        allowed = declared_imports()[init.parent.name]
        words = {entry.split(".")[-1] for entry in allowed} or {"nothing"}
        unsaid = sorted(w for w in words if w not in doc)
        assert "import" in doc and not unsaid, f"{init}: the docstring says what the package may import: {unsaid}"


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
    page = ARCHITECTURE_PAGE.read_text()
    table = page[page.index("| package / module |") :].split("\n\n")[0]
    for layer in LAYERS:
        assert f"**`{layer}/`**" in table, layer
    modules = {p.name for p in PACKAGE.glob("*/*.py") if p.name != "__init__.py"}
    missing = sorted(m for m in modules if f"`{m}`" not in table)
    assert not missing, f"modules the table of docs/architecture.md does not name: {missing}"


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


# The one module allowed past MAX_MODULE_LINES, and why: the @triton.jit kernels and their autotune configs are kept in
# one file (STYLE.md: one file of kernels, one of launchers), and splitting a kernel from the helpers it inlines
# would only scatter one piece of math.
LONG_MODULES = {"moe/kernels/triton_kernels.py"}
MAX_MODULE_LINES = 400


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """{path under root: lines} of every module of more than `limit` lines."""
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {path: n for path, n in sizes.items() if n > limit}


def test_each_module_holds_one_concern_of_at_most_400_lines(tmp_path):
    """A module past 400 lines holds more than one concern (export/ was one file of 996, model/tiny.py 578)."""
    assert set(long_modules(PACKAGE)) == LONG_MODULES, long_modules(PACKAGE)
    (tmp_path / "big.py").write_text("x = 1\n" * 401)  # broken control: the count sees a long module
    assert long_modules(tmp_path) == {"big.py": 401}
