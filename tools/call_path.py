"""The path of one synchronous CUDA all_reduce through cupycoll, traced and timed on CPU:
``python -m tools.call_path [--calls N] [--json FILE] [--through-dist] [--cpu-route]``, and
one CUDA timeout walked across threads: ``python -m tools.call_path --timeout``.

It builds the group the CPU tests build (``tests/standins.py``: the real
``ProcessGroupCupycoll`` and ``CudaBackend``, every tensor counting as ``cuda:0``, the CUDA
runtime answered on CPU by a GPU that is done at once) over a real blocking
:class:`~cupycoll.nccl.communicator.Communicator` whose NCCL does nothing. A first all_reduce creates the communicator; then one
``group.allreduce([t], opts)`` and its ``wait()`` run under ``sys.setprofile``, and every
Python call whose code lives in the cupycoll package is listed with its depth. From that list
it prints the number of calls, the modules they touch, the calls from one module into
another, and the upward calls: those from a module into one above it in :data:`LAYERS`
(docs/design.md, "The house"). Then it times ``--calls`` all_reduce + wait without tracing
and prints host microseconds per call, wall time and the calling thread's CPU time (which
other processes on a loaded machine stretch less): a proxy, on CPU, for the Python share of
the host cost. Then the other hot calls (FSDP's all_gather_into_tensor and
reduce_scatter_tensor, DDP's broadcast) the same way, and last a coalescing block of 64
all_reduces as torch's ``_coalescing_manager`` makes it: the calls each makes into cupycoll
and its thread CPU (per all_reduce for the block).

Deliberately left out: the GPU and NCCL themselves (the GPU machine measures the real cost
against torch's nccl: ``cupycoll-bench --scenario overhead``), C functions and code outside
the package (torch, the stand-ins: their cupycoll callees still count, at the depth of their
nearest cupycoll caller), other threads (the watchdog's), other collectives and more ranks.
A generator counts as called once, when first entered, not at each resumption. Needs CuPy's
NCCL module and libnccl, as the CPU tier does; no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import sys
import time
from collections import Counter, namedtuple
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent

# docs/design.md's house, top to bottom; the modules of one entry are one layer. The last
# one holds the services every layer above calls (Works, the watchdog, the flight recorder,
# settings): a call from them into a layer above (a callback) is an upward call too.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("process_group", "py_backend"),
    ("shell", "shell_calls"),
    ("collectives",),
    ("_args", "call_forms"),
    ("issue", "coalescing"),
    ("backend", "cpu_half"),
    ("faults.all_groups", "faults.lifecycle", "faults.teardown", "nccl.bootstrap"),
    ("nccl.communicators", "nccl.communicator", "nccl.children", "nccl.call_guard", "nccl.group"),
    ("nccl.bindings", "nccl.header", "_cuda", "compat", "compat.release", "compat.calls", "compat.groups",
     "compat.dynamo", "compat.stores", "compat.gloo", "compat.torch_state", "compat.cupy_calls", "config", "logs",
     "algorithms", "kernels", "errors", "work",
     "faults.watchdog_thread", "faults.reports", "faults.last_words",
     "faults.watchdog", "faults.watchdog_cuda", "faults.heartbeat", "trace.group", "trace.gloo_work",
     "trace.listener", "trace.exchange", "trace.news", "trace.diagnosis", "trace.records", "trace.recorder",
     "trace.dumps", "trace.mismatch"),
)

GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

Call = namedtuple("Call", "depth module function")
"""One call: its depth below the traced entry (0: called from outside the package), its
module (the file's path under cupycoll/, dotted, no ``.py``) and its function (the
qualified name from Python 3.11 on, the bare name before)."""


def name(call: Call) -> str:
    return f"{call.module}.{call.function}"


# -- tracing ----------------------------------------------------------------------------


def trace_calls(run: Callable[[], object], package_dir: Path) -> List[Call]:
    """The Python calls into code under ``package_dir`` that ``run()`` makes on this thread.
    The garbage collector is run first and kept off meanwhile: a collection inside ``run()``
    would list the finalizers of earlier garbage as its calls."""
    import gc

    prefix = str(package_dir) + os.sep
    calls: List[Call] = []
    open_frames: list = []  # the package's frames under way, innermost last
    generators: Dict[int, object] = {}  # id -> frame (held, so the id stays its own)

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if not code.co_filename.startswith(prefix):
                return
            resumed = False
            if code.co_flags & GENERATOR_FLAGS:
                resumed = generators.get(id(frame)) is frame
                generators[id(frame)] = frame
            if not resumed:
                module = code.co_filename[len(prefix):-len(".py")].replace(os.sep, ".")
                calls.append(Call(len(open_frames), module, getattr(code, "co_qualname", code.co_name)))
            open_frames.append(frame)
        elif event == "return" and open_frames and open_frames[-1] is frame:
            open_frames.pop()

    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
        if collecting:
            gc.enable()
    return calls


def callers(calls: Sequence[Call]) -> List[Optional[Call]]:
    """Each call's caller in the list (None for a call from outside the package)."""
    stack: List[Call] = []
    found: List[Optional[Call]] = []
    for call in calls:
        del stack[call.depth:]
        found.append(stack[-1] if stack else None)
        stack.append(call)
    return found


