"""The ring's plans in stream order: the commands that run a plan's actions on two streams,
ordered by events, and what one call of them costs the host.

:func:`issue` turns a :class:`~cupycoll.ring.schedule.Plan` into :data:`Command` s in issue
order: each action run on the caller's stream or the ring's side stream, with the event
records and waits that order them (a plan of one round runs on the caller's stream alone;
one with more runs its transfers on the side stream, to overlap the other lane's
reduction). :func:`launches` counts what those commands launch. :mod:`cupycoll.ring.algorithm`
executes the commands in list order; the tests' numpy model (tests/ring_simulator.py) checks
their order.

Deliberately left out: what the actions are and which rank does what (the schedule,
:mod:`cupycoll.ring.schedule`), and, as there, CuPy, torch, numpy, real streams and pointers:
streams appear only as the two names :data:`CALLER` and :data:`SIDE`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple, Union

from .schedule import Action, Alone, Exchange, Gather, Plan, Reduce, Stage

CALLER = "caller"  # the stream the collective was called with: kernels run there
SIDE = "side"  # the ring's own stream: a pipelined plan's NCCL calls run there
STREAMS = (CALLER, SIDE)


@dataclasses.dataclass(frozen=True)
class Run:
    stream: str
    action: Action


@dataclasses.dataclass(frozen=True)
class Record:
    """Record event ``event`` on ``stream``. Events are reused: a wait sees the latest
    record issued before it (CUDA's semantics)."""

    stream: str
    event: Tuple


@dataclasses.dataclass(frozen=True)
class Wait:
    """Later work on ``stream`` waits for ``event`` (a no-op if it was never recorded)."""

    stream: str
    event: Tuple


Command = Union[Run, Record, Wait]


def is_empty(action: Action) -> bool:
    """Whether ``action`` moves or computes nothing (a slice past its chunk's end)."""
    if isinstance(action, (Stage, Reduce, Alone)):
        return action.stop == action.start
    if isinstance(action, Exchange):
        return action.send_stop == action.send_start and action.recv_stop == action.recv_start
    return action.share == 0 and action.tail_stop == action.tail_start


def issue(plan: Plan) -> List[Command]:
    """The commands that run ``plan``, empty actions left out.

    A plan of one round runs on the caller's stream alone: its every action depends on the
    one before, so a second stream would overlap nothing. A pipelined plan runs kernels on
    the caller's stream and NCCL calls on the side stream. Per lane, the caller records
    ("reduced", lane) after each kernel and the side stream records ("received", lane) after
    each transfer; each waits for the other's latest before it touches the lane's slots.
    Lanes do not wait for each other, which is what lets lane 1's transfer run during lane
    0's reduction. The first records order the whole ring after the caller's earlier work;
    the last wait orders the caller's later work after the side stream's last transfer.
    Records and waits that order nothing more than the commands before them already do are
    then left out (:func:`_prune`).
    """
    actions = [a for a in plan.actions if not is_empty(a)]
    if plan.geometry.rounds <= 1:
        return [Run(CALLER, action) for action in actions]
    commands: List[Command] = [Record(CALLER, ("reduced", lane)) for lane in range(plan.geometry.lanes)]
    side_used = False
    for action in actions:
        if isinstance(action, (Stage, Reduce)):
            # A Reduce consumes the transfer just received; a Stage overwrites a slot that
            # the lane's last transfer may still be sending from (the round before it could
            # end with a send and no receive, so no Reduce waited for that transfer).
            commands += [Wait(CALLER, ("received", action.lane)), Run(CALLER, action),
                         Record(CALLER, ("reduced", action.lane))]
        elif isinstance(action, Exchange):
            commands += [Wait(SIDE, ("reduced", action.lane)), Run(SIDE, action),
                         Record(SIDE, ("received", action.lane))]
            side_used = True
        elif isinstance(action, Gather):
            # Every owned chunk must be final, and every read of this rank's input done
            # (in place, the gather overwrites it), before any chunk moves.
            commands += [Record(CALLER, ("gathered",)), Wait(SIDE, ("gathered",)), Run(SIDE, action)]
            side_used = True
        else:
            commands.append(Run(CALLER, action))
    if side_used:
        commands += [Record(SIDE, ("side done",)), Wait(CALLER, ("side done",))]
    return _prune(commands)


def _prune(commands: Sequence[Command]) -> List[Command]:
    """``commands`` without the waits whose stream has already seen everything the event
    stands for, then without the records no remaining wait reads. Vector clocks: one count
    of run commands per stream; the caller's starts at one, for its work before the call."""
    clocks: Dict[str, List[int]] = {CALLER: [1, 0], SIDE: [0, 0]}
    recorded: Dict[Tuple, Tuple[int, ...]] = {}
    kept: List[Command] = []
    for command in commands:
        clock = clocks[command.stream]
        if isinstance(command, Run):
            clock[STREAMS.index(command.stream)] += 1
        elif isinstance(command, Record):
            recorded[command.event] = tuple(clock)
        else:
            seen = recorded.get(command.event)
            if seen is None or all(mine >= theirs for mine, theirs in zip(clock, seen)):
                continue
            clocks[command.stream] = [max(mine, theirs) for mine, theirs in zip(clock, seen)]
        kept.append(command)
    read: set = set()  # events a wait later in the list reads from the next record back
    result: List[Command] = []
    for command in reversed(kept):
        if isinstance(command, Wait):
            read.add(command.event)
        elif isinstance(command, Record):
            if command.event not in read:
                continue
            read.discard(command.event)
        result.append(command)
    return result[::-1]


# ------------------------------------------------------------------------ launch counts

@dataclasses.dataclass(frozen=True)
class Launches:
    """What one call of a plan costs the host: NCCL groups (ncclGroupStart/End pairs), NCCL
    calls, kernels, device-to-device copies and event operations (records and waits)."""

    nccl_groups: int
    nccl_calls: int
    kernels: int
    copies: int
    events: int

    @property
    def total(self) -> int:
        return self.nccl_groups + self.nccl_calls + self.kernels + self.copies + self.events


def launches(commands: Sequence[Command]) -> Launches:
    """The host operations :mod:`cupycoll.ring.algorithm` issues for ``commands`` (its
    scratch bookkeeping, one wait and one record per call, not counted). An exchange or a
    gather of two NCCL calls is one NCCL group; of one, that call alone."""
    groups = calls = kernels = copies = events = 0
    for command in commands:
        if not isinstance(command, Run):
            events += 1
            continue
        action = command.action
        if isinstance(action, Exchange):
            n = (action.send_stop > action.send_start) + (action.recv_stop > action.recv_start)
        elif isinstance(action, Gather):
            n = (action.share > 0) + (action.tail_stop > action.tail_start)
        elif isinstance(action, Alone) and not action.transform:
            copies += 1
            continue
        else:
            kernels += 1
            continue
        calls += n
        groups += n > 1
    return Launches(groups, calls, kernels, copies, events)
