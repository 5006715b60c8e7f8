"""A cupycoll group under ``torch.compile``: its methods always run eagerly, wrapped in
``torch.compiler.disable`` once torch's Dynamo is imported (at once where it is already).

Left out: what a compiled region calls (functional collectives and FSDP2 reach a group
through torch's C++ ops, not these methods); which classes are wrapped (the shapes ask).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import sys
import threading
from typing import Optional

import torch
from torch.distributed import ProcessGroup


def run_eagerly_under_compile(cls: type, base: type = ProcessGroup) -> type:
    """Wrap each method of ``cls`` that overrides one of ``base``'s (torch's ProcessGroup or
    c10d Backend) in ``torch.compiler.disable``, so that it always runs eagerly: now when
    torch's Dynamo is imported already, else as soon as it is.

    Inside a ``torch.compile``d region Dynamo compiles every Python frame entered, one that
    torch's C++ enters too (DDP's reducer calling the group's ``broadcast`` to rebuild its
    buckets). From torch 2.13 Dynamo sees a process group as an opaque object whose
    unregistered members it refuses to read, so compiling the adapter's methods fails; on
    earlier releases it only wasted compile time. Applied on every release: a group's methods
    launch communication and are never worth compiling. Costs about 1 µs a call.

    ``torch.compiler.disable`` imports Dynamo (seconds, on every supported release), which a
    script that never compiles should not pay at ``init_process_group``: nothing can be
    compiled before Dynamo is imported, so wrapping right after its import (a one-shot hook
    on ``sys.meta_path``, :class:`_AfterDynamoImport`) is in time."""
    with _UNWRAPPED_LOCK:
        if "torch._dynamo" not in sys.modules:
            _UNWRAPPED.append((cls, base))
            _AfterDynamoImport.install()
            return cls
    _disable_overrides(cls, base)
    return cls


def _disable_overrides(cls: type, base: type) -> None:
    for name in dir(cls):  # the class's own methods and those it mixes in
        if name.startswith("__") or not hasattr(base, name):
            continue
        value = inspect.getattr_static(cls, name)
        if callable(value) and value is not inspect.getattr_static(base, name):
            setattr(cls, name, torch.compiler.disable(value))


# The classes waiting for Dynamo's import to be wrapped, and the lock that orders their
# registration against that import's hook.
_UNWRAPPED: list = []
_UNWRAPPED_LOCK = threading.RLock()


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch._dynamo`` is imported it lets the other finders
    find it, and wraps the waiting classes once the module has run."""

    _installed: Optional["_AfterDynamoImport"] = None

    @classmethod
    def install(cls) -> None:
        if cls._installed is None:
            cls._installed = cls()
            sys.meta_path.insert(0, cls._installed)

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # one-shot; and the search below must not find us again
        type(self)._installed = None
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            with _UNWRAPPED_LOCK:
                waiting = list(_UNWRAPPED)
                _UNWRAPPED.clear()
            for cls, base in waiting:
                _disable_overrides(cls, base)
        loader.exec_module = exec_module
        return spec
