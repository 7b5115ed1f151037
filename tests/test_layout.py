"""The repository's rooms: which package may import which, no import cycle, no room too big.

Read from the source with `ast` (every import, also those inside functions), so a lazy
import that closes a cycle is caught too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "driver", "evaluation", "reports", "multilora", "verifier_sandbox", "evolution", "bench")
LIBRARIES = ("multilora", "verifier_sandbox", "evolution")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports (`from x import y` counts as x.y when that is a module)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _external(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _top(module: str) -> str:
    return module.split(".")[0]


def test_no_import_cycle_between_modules():
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
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
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    # a package's __init__ that re-exports its modules is not a cycle of modules
    cycles = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") for m in c)]
    assert not cycles, cycles


def test_libraries_import_neither_ray_nor_the_job():
    for name, path in MODULES.items():
        if _top(name) in LIBRARIES:
            assert "ray" not in _external(path), name
            assert {_top(m) for m in GRAPH[name]} <= set(LIBRARIES), (name, GRAPH[name])


def test_only_the_benchmarks_import_bench():
    for name in MODULES:
        if _top(name) != "bench":
            assert not any(_top(m) == "bench" for m in GRAPH[name]), (name, GRAPH[name])


def test_the_training_job_reaches_evaluation_and_reports_only_from_its_cli():
    for name in MODULES:
        if _top(name) in ("driver", "actors") and name != "driver.cli":
            assert not any(_top(m) in ("evaluation", "reports") for m in GRAPH[name]), (name, GRAPH[name])


def test_no_package_holds_more_than_a_quarter_of_the_code():
    lines: dict[str, int] = defaultdict(int)
    for name, path in MODULES.items():
        lines[_top(name)] += len(path.read_text().splitlines())
    total = sum(lines.values())
    largest = max(lines, key=lines.get)
    assert lines[largest] <= total / 4, (largest, lines[largest], total, dict(lines))
