"""cupycoll's exit and fork hooks (cupycoll.hooks): one declared order, every module's hook
in it, none registered anywhere else, and one hook's failure does not skip the next."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import cupycoll.process_group  # noqa: F401 - imports every module that registers a hook
from cupycoll import hooks

PACKAGE = Path(hooks.__file__).resolve().parent


def test_every_hook_of_the_package_has_its_declared_place():
    assert set(hooks._exit) == set(hooks.EXIT_ORDER)
    assert set(hooks._fork) == set(hooks.FORK_ORDER)


def test_no_module_registers_an_exit_or_fork_hook_of_its_own():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "hooks.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "atexit.register" not in text and "register_at_fork" not in text, path


def test_hooks_run_in_the_declared_order_whatever_order_they_were_registered_in(monkeypatch):
    monkeypatch.setattr(hooks, "_exit", {})
    ran = []
    for owner in reversed(hooks.EXIT_ORDER):
        hooks.at_exit(owner, lambda owner=owner: ran.append(owner))
    hooks.run_exit_hooks()
    assert ran == list(hooks.EXIT_ORDER)


def test_a_failing_hook_is_logged_and_the_next_one_runs(monkeypatch, caplog):
    monkeypatch.setattr(hooks, "_fork", {})
    ran = []
    first, second = hooks.FORK_ORDER[:2]

    def fail():
        raise RuntimeError("broken")

    hooks.in_forked_child(first, fail)
    hooks.in_forked_child(second, lambda: ran.append(second))
    with caplog.at_level(logging.ERROR, logger="cupycoll.hooks"):
        hooks.run_fork_hooks()
    assert ran == [second]
    assert f"the fork hook of cupycoll.{first} failed" in caplog.text


def test_a_hook_without_a_declared_place_is_refused():
    with pytest.raises(ValueError, match="'ring' has no place in hooks.EXIT_ORDER"):
        hooks.at_exit("ring", lambda: None)
    with pytest.raises(ValueError, match="'ring' has no place in hooks.FORK_ORDER"):
        hooks.in_forked_child("ring", lambda: None)
