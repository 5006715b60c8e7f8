"""Every read of torch's private state: what torch keeps only in its own Python (a
caller's frame, distributed_c10d's ``_world`` and default group and store) and hands no
backend, read by the names torch 2.7.1 - 2.15 give them, so that a torch release that
renames them breaks this module alone.

Left out: torch's protocol for a ProcessGroup written in Python (the ``_``-named methods the
shapes override or call, which torch itself drives), and what is read of torch's public API.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Callable, List, Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup


# Read by the names torch's distributed_c10d.py gives them, which are the same on every
# supported release (2.7.1 - 2.15; each CI leg's tests/test_compat.py checks them).


def cuda_backend_being_created() -> Optional[str]:
    """The CUDA backend (lower case, as torch's backend string names it) of the group that
    torch's ``_new_process_group_helper``, up the caller's stack, is creating: ``""`` when
    that string does not parse, None when the caller is not inside the helper."""
    # torch 2.7.1 - 2.14 ask the default group's CUDA backend ``supports_splitting`` while
    # creating any subgroup of a bound default group (_get_split_source), whatever the new
    # group's backend, and tell it nothing of that backend; 2.15 passes the requested backend
    # to _get_split_source and compares the names itself, but still asks. The helper's
    # ``backend`` argument, read from its frame, is the only record of the new group's.
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            backend = frame.f_locals.get("backend")
            try:
                mapping = dist.distributed_c10d.BackendConfig(backend).get_device_backend_map()
            except Exception:  # noqa: BLE001 - an unparsable backend names no CUDA backend
                return ""
            return str(mapping.get("cuda", "")).lower()
        frame = frame.f_back
    return None


# How far above its caller calling_coalescing_manager looks for torch's manager: the caller
# (a group's hook), _start_coalescing, torch.compiler.disable's wrapper around it
# (run_eagerly_under_compile), the manager's body and contextlib's __enter__.
_COALESCING_MANAGER_REACH = 6


def calling_coalescing_manager(on_freed: Optional[Callable] = None):
    """A weak reference to the ``torch.distributed._coalescing_manager`` generator whose
    ``with`` statement is calling ``_start_coalescing`` up the caller's stack (None when it
    is called some other way); ``on_freed(ref)`` runs when that generator is freed."""
    # torch 2.7.1 - 2.15: _coalescing_manager is a contextlib generator that calls
    # _start_coalescing from its body and, when the ``with`` body raises, never calls
    # _end_coalescing (nothing runs in a finally). Only the generator (contextlib's
    # __enter__ frame holds it as ``self.gen``) tells when that ``with`` statement is over:
    # closed, or freed.
    frame = sys._getframe(1)
    for _ in range(_COALESCING_MANAGER_REACH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        generator = getattr(owner, "gen", None)
        if inspect.isgenerator(generator) and generator.gi_code.co_name == "_coalescing_manager":
            if on_freed is None:
                return weakref.ref(generator)
            method = weakref.WeakMethod(on_freed)  # the ref must not keep the group alive
            return weakref.ref(generator, lambda ref: method() and method()(ref))
        frame = frame.f_back
    return None


# How far above its caller calling_batch_isend_irecv looks: the caller (a group's send or
# recv), torch.compiler.disable's wrapper around it, torch's isend/irecv and its logging
# decorators, batch_isend_irecv.
_BATCH_REACH = 8
_C10D_FILE = dist.distributed_c10d.__file__


def calling_batch_isend_irecv() -> bool:
    """Is torch's ``batch_isend_irecv`` up the caller's stack (the caller: a group's send or
    recv)? torch 2.7.1 - 2.15 hand a ProcessGroup written in Python the ops of a batch one by
    one (its coalescing manager is taken only for torch's own ProcessGroup type), and their
    frame is all that tells a batch's send from a lone one."""
    frame = sys._getframe(1)
    for _ in range(_BATCH_REACH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "batch_isend_irecv" and code.co_filename == _C10D_FILE:
            return True
        frame = frame.f_back
    return False


def forget_coalescing_manager(group: ProcessGroup) -> None:
    """Drop torch's record of a ``_coalescing_manager`` on ``group`` whose body raised."""
    # torch 2.7.1 - 2.15 pop the group from _world.pg_coalesce_state only after the manager's
    # body returned; a raising body leaves it there, and every later dist.all_reduce (and the
    # other fast-path collectives) on the group is captured into that dead manager's list
    # instead of reaching the group.
    dist.distributed_c10d._world.pg_coalesce_state.pop(group, None)


# torch's registry of groups (distributed_c10d's _world and the default group's helpers),
# read as torch 2.7.1 - 2.15 keep it, for a shrink: is a group still registered, which others
# are, its name, the default group and its store.
def default_group() -> ProcessGroup:
    """The default group; ValueError (torch's) when none was initialized."""
    return dist.distributed_c10d._get_default_group()


def default_store():
    return dist.distributed_c10d._get_default_store()


def registered_groups() -> List[ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map)


def is_registered(group: ProcessGroup) -> bool:
    return group in dist.distributed_c10d._world.pg_map


def group_name(group: ProcessGroup) -> str:
    """The name torch gave ``group`` (its own record once it was destroyed, if any)."""
    return dist.distributed_c10d._world.pg_names.get(group) or getattr(group, "group_name", "?")
