"""Every torch and CuPy version difference cupycoll copes with, and every read of torch's
private state, in one place.

cupycoll supports torch 2.7.1 to 2.15, CuPy 13 (from 13.0) and 14 (from 14.2), NCCL 2.26.2
onwards (the versions CI runs: see docs/compatibility.md). Where those versions
differ in something cupycoll uses, the difference is handled here, once, with a comment
naming the version that changed it; the rest of the package calls these functions and never
probes versions itself. What torch keeps only in its own Python (a caller's frame, the
``_world`` of distributed_c10d) is read here too, by helpers that name the releases whose
code they read, so a torch release that renames them breaks this module alone.
Each entry has a test in ``tests/test_compat.py`` that asserts the installed version's
behaviour.

Left out: what every supported version has (``torch.uint32``, the fp8 dtypes, gloo's
``alltoall_base``: nothing to decide), and NCCL's own version facts (which data types and
``ncclConfig_t`` fields exist since which release), which are data in
:mod:`cupycoll.nccl.bindings` next to the declarations they describe. This module imports
no CuPy at import time: CuPy is handed in by the callers that already loaded it.

Elsewhere on purpose, as a try/except at their one call site rather than a version check:
:mod:`cupycoll.faults.lifecycle`'s exit hook (Python 3.12+ refuses to start a thread while the
interpreter finalizes) and :mod:`cupycoll.nccl.bindings`' library search (no
``cuda.pathfinder`` with CuPy 13). Also elsewhere: torch's protocol for a ProcessGroup
written in Python (the ``_``-named methods :mod:`cupycoll.process_group` overrides or calls
on itself, and the options classes of ``torch._C._distributed_c10d``, where
``AllgatherOptions`` has no public name), which torch itself drives; ``Backend._plugins``
in :mod:`cupycoll._registration`, whose entry point runs during ``import torch`` and stays
cheap by not importing this module; and ``_create_work_from_future`` in
:mod:`cupycoll.work`.
"""

from __future__ import annotations

import datetime
import importlib.abc
import importlib.util
import inspect
import operator
import os
import re
import sys
import threading
import weakref
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .errors import CupycollValueError