def cross_module(calls: Sequence[Call]) -> Dict[Tuple[str, str], int]:
    """(caller's module, callee's module) -> how many calls, in order of first occurrence."""
    pairs: Counter = Counter()
    for call, caller in zip(calls, callers(calls)):
        if caller is not None and caller.module != call.module:
            pairs[caller.module, call.module] += 1
    return dict(pairs)


def layer_of(layers: Sequence[Sequence[str]]) -> Dict[str, int]:
    return {module: index for index, modules in enumerate(layers) for module in modules}


def upward_calls(calls: Sequence[Call], layers: Sequence[Sequence[str]]) -> List[Tuple[Call, Call]]:
    """(caller, callee) for each call from a module into one of a higher layer (a lower index
    in ``layers``); modules outside ``layers`` are not judged."""
    level = layer_of(layers)
    found = []
    for call, caller in zip(calls, callers(calls)):
        if caller is None or call.module not in level or caller.module not in level:
            continue
        if level[call.module] < level[caller.module]:
            found.append((caller, call))
    return found


# -- the group on CPU stand-ins -------------------------------------------------------


class _Library:
    """The NCCL library of a Communicator on CPU stand-ins: every call on a communicator
    succeeds at once (the async-error query answers ncclSuccess)."""

    def __getattr__(self, name):
        if name.startswith("nccl"):
            return lambda *args: 0
        raise AttributeError(name)

    def has(self, name):
        return True

    @property
    def unchecked(self):  # NcclLibrary.unchecked: the bare functions by name
        return self

    def __getitem__(self, name):
        return self.__getattr__(name)

    def failure(self, function, status):
        raise AssertionError(f"{function} returned {status} on the stand-in")


