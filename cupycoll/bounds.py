"""Every time bound of cupycoll's fault handling, in one table.

One number is the user's: the group **timeout** (``Options(timeout=...)``,
``CUPYCOLL_TIMEOUT``, default :data:`cupycoll.config.DEFAULT_TIMEOUT`, 10 minutes as torch's
nccl): how long a call may wait for a peer or the GPU. Every other bound is fixed here and
bounds what cupycoll itself does once the timeout has passed, so that from a hang to the error
in the caller's hands takes at most::

    timeout + watchdog interval + DIAGNOSIS_WAIT_S (+ the abort, bounded by FAULT_DEADLINE)

Each constant says what it bounds and why it has its value. docs/faults.md lists them as a
table, which a test checks against this module.

Deliberately left out: the timeout itself and the watchdog interval (settings: config), and
NCCL's own timeouts (``NCCL_*`` variables reach NCCL unchanged).
"""

from __future__ import annotations

# -- a fault's handling --------------------------------------------------------------------

#: The most a fault's handling may take once detected: its diagnosis (at most
#: DIAGNOSIS_WAIT_S) plus ncclCommAbort (tens to hundreds of milliseconds when healthy). Past
#: it, ``terminate`` exits without waiting for the rest and ``raise`` logs that the abort hangs.
#: The Works have failed before the abort starts, so the bound only decides when the process
#: gives up on ncclCommAbort. torch bounds its abort the same way.
FAULT_DEADLINE = 15.0

#: How long an abort a user calls (``group.abort()``, ``abort_all()``, a shutdown that falls
#: back to an abort) waits for ncclCommAbort before it returns anyway, and how long a second
#: aborter waits for the first one's: the same as a fault's, for the same reason.
ABORT_DEADLINE = FAULT_DEADLINE

#: ``destroy_process_group``'s wait for work still in flight before it aborts instead (and
#: never more than the timeout). Short: work a program never waited for at destroy time is
#: either done in microseconds or stuck (an unmatched send, a peer that already left).
SHUTDOWN_GRACE = 10.0

#: What a fault's end leaves for after it may take at most this long each: the flight-recorder
#: dump and torchrun's error file before an exit 70, the dump and the ERROR line after an end.
#: Each runs on a thread of its own, waited for this long, so that a folder or a logging
#: handler that blocks never holds back the abort or the exit.
DUMP_WAIT_S = 1.0

#: The atexit abort of every group never destroyed, in all: past it the process exits anyway.
EXIT_DEADLINE = 10.0

#: A watchdog pass that has not finished after max(HEARTBEAT_TIMEOUT, 20 intervals) is
#: reported with its stack (and ends the process under ``terminate``): a pass only queries
#: events, so it can hang only on the CUDA driver or on a hung NCCL call's lock.
HEARTBEAT_TIMEOUT = 60.0
HEARTBEAT_INTERVALS = 20

# -- the diagnosis: which rank is behind -------------------------------------------------

#: How long a timed-out rank waits for the others' records before it reports what it has: a
#: silent rank is then named as not answering. Longer than RESPONDER_INTERVAL_S, so a rank
#: that is alive but busy elsewhere answers in time.
DIAGNOSIS_WAIT_S = 4.0

#: Where the store cannot be cloned (torch before 2.8), how often each rank's listener looks
#: at its bell for a peer's diagnosis request or published fault (one ``check`` a look,
#: whatever the number of groups). With a clone it waits for the bell, served by the store,
#: and wakes at once. Well under DIAGNOSIS_WAIT_S, so a busy rank still answers in time.
RESPONDER_INTERVAL_S = 2.0

#: How long a rank that found a fault waits for the store to take its publication (the
#: group's news and the members' bells) before it goes on ending the group: a dead store
#: must not hold the abort back.
PUBLISH_WAIT_S = 1.0