def _release(version: str) -> tuple:
    """``"2.15.0+cu132"`` -> ``(2, 15)``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


TORCH = _release(torch.__version__)

# ------------------------------------------------------------------------------ torch

# How "cupycoll" becomes known to init_process_group without ``import cupycoll``: every
# supported release autoloads "torch.backends" entry points at ``import torch``; torch 2.14
# also loads a "torch.distributed.backends" entry point named like the backend when
# init_process_group meets an unknown name (2.13 has no Backend._ensure_backend_registered,
# 2.15 has; 2.14 is not run, but 2.14.1's distributed_c10d.py has it). pyproject.toml
# declares both; cupycoll's code does not branch on these.
TORCH_LAZY_BACKEND_ENTRY_POINTS = TORCH >= (2, 14)


# torch 2.13 renamed the tensor-in/tensor-out collectives all_gather_into_tensor and
# reduce_scatter_tensor to all_gather_single and reduce_scatter_single; the old names, which
# every supported version has, warn there ("... is deprecated"). 2.11 has only the old
# names; 2.12 is not run (the rename, the stack of pytorch#186134, came in June 2026, after
# its release), and the old names work there anyway. For callers outside the package (the
# benchmark): warning-free on every version. The same release binds ProcessGroup's methods
# under the new names too (all_gather_single, all_gather_single_coalesced,
# reduce_scatter_single, reduce_scatter_single_coalesced, all_to_all_single) next to the old
# ones (_allgather_base, allgather_into_tensor_coalesced, _reduce_scatter_base,
# reduce_scatter_tensor_coalesced, alltoall_base); 2.11 and 2.7.1 bind the old ones alone
# (run here). A cupycoll group answers both names on every release.
TENSOR_COLLECTIVES_RENAMED = TORCH >= (2, 13)
if TENSOR_COLLECTIVES_RENAMED:
    all_gather_single = dist.all_gather_single
    reduce_scatter_single = dist.reduce_scatter_single
else:
    all_gather_single = dist.all_gather_into_tensor
    reduce_scatter_single = dist.reduce_scatter_tensor


# torch 2.9 gave every short form of ProcessGroup's methods (a bare op, a root, one tensor) a
# trailing ``timeout`` and added the forms alltoall_base(..., timeout) and barrier(timeout)
# (pytorch#158123, July 2025, after 2.8's branch cut). Run here: 2.11, 2.13 and 2.15 bind
# them, 2.7.1 does not; 2.8 - 2.10 are not run. cupycoll.call_forms takes the timeouts on
# every release (2.7.1's binding refuses such a call, and binds no other form to it), so
# nothing in the package branches on this: it says which forms this torch's own binding has.
SHORT_FORMS_TAKE_TIMEOUT = TORCH >= (2, 9)


def premul_factor(reduce_op) -> Optional[object]:
    """The factor of a ``ReduceOp`` made by ``dist._make_nccl_premul_sum`` (a number or a
    one-element tensor); None when ``reduce_op`` carries none."""
    # torch 2.13 binds ReduceOp.factor; 2.7-2.12 do not, and reading it there made a valid
    # PREMUL_SUM op look like one without a factor. The pickling state is the same on all
    # of them: __getstate__() returns (op, factor), factor None unless PREMUL_SUM.
    if type(reduce_op) is not ReduceOp:  # a bare RedOpType carries no factor
        return None
    state = reduce_op.__getstate__()
    return state[1] if len(state) > 1 else None


#: torch 2.11: every options object has ``asyncOp`` (2.7 has it on the options of broadcast,
#: all-gather, scatter and reduce-scatter only; 2.8 - 2.10 are not run).
EVERY_OPTIONS_HAS_ASYNC_OP = TORCH >= (2, 11)

if EVERY_OPTIONS_HAS_ASYNC_OP:
    #: async_requested(opts): did the caller pass ``async_op=True``? (One C call: the hot path's.)
    async_requested = operator.attrgetter("asyncOp")
else:
    def async_requested(opts) -> bool:
        """Did the caller pass ``async_op=True``? Where an options object has no asyncOp,
        torch waits on the Work itself, so the call counts as asynchronous."""
        return bool(getattr(opts, "asyncOp", True))


# The current stream's raw pointer in one C call: torch._C._cuda_getCurrentRawStream (every
# CUDA build from 1.10 to 2.15; what Inductor's generated code calls), about 0.2 µs where
# torch.cuda.current_stream() builds a Python Stream (about 4 µs). A build without it (CPU
# builds, and the stand-ins of the CPU tests) takes the public call.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream_pointer(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


#: current_raw_stream(device_index): the current CUDA stream of device ``device_index`` on
#: this thread, as a raw pointer (the C call itself where torch has it: no Python frame).
current_raw_stream = _raw_stream if _raw_stream is not None else _current_stream_pointer


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


# torch 2.7.1 - 2.15: the Work ``_create_work_from_future`` makes returns True from wait()
# even when its future failed, so a gloo error computed through a future would read as success.
class FutureWork(dist.Work):
    """A CPU Work over a ``torch.futures.Future``, for results cupycoll computes from a gloo
    call (the fallbacks below). Unlike ``_create_work_from_future``'s, ``wait()`` raises the
    future's error, so a gloo timeout or a dead peer is not reported as success."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except Exception as exc:  # noqa: BLE001 - the future's own error, handed back
            return exc
        return None

    def result(self) -> List[torch.Tensor]:
        return self._future.wait()

    def get_future(self) -> torch.futures.Future:
        return self._future


# torch 2.8 gave the stores clone(): a new client of the same server, a connection of its
# own (pytorch#150966, April 2025, between 2.7's and 2.8's branch cuts; 2.7.1 has none, 2.11,
# 2.13 and 2.15 have it; 2.8 - 2.10 are not run). Where there is one, a rank's diagnosis
# listener waits for its bell on it, served by the store (a wait on the group's own client
# would hold every other call of that client back: a client serves one call at a time);
# where there is none it looks every bounds.RESPONDER_INTERVAL_S.
STORE_CLONE = TORCH >= (2, 8)


def clone_store(store):
    """A client of ``store``'s server of its own (see STORE_CLONE), or None where torch has
    none. A store that cannot be cloned raises what its ``clone`` raises."""
    if not STORE_CLONE:
        return None
    return store.clone()


