"""Every place in the repository that makes ranks share a GPU turns InfiniBand off.

Ranks sharing one GPU are told apart by a distinct NCCL_HOSTID each, so NCCL treats them as
separate hosts and talks between them over the network. On a machine with an InfiniBand or
RoCE adapter it then prefers that adapter to the loopback socket, and the ranks either fail
to connect or take a path nobody meant to test: whatever sets NCCL_HOSTID must also set
NCCL_IB_DISABLE. A static scan, so that a new launcher cannot forget it unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Set

import pytest

from mp import run_python

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("cupycoll", "bench", "tools", "examples", "tests")


def variables_set(source: str) -> Set[str]:
    """The environment variable names ``source`` assigns, in the forms this repository uses:
    ``env["X"] = v``, ``{"X": v}``, ``f(X=v)`` (os.environ.update, dict), ``env.setdefault("X",
    v)``, and ``("X", "v")`` pairs looped over into setdefault (tools/verify_gpu.py). Reading
    a variable, comparing with its name or naming it in text does not count."""
    found: Set[str] = set()

    def name(node) -> str:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(name(t.slice) for t in targets if isinstance(t, ast.Subscript))
        elif isinstance(node, ast.Dict):
            found.update(name(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Call):
            found.update(k.arg for k in node.keywords if k.arg)
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("setdefault", "putenv") and node.args:
                found.add(name(node.args[0]))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 2 and name(node.elts[1]):
            found.add(name(node.elts[0]))
    found.discard("")
    return found


def python_sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(ROOT).parts):
                yield path


def test_the_scan_sees_each_way_of_setting_a_variable():
    assert variables_set('os.environ["NCCL_HOSTID"] = f"h-{rank}"') == {"NCCL_HOSTID"}
    assert variables_set('env = {"NCCL_HOSTID": "a", "NCCL_IB_DISABLE": "1"}') == {"NCCL_HOSTID", "NCCL_IB_DISABLE"}
    assert variables_set('os.environ.update(NCCL_HOSTID="x", NCCL_IB_DISABLE="1")') == {
        "NCCL_HOSTID", "NCCL_IB_DISABLE"}
    assert variables_set('env.setdefault("NCCL_IB_DISABLE", "1")') == {"NCCL_IB_DISABLE"}
    assert variables_set('for k, v in (("NCCL_IB_DISABLE", "1"),): env.setdefault(k, v)') >= {"NCCL_IB_DISABLE"}
    # reading, comparing and mentioning are not setting
    assert variables_set('x = os.environ.get("NCCL_HOSTID", "")\n'
                         'y = {k: v for k, v in e.items() if k != "NCCL_HOSTID"}\n'
                         'print("each rank gets its own NCCL_HOSTID")') == set()
    # the omission this file exists to catch: NCCL_HOSTID set, NCCL_IB_DISABLE not
    no_ib_disable = ('if args.share_gpu:\n'
                     '    os.environ["NCCL_HOSTID"] = f"{os.uname().nodename}-rank{rank}"\n'
                     '    os.environ["NCCL_SOCKET_IFNAME"] = "lo"\n')
    assert "NCCL_HOSTID" in variables_set(no_ib_disable) and "NCCL_IB_DISABLE" not in variables_set(no_ib_disable)


def test_every_source_that_sets_nccl_hostid_also_disables_infiniband():
    setters, lacking = [], []
    for path in python_sources():
        names = variables_set(path.read_text(encoding="utf-8"))
        if "NCCL_HOSTID" in names:
            setters.append(path.relative_to(ROOT).as_posix())
            if "NCCL_IB_DISABLE" not in names:
                lacking.append(path.relative_to(ROOT).as_posix())
    # the scan really finds the launchers (a scan that finds nothing proves nothing)
    assert {"examples/train_ddp.py", "tests/mp.py", "bench/launch.py"} <= set(setters), setters
    assert lacking == [], f"these set NCCL_HOSTID but not NCCL_IB_DISABLE=1: {lacking}"


@pytest.mark.parametrize("path", ["examples/train_ddp.py", "tests/mp.py", "bench/launch.py",
                                  "bench/fault_bench.py", "tools/gpu_probe.py"])
def test_each_known_launcher_also_puts_nccl_on_the_loopback_interface(path):
    names = variables_set((ROOT / path).read_text(encoding="utf-8"))
    assert {"NCCL_HOSTID", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME"} <= names, names


def test_run_python_lets_the_caller_env_override_the_shared_defaults():
    # The GPU tier's DDP parity test passes shared_gpu_env()'s NCCL_IB_DISABLE, which
    # run_python also sets by default: the caller's value wins, and naming it twice is fine.
    result = run_python("-c", "import os; print(os.environ['NCCL_IB_DISABLE'], os.environ['NCCL_SOCKET_IFNAME'])",
                        timeout=60, env={"NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "lo"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "lo"]
