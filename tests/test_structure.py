"""The package's layering, read statically from its source (no imports run): the runtime never imports the
tooling in ``kvcodec.tools`` (only the command line does, inside a function), ``kvcodec.formats`` imports nothing
above itself, the kernels nothing but the formats, no part of the store imports its facade, and no modules import
each other in a circle.  Imports under ``if TYPE_CHECKING`` count like any other: they are dependencies too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = {"kvcodec": REPO / "kvcodec"}
TOOLS = "kvcodec.tools"
# The tooling-facing runtime module that may import the tools inside a function, when the command that needs them
# runs.  (Nothing that serves does: an engine hook's first-use calibration lives in the runtime.)
LAZY_TOOL_USERS = {"kvcodec.cli"}
STORE_FACADE = "kvcodec.store.store"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(module, line, at_module_level)`` for each import of one of ours; ``from P import n`` counts as an import
    of ``P`` and, where ``n`` is a module, of ``P.n``.  Imports under ``if TYPE_CHECKING`` count as module-level
    ones: the module is written against the other, whether or not the import runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                out.append((base, child.lineno, top))
                out.extend((f"{base}.{a.name}", child.lineno, top) for a in child.names if f"{base}.{a.name}" in MODULES)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), True)
    return [(m, line, top) for m, line, top in out if m in MODULES]


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(REPO)}:{line}"


def test_the_sources_are_found():
    assert {"kvcodec", "kvcodec.api", "kvcodec.formats.v1", "kvcodec.kernels.cachegen", TOOLS} <= set(MODULES)


def test_the_runtime_does_not_import_the_tools():
    bad = [f"{_where(name, line)} imports {target}" + ("" if top else " (in a function)")
           for name, imports in IMPORTS.items() if not _within(name, TOOLS)
           for target, line, top in imports
           if _within(target, TOOLS) and (top or name not in LAZY_TOOL_USERS)]
    assert not bad, "runtime modules import kvcodec.tools:\n" + "\n".join(bad)


@pytest.mark.parametrize("package, allowed", [("kvcodec.formats", ("kvcodec.formats",)),
                                              ("kvcodec.kernels", ("kvcodec.kernels", "kvcodec.formats"))])
def test_the_bottom_layers_import_nothing_above_them(package, allowed):
    bad = [f"{_where(name, line)} imports {target}"
           for name, imports in IMPORTS.items() if _within(name, package)
           for target, line, _ in imports if not any(_within(target, a) for a in allowed)]
    assert not bad, f"{package} imports from above itself:\n" + "\n".join(bad)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_circles():
    # Imports inside functions count too: a circle closed at call time still ties the two modules together.  A
    # module's own enclosing packages are left out: Python has started them before the module runs.
    edges = {name: {t for t, _, _ in imports if t != name and not name.startswith(t + ".")}
             for name, imports in IMPORTS.items()}
    circles = _circles(edges)
    described = [" <-> ".join(c) + "\n  " + "\n  ".join(f"{_where(a, line)} imports {b}" for a in c
                                                       for b, line, _ in IMPORTS[a] if b in c and b != a)
                 for c in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_type_only_imports_are_dependencies(tmp_path):
    """A circle hidden behind ``if TYPE_CHECKING`` (the store's load and plan importing its facade) is still one."""
    source = tmp_path / "load.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvcodec.store.store import KVStore\n")
    assert _imports("kvcodec.store.load", source) == [(STORE_FACADE, 3, True)]


def test_no_part_of_the_store_imports_its_facade():
    """Tiers, source, telemetry, plan and load work below :class:`KVStore`; only the package re-exports it and the
    configuration builds it."""
    bad = [f"{_where(name, line)} imports {target}"
           for name, imports in IMPORTS.items()
           if _within(name, "kvcodec.store") and name not in ("kvcodec.store", "kvcodec.store.config")
           for target, line, _ in imports if target == STORE_FACADE]
    assert not bad, "parts of the store import kvcodec.store.store:\n" + "\n".join(bad)


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_package_ships():
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages <= listed, f"packages missing from pyproject.toml: {sorted(packages - listed)}"


def test_regression_top_level_kernels_folder_shadowed_hub_kernels():
    """Tests and commands run with the repository as the working directory, which Python puts first on ``sys.path``.
    A top-level ``kernels/`` (once mapped into the package as ``kvcodec.kernels``) was then what transformers 5.25
    imported as Hugging Face's ``kernels`` package, and every model load failed.  So the repository's top holds no
    importable folder or module but ``kvcodec``."""
    importable = sorted(path.name for path in REPO.iterdir()
                        if (path.is_dir() and (path / "__init__.py").exists()) or path.suffix == ".py")
    assert importable == ["kvcodec"], f"importable names at the repository's top: {importable}"