def root_store(store):
    """The store beneath ``store``'s prefixes: the one every group of a job shares (every
    supported torch has ``PrefixStore.underlying_store``)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def store_set_many(store, keys: Sequence[str], values: Sequence[bytes]) -> None:
    """Set ``keys`` to ``values`` in one call (``multi_set``: torch 2.1+, every supported
    release; one ``set`` each on a store that does not implement it, as a Python store may)."""
    try:
        store.multi_set(list(keys), list(values))
    except (AttributeError, NotImplementedError):
        for key, value in zip(keys, values):
            store.set(key, value)


# torch 2.8 lets gloo connect lazily (pytorch#150801, April 2025: create_device(lazy_init=...)
# and TORCH_GLOO_LAZY_INIT, which torch's ProcessGroupGloo constructor reads at each creation:
# "1", "true", "yes" or "y"): a pair connects on its first use instead of every rank
# connecting to every other one at creation. 2.7.1 has no lazy_init; 2.11, 2.13 and 2.15 have
# it (2.8 - 2.10 are not run). What it costs, seen on 2.13: the creation waits for no peer
# (each rank only publishes its address), and the side of a pair that listens (gloo picks it
# by the pair's addresses) waits for its peer's connection up to 5 times the timeout
# (gloo/transport/tcp/pair.h, waitUntil), so a collective a peer never makes fails there
# after five timeouts, not one. A group's CPU half is therefore torch's own gloo (eager unless
# the job sets TORCH_GLOO_LAZY_INIT, read by cupycoll.config.gloo_lazy_init), and a lazy one's
# creation counts every rank in (cupycoll.shell.build_gloo_half).
GLOO_LAZY_INIT = TORCH >= (2, 8)


def new_gloo(store, rank: int, size: int, timeout: datetime.timedelta) -> "dist.ProcessGroupGloo":
    """torch's gloo backend on ``store``, its device as torch's constructor picks it
    (GLOO_SOCKET_IFNAME; lazy where the job sets TORCH_GLOO_LAZY_INIT: GLOO_LAZY_INIT)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def has_backend(group: ProcessGroup, device: torch.device) -> bool:
    """Has ``group`` a backend registered for ``device``'s type?"""
    return device in group._device_types


# torch 2.12 gave ProcessGroupGloo the list form of alltoall: pytorch#165435 (for
# pytorch#88245) landed in April 2026, between 2.11 and 2.12's release in May. Run here: 2.11
# raises "Backend gloo does not support alltoall", 2.13 and 2.15 do not; 2.12 itself is not.
# alltoall_base (all_to_all_single) works on every supported version, so before 2.12
# cupycoll's CPU route builds the list form from it.
GLOO_HAS_ALLTOALL = TORCH >= (2, 12)


def gloo_alltoall(gloo: ProcessGroup, outputs: Sequence[torch.Tensor],
                  inputs: Sequence[torch.Tensor], opts) -> dist.Work:
    """``alltoall`` on a gloo group, also where gloo lacks it (see GLOO_HAS_ALLTOALL).

    The fallback sends the inputs flattened into one buffer through ``alltoall_base`` with
    per-peer element counts as split sizes, then copies each peer's slice into its output
    when the transfer completes (so ``async_op=True`` stays asynchronous)."""
    if GLOO_HAS_ALLTOALL:
        return gloo.alltoall(list(outputs), list(inputs), opts)
    send = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
    recv = torch.empty(sum(t.numel() for t in outputs), dtype=send.dtype)
    work = gloo.alltoall_base(recv, send, [t.numel() for t in outputs],
                              [t.numel() for t in inputs], opts)

    def unpack(done) -> List[torch.Tensor]:
        done.wait()  # gloo's error (a timeout, a dead peer) fails this Work too
        for out, piece in zip(outputs, torch.split(recv, [t.numel() for t in outputs])):
            out.copy_(piece.view(out.shape))
        return list(outputs)

    return FutureWork(work.get_future().then(unpack))


# torch 2.7's gloo _reduce_scatter_base (reduce_scatter_tensor) sums whatever the op:
# MAX, MIN, PRODUCT and AVG all come back as SUM (run here: 2.7.1). 2.11's honours the op.
# Which release in between fixed it is unknown: 2.8 - 2.10 are not run, and no fix was found
# in torch's issues. So the gate is conservative: those releases take the fallback, which is
# correct on every version (the tests run it on each CI leg) and costs only twice the traffic.
# There gloo's checks of the tensors (dtypes, the first dimension a world's worth of the
# output's, the rest alike) are failed CHECKs that abort the process (run here: 2.7.1), where
# 2.11's raise a RuntimeError: so the fallback checks them first.
GLOO_REDUCE_SCATTER_HONOURS_OP = TORCH >= (2, 11)


