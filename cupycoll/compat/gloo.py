"""Version differences in torch's gloo, the CPU half of every cupycoll group: lazy
connection, the list forms of alltoall and reduce_scatter, reduce_scatter_tensor's op, AVG,
where a timed-out rendezvous leaves its keys, and its shutdown; what an older gloo lacks or
gets wrong is built from what it has, with Works (:class:`FutureWork`) that fail when gloo
fails.

Left out: building a group's gloo half and counting its ranks in (:mod:`cupycoll.cpu_half`),
routing calls to it (:mod:`cupycoll.shell`), and AVG on the CPU route
(:mod:`cupycoll.cpu_average`, which asks ``GLOO_AVERAGES_FLOATS``).
"""

from __future__ import annotations

import datetime
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from ..errors import CupycollValueError
from .release import TORCH


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
# creation counts every rank in (cupycoll.cpu_half.build_gloo_half).
GLOO_LAZY_INIT = TORCH >= (2, 8)


def new_gloo(store, rank: int, size: int, timeout: datetime.timedelta) -> "dist.ProcessGroupGloo":
    """torch's gloo backend on ``store``, its device as torch's constructor picks it
    (GLOO_SOCKET_IFNAME; lazy where the job sets TORCH_GLOO_LAZY_INIT: GLOO_LAZY_INIT)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)



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
