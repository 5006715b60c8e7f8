"""torch's own DistributedTest suite, a chosen part of it, against cupycoll's CPU route at
world size 2 (tests/workers/torch_suite.py redirects the suite's gloo groups to cupycoll).

The part is chosen for what cupycoll changes on the way to gloo and only torch's suite
checks: the words of a timeout (torch matches ``(Timed out|closed|timeout)``) and argument
errors raised where gloo raises them. (Works and their futures against gloo's are
tests/test_work_surface.py's.) Each test spawns its two ranks, about 20 s on a busy 2-core
machine, so the whole suite, about 280 tests, is a recorded run rather than part of every
CI leg: ``make test-torch-suite`` (docs/design.md lists what it printed).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mp import ROOT

pytest.importorskip("expecttest", reason="torch's testing module needs expecttest (the test extra)")

# What it guards, the words and errors cupycoll hands torch's expectations, is cupycoll's own
# and the same on every stack: one CI leg catches a change (spawning torch's test harness
# costs about a minute a leg).
pytestmark = [pytest.mark.any_stack, pytest.mark.launches]

SUITE = "tests/workers/torch_suite.py"
CLASS = "TestCupycollCpuRoute"

CHOSEN = (
    "test_barrier_timeout_full_group",
    "test_gather_checks",
)


def suite_command(names):
    """torch's suite runs under unittest, as torch's own CI runs it (before torch 2.7 its test
    case cannot be collected by pytest)."""
    return [sys.executable, SUITE, *[f"{CLASS}.{name}" for name in names]]


def suite_env(tmp_path):
    return dict(os.environ, BACKEND="gloo", WORLD_SIZE="2", TEMP_DIR=str(tmp_path),
                PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "workers"), str(ROOT)]))


def test_torchs_distributed_suite_passes_on_the_cpu_route(tmp_path):
    done = subprocess.run(suite_command(CHOSEN), cwd=ROOT, env=suite_env(tmp_path), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert f"Ran {len(CHOSEN)} tests" in done.stderr, done.stderr[-3000:]
