"""Every torch and CuPy version difference cupycoll copes with, and every read of torch's
private state, in one package.

cupycoll supports torch 2.7.1 to 2.15, CuPy 13 (from 13.0) and 14 (from 14.2), NCCL 2.26.2
onwards (the versions CI runs: see docs/compatibility.md). Where those versions
differ in something cupycoll uses, the difference is handled here, once, with a comment
naming the version that changed it; the rest of the package calls these names as
``compat.<name>`` and never probes versions itself. What torch keeps only in its own Python
(a caller's frame, the ``_world`` of distributed_c10d) is read here too, by helpers that
name the releases whose code they read, so a torch release that renames them breaks this
package alone. Each entry has a test in ``tests/test_compat.py`` that asserts the installed
version's behaviour.

One submodule per subject, each comparing :data:`TORCH` (:mod:`~cupycoll.compat.release`):

* :mod:`~cupycoll.compat.calls`: how torch's calls are made (the tensor collectives'
  names, the short forms' timeout, ``asyncOp``, a ReduceOp's factor, the raw current stream);
* :mod:`~cupycoll.compat.groups`: how torch holds a Python group (entry points,
  split_group, the c10d Backend trampoline and the default shape, the GIL when a group is
  freed, its registered and default backends);
* :mod:`~cupycoll.compat.dynamo`: a group's methods kept out of ``torch.compile``;
* :mod:`~cupycoll.compat.stores`: a store's own client, the store beneath its prefixes,
  several keys in one call;
* :mod:`~cupycoll.compat.gloo`: the CPU half's gloo (lazy connection, the list forms an
  older gloo lacks, reduce_scatter_tensor's op, AVG, its rendezvous keys, its shutdown);
* :mod:`~cupycoll.compat.torch_state`: torch's private state (the group-creating frame, the
  coalescing manager and ``batch_isend_irecv`` on the stack, ``_world``, the default group
  and store);
* :mod:`~cupycoll.compat.cupy_calls`: CuPy 13 against 14.

This module is the one place that imports them: every name the package uses is imported
here, so that ``from cupycoll import compat; compat.<name>`` finds it whatever submodule
holds it. A gate a submodule reads at call time is read from that submodule's globals.

Left out: what every supported version has (``torch.uint32``, the fp8 dtypes, gloo's
``alltoall_base``: nothing to decide), and NCCL's own version facts (which data types and
``ncclConfig_t`` fields exist since which release), which are data in
:mod:`cupycoll.nccl.header` next to the declarations they describe. Nothing here imports
CuPy at import time: CuPy is handed in by the callers that already loaded it.

Elsewhere on purpose, as a try/except at their one call site rather than a version check:
:mod:`cupycoll.faults.all_groups`'s exit hook (Python 3.12+ refuses to start a thread while the
interpreter finalizes) and :mod:`cupycoll.nccl.bindings`' library search (no
``cuda.pathfinder`` with CuPy 13). Also elsewhere: torch's protocol for a ProcessGroup
written in Python (the ``_``-named methods :mod:`cupycoll.process_group` overrides or calls
on itself, and the options classes of ``torch._C._distributed_c10d``, where
``AllgatherOptions`` has no public name), which torch itself drives; ``Backend._plugins``
in :mod:`cupycoll._registration`, whose entry point runs during ``import torch`` and stays
cheap by not importing this package; and ``_create_work_from_future`` in
:mod:`cupycoll.work`.
"""

from __future__ import annotations

from .release import TORCH, _release
from .calls import (EVERY_OPTIONS_HAS_ASYNC_OP, SHORT_FORMS_TAKE_TIMEOUT, TENSOR_COLLECTIVES_RENAMED,
                    all_gather_single, async_requested, current_raw_stream, premul_factor,
                    reduce_scatter_single)
from .groups import (BACKEND_SHAPE_BY_DEFAULT, PROCESS_GROUP_FREED_WITHOUT_GIL, PY_BACKEND,
                     PY_BACKEND_SPLIT_CAN_DECLINE, PY_BACKEND_WORKS_ANSWER_TRUE,
                     SPLIT_GROUP_REACHES_PYTHON_GROUPS, TORCH_LAZY_BACKEND_ENTRY_POINTS, has_backend,
                     set_default_backend)
from .dynamo import run_eagerly_under_compile
from .stores import STORE_CLONE, clone_store, root_store, store_set_many
from .gloo import (GLOO_AVERAGES_FLOATS, GLOO_HAS_ALLTOALL, GLOO_HAS_REDUCE_SCATTER, GLOO_LAZY_INIT,
                   GLOO_REDUCE_SCATTER_HONOURS_OP, FutureWork, gloo_alltoall, gloo_ranks_absent,
                   gloo_reduce_scatter, gloo_reduce_scatter_tensor, new_gloo, shutdown)
from .torch_state import (calling_batch_isend_irecv, calling_coalescing_manager, cuda_backend_being_created,
                          default_group, default_store, forget_coalescing_manager, group_name, is_registered,
                          registered_groups)
from .cupy_calls import cupy_major, external_stream, load_pip_nvrtc

# The names imported above, each read as compat.<name> (where a submodule holds it matters to no caller).
__all__ = [
    "TORCH", "_release", "EVERY_OPTIONS_HAS_ASYNC_OP", "SHORT_FORMS_TAKE_TIMEOUT",
    "TENSOR_COLLECTIVES_RENAMED", "all_gather_single", "async_requested", "current_raw_stream",
    "premul_factor", "reduce_scatter_single", "BACKEND_SHAPE_BY_DEFAULT", "PROCESS_GROUP_FREED_WITHOUT_GIL",
    "PY_BACKEND", "PY_BACKEND_SPLIT_CAN_DECLINE", "PY_BACKEND_WORKS_ANSWER_TRUE",
    "SPLIT_GROUP_REACHES_PYTHON_GROUPS", "TORCH_LAZY_BACKEND_ENTRY_POINTS", "has_backend",
    "set_default_backend", "run_eagerly_under_compile", "STORE_CLONE", "clone_store", "root_store",
    "store_set_many", "GLOO_AVERAGES_FLOATS", "GLOO_HAS_ALLTOALL", "GLOO_HAS_REDUCE_SCATTER", "GLOO_LAZY_INIT",
    "GLOO_REDUCE_SCATTER_HONOURS_OP", "FutureWork", "gloo_alltoall", "gloo_ranks_absent",
    "gloo_reduce_scatter", "gloo_reduce_scatter_tensor", "new_gloo", "shutdown", "calling_batch_isend_irecv",
    "calling_coalescing_manager", "cuda_backend_being_created", "default_group", "default_store",
    "forget_coalescing_manager", "group_name", "is_registered", "registered_groups", "cupy_major",
    "external_stream", "load_pip_nvrtc",
]