#: A CPU Work waited on waits in gloo in slices of this length, so that a fault a peer
#: published (or an abort) fails it within one rather than at gloo's own timeout.
CPU_WAIT_SLICE_S = 0.5

#: How long a rank closing a group waits to count itself out of the group's diagnosis keys.
FORGET_WAIT_S = 1.0

# -- recovery ---------------------------------------------------------------------------

#: What a shrink's survivors wait for each other beyond the time the last of them may take to
#: learn of the fault by itself (the group timeout, a watchdog interval and DIAGNOSIS_WAIT_S:
#: a survivor the publication did not reach finds the fault by its own timeout): the time to
#: get from the error to shrink_group.
SHRINK_MARGIN_S = 2.0


def shrink_gathering(timeout_s: float, watchdog_interval_s: float) -> float:
    """How long a shrink's survivors wait for each other: until every survivor has learnt of
    the fault, whoever learnt first (see SHRINK_MARGIN_S)."""
    return timeout_s + watchdog_interval_s + DIAGNOSIS_WAIT_S + SHRINK_MARGIN_S


# -- communicator creation -----------------------------------------------------------------

#: Store waits (the unique id, all members arrived) are served by the store in slices of
#: this length, so that an abort ends them within one; the whole wait is bounded by the
#: timeout. Longer than a typical arrival skew (a waiting rank then makes one call), short
#: enough for an abort to be prompt.
STORE_WAIT_S = 1.0

#: A last arrival that claimed the decision ("pending") but published no unique id within this
#: long is taken as gone, and the generation is abandoned (bounded by the timeout as a whole).
PENDING_GRACE_S = 5.0

# -- NCCL calls under way ----------------------------------------------------------------

#: An NCCL call enqueues in microseconds. One inside NCCL for longer than this is blocked
#: (a blocking communicator connecting to a peer that has not made the call, a full launch
#: queue): the watchdog then queries NCCL's asynchronous error beside it (it may be the only
#: news of the fault), and an abort does not wait for it.
CALL_BLOCKED_S = 1.0

#: A synchronous call (its Work holds no tensors; the caller's stream orders what follows)
#: joins the open watched batch of its stream when that batch is younger than this, instead
#: of recording a CUDA event of its own: the batch's one event, recorded when the next call
#: finds it older, when a Work of it is asked, or by the watchdog's next pass, covers every
#: call before it (calls on one stream finish in order). So a busy stream costs one event per
#: this interval, and a call's completion is seen at most this much (plus one watchdog
#: interval) late; its timeout still runs from its batch's first call.
SEAL_S = 0.001

#: Every bound above by name, for docs/faults.md's table and the test that checks it.
TABLE = {
    "FAULT_DEADLINE": FAULT_DEADLINE,
    "ABORT_DEADLINE": ABORT_DEADLINE,
    "SHUTDOWN_GRACE": SHUTDOWN_GRACE,
    "DUMP_WAIT_S": DUMP_WAIT_S,
    "EXIT_DEADLINE": EXIT_DEADLINE,
    "HEARTBEAT_TIMEOUT": HEARTBEAT_TIMEOUT,
    "HEARTBEAT_INTERVALS": HEARTBEAT_INTERVALS,
    "DIAGNOSIS_WAIT_S": DIAGNOSIS_WAIT_S,
    "RESPONDER_INTERVAL_S": RESPONDER_INTERVAL_S,
    "PUBLISH_WAIT_S": PUBLISH_WAIT_S,
    "FORGET_WAIT_S": FORGET_WAIT_S,
    "CPU_WAIT_SLICE_S": CPU_WAIT_SLICE_S,
    "SHRINK_MARGIN_S": SHRINK_MARGIN_S,
    "STORE_WAIT_S": STORE_WAIT_S,
    "PENDING_GRACE_S": PENDING_GRACE_S,
    "CALL_BLOCKED_S": CALL_BLOCKED_S,
    "SEAL_S": SEAL_S,
}
