"""The timeout diagnosis's listeners: one thread per rank of the process, which answers the
other ranks' requests for that rank and hands on the faults they publish.

A rank that is behind is not timing out itself: it may be computing, or waiting in another
group. Its **listener** answers for it: one daemon thread per rank of the process (one per
process but in tests), which waits, served by the store, on that rank's one *bell* key
(:func:`cupycoll.trace.news.bell_key`, on the root store beneath the groups' prefixes) on a
connection of its own (a clone of the store: torch 2.8+, :data:`cupycoll.compat.STORE_CLONE`);
idle, it makes no store call at all. Rung, it reads the news of each group it serves (one
``get`` each), appends that rank's record for a peer's request
(:func:`cupycoll.trace.exchange.answer`: unless the rank published its own for that
collective) and, with a trace folder, dumps its recorders too. Where the store cannot be
cloned it looks at its bell every :data:`cupycoll.bounds.RESPONDER_INTERVAL_S` instead (one
``check`` a look, whatever the number of groups). A store error ends the serving of that
group, logged as a warning. A rank that neither times out nor answers (dead, or holding the
GIL outside cupycoll) is named as not answering.

A fault a peer published (:func:`cupycoll.trace.news.publish_fault`) is handed to that
group's ``on_fault`` callback (its lifetime, which fails the group's pending Works at once
with the same typed error). A malformed news item is skipped.

:data:`RESPONDER` holds the process's listeners (:func:`serve`, :func:`unserve`); at exit
they are rung awake and joined, and a forked child starts with none.

Deliberately left out: the exchange of a rank that times out itself
(:mod:`cupycoll.trace.exchange`) and what a published fault means (the group's lifetime).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

from .. import bounds, compat, hooks
from . import exchange, recorder as _recorder
from .news import bell_key, is_store_timeout, key_prefix, store_timeout
from .recorder import Recorder
from .records import escape, json_lines, valid_item

logger = logging.getLogger(__name__)  # a child of "cupycoll"

RESPONDER_INTERVAL_S = bounds.RESPONDER_INTERVAL_S
# How long a listener's wait for its bell lasts before it waits again: as long as it gets.
# It is rung to wake (a peer's news, or its own stop at exit); a wait that runs out costs a
# store call and a warning line from torch's TCPStore client.
_BELL_WAIT_S = 24 * 3600.0


class _Served:
    """One group a listener serves: the news it has read, the collectives it answered for."""

    def __init__(self, store, recorder: Recorder, dump_dir: Optional[str],
                 on_fault: Optional[Callable[[str, str, int], None]]):
        self.store, self.recorder, self.dump_dir = store, recorder, dump_dir
        self.on_fault = on_fault
        self.prefix = key_prefix(recorder.group, recorder.incarnation)
        self.read = 0  # bytes of the news read
        self.answered: collections.deque = collections.deque(maxlen=64)

    def poll(self) -> None:
        """Read the group's news since the last look (one ``check``, then one ``get`` when
        there is any) and act on each item; a malformed one is skipped."""
        store = self.store
        news_key = f"{self.prefix}/news"
        # check first: get() would wait for a key a group that never had news never gets
        if not store.check([news_key]):
            return
        news = store.get(news_key)
        end = news.rfind(b"\n") + 1 if isinstance(news, bytes) else 0  # whole lines only
        fresh, self.read = news[self.read:end], max(self.read, end)
        me = self.recorder.ranks[self.recorder.rank]
        for value in json_lines(fresh):
            item = valid_item(value)
            if item is None:
                logger.debug("group %r: a malformed news item was skipped: %s",
                             self.recorder.group, escape(value))
            elif item["from"] == me:
                continue
            elif item["kind"] == "ask" and item["seq"] not in self.answered:
                self.answered.append(item["seq"])
                exchange.answer(self.store, self.recorder, item["seq"], self.dump_dir)
            elif item["kind"] == "fault" and self.on_fault is not None:
                self.on_fault(item["error"], item["message"], item["from"])


class _Listener:
    """One rank's listener: a thread waiting on the rank's bell, serving every group of that
    rank on one root store."""

    def __init__(self, root, global_rank: int, interval: float, on_end: Callable[["_Listener"], None]):
        self.root, self.global_rank = root, global_rank
        self.bell = bell_key(global_rank)
        self.interval = interval
        self.served: Dict[int, _Served] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.waits = False  # waiting on a clone, served by the store (else looking every interval)
        self._on_end = on_end
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cupycoll-listener-{global_rank}", daemon=True)

    def ring(self) -> None:
        """Wake the thread now (from this process: its own bell, through the main connection)."""
        self._wake.set()
        if self.waits:
            self.root.set(self.bell, b"1")

    def _run(self) -> None:
        waiter = None
        try:
            waiter = compat.clone_store(self.root)
        except Exception as exc:  # noqa: BLE001 - no clone: look every interval instead
            logger.debug("the store could not be cloned (%r): looking every %g s", exc, self.interval)
        self.waits = waiter is not None
        try:
            while True:
                with self.lock:
                    served = list(self.served.values())
                    if self.stopping or (not served and not self.waits):
                        return
                if waiter is not None:
                    try:
                        waiter.wait([self.bell], store_timeout(_BELL_WAIT_S))
                    except Exception as exc:  # noqa: BLE001 - ran out: wait again
                        if not is_store_timeout(exc):
                            raise
                        continue
                    waiter.delete_key(self.bell)  # first: a ring from now on is seen next time
                else:
                    self._wake.wait(self.interval)
                    self._wake.clear()
                    with self.lock:
                        if self.stopping:
                            return
                    if not self.root.check([self.bell]):
                        continue
                    self.root.delete_key(self.bell)
                self._poll()
        except Exception as exc:  # noqa: BLE001 - a dead store: stop listening
            with self.lock:
                served, self.served = list(self.served.values()), {}
            for item in served:
                logger.warning("group %r: the store failed (%s); no longer answering diagnosis requests "
                               "for it", item.recorder.group, exc)
        finally:
            self._on_end(self)

    def _poll(self) -> None:
        with self.lock:  # the groups served now: one may have come while it waited
            if self.stopping:
                return
            served = list(self.served.values())
        for item in served:
            try:
                item.poll()
            except Exception as exc:  # noqa: BLE001 - that group's store failed: stop serving it
                logger.warning("group %r: the store failed (%s); no longer answering diagnosis requests "
                               "for it", item.recorder.group, exc)
                with self.lock:
                    self.served.pop(id(item.recorder), None)


class Responder:
    """The process's listeners (one per rank and root store; in a real job, one), which
    answer peers' diagnosis requests and hand their published faults on, for every served
    group."""

    def __init__(self):
        self._listeners: Dict[tuple, _Listener] = {}
        self._lock = threading.Lock()

    def serve(self, store, recorder: Recorder, dump_dir: Optional[str] = None,
              interval: float = RESPONDER_INTERVAL_S,
              on_fault: Optional[Callable[[str, str, int], None]] = None) -> None:
        """Answer for ``recorder``'s rank in its group on ``store`` (``interval``: how often
        to look where the store cannot wait for us); ``on_fault(error, message, from_rank)``:
        a peer published the group's fault."""
        root = compat.root_store(store)
        key = (id(root), recorder.ranks[recorder.rank])
        with self._lock:
            listener = self._listeners.get(key)
            if listener is None or listener.stopping or not listener.thread.is_alive() and listener.thread.ident:
                listener = self._listeners[key] = _Listener(root, key[1], interval, self._ended)
                start = True
            else:
                start = False
            with listener.lock:
                listener.served[id(recorder)] = _Served(store, recorder, dump_dir, on_fault)
                listener.interval = min(listener.interval, interval)
        if start:
            listener.thread.start()

    def unserve(self, recorder: Recorder, wait_s: float = bounds.FORGET_WAIT_S) -> None:
        """Stop answering for ``recorder``'s group; a listener left with no group ends (rung
        awake, waited for at most ``wait_s``), taking its bell with it."""
        with self._lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            with listener.lock:
                if listener.served.pop(id(recorder), None) is None:
                    continue
                last = not listener.served
                if last:
                    listener.stopping = True
            if last:
                _end_listeners([listener], wait_s)

    def _ended(self, listener: _Listener) -> None:
        with self._lock:
            for key, known in list(self._listeners.items()):
                if known is listener:
                    del self._listeners[key]

    @property
    def running(self) -> bool:
        with self._lock:
            return any(listener.thread.is_alive() for listener in self._listeners.values())

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop listening and let the threads leave (at exit: a daemon thread still inside a
        store call when the interpreter finalizes can abort the process, "terminate called
        without an active exception"): each is rung awake, then joined."""
        with self._lock:
            listeners = list(self._listeners.values())
        for listener in listeners:
            with listener.lock:
                listener.stopping = True
                listener.served = {}
        _end_listeners(listeners, wait_s)


def _end_listeners(listeners: List[_Listener], wait_s: float) -> None:
    """Ring each of ``listeners`` (set to stop) awake and wait for its thread, at most
    ``wait_s`` in all (a ring may block on a dead store: it runs on a thread of its own)."""
    deadline = time.monotonic() + wait_s
    for listener in listeners:
        ringer = threading.Thread(target=_quietly, args=(listener.ring,), daemon=True)
        try:
            ringer.start()
        except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
            _quietly(listener.ring)
            continue
        ringer.join(max(0.0, deadline - time.monotonic()))
    for listener in listeners:
        thread = listener.thread
        if thread is not threading.current_thread() and thread.ident is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


def _quietly(call: Callable[[], None]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - a dead store at exit: nothing to wake
        pass


RESPONDER = Responder()
serve = RESPONDER.serve
unserve = RESPONDER.unserve


def _after_fork_in_child() -> None:
    # The parent's listener threads are not in the child, and a thread of the parent may
    # have held their locks or the recorders' when it forked; the parent's groups are not
    # the child's to answer for. Start afresh (serve() starts a thread again).
    RESPONDER.__init__()
    _recorder._lock = threading.Lock()
    exchange.after_fork_in_child()


hooks.in_forked_child("diagnosis", _after_fork_in_child)
hooks.at_exit("diagnosis", RESPONDER.stop)
