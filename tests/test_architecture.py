"""The house rules docs/architecture.md states, held by the code itself: layers import downwards
only, no import cycle (imports under TYPE_CHECKING and inside functions count), no private name
imported across modules, short functions, a short engine and a short README, and a clean lint."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pc_rag"

# lowest first; a module may import from its own layer and the layers below
LAYERS = (
    ("errors", "paths", "atomic", "forks"),
    ("kernels",),
    ("prompt",),
    ("kv",),
    ("weights",),
    ("forward",),
    ("model",),
    ("prefill",),
    ("decode",),
    ("registry_snapshot", "registry", "registry_sync", "planner", "embedding"),
    ("background", "callers", "admission", "scheduler", "registration", "serving", "warm_up", "conformance"),
    ("engine", "engine_parts"),
    ("integrations", "retrievers", "server", "distributed", "corpus", "demo", "cli"),
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every pc_rag import of module ``name``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import x` imports a module
                sub = f"{target}.{alias.name}"
                found.append((sub, [], node.lineno) if sub in MODULES else (target, [alias.name], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
    return [(t, n, line) for t, n, line in found if t == "pc_rag" or t.startswith("pc_rag.")]


def layer(name: str) -> int | None:
    parts = name.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "pc_rag" and layer(m) is None] == []


def test_layers_import_downwards_only():
    upward = [f"{m}:{line} imports {t} (layer {layer(t)} above {layer(m)})"
              for m in MODULES if m != "pc_rag" for t, _, line in imports(m)
              if t != "pc_rag" and layer(t) is not None and layer(t) > layer(m)]  # type: ignore[operator]
    assert upward == []


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in imports(m) if t in MODULES and t != m and t != "pc_rag"} for m in MODULES}
    # a package's __init__ runs before its modules: an edge to it is an edge to what it imports
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_private_name_is_imported_across_modules():
    private = [f"{m}:{line} imports {n} from {t}" for m in MODULES for t, names, line in imports(m)
               for n in names if n.startswith("_") and n != "__version__"]
    assert private == []


def _lengths(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1  # type: ignore[operator]


def test_no_function_over_60_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in MODULES.values() for name, line, n in _lengths(p) if n > 60]
    assert long == []


def test_no_module_over_500_lines():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 500]
    assert long == []


# the serving loop's rooms (docs/architecture.md, "The scheduler's loop"): the scheduler calls into
# each, and none reaches back into the scheduler
SERVING_ROOMS = ("pc_rag.callers", "pc_rag.admission", "pc_rag.kv.budget", "pc_rag.decode.layout", "pc_rag.decode.loop",
                 "pc_rag.prefill.chunked")


def test_the_scheduler_calls_into_each_room_and_no_room_into_the_scheduler():
    called = {target for target, _, _ in imports("pc_rag.scheduler")}
    assert [room for room in SERVING_ROOMS if room not in called] == []
    assert [room for room in SERVING_ROOMS if any(t == "pc_rag.scheduler" for t, _, _ in imports(room))] == []


def test_lint_is_clean():
    """pyflakes, pycodestyle's errors and import order (the rule set pyproject.toml fixes) over the
    package, the tests and the benchmarks: unused imports and names, undefined names, shadowing."""
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "pc_rag", "tests", "benchmarks"],
                           cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


@pytest.mark.parametrize(("path", "limit"), [("pc_rag/engine.py", 300), ("README.md", 300)])
def test_short_files(path, limit):
    assert len((ROOT / path).read_text().splitlines()) <= limit


def test_readme_links_reach_the_docs():
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README does not link docs/{page.name}"
