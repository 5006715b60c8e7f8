"""cupycoll's optional integrations (cupycoll.torchft): ``import cupycoll`` never imports them,
and one imported without its framework says what to install."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from cupycoll.errors import MissingDependencyError


def test_the_torchft_integration_without_torchft_says_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # an import of it raises ImportError
    monkeypatch.delitem(sys.modules, "cupycoll.torchft", raising=False)
    with pytest.raises(MissingDependencyError, match=r"cupycoll.torchft needs torchft.*pip install torchft"):
        importlib.import_module("cupycoll.torchft")


def test_import_cupycoll_imports_no_integration():
    code = "import sys, cupycoll; print('cupycoll.torchft' in sys.modules, 'torchft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
