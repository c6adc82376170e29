"""The dependency rules of docs/architecture.md, "Layout", read off the source itself.

Every import counts: module level, function-local and `if TYPE_CHECKING:` ones alike, since a
cycle that only type checking closes still ties two modules together for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "controller", "worker", "cli")
# package -> the project packages it may import (services is the shared contract)
ALLOWED = {
    "services": set(),
    "controller": {"services"},
    "worker": {"services"},
    "cli": {"services"},
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, resolved to modules that exist."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod when one exists
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` names a.b.c; keep the longest known
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_graph_is_read(graph):
    # guards the parser itself: a resolver that found nothing would pass every rule below
    assert "services.store" in graph["controller.lease"]
    assert len(graph) > 40


def test_no_import_cycles(graph):
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n) :] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_packages_depend_one_way(graph):
    bad = [
        f"{m} imports {n}"
        for m, deps in graph.items()
        for n in deps
        if n.split(".")[0] != m.split(".")[0] and n.split(".")[0] not in ALLOWED[m.split(".")[0]]
    ]
    assert not bad, "\n".join(bad)


def test_controller_and_services_never_import_torch():
    """The controller image and the CLI stay small: torch is the worker's alone."""
    bad = []
    for pkg in ("controller", "services", "cli"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                bad += [
                    f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "torch"
                ]
    assert not bad, "\n".join(bad)


def test_no_reference_to_a_design_file_outside_the_repository():
    hits = []
    for path in ROOT.rglob("*"):
        if (
            path.is_file()
            and path.suffix in (".py", ".md", ".yaml", ".yml", ".js", ".toml")
            and not any(p in path.parts for p in (".venv", "node_modules", ".git", ".tools"))
        ):
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if "DESIGN.md" in line and path != Path(__file__):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    assert not hits, "cite docs/architecture.md instead:\n" + "\n".join(hits)