def _standin_classes():
    """(the stand-ins module, the CudaBackend and the group class of the call path): every
    tensor counts as on cuda:0, and the communicator is the real one around a library that
    does nothing (no store gate, no NCCL)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import standins
    from cupycoll.nccl.communicator import Communicator

    class Backend(standins.CpuAsCudaBackend):
        def _connect(self, key, creator, size, rank, device):
            comm = Communicator(device, rank, size, handle=1, timeout=60.0)
            comm._lib = _Library()
            return comm

    class Group(standins.CpuAsCudaGroup):
        backend_class = Backend

    return standins, Backend, Group


@contextlib.contextmanager
def standin_group(size: int = 2) -> Iterator[object]:
    """Rank 0 of a ``size``-rank cupycoll group whose CUDA route runs on CPU tensors and whose
    GPU finishes every call at once; aborted on exit, when the stand-ins go."""
    import torch.distributed as dist
    from cupycoll import _cuda

    standins, Backend, Group = _standin_classes()

    # The CUDA runtime of a GPU that is done at once (the stand-ins' InstantRuntime).
    with _cuda.install(standins.InstantRuntime()):
        group = Group(dist.HashStore(), 0, size, datetime.timedelta(seconds=60))
        try:
            yield group
        finally:
            group.abort()


def _sync_options(kind: str = "AllreduceOptions"):
    """A synchronous call's options: torch's c10d options class ``kind``, asyncOp off."""
    from torch._C import _distributed_c10d as c10d

    opts = getattr(c10d, kind)()
    if hasattr(opts, "asyncOp"):  # none on torch 2.7's all_reduce: every call is asynchronous there
        opts.asyncOp = False
    return opts


def measure(timed_calls: int = 2000) -> dict:
    """The traced call's figures and the host time of ``timed_calls`` untraced ones."""
    import torch
    from bench.group_cost import per_call_us

    import cupycoll

    with standin_group() as group:
        tensor, opts = torch.ones(4), _sync_options()

        def all_reduce():
            group.allreduce([tensor], opts).wait()

        all_reduce()  # the first call creates the communicator
        per_call_us(all_reduce, max(1, timed_calls // 10), repeats=1)  # warm-up
        # The steady state: the watchdog's pass has recorded the open slot's event and returned
        # the finished calls' slots to the pool (the traced call opens a slot of its own).
        steady = _steady(group)
        steady()
        calls = trace_calls(all_reduce, Path(cupycoll.__file__).resolve().parent)
        host_us = per_call_us(all_reduce, timed_calls, repeats=3)
        # The caller's CPU time: what other processes on a loaded machine do not stretch.
        cpu_us = per_call_us(all_reduce, timed_calls, repeats=3, clock=time.thread_time)
        collections, gc_us = garbage_collections(all_reduce, GC_CALLS)
        other_hot = {}
        for name, call in other_hot_calls(group).items():
            call()  # the first call learns a reduction's plan
            steady()
            traced = trace_calls(call, Path(cupycoll.__file__).resolve().parent)
            other_hot[name] = {"calls": len(traced),
                                "thread_cpu_us": per_call_us(call, timed_calls, repeats=3, clock=time.thread_time)}
        with cupycoll.algorithm("nccl"):  # an override in force: the plan is made at every call
            all_reduce()
            steady()
            general = trace_calls(all_reduce, Path(cupycoll.__file__).resolve().parent)
        block = coalesced_block(group, BLOCK_PARTS)
        block()  # the first block learns nothing new: the plan is the all_reduce's
        steady()
        block_calls = trace_calls(block, Path(cupycoll.__file__).resolve().parent)
        block_us = per_call_us(block, max(1, timed_calls // BLOCK_PARTS), repeats=3, clock=time.thread_time)
    pairs = cross_module(calls)
    upward = upward_calls(calls, LAYERS)
    level = layer_of(LAYERS)
    modules = list(dict.fromkeys(call.module for call in calls))
    return {
        "what": "one synchronous all_reduce of 4 float32 elements (group.allreduce + Work.wait), "
                "rank 0 of 2, CPU stand-ins (tests/standins.py)",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "calls": len(calls),
        "modules": len(modules),
        "module_names": modules,
        "unlayered_modules": [m for m in modules if m not in level],
        "cross_module_calls": sum(pairs.values()),
        "cross_module": [{"from": a, "to": b, "calls": n} for (a, b), n in pairs.items()],
        "layers": [list(layer) for layer in LAYERS],
        "upward_calls": [{"from": name(a), "to": name(b)} for a, b in upward],
        "trace": [call._asdict() for call in calls],
        "timed_calls": timed_calls,
        "host_us_per_call": host_us,
        "thread_cpu_us_per_call": cpu_us,
        "gc_calls": GC_CALLS,
        "gc_collections": collections,
        "gc_us_per_call": gc_us,
        "other_hot_calls": other_hot,
        "general_calls": len(general),
        "general_modules": len(set(call.module for call in general)),
        "general_upward_calls": [{"from": name(a), "to": name(b)} for a, b in upward_calls(general, LAYERS)],
        "block_parts": BLOCK_PARTS,
        "block_calls": len(block_calls),
        "block_upward_calls": [{"from": name(a), "to": name(b)} for a, b in upward_calls(block_calls, LAYERS)],
        "block_thread_cpu_us_per_part": block_us / BLOCK_PARTS,
    }


def _steady(group) -> Callable[[], None]:
    """A watchdog pass's effect on the group's watch, at once: every open slot's event
    recorded, every finished slot back in the pool (the calls' GPU is done at once)."""
    watch = group._cuda.watch

    def steady():
        watch._seal_open(float("inf"))
        watch.retire()
    return steady


def other_hot_calls(group) -> Dict[str, Callable[[], None]]:
    """The other hot calls as torch hands them to the group, synchronous, on 4
    float32 elements (per rank: FSDP's shard): all_gather_into_tensor (FSDP unsharding
    parameters), reduce_scatter_tensor (FSDP reducing gradients) and broadcast (DDP's
    buffers, at every forward), each with its Work's wait."""
    import torch

    shard, whole = torch.ones(4), torch.ones(4 * group.size())
    gather, scatter, broadcast = (_sync_options(kind) for kind in
                                  ("AllgatherOptions", "ReduceScatterOptions", "BroadcastOptions"))
    return {"all_gather_into_tensor": lambda: group._allgather_base(whole, shard, gather).wait(),
            "reduce_scatter_tensor": lambda: group._reduce_scatter_base(shard, whole, scatter).wait(),
            "broadcast": lambda: group.broadcast([shard], broadcast).wait()}


# All_reduces in the coalescing block timed beside the single call (the benchmark's
# coalescing scenario issues 64).
BLOCK_PARTS = 64


def coalesced_block(group, parts: int) -> Callable[[], None]:
    """One synchronous coalescing block of ``parts`` all_reduces, as torch's
    ``_coalescing_manager`` makes it with a device given: ``_start_coalescing``, one
    ``allreduce_coalesced`` of the parts, ``_end_coalescing`` and its Work's wait."""
    import torch
    from torch._C import _distributed_c10d as c10d

    tensors, device = [torch.ones(4) for _ in range(parts)], torch.device("cuda", 0)
    opts = c10d.AllreduceCoalescedOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False

    def block():
        group._start_coalescing(device)
        group.allreduce_coalesced(tensors, opts)
        group._end_coalescing(device).wait()
    return block


# Calls over which the garbage collector's work is counted.
GC_CALLS = 10_000


def garbage_collections(run: Callable[[], object], calls: int) -> Tuple[Dict[int, int], float]:
    """The collections the cyclic garbage collector ran during ``calls`` runs of ``run`` (by
    generation), and their time per run in µs. A per-call object that outlives its caller
    (kept by the watchdog until its pass, say) shows here, not in the median host time."""
    import gc

    gc.collect()
    counts: Dict[int, int] = {0: 0, 1: 0, 2: 0}
    spent = [0.0]
    started = [0.0]

    def count(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            spent[0] += time.perf_counter() - started[0]

    gc.callbacks.append(count)
    try:
        for _ in range(calls):
            run()
    finally:
        gc.callbacks.remove(count)
    return counts, spent[0] / calls * 1e6


# -- one timeout, walked ------------------------------------------------------------------


def trace_threads(run: Callable[[], object], package_dir: Path) -> Dict[str, List[Call]]:
    """:func:`trace_calls` on every thread: the calls into code under ``package_dir`` that
    ``run()`` makes, and those of the threads it starts meanwhile, by thread name (a thread
    started twice under one name is one list)."""
    import threading

    prefix = str(package_dir) + os.sep
    found: Dict[str, List[Call]] = {}
    stacks: Dict[int, list] = {}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if not code.co_filename.startswith(prefix):
                return
            stack = stacks.setdefault(threading.get_ident(), [])
            module = code.co_filename[len(prefix):-len(".py")].replace(os.sep, ".")
            found.setdefault(threading.current_thread().name, []).append(
                Call(len(stack), module, getattr(code, "co_qualname", code.co_name)))
            stack.append(frame)
        elif event == "return":
            stack = stacks.get(threading.get_ident())
            if stack and stack[-1] is frame:
                stack.pop()

    previous = sys.getprofile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
    return found


def timeout_walk(timeout_s: float = 1.0, interval_s: float = 0.05) -> dict:
    """One CUDA timeout, walked: rank 0 of 1 on the stand-ins, a synchronous all_reduce whose
    GPU never finishes (timeout ``timeout_s``, watchdog every ``interval_s``), from the call
    through the watchdog's finding and the group's end to the caller's error. Per thread: its
    calls into cupycoll, the modules they touch, and the callbacks it crosses (calls from a
    module into one above it in :data:`LAYERS`, each pair once: the watchdog's thread starts
    at the bottom, so what it asks of the communicators and the lifetime counts here)."""
    import torch
    import torch.distributed as dist

    import cupycoll
    from cupycoll import _cuda
    from cupycoll.errors import CollectiveTimeoutError
    from cupycoll.faults import lifecycle, watchdog_thread

    standins, Backend, Group = _standin_classes()
    raised: List[BaseException] = []

    with _cuda.install(standins.DeviceLedger(keep_calls=False)), \
            mock.patch.object(lifecycle, "WATCHDOG", watchdog_thread.Watchdog()):
        group = Group(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60),
                      cupycoll.Options(timeout=timeout_s, watchdog_interval=interval_s))

        def run():  # from the call to the caller's error
            work = group.allreduce([torch.ones(4)], _sync_options())
            group._cuda.life.ended.wait(timeout_s * 10 + 30)
            try:
                work.wait()
            except CollectiveTimeoutError as exc:
                raised.append(exc)
        try:
            threads = trace_threads(run, Path(cupycoll.__file__).resolve().parent)
        finally:
            group.abort()
    walked = {}
    for thread, calls in threads.items():
        crossed = dict.fromkeys((name(a), name(b)) for a, b in upward_calls(calls, LAYERS))  # each once
        walked[thread] = {"calls": len(calls),
                          "modules": list(dict.fromkeys(call.module for call in calls)),
                          "callbacks": [{"from": a, "to": b} for a, b in crossed]}
    return {"timeout_s": timeout_s, "interval_s": interval_s, "threads": walked,
            "modules": sorted({m for t in walked.values() for m in t["modules"]}),
            "raised": type(raised[0]).__name__ if raised else None}


def timeout_report(walk: dict) -> List[str]:
    lines = [f"one CUDA timeout, walked (rank 0 of 1 on the stand-ins, timeout {walk['timeout_s']:g} s, "
             f"watchdog every {walk['interval_s']:g} s): {len(walk['threads'])} threads, "
             f"{len(walk['modules'])} modules; the caller got {walk['raised']}"]
    for thread, seen in walk["threads"].items():
        lines.append(f"  {thread}: {seen['calls']} calls, {len(seen['modules'])} modules "
                     f"({', '.join(seen['modules'])}); {len(seen['callbacks'])} callbacks crossed")
        lines += [f"    {c['from']} -> {c['to']}" for c in seen["callbacks"]]
    return lines


# -- through torch's dispatch, in each shape --------------------------------------------


def through_dist(timed_calls: int = 2000) -> dict:
    """Thread CPU µs per ``dist.all_reduce(t)`` (synchronous) through torch's own dispatch on
    the stand-ins' rank 0 of 1, in each shape this torch has, and, where torch dispatches to
    a Python Backend (2.14+), the floor of that dispatch: a Backend that does nothing and
    returns a finished Work (torch's trampoline and holder alone), and that floor reading
    the arguments as any backend must to make the call."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    from bench.group_cost import per_call_us
    from cupycoll import _cuda, compat
    from cupycoll.shell import group_arguments

    standins, Backend, Group = _standin_classes()

    def process_group_shape(opts, pg_options):
        args, kwargs = group_arguments(opts, pg_options)
        return Group(*args, **kwargs)

    shapes = {"process_group": process_group_shape}
    if compat.PY_BACKEND:
        from cupycoll import py_backend

        CudaShape = standins.backend_shape(Backend)

        class DoneWork(dist.Work):
            """A Python Work that is done: torch's holder calls its wait() as it calls cupycoll's."""

            def wait(self, timeout=None):
                return True

        class Done(c10d.Backend):
            """The trampoline's floor: a Python Backend that does nothing but return a Python Work."""

            def __init__(self, store, rank, size, timeout):
                super().__init__(rank, size)

            def allreduce(self, tensors, opts=None):
                return DoneWork()

            def getBackendName(self):
                return "floor"

        class Reading(Done):
            """The floor, reading what any backend reads of its arguments to make the call
            (the tensor's device, layout, dtype, shape, pointer and size; the op; asyncOp)."""

            def allreduce(self, tensors, opts=None):
                tensor = tensors[0]
                (tensor.get_device(), tensor.is_contiguous(), tensor.dtype, tensor.shape, tensor.data_ptr(),
                 tensor.numel(), opts.reduceOp.op, compat.async_requested(opts))
                return DoneWork()

        shapes["backend"] = lambda opts, pg_options: py_backend.create(opts, pg_options, cls=CudaShape)
        shapes["trampoline floor"] = lambda opts, pg_options: Done(opts.store, opts.group_rank,
                                                                    opts.group_size, opts.timeout)
        shapes["trampoline floor, reading the arguments"] = lambda opts, pg_options: Reading(
            opts.store, opts.group_rank, opts.group_size, opts.timeout)
    figures = {}
    with _cuda.install(standins.InstantRuntime()):
        for shape, creator in shapes.items():
            name = "cupycoll_call_path_" + shape.replace(" ", "_").replace(",", "")
            floor = shape.startswith("trampoline floor")
            devices = ["cpu", "cuda"] if floor else ["cuda"]  # the floor takes the CPU tensor itself
            if name.upper() not in dist.Backend._plugins:
                dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)
            dist.init_process_group(name if floor else f"cuda:{name}", store=dist.HashStore(), rank=0,
                                    world_size=1)
            try:
                tensor = torch.ones(4)  # a CUDA tensor on the stand-ins; torch hands it to the group's backend
                group = dist.group.WORLD

                def call():
                    dist.all_reduce(tensor, group=group)
                call()
                per_call_us(call, max(1, timed_calls // 10), repeats=1)
                figures[shape] = per_call_us(call, timed_calls, repeats=3, clock=time.thread_time)
            finally:
                dist.destroy_process_group()
    return figures


# -- the CPU route ----------------------------------------------------------------------


def cpu_route(timed_calls: int = 2000, rounds: int = 3) -> dict:
    """The CPU route at world size 1, thread CPU µs per synchronous call of a 4-element CPU
    tensor (medians of ``rounds`` interleaved rounds, each the median of 3 runs):

    * ``gloo`` and ``cupycoll``: ``dist.all_reduce`` on plain gloo and on a cupycoll group,
      whose CPU half is a gloo group of its own;
    * ``recorded_floor``: ``dist.all_reduce`` on the least a Python group that keeps a
      flight recorder can do: a ProcessGroup subclass whose all_reduce records an entry in
      cupycoll's recorder, calls gloo, waits and marks the entry completed (no checks, no
      diagnosis, no CUDA half). What any group recording each call costs at least;
    * ``cupycoll_share``: what cupycoll adds to the synchronous call it makes on its CPU half
      (the options ``dist.all_reduce`` passes), measured with torch's ``FakeProcessGroup`` (a
      C++ group that finishes every call at once) as that half: ``group.allreduce + wait``
      minus the fake's own ``allreduce + wait``.

    The process runs on one CPU meanwhile (where the platform lets it choose): gloo runs each
    Work on a worker thread, and across two CPUs the caller's CPU time mostly counts the
    cross-CPU wake-ups of that hand-over, which come and go with the scheduler (the same call
    measured 7 µs or 25 µs from one run to the next); on one CPU it is the code's cost.
    """
    import statistics

    import torch
    from torch._C import _distributed_c10d as c10d

    import cupycoll  # noqa: F401 - registers the backend

    fake_class = c10d.FakeProcessGroup
    tensor, opts = torch.ones(4), _sync_options()
    samples: Dict[str, List[float]] = {"gloo": [], "recorded_floor": [], "cupycoll": [], "cupycoll_share": []}
    pinned = hasattr(os, "sched_setaffinity")
    if pinned:  # before the groups' worker threads start: they inherit it
        allowed = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(allowed)})
    try:
        _cpu_route_rounds(timed_calls, rounds, tensor, opts, fake_class, samples)
    finally:
        if pinned:
            os.sched_setaffinity(0, allowed)
    figures = {name: statistics.median(values) for name, values in samples.items()}
    figures["one_cpu"] = pinned
    return figures


def _recorded_floor_group():
    """The creator of the CPU route's floor (see :func:`cpu_route`), registered once."""
    import torch.distributed as dist

    from cupycoll.process_group import build_gloo_half
    from cupycoll.trace import recorder

    class Recorded(dist.ProcessGroup):
        def __init__(self, store, rank, size, timeout):
            super().__init__(rank, size)
            self._gloo = build_gloo_half(store, rank, size, timeout)[0]
            self._recorder = recorder.Recorder("floor", list(range(size)), rank)  # registered nowhere

        def allreduce(self, tensors, opts=None):
            tensor = tensors[0]
            entry = self._recorder.record("all_reduce", (tensor.shape,), (tensor.dtype,), None, "gloo", "issued")
            work = self._gloo.allreduce(tensors, opts)
            work.wait()
            self._recorder.mark(entry, "completed")
            return work

        def getBackendName(self):
            return "recorded_floor"

    name = "cupycoll_call_path_recorded_floor"
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            name, lambda o, _: Recorded(o.store, o.group_rank, o.group_size, o.timeout),
            extended_api=True, devices=["cpu"])
    return name


def _cpu_route_rounds(timed_calls, rounds, tensor, opts, fake_class, samples) -> None:
    import torch.distributed as dist

    from bench.group_cost import per_call_us

    floor = _recorded_floor_group()
    for _ in range(rounds):
        for backend in ("gloo", floor, "cupycoll"):
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            try:
                def call():
                    dist.all_reduce(tensor)
                call()
                per_call_us(call, max(1, timed_calls // 10), repeats=1)
                samples["recorded_floor" if backend == floor else backend].append(
                    per_call_us(call, timed_calls, repeats=3, clock=time.thread_time))
                if backend == "cupycoll":
                    group = dist.group.WORLD
                    fake = (fake_class._create_internal(0, 1) if hasattr(fake_class, "_create_internal")
                            else fake_class(0, 1))
                    with mock.patch.object(group, "_cpu", fake):
                        def routed():
                            group.allreduce([tensor], opts).wait()

                        def alone():
                            fake.allreduce([tensor], opts).wait()
                        routed()
                        samples["cupycoll_share"].append(
                            per_call_us(routed, timed_calls, repeats=3, clock=time.thread_time)
                            - per_call_us(alone, timed_calls, repeats=3, clock=time.thread_time))
            finally:
                dist.destroy_process_group()


# -- output -----------------------------------------------------------------------------


def watch_cost(timed_calls: int = 2000, rounds: int = 15) -> dict:
    """What watching a synchronous all_reduce costs the caller on the stand-ins: the calling
    thread's CPU time per call of a group that watches its calls less one that does not
    (``Options(watch_calls=False)``), over ``rounds`` alternated rounds; the median of the
    rounds' differences, with their interquartile range and range. The stand-ins' events are
    Python, so this is the watch's own share; the GPU machine measures it with real events
    (``python -m bench.fault_bench``)."""
    import statistics

    import torch
    import torch.distributed as dist
    from bench.group_cost import per_call_us

    from cupycoll import _cuda, config

    standins, _, Group = _standin_classes()
    with _cuda.install(standins.InstantRuntime()):
        groups = {watched: Group(dist.HashStore(), 0, 2, datetime.timedelta(seconds=60),
                                 config.Options(watch_calls=watched)) for watched in (True, False)}
        try:
            tensor, opts = torch.ones(4), _sync_options()
            calls = {watched: (lambda g=g: g.allreduce([tensor], opts).wait()) for watched, g in groups.items()}
            for call in calls.values():
                call()
                per_call_us(call, max(1, timed_calls // 2), repeats=1)  # warm-up
            steady = _steady(groups[True])
            differences = []
            for _ in range(rounds):
                watched = per_call_us(calls[True], timed_calls, repeats=1, clock=time.thread_time)
                differences.append(watched - per_call_us(calls[False], timed_calls, repeats=1, clock=time.thread_time))
                steady()  # the watchdog's pass between rounds: finished slots back in the pool
        finally:
            for group in groups.values():
                group.abort()
    quartiles = statistics.quantiles(differences, n=4)
    return {"rounds": rounds, "timed_calls": timed_calls, "median_us": statistics.median(differences),
            "iqr_us": [quartiles[0], quartiles[2]], "range_us": [min(differences), max(differences)]}


def report(figures: dict) -> List[str]:
    lines = [f"cupycoll call path: {figures['what']}",
             f"Python {figures['python']}, torch {figures['torch']}; Python calls into cupycoll on "
             "the caller's thread", "", "call tree (module.function, indented by depth):"]
    lines += ["  " * (c["depth"] + 1) + f"{c['module']}.{c['function']}" for c in figures["trace"]]
    lines += ["", f"calls: {figures['calls']}",
              f"modules: {figures['modules']} ({', '.join(figures['module_names'])})",
              f"cross-module calls: {figures['cross_module_calls']}"]
    lines += [f"  {p['from']} -> {p['to']}: {p['calls']}" for p in figures["cross_module"]]
    order = " > ".join("/".join(layer) for layer in figures["layers"][:-1]) + " > services"
    lines.append(f"upward calls ({order}): {len(figures['upward_calls'])}")
    lines += [f"  {u['from']} -> {u['to']}" for u in figures["upward_calls"]]
    if figures["unlayered_modules"]:
        lines.append(f"modules outside the layer order: {', '.join(figures['unlayered_modules'])}")
    lines += [f"host time: {figures['host_us_per_call']:.1f} us per call (wall), "
              f"{figures['thread_cpu_us_per_call']:.1f} us (the calling thread's CPU time); each the "
              f"median of 3 runs of {figures['timed_calls']} synchronous all_reduce + wait, untraced, "
              "on the CPU stand-ins",
              f"garbage collections during {figures['gc_calls']} calls: "
              + ", ".join(f"generation {g}: {n}" for g, n in sorted(figures['gc_collections'].items()))
              + f" ({figures['gc_us_per_call']:.2f} us per call in the collector)",
              "  a proxy for the Python share of the host cost; the GPU machine measures the real "
              "cost against torch's nccl (cupycoll-bench --scenario overhead)",
              "the other hot calls, synchronous, + wait: " + "; ".join(
                  f"{name} {f['calls']} calls into cupycoll, {f['thread_cpu_us']:.1f} us of thread CPU"
                  for name, f in figures["other_hot_calls"].items()),
              f"the same all_reduce with an algorithm override in force (its plan made at every call): "
              f"{figures['general_calls']} calls into cupycoll, {figures['general_modules']} modules, "
              f"{len(figures['general_upward_calls'])} upward",
              f"a coalescing block of {figures['block_parts']} all_reduces: {figures['block_calls']} calls into "
              f"cupycoll ({len(figures['block_upward_calls'])} upward), "
              f"{figures['block_thread_cpu_us_per_part']:.1f} us of thread CPU per all_reduce"]
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.call_path", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="untraced calls per timed run (default 2000)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--through-dist", action="store_true",
                        help="also time dist.all_reduce through torch's dispatch, in each shape this torch "
                             "has, and (torch 2.14+) the floor of its Python-Backend trampoline")
    parser.add_argument("--timeout", action="store_true",
                        help="instead, walk one CUDA timeout: per thread the calls into cupycoll, the modules "
                             "they touch and the callbacks crossed")
    parser.add_argument("--watch", action="store_true",
                        help="also time what watching a synchronous all_reduce costs the caller: a watched "
                             "group less an unwatched one, over 15 alternated rounds, with the spread")
    parser.add_argument("--cpu-route", action="store_true",
                        help="also time the CPU route at world size 1 against plain gloo and against the "
                             "floor of a Python group that records each call, and cupycoll's share of it "
                             "(over a CPU half that finishes every call at once)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls must be >= 1")
    if args.timeout:
        walk = timeout_walk()
        print("\n".join(timeout_report(walk)))
        if args.json:
            Path(args.json).write_text(json.dumps(walk, indent=2) + "\n")
        return 0
    figures = measure(args.calls)
    print("\n".join(report(figures)))
    if args.through_dist:
        figures["through_dist"] = through_dist(args.calls)
        print("dist.all_reduce (synchronous), thread CPU per call, median of 3 runs of "
              f"{args.calls}, by how torch holds the group:")
        for shape, us in figures["through_dist"].items():
            print(f"  {shape}: {us:.1f} us")
    if args.watch:
        figures["watch"] = cost = watch_cost(args.calls)
        print(f"the watch per synchronous all_reduce, thread CPU: {cost['median_us']:.2f} us (median of "
              f"{cost['rounds']} alternated rounds of {args.calls}; IQR {cost['iqr_us'][0]:.2f}..{cost['iqr_us'][1]:.2f}, "
              f"range {cost['range_us'][0]:.2f}..{cost['range_us'][1]:.2f})")
    if args.cpu_route:
        figures["cpu_route"] = route = cpu_route(args.calls)
        where = "on one CPU, " if route["one_cpu"] else ""
        print(f"CPU route, dist.all_reduce at world size 1, thread CPU per call ({where}medians of 3 "
              f"interleaved rounds of {args.calls}): gloo {route['gloo']:.1f} us, a Python group recording each "
              f"call and waiting {route['recorded_floor']:.1f} us ({route['recorded_floor'] / route['gloo']:.2f}x), "
              f"cupycoll {route['cupycoll']:.1f} us ({route['cupycoll'] / route['gloo']:.2f}x); cupycoll's share "
              f"over a CPU half that finishes at once: {route['cupycoll_share']:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
