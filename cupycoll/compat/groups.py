"""Version differences in how torch holds a Python group: the backend's entry points,
split_group, the c10d Backend trampoline (and so a group's default shape), what freeing a
ProcessGroup does with the GIL, a group's registered backends and its default one.

Left out: which shape a group takes (:func:`cupycoll.config.shape`, handed
``BACKEND_SHAPE_BY_DEFAULT``), the shapes themselves (:mod:`cupycoll.process_group`,
:mod:`cupycoll.py_backend`), Dynamo's view of a group (:mod:`cupycoll.compat.dynamo`).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from .release import TORCH


# How "cupycoll" becomes known to init_process_group without ``import cupycoll``: every
# supported release autoloads "torch.backends" entry points at ``import torch``; torch 2.14
# also loads a "torch.distributed.backends" entry point named like the backend when
# init_process_group meets an unknown name (2.13 has no Backend._ensure_backend_registered,
# 2.15 has; 2.14 is not run, but 2.14.1's distributed_c10d.py has it). pyproject.toml
# declares both; cupycoll's code does not branch on these.
TORCH_LAZY_BACKEND_ENTRY_POINTS = TORCH >= (2, 14)



# torch 2.11's split_group (dist.split_group, and init_device_mesh for a bound default group)
# calls the parent ProcessGroup's split_group, which a Python group overrides; 2.7.1's builds a
# ProcessGroupNCCL itself and refuses any other backend ("its backend does not support
# splitting"), and its DeviceMesh takes that path whenever the default group has a
# bound_device_id. 2.8 - 2.10 are not run: treated as 2.7.1. Where it cannot, a cupycoll group
# keeps the device it was bound to for itself (its subgroups are still split from it through
# new_group) and shows torch no bound_device_id, so that init_device_mesh makes its groups with
# new_group.
SPLIT_GROUP_REACHES_PYTHON_GROUPS = TORCH >= (2, 11)



# torch 2.14 dispatches to a Python subclass of c10d's Backend: its PyBackend trampoline
# (torch/csrc/distributed/c10d/py/PyBackend.hpp, present in 2.14.1's and 2.15.0's wheels)
# forwards every collective, coalescing, split, abort and shutdown to the Python override.
# Before it, a Python Backend's methods are never called from C++, so a Python group must be
# a whole ProcessGroup (cupycoll.process_group). 2.14.0 is not run; 2.14.1 and 2.15 are.
PY_BACKEND = TORCH >= (2, 14)

# Which shape a group takes by default. The trampoline wraps whatever Work a Python Backend
# returns in its PyWorkHolder (torch/csrc/distributed/c10d/py/PyProcessGroup.hpp, the same in
# 2.14.1, 2.15.0 and torch's main of November 2026), which passes on wait() and get_future()
# alone and answers the rest from its own state, never set: is_completed() False for good
# (after wait() too), is_success() True and exception() None whatever happened, result()
# "not implemented". No Work a backend returns changes that, C++ ones included
# (_create_work_from_future, whose own answers differ but never reach the caller). So no
# release yet gives true Works in the Backend shape, and the ProcessGroup shape, whose Works
# reach the caller unwrapped, is the default on every release; the Backend shape is there
# for CUPYCOLL_SHAPE=backend. tests/test_work_answers.py pins the holder's answers on each
# release that has it: the release that passes them on fails it, and its gate goes here.
PY_BACKEND_WORKS_ANSWER_TRUE = False
BACKEND_SHAPE_BY_DEFAULT = PY_BACKEND and PY_BACKEND_WORKS_ANSWER_TRUE

# The trampoline's split (PyBackend.hpp's split, through initSlotAndCast, 2.14.1 and 2.15)
# casts what a Python Backend's split returns and dereferences it: None, a rank's "no group"
# when it is in none of split_group's sub-lists, crashes the process (seen here: 2.15). So a
# Python Backend cannot decline a split on any release yet; cupycoll raises there instead.
PY_BACKEND_SPLIT_CAN_DECLINE = False



def has_backend(group: ProcessGroup, device: torch.device) -> bool:
    """Has ``group`` a backend registered for ``device``'s type?"""
    return device in group._device_types



# Freeing a ProcessGroup's Python object releases the GIL before its C++ destructor runs
# (pytorch#154976, June 2025; the bindings of 2.13 and 2.15 checked here). Before, it held
# the GIL, and a group holding the last reference to a gloo backend hung the process when
# freed right after a CPU call: gloo's destructor joins its worker threads while a worker,
# dropping the finished Work, waits for the GIL to free a tensor that Python let go of
# (torch 2.7.1, seen here). Earlier than 2.9 is treated as 2.7.1: there a group does not
# hold its gloo in its own C++ part (cupycoll.shell.GroupShell._keep_gloo_last).
PROCESS_GROUP_FREED_WITHOUT_GIL = TORCH >= (2, 9)



def set_default_backend(group: ProcessGroup, backend_type) -> None:
    """Make ``backend_type`` (one registered on ``group``) its default backend.

    A Python group that torch adopts whole has none otherwise, and torch 2.15's
    init_process_group attaches a flight-recorder hook that looks the default up ("Could not
    find the default backend type 0 ..."): every init failed without this."""
    # A private method, which every supported release has (2.7.1 - 2.15).
    group._set_default_backend(backend_type)
