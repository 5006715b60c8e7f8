"""CPU tier: bench's modules import each other without a circle.

Read from the source (module- and function-level imports alike), so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _imports() -> dict:
    modules = {p.stem for p in BENCH.glob("*.py")}
    graph = {}
    for path in BENCH.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                parts = node.module.split(".")
                found |= {parts[1]} if len(parts) > 1 else {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("bench.")}
        graph[path.stem] = (found & modules) - {path.stem}
    return graph


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_no_bench_module_imports_one_that_imports_it_back():
    graph = _imports()
    assert {"runner", "scenarios", "rank", "calls", "cli"} <= set(graph)
    circles = sorted(name for name in graph if name in _reachable(graph, name))
    assert circles == [], f"modules on an import circle: {circles}"
