"""CPU tier: the cupycoll package's import rules (docs/design.md, "The house").

Read from the source (module- and function-level imports alike), so nothing is imported:
no module imports one that imports it back, and torch's private state is read in
cupycoll/compat.py alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from import_graph import circles, imports

PACKAGE = Path(__file__).resolve().parent.parent / "cupycoll"


def test_no_package_module_imports_one_that_imports_it_back():
    graph = imports(PACKAGE, "cupycoll")
    assert {"process_group", "backend", "_registration", "compat", "call_queue"} <= set(graph)
    assert "process_group" in graph["_registration"]  # the creator's import is read too
    assert circles(graph) == [], f"modules on an import circle: {circles(graph)}"


# What reads torch's private state: frames of torch's code, distributed_c10d's globals.
_TORCH_PRIVATE = {"sys._getframe": r"\bsys\._getframe\b", "_world": r"\._world\b",
                  "_get_default_group": r"\b_get_default_group\b",
                  "_get_default_store": r"\b_get_default_store\b"}


def test_torchs_private_state_is_read_in_compat_alone():
    readers = {}
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        found = [name for name, pattern in _TORCH_PRIVATE.items() if re.search(pattern, source)]
        if found:
            readers[path.name] = found
    assert readers == {"compat.py": ["sys._getframe", "_world", "_get_default_group", "_get_default_store"]}
