"""A group's diagnosis keys on the store: its news, its members' bells, and their end.

The keys are made of the group and its incarnation (:func:`key_prefix`), so a re-created
group never reads an older one's. A rank tells the others something by appending one JSON
line to the group's news (:func:`append_news`: a diagnoser's request, or a fault) and
ringing their bells (one ``multi_set`` of ``cupycoll-bell/<global rank>`` on the root store,
beneath the groups' prefixes), which their listeners wait on
(:mod:`cupycoll.trace.listener`).

**A fault one rank finds reaches every rank.** Once a group's lifetime has made a fault its
own (and explained it), :func:`publish_fault` appends it to the group's news and rings the
members' bells; each member's listener hands it to that group's ``on_fault`` callback. A
published fault is never published again.

The keys live as long as the group: when a rank closes the group it counts itself out
(:func:`forget`), and the last rank out deletes every key of that group's diagnoses and
news (and the bells the group rang), so a store that outlives many groups (a job that
recovers by making new ones) does not grow with their timeouts. A group that never
diagnosed anything leaves no key behind either. A rank that dies never counts itself out,
so the keys of a group with a dead rank stay in the store.

Each of those runs on a daemon thread that the caller leaves after its bound: torch's store
calls block for the store's own timeout (minutes), so a dead store must not hold the caller.

Deliberately left out: the records, counts and verdict of one diagnosis
(:mod:`cupycoll.trace.exchange`) and reading the news (:mod:`cupycoll.trace.listener`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import List, Sequence

from .. import bounds, compat
from .recorder import Recorder
from .records import FAULT_KINDS, MESSAGE_LIMIT, json_lines, valid_item

logger = logging.getLogger(__name__)  # a child of "cupycoll"

FORGET_WAIT_S = bounds.FORGET_WAIT_S
KEY_ROOT = "cupycoll-diag"
BELL_ROOT = "cupycoll-bell"


def key_prefix(group: str, incarnation: int) -> str:
    return f"{KEY_ROOT}/{group}/{incarnation}"


def bell_key(global_rank: int) -> str:
    return f"{BELL_ROOT}/{global_rank}"


def store_timeout(seconds: float):
    """``seconds`` as the timeout a store call takes."""
    import datetime

    # never under 1 ms: torch's stores read a timeout that rounds to 0 ms as none at all
    return datetime.timedelta(milliseconds=max(1, int(seconds * 1000)))


def is_store_timeout(exc: BaseException) -> bool:
    """Did a store call raise ``exc`` because its timeout ran out?"""
    return isinstance(exc, RuntimeError) and "timeout" in str(exc).lower()


def _ring(store, ranks: Sequence[int], but: int) -> None:
    """Ring the bells of ``ranks`` (global ranks) but ``but``: one multi_set."""
    keys = [bell_key(r) for r in ranks if r != but]
    if keys:
        compat.store_set_many(compat.root_store(store), keys, [b"1"] * len(keys))


def append_news(store, prefix: str, item: dict, ranks: Sequence[int], me: int) -> None:
    """Append ``item`` to the group's news, then ring the other members' bells."""
    store.append(f"{prefix}/news", json.dumps(item) + "\n")
    _ring(store, ranks, me)


def publish_fault(store, recorder: Recorder, error: BaseException, wait_s: float = bounds.PUBLISH_WAIT_S) -> bool:
    """Tell the group's other ranks that ``error`` ended the group here: one item in its
    news, their bells rung. Returns within ``wait_s`` whatever the store does (True once the
    store took it); never raises."""
    if store is None or len(recorder.ranks) < 2:
        return False
    name = type(error).__name__
    item = {"kind": "fault", "from": recorder.ranks[recorder.rank],
            "error": name if name in FAULT_KINDS else "PeerFailedError",
            "message": str(error)[:MESSAGE_LIMIT]}
    done = threading.Event()

    def publish() -> None:
        try:
            append_news(store, key_prefix(recorder.group, recorder.incarnation), item, recorder.ranks,
                        recorder.ranks[recorder.rank])
            done.set()
        except Exception as exc:  # noqa: BLE001 - the peers find it by their own timeout
            logger.debug("publishing the fault of group %r failed: %r", recorder.group, exc)
    thread = threading.Thread(target=publish, name="cupycoll-publish", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
        return False
    thread.join(wait_s)
    return done.is_set()


def forget(store, recorder: Recorder, wait_s: float = FORGET_WAIT_S) -> None:
    """This rank closed the group: count it out of the group's diagnosis keys; the last rank
    out deletes them all (the records, the news, their counters). Returns within ``wait_s``
    whatever the store does; never raises (a store without ``delete_key`` keeps its keys)."""
    size = len(recorder.ranks)
    if store is None or size < 2:
        return
    thread = threading.Thread(target=_count_out, name="cupycoll-diagnosis-forget", daemon=True,
                              args=(store, key_prefix(recorder.group, recorder.incarnation), list(recorder.ranks)))
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads; the keys stay
        return
    thread.join(wait_s)


def _count_out(store, prefix: str, ranks: List[int]) -> None:
    try:
        if store.add(f"{prefix}/closed", 1) < len(ranks):
            return
        keys = [f"{prefix}/closed"]
        news_key = f"{prefix}/news"
        if store.check([news_key]):
            keys.append(news_key)
            seqs = {item["seq"] for item in map(valid_item, json_lines(store.get(news_key)))
                    if item is not None and item["kind"] == "ask"}
            for seq in seqs:  # each request's diagnosis keys (cupycoll.trace.exchange)
                keys += [f"{prefix}/{seq}/{name}" for name in ("records", "count", "all", "most", "verdict")]
            # the group rang its members' bells: a bell its listener has not taken stays rung
            root = compat.root_store(store)
            for rank in ranks:
                root.delete_key(bell_key(rank))
        for key in keys:
            store.delete_key(key)
    except Exception as exc:  # noqa: BLE001 - the keys stay; nothing else depends on them
        logger.debug("diagnosis keys under %r not deleted: %s", prefix, exc)
