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

#: How often each process's responder looks for a peer's diagnosis request (one counter per
#: group per pass: what torch's heartbeat monitor costs too).
RESPONDER_INTERVAL_S = 1.0

#: How often a diagnosis polls the store while it waits.
DIAGNOSIS_POLL_S = 0.05

#: How long a rank closing a group waits to count itself out of the group's diagnosis keys.
FORGET_WAIT_S = 1.0

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

#: Every bound above by name, for docs/faults.md's table and the test that checks it.
TABLE = {
    "FAULT_DEADLINE": FAULT_DEADLINE,
    "ABORT_DEADLINE": ABORT_DEADLINE,
    "SHUTDOWN_GRACE": SHUTDOWN_GRACE,
    "EXIT_DEADLINE": EXIT_DEADLINE,
    "HEARTBEAT_TIMEOUT": HEARTBEAT_TIMEOUT,
    "HEARTBEAT_INTERVALS": HEARTBEAT_INTERVALS,
    "DIAGNOSIS_WAIT_S": DIAGNOSIS_WAIT_S,
    "RESPONDER_INTERVAL_S": RESPONDER_INTERVAL_S,
    "DIAGNOSIS_POLL_S": DIAGNOSIS_POLL_S,
    "FORGET_WAIT_S": FORGET_WAIT_S,
    "STORE_WAIT_S": STORE_WAIT_S,
    "PENDING_GRACE_S": PENDING_GRACE_S,
    "CALL_BLOCKED_S": CALL_BLOCKED_S,
}