def gloo_reduce_scatter_tensor(gloo: ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                               opts) -> dist.Work:
    """``reduce_scatter_tensor`` on a gloo group with the op the caller gave.

    Where gloo would sum anyway (GLOO_REDUCE_SCATTER_HONOURS_OP), an all-reduce of the whole
    input with the op, of which this rank keeps its chunk: twice the traffic, right result;
    and tensors gloo would refuse are a CupycollValueError there, before anything is sent.
    Elsewhere bad input gets gloo's own errors, as from _reduce_scatter_base."""
    if GLOO_REDUCE_SCATTER_HONOURS_OP:
        return gloo._reduce_scatter_base(output, input, opts)
    size = gloo.size()
    if (input.dtype != output.dtype or output.dim() == 0 or input.dim() != output.dim()
            or input.shape[1:] != output.shape[1:] or input.shape[0] != output.shape[0] * size):
        raise CupycollValueError(
            f"reduce_scatter_tensor on CPU tensors: input {_shown(input)} for output {_shown(output)} in a "
            f"group of {size}; the input must be the output's dtype and shape but for its first "
            f"dimension, {size} times the output's")
    if opts.reduceOp == ReduceOp.SUM:
        return gloo._reduce_scatter_base(output, input, opts)
    full = input.detach().clone().reshape(-1)
    # gloo's all-reduce has no AVG ("Cannot use ReduceOp.AVG with Gloo"): SUM, then divide.
    average = opts.reduceOp == ReduceOp.AVG
    all_opts = dist.AllreduceOptions()
    all_opts.reduceOp = ReduceOp.SUM if average else opts.reduceOp
    work = gloo.allreduce([full], all_opts)
    start = gloo.rank() * output.numel()

    # The callback must not hold the group: it is released on a gloo worker thread, and if
    # it held the last reference, the group's destructor would join that very thread (abort).
    def keep_chunk(done) -> List[torch.Tensor]:
        done.wait()  # gloo's error (a timeout, a dead peer, an op it lacks) fails this Work too
        chunk = full[start:start + output.numel()].view(output.shape)
        output.copy_(chunk / size if average else chunk)
        return [output]

    return FutureWork(work.get_future().then(keep_chunk))


# torch 2.8 gave ProcessGroupGloo the list form of reduce_scatter (pytorch#149869, March
# 2025: an all-reduce per rank). Run here: 2.7.1 raises "ProcessGroupGloo does not support
# reduce_scatter", 2.11, 2.13 and 2.15 honour every op. 2.8 - 2.10 are not run: treated as
# 2.7.1, as whether the first version passed the op on is not known. Before 2.11 cupycoll's
# CPU route builds the list form from reduce_scatter_tensor's (above), correct on every
# version.
GLOO_HAS_REDUCE_SCATTER = TORCH >= (2, 11)


def gloo_reduce_scatter(gloo: ProcessGroup, outputs: Sequence[torch.Tensor],
                        input_lists: Sequence[Sequence[torch.Tensor]], opts) -> dist.Work:
    """``reduce_scatter`` (the list form) on a gloo group, also where gloo lacks it (see
    GLOO_HAS_REDUCE_SCATTER).

    The fallback takes what gloo's list form takes, one output and one list of an input per
    rank, each of the output's shape and dtype (else a CupycollValueError naming them, before
    anything is sent), and reduce-scatters the inputs joined along their first dimension
    into the output with :func:`gloo_reduce_scatter_tensor`."""
    if GLOO_HAS_REDUCE_SCATTER:
        return gloo.reduce_scatter(outputs, input_lists, opts)
    size = gloo.size()
    if len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != size:
        raise CupycollValueError(
            f"reduce_scatter on CPU tensors: {len(outputs)} outputs and input lists of "
            f"{[len(inputs) for inputs in input_lists]} tensors in a group of {size}; gloo takes one output "
            f"and one list of {size} inputs (one per rank)")
    output, inputs = outputs[0], list(input_lists[0])
    for index, tensor in enumerate(inputs):
        if tensor.dtype != output.dtype or tensor.shape != output.shape:
            raise CupycollValueError(
                f"reduce_scatter on CPU tensors: input {index} is {_shown(tensor)}, the output "
                f"{_shown(output)}; each input must be the output's dtype and shape")
    if output.dim() == 0:  # reduce_scatter_tensor's chunks lie along a first dimension
        output, inputs = output.view(1), [tensor.view(1) for tensor in inputs]
    return gloo_reduce_scatter_tensor(gloo, output, torch.cat(inputs), opts)


