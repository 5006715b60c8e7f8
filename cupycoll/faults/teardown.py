"""A group's CUDA half taken apart, once its lifetime has decided that it ends
(:mod:`cupycoll.faults.lifecycle`), each step in its order:

* :func:`end`, after an abort or a fault: ``ncclCommAbort`` of every communicator (never
  beside a call another thread has inside NCCL: the call runs it on its way out,
  :mod:`cupycoll.nccl.call_guard`); then, once every abort has returned, the Works' tensors
  and the algorithms' scratch released (no buffer is freed under a kernel that still runs);
  then the group's CPU half shut down. Its CUDA calls run with the group's device current.
  :func:`within` runs it on a thread of its own, waited for at most
  :data:`cupycoll.bounds.ABORT_DEADLINE`, for a caller that must return.
* :func:`finalize`, a clean shutdown: the algorithms' runners closed, then every
  communicator finalized and destroyed (aborted when that fails), then what was in flight
  released.

Every step runs whatever an earlier one raised: a failing step is a ``RuntimeWarning``
(:func:`step`), and a KeyboardInterrupt or SystemExit one met is handed back, to be raised
once all have run (:func:`reraise`).

Deliberately left out: deciding anything (whether and why the group ends, that it ends
once, its state, its fault: the lifetime's), and retries.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, List, Optional

from .. import bounds


def warn(message: str) -> None:
    """A teardown step's failure: a RuntimeWarning, never an error."""
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def step(what: str, function, *args) -> Optional[BaseException]:
    """Run one teardown step; a failure is reported, and returned, never raised."""
    try:
        function(*args)
    except BaseException as exc:  # noqa: BLE001 - teardown must finish every step
        warn(f"cupycoll: {what} failed: {exc!r}")
        return exc
    return None


def reraise(interrupts) -> None:
    """Raise the first KeyboardInterrupt or SystemExit a step met (after every step ran)."""
    for exc in interrupts:
        if exc is not None and not isinstance(exc, Exception):
            raise exc


def end(name: Callable[[], str], watch, comms, close_cpu: Optional[Callable[[], None]], asker: int) -> List:
    """Abort ``comms`` (for the thread ``asker``), then, once every abort has returned,
    release what ``watch`` holds and close the runners, then ``close_cpu()``. Returns what
    the steps met, for :func:`reraise` once the caller has marked the end done. ``name()``:
    the group's name, asked only for a message."""
    interrupts: List = []
    # The end's CUDA calls (the aborts, freeing events and scratch) run with the group's
    # device current: on a thread that never chose one, cuda:0 is, and NCCL's abort sets
    # back the device it was called with, which would make a context there.
    guard = watch.on_device()
    try:
        guard.__enter__()
    except BaseException as exc:  # noqa: BLE001 - the end runs anyway, on this device
        warn(f"cupycoll: making the device of process group {name()!r} current failed: {exc!r}")
        guard = None
    try:
        for comm, error in comms.abort(asker):
            warn(f"cupycoll: aborting {comm} failed: {error!r}")
            if not isinstance(error, Exception):
                interrupts.append(error)
        # Only once every ncclCommAbort returned may what the kernels used be released;
        # one left to a blocked call's way out keeps it all held.
        # A call inside NCCL past the timeout (or CALL_BLOCKED_S) is blocked: not waited for.
        if comms.settled(bounds.ABORT_DEADLINE, min(bounds.CALL_BLOCKED_S, watch.timeout)):
            interrupts.append(step("releasing the Works' tensors", watch.release))
            close_runners(comms)
        if close_cpu is not None:
            interrupts.append(step("shutting down the group's CPU half", close_cpu))
    finally:
        if guard is not None:
            step("setting the previous device back", guard.__exit__, None, None, None)
    return interrupts


def within(run: Callable, args: tuple, ended: threading.Event, name: Callable[[], str]) -> None:
    """``run(*args)`` (a group's end) on a thread of its own, waited for until ``ended`` is
    set, at most :data:`cupycoll.bounds.ABORT_DEADLINE`: ncclCommAbort can hang (NCCL's known
    hangs). Past that the Works have failed already and their tensors stay held until it
    returns (a kernel may still use them). ``name()``: the group's name, asked only for a message."""
    ender = threading.Thread(target=run, args=args, name="cupycoll-abort", daemon=True)
    try:
        ender.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the exit hook bounds it
        run(*args)
        return
    if not ended.wait(bounds.ABORT_DEADLINE):
        warn(f"cupycoll: ncclCommAbort of process group {name()!r} has not returned after "
             f"{bounds.ABORT_DEADLINE:g} s; its Works have failed, and their tensors stay held until it does")
    else:
        ender.join(bounds.ABORT_DEADLINE)


def finalize(watch, comms, timeout: float) -> None:
    """Close the runners, shut every communicator down within ``timeout`` (abort one whose
    shutdown fails), then release what ``watch`` held."""
    close_runners(comms)
    for comm in comms.all():
        if step(f"shutting down {comm}", comm.shutdown, timeout) is not None:
            step(f"aborting {comm} after its shutdown failed", comm.abort)
    watch.release()


def close_runners(comms) -> None:
    for algorithm, error in comms.close_runners():
        warn(f"cupycoll: closing the {algorithm} algorithm's runner failed: {error!r}")
