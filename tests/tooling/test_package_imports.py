"""CPU tier: the cupycoll package's import rules (docs/design.md, "The house").

Read from the source (module- and function-level imports alike), so nothing is imported:
no module imports one that imports it back, nor one of a layer above it; the NCCL layer,
fault handling and the flight recorder keep apart; the package imports neither bench/ nor
tools/, and bench/ no tool; torch's private state is read in cupycoll/compat/torch_state.py alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from import_graph import circles, imports

PACKAGE = Path(__file__).resolve().parents[2] / "cupycoll"


def test_no_package_module_imports_one_that_imports_it_back():
    graph = imports(PACKAGE, "cupycoll")
    assert {"process_group", "backend", "_registration", "compat", "issue"} <= set(graph)
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
            readers[path.relative_to(PACKAGE).as_posix()] = found
    assert readers == {"compat/torch_state.py": ["sys._getframe", "_world", "_get_default_group",
                                                 "_get_default_store"]}


# compat's submodules, one per subject; the package's __init__ imports them all.
_COMPAT = {"compat.release", "compat.calls", "compat.groups", "compat.dynamo", "compat.stores", "compat.gloo",
           "compat.torch_state", "compat.cupy_calls"}
# docs/design.md's house, top to bottom: a module may import its own layer and those below,
# never one above (an arrow back up is a callback's business, handed down as an argument).
LAYERS = (
    {"torchft"},
    {"", "__main__", "_registration", "process_group", "py_backend", "shrink", "trace.__main__", "trace.analyze"},
    {"shell", "shell_calls"},
    {"collectives"},
    {"issue", "coalescing"},
    {"backend", "cpu_half"},
    {"faults.all_groups", "faults.lifecycle", "faults.teardown", "nccl.bootstrap", "ring", "ring.algorithm"},
    {"_args", "call_forms", "cpu_average", "faults", "faults.watchdog", "faults.heartbeat", "faults.watchdog_cuda",
     "faults.watchdog_thread", "faults.reports", "faults.last_words",
     "nccl", "nccl.communicators", "nccl.communicator", "nccl.children", "nccl.call_guard", "nccl.group", "trace",
     "trace.group", "trace.gloo_work", "trace.listener", "trace.exchange", "trace.news", "trace.diagnosis",
     "trace.mismatch", "ring.programs", "ring.stream_order", "ring.schedule", "ring.kernels"},
    {"work", "_cuda", "compat", "config", "logs", "_parsers", "bounds", "errors", "hooks", "algorithms", "kernels",
     "nccl.bindings", "nccl.header", "trace.recorder", "trace.dumps", "trace.records", "_version"} | _COMPAT,
)
# Subpackages that never import each other, whatever their layers: the NCCL layer knows no
# policy, fault handling no flight recorder (the diagnosis is handed in), and back.
NEVER = {"nccl": ("faults", "trace"), "faults": ("backend", "trace"), "trace": ("faults",)}


def test_compats_submodules_are_imported_through_its_init_alone():
    # The rest of the package reads compat.<name>, wherever a name's subject put it; a gate's
    # submodule imports nothing of compat but the release the gates compare.
    graph = imports(PACKAGE, "cupycoll")
    importers = {module: sorted(targets & _COMPAT) for module, targets in graph.items() if targets & _COMPAT}
    assert importers.pop("compat") == sorted(_COMPAT)
    assert set(importers) <= _COMPAT and all(targets == ["compat.release"] for targets in importers.values())


def _layer(module: str) -> int:
    found = [index for index, layer in enumerate(LAYERS) if module in layer]
    assert found, f"{module} is in no layer of the house: add it to LAYERS (and docs/design.md)"
    return found[0]


def test_no_package_module_imports_one_above_it():
    graph = imports(PACKAGE, "cupycoll")
    upward = sorted((module, target) for module, targets in graph.items() for target in targets
                    if _layer(target) < _layer(module))
    assert upward == []


def test_the_subpackages_that_must_not_know_each_other_do_not():
    graph = imports(PACKAGE, "cupycoll")
    crossing = sorted((module, target) for module, targets in graph.items() for target in targets
                      for low, forbidden in NEVER.items()
                      if module.split(".")[0] == low and target.split(".")[0] in forbidden)
    assert crossing == []


def _imported_top_names(folder: Path) -> dict:
    """file -> the top-level names (cupycoll, bench, tools, ...) its imports reach."""
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
        found[path.relative_to(folder.parent).as_posix()] = names
    return found


def test_the_package_imports_no_tool_and_the_benchmark_no_tool_of_the_checkout():
    # tools/ (the checkout's own scripts) stand above bench/ (the benchmark, shipped as a
    # command), which stands above the package: nothing imports upward.
    root = PACKAGE.parent
    package = {path: names & {"bench", "tools"} for path, names in _imported_top_names(PACKAGE).items()}
    bench = {path: names & {"tools"} for path, names in _imported_top_names(root / "bench").items()}
    assert {path: names for path, names in {**package, **bench}.items() if names} == {}
