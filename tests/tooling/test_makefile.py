"""The Makefile's interpreter choice and install command, checked with ``make -n`` (prints
the commands, runs none), and what ``make demo`` says where torch is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.any_stack,
              pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")]


def _dry_run(*args: str) -> str:
    # Not the calling make's variables either: `make test` run with TORCH_SPEC=... (as CI
    # does) hands them to every make below it through MAKEFLAGS, as command-line values.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RUN_PY", "CUDA_EXTRA", "TORCH_INDEX", "TORCH_SPEC", "MAKEFLAGS", "MFLAGS",
                        "MAKELEVEL", "MAKEOVERRIDES")}
    out = subprocess.run(["make", "-n", "-C", ROOT, *args], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_demo_uses_the_venv_when_it_exists(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert f"{venv}/bin/python examples/demo.py" in _dry_run("demo", f"VENV={venv}")


def test_demo_uses_the_machine_python_without_a_venv(tmp_path):
    out = _dry_run("demo", f"VENV={tmp_path / 'none'}", "PYTHON=/opt/site/python3")
    assert "/opt/site/python3 examples/demo.py" in out


def test_install_picks_the_extra_from_torch_and_honours_pins(tmp_path):
    out = _dry_run("install", f"VENV={tmp_path / 'v'}", "TORCH_INDEX=", "PIP_PINS=cupy-cuda12x==13.0.0")
    assert "--extra-index-url" not in out
    assert "torch.version.cuda" in out  # CUDA_EXTRA empty: derived from the torch build
    assert 'extras="test,$extra"' in out
    assert 'pip install -e ".[$extras]" cupy-cuda12x==13.0.0' in out  # not --quiet: its progress shows
    # two installs from one checkout (CI builds two venvs at once) take turns at the
    # editable step, which writes cupycoll.egg-info into the checkout
    if shutil.which("flock"):
        assert 'flock pyproject.toml ' in out.split('-e ".[$extras]"')[0].splitlines()[-1]
    out = _dry_run("install", f"VENV={tmp_path / 'v'}", "TORCH_INDEX=https://example.invalid/cpu",
                   "CUDA_EXTRA=cuda13")
    assert '--index "https://example.invalid/cpu"' in out and "--index-is-default" not in out
    assert 'extra="cuda13"' in out


def _torch_install(out: str) -> str:
    """The recipe line that installs torch, continuation lines joined, spaces collapsed."""
    joined = out.replace("\\\n", " ")
    (line,) = [line for line in joined.splitlines() if "tools/install_torch.py" in line]
    return " ".join(line.split())


def test_torch_is_installed_by_the_script_only_where_the_venv_has_none(tmp_path):
    line = _torch_install(_dry_run("install", f"VENV={tmp_path / 'v'}"))
    assert line.startswith(f'{tmp_path / "v"}/bin/python -c "import torch" 2>/dev/null || '
                           f'{tmp_path / "v"}/bin/python tools/install_torch.py --spec "torch>=2.7.1"')
    # the defaults are marked as such: the script may probe the index and replace the spec
    assert "--spec-is-default" in line and "--index-is-default" in line
    index = "" if shutil.which("nvidia-smi") else "https://download.pytorch.org/whl/cpu"
    assert f'--index "{index}"' in line


def test_torch_spec_and_index_set_on_the_command_line_are_passed_as_set(tmp_path):
    # CI's legs: TORCH_INDEX= TORCH_SPEC=torch==X
    line = _torch_install(_dry_run("install", f"VENV={tmp_path / 'v'}", "TORCH_INDEX=", "TORCH_SPEC=torch==2.7.1"))
    assert '--spec "torch==2.7.1" --index ""' in line
    assert "-is-default" not in line
    line = _torch_install(_dry_run("install", f"VENV={tmp_path / 'v'}", "TORCH_SPEC=torch==2.11.0"))
    assert "--spec-is-default" not in line and "--index-is-default" in line


def test_demo_without_torch_says_how_to_install():
    # -S: no site-packages, so no torch, as in a new shell without the venv
    proc = subprocess.run([sys.executable, "-S", os.path.join(ROOT, "examples", "demo.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "has no torch" in proc.stderr and "make install" in proc.stderr


def _recipe(out: str, marker: str) -> str:
    """The one recipe line of a dry run that holds ``marker``, continuation lines joined."""
    (line,) = [line for line in out.replace("\\\n", " ").splitlines() if marker in line]
    return " ".join(line.split())


def test_make_test_runs_the_tier_with_its_own_plugins_only(tmp_path):
    line = _recipe(_dry_run("test", f"VENV={tmp_path / 'v'}", "PYTEST_ARGS=-q"), "-m pytest")
    # the machine's pytest plugins (the venv sees its site-packages) stay out; the two the
    # tier uses are named
    assert line.startswith(f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {tmp_path / 'v'}/bin/python -m pytest ")
    assert "-p xdist.plugin -p pytest_timeout -n 3 --dist worksteal --timeout 300" in line
    assert line.endswith('-m "not gpu" -q')


def test_make_test_quick_runs_tests_that_exist(tmp_path):
    line = _recipe(_dry_run("test-quick", f"VENV={tmp_path / 'v'}"), "-m pytest")
    ids = [word.strip('"') for word in line.split() if word.strip('"').startswith("tests/")]
    assert len(ids) >= 3
    for test_id in ids:
        path, _, name = test_id.partition("::")
        assert os.path.isfile(os.path.join(ROOT, path)), f"QUICK_TESTS names {path}, which is gone"
        if name:
            function = name.split("[")[0]
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                assert f"def {function}(" in f.read(), f"QUICK_TESTS names {test_id}, which is gone"


def test_make_bench_runs_the_benchmark_on_cpu_where_there_is_no_gpu(tmp_path):
    out = _dry_run("bench", f"VENV={tmp_path / 'none'}", "PYTHON=/opt/site/python3")
    line = _recipe(out, "-m bench")
    device = "" if shutil.which("nvidia-smi") else "--device cpu "
    assert line.endswith(f"/opt/site/python3 -m bench {device}all_reduce -b 1K -e 16M -f 4")
    line = _recipe(_dry_run("bench", f"VENV={tmp_path / 'none'}", "BENCH_ARGS=--scenario overhead",
                            "BENCH_DEVICE="), "-m bench")
    assert line.endswith("-m bench --scenario overhead")


def test_make_test_installs_torchft_before_the_tier_only_where_torchft_spec_names_it(tmp_path):
    out = _dry_run("test", f"VENV={tmp_path / 'v'}", "TORCHFT_SPEC=torchft==0.2.0")
    lines = out.replace("\\\n", " ").splitlines()
    install = [i for i, line in enumerate(lines) if 'pip install "torchft==0.2.0" "parameterized==0.9.0"' in line]
    tier = [i for i, line in enumerate(lines) if "-m pytest" in line]
    assert len(install) == 1 and len(tier) == 1 and install[0] < tier[0], out
    assert lines[install[0]].startswith(f"{tmp_path / 'v'}/bin/python -m pip install")
    assert "torchft" not in _dry_run("test", f"VENV={tmp_path / 'v'}")
