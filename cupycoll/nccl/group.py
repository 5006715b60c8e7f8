"""NCCL groups per thread: ncclGroupStart/End of a library, and which communicators the
calls inside used, so that each is polled (nonblocking) or aborted when the outermost group
ends.

The library is the one a communicator resolved once, when it was built (an empty group
costs about a microsecond). Inside a group a nonblocking call is not polled on its own: NCCL
settles the whole group at ``ncclGroupEnd``, after which each communicator of the group is
polled.

Deliberately left out: cancelling a group (NCCL cannot: ``ncclGroupEnd`` launches whatever
was enqueued, which is why fallible Python steps run before the group opens, see
``CudaBackend._launch_all``) and groups spanning threads (NCCL groups are per thread).
"""

from __future__ import annotations

import contextlib
import threading

from . import bindings as nccl_bindings

# NCCL groups are per thread, so is this bookkeeping: "depth" (0 or absent: no group open)
# and "members".
per_thread = threading.local()



def _open_group():
    state = per_thread.__dict__
    if "depth" not in state:
        state["depth"], state["members"] = 0, []
    return state


@contextlib.contextmanager
def nccl_group(lib: "nccl_bindings.NcclLibrary"):
    """ncclGroupStart/End of ``lib`` around the body; End runs even when the body raises.

    Communicators used in the body are polled (nonblocking) once the outermost group ends.
    When the body raises, ncclGroupEnd still launches the calls enqueued before (an open
    group cannot be cancelled; a communicator aborted inside one is freed under ncclGroupEnd),
    a partial batch the peers' full one no longer matches: each communicator used is then
    aborted and its ``on_abort`` told, while the caller still holds the batch's tensors."""
    state = _open_group()
    lib.ncclGroupStart()
    state["depth"] += 1
    raised = None
    try:
        yield
    except BaseException as exc:
        raised = exc
        raise
    finally:
        state["depth"] -= 1
        outermost = state["depth"] == 0
        members = state["members"] if outermost else []
        if outermost:  # an inner group's error counts even when the body between caught it
            state["members"], raised = [], state.pop("raised", None) or raised
        elif raised is not None:
            state["raised"] = raised  # the outermost group ends the partial batch
        cut = False  # an abort of a member ended the launch (it failed the group's Works)
        # Over several communicators, a failing ncclGroupEnd sets every member's abort flag,
        # and kernels issued earlier on them may end early: the members stay fenced (their
        # watch retires nothing) until their owners have been told, so no such kernel's
        # event reads as a success first.
        fenced = members if len(members) > 1 else []
        for comm in fenced:
            comm.fences += 1
        try:
            try:
                lib.ncclGroupEnd()
            except Exception as exc:
                gone = next((c for c in members if c.ended), None)
                if gone is None:
                    for comm in fenced:
                        comm.tell_owner(exc)
                    raise
                cut = True
                raise gone.cut_short("ncclGroupEnd") from exc
        finally:
            for comm in fenced:
                comm.fences -= 1
            for comm in members:
                comm._leave_group()
            for comm in members:
                if raised is not None:
                    comm._abort_for(raised)
                elif not cut and comm.nonblocking:  # a blocking one has nothing to poll
                    comm._poll("ncclGroupEnd")


def join(comm) -> bool:
    """Inside an open group: record ``comm`` (polled or aborted at the group's end), True.
    Outside one: False, and the caller settles its call itself."""
    state = per_thread.__dict__
    if not state.get("depth"):  # also where no group was ever opened on this thread
        return False
    if comm not in state["members"]:
        comm._enter_group()  # until ncclGroupEnd: an abort elsewhere waits for it
        state["members"].append(comm)
    return True