def _shown(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')}{tuple(tensor.shape)}"


def gloo_ranks_absent(store, rank: int, size: int) -> Optional[List[int]]:
    """The ranks that never published their address into ``store`` (the store a
    ProcessGroupGloo was built on) while this ``rank`` waited in its rendezvous; None when
    that cannot be told (the layout below does not hold, or the store does not answer)."""
    # torch 2.7.1 - 2.15's ProcessGroupGloo runs gloo's rendezvous once per device under a
    # prefix of the device's index: one device, so rank r's addresses are key "0/<r>" (a
    # timed-out creation names it: "wait timeout ... keys: .../0/2"). This rank's own key
    # must be there; if it is not, the layout changed and no rank is named.
    try:
        present = [store.check([f"0/{r}"]) for r in range(size)]
    except Exception:  # noqa: BLE001 - a dead store: nothing can be told
        return None
    if not present[rank]:
        return None
    return [r for r, there in enumerate(present) if not there]


# gloo runs ReduceOp.AVG as its sum divided in place by the group size (`tensor /= size`):
# floating tensors average on torch 2.13 and 2.15 (run here), integer ones fail there
# ("result type Float can't be cast to the desired output type Long"), and torch 2.7.1's
# gloo refuses AVG on any dtype ("Cannot use ReduceOp.AVG with Gloo"). 2.8 - 2.12 are not
# known here (2.11 runs in CI): treated as 2.7.1. The CPU route averages itself
# (cupycoll.cpu_average) every dtype before 2.13 and, from 2.13, the ones gloo cannot.
GLOO_AVERAGES_FLOATS = TORCH >= (2, 13)


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


def shutdown(group: Optional[ProcessGroup]) -> None:
    """Shut a gloo-backed group down; None (a group without a CPU half, as the tests' CUDA
    stand-ins) has nothing to shut. gloo's threads and sockets end only when the group is
    freed (torch 2.7.1 to 2.15 alike), so nothing may keep an ended group alive."""
    # A backend that does not implement shutdown makes torch raise RuntimeError; that leaves
    # the teardown to the destructor.
    if group is None:
        return
    try:
        group.shutdown()
    except RuntimeError:
        pass


# ------------------------------------------------------------------------------ torch's private state
#
# What torch keeps only in its own Python (a caller's frame, a module global) and hands no
# backend. Read here by the names torch's distributed_c10d.py gives them, which are the same
# on every supported release (2.7.1 - 2.15; each CI leg's tests/test_compat.py checks them).


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


# ------------------------------------------------------------------------------ CuPy


def cupy_major(cupy) -> int:
    return int(cupy.__version__.split(".")[0])


def load_pip_nvrtc(cupy) -> Optional[str]:
    """Make the NVRTC of the ``nvidia-cuda-nvrtc`` pip package (the cuda12/cuda13 extras
    install it) the one CuPy compiles with; the path loaded, or None."""
    # CuPy 14 finds pip-installed CUDA libraries itself (through cuda-pathfinder). CuPy 13
    # asks the dynamic loader for libnvrtc.so.<major>, whose search path does not include
    # site-packages, so the ring kernels could not compile. A library loaded first by path
    # is matched by its soname when CuPy asks.
    if cupy_major(cupy) >= 14:
        return None
    import ctypes
    import glob

    for entry in sys.path:
        found = sorted(glob.glob(os.path.join(entry, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        for path in found:
            if re.fullmatch(r"libnvrtc\.so\.\d+", os.path.basename(path)):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                return path
    return None


def external_stream(cupy, handle, ptr: int, device: int):
    """A CuPy stream object for the CUDA stream ``ptr`` on ``device``, not owned by CuPy.
    ``handle`` is an object with ``__cuda_stream__`` for ``ptr``."""
    # CuPy 14 added Stream.from_external (any __cuda_stream__ object) and deprecates
    # ExternalStream; CuPy 13 has only ExternalStream.
    if cupy_major(cupy) >= 14:
        return cupy.cuda.Stream.from_external(handle)
    return cupy.cuda.ExternalStream(ptr, device)
