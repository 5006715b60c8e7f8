"""CPU tier: bench's modules import each other without a circle.

Read from the source (module- and function-level imports alike), so nothing is imported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import circles, imports

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_no_bench_module_imports_one_that_imports_it_back():
    graph = imports(BENCH, "bench")
    assert {"runner", "scenarios", "rank", "calls", "cli"} <= set(graph)
    assert circles(graph) == [], f"modules on an import circle: {circles(graph)}"
