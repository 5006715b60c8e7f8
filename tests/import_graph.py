"""The import graph of one folder of modules, read from the source (module- and
function-level imports alike), so nothing is imported: what tests of a package's import
rules walk."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Set


def _module_name(folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(folder: Path, package: str) -> Dict[str, Set[str]]:
    """module -> the modules of ``folder`` it imports (``package``: its import name).
    Modules of subpackages are named by their dotted path below ``folder`` (``nccl.bindings``;
    a subpackage's ``__init__`` by the subpackage's name)."""
    paths = {_module_name(folder, p): p for p in folder.rglob("*.py") if _module_name(folder, p)}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                    base = ".".join(base + (node.module.split(".") if node.module else []))
                elif (node.module or "") == package or (node.module or "").startswith(f"{package}."):
                    base = node.module[len(package) + 1:]
                else:
                    continue
                if base:
                    found.add(base)
                found |= {f"{base}.{a.name}" if base else a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name[len(package) + 1:] for a in node.names if a.name.startswith(f"{package}.")}
        graph[name] = (found & modules) - {name}
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
