"""The import graph of the library packages has no cycles: between modules, and between the units a reader sees
in the folder tree (a subpackage such as ``serving/engine/`` as one unit, a module beside it as another), so data
flows one way (``serving.llm_engine`` -> ``serving.spec_decode`` -> ``serving.engine``, never back). Imports are
read from the source (``ast``), function-local ones included, those under ``if TYPE_CHECKING:`` left out (they
never run); an import of an enclosing package is not an edge (its ``__init__`` runs first anyway)."""

import ast
import collections
from pathlib import Path

import pytest
from helpers import REPO

PACKAGES = ("apex_data", "apex_jax", "pallas_kernels", "pc", "serving")


def modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of ``PACKAGES``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` (source ``path``) imports."""
    found = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def unit(name: str) -> str:
    """The unit ``name`` belongs to: its first subpackage below the top-level package, else the module itself."""
    parts = name.split(".")
    if len(parts) >= 2 and (REPO / parts[0] / parts[1] / "__init__.py").exists():
        return ".".join(parts[:2])
    return name


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return found


@pytest.fixture(scope="module")
def module_edges() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def test_no_module_imports_itself_back(module_edges):
    assert cycles(module_edges) == []


def test_no_package_imports_itself_back(module_edges):
    edges = collections.defaultdict(set)
    for source, targets in module_edges.items():
        for target in targets:
            if unit(source) != unit(target) and not unit(source).startswith(unit(target) + "."):
                edges[unit(source)].add(unit(target))
    assert cycles(edges) == []
    assert "serving.engine" in edges["serving.spec_decode"]  # the check sees the units it is about


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
