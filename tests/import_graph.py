"""The import graph of one folder of modules, read from the source (module- and
function-level imports alike), so nothing is imported: what tests of a package's import
rules walk."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set


def imports(folder: Path, package: str) -> Dict[str, Set[str]]:
    """module -> the modules of ``folder`` it imports (``package``: its import name)."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph = {}
    for path in folder.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{package}."):
                found |= {node.module.split(".")[1]}
            elif isinstance(node, ast.ImportFrom) and node.module == package:
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith(f"{package}.")}
        graph[path.stem] = (found & modules) - {path.stem}
    return graph


def circles(graph: Dict[str, Set[str]]) -> list:
    """The modules that reach themselves through their imports, sorted."""
    def reachable(start: str) -> set:
        seen, todo = set(), [start]
        while todo:
            for name in graph[todo.pop()] - seen:
                seen.add(name)
                todo.append(name)
        return seen
    return sorted(name for name in graph if name in reachable(name))
