"""CPU tier: the cupycoll package's import rules (docs/design.md, "The house").

Read from the source (module- and function-level imports alike), so nothing is imported:
no module imports one that imports it back, and torch's private state is read in
cupycoll/compat.py alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "cupycoll"


def _imports() -> dict:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    graph = {}
    for path in PACKAGE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupycoll."):
                found |= {node.module.split(".")[1]}
            elif isinstance(node, ast.ImportFrom) and node.module == "cupycoll":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("cupycoll.")}
        graph[path.stem] = (found & modules) - {path.stem}
    return graph


def _reachable(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


def test_no_package_module_imports_one_that_imports_it_back():
    graph = _imports()
    assert {"process_group", "backend", "_registration", "compat", "call_queue"} <= set(graph)
    assert "process_group" in graph["_registration"]  # the creator's import is read too
    circles = sorted(name for name in graph if name in _reachable(graph, name))
    assert circles == [], f"modules on an import circle: {circles}"


# What reads torch's private state: frames of torch's code, distributed_c10d's globals.
_TORCH_PRIVATE = {"sys._getframe": r"\bsys\._getframe\b", "_world": r"\._world\b",
                  "_get_default_group": r"\b_get_default_group\b"}


def test_torchs_private_state_is_read_in_compat_alone():
    readers = {}
    for path in PACKAGE.glob("*.py"):
        source = path.read_text(encoding="utf-8")
        found = [name for name, pattern in _TORCH_PRIVATE.items() if re.search(pattern, source)]
        if found:
            readers[path.name] = found
    assert readers == {"compat.py": ["sys._getframe", "_world"]}
