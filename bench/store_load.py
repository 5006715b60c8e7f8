"""``cupycoll-bench --scenario store``: what cupycoll's own store traffic costs one TCPStore server.

Every cupycoll rank reaches rank 0's TCPStore, one server thread that torch's rendezvous and
heartbeats share: communicator creation (:mod:`cupycoll.nccl.bootstrap`), the timeout
diagnosis and its per-process listener (:mod:`cupycoll.trace.exchange`,
:mod:`cupycoll.trace.listener`) all go through it.
This scenario runs N simulated ranks as threads of one process, each with a TCPStore client
of its own (its own connection, as a rank has), against one real server in a child process,
and counts the store calls each rank makes:

* **creation**: one communicator among all ranks, the ranks arriving spread over
  ``--store-skew`` seconds (NCCL's unique id replaced by random bytes: no GPU);
* **subgroup creation**: every rank in one subgroup of 8, each subgroup its own communicator;
* **timeout diagnosis**: every rank but one times out in the same collective (spread over
  0.2 s) and asks where the others are; the last rank is behind and answers through its
  listener;
* **an idle minute**: four groups per rank served, nothing wrong (measured for
  ``--store-idle`` seconds and scaled to a minute).

It then measures the server's saturated rate on this machine (clients on threads calling
``check`` as fast as the server answers) and projects each figure to 1,024 and 16,384 ranks:
the calls per rank as ``a + b * N`` fitted over the measured sizes where they grow (else the
constant they are, :func:`model`), the total per event, and the seconds of the server's
time it takes at the measured rate, beside ProcessGroupNCCL's.

Deliberately left out: gloo's own rendezvous (its full mesh; where torch's
``TORCH_GLOO_LAZY_INIT`` makes it lazy, the CPU half's count of the ranks:
:func:`cupycoll.cpu_half.build_gloo_half`), torch's rendezvous, and wall times at scale (2 cores say
nothing of 16,384 processes; the counts are exact and extrapolate by formula).
"""

from __future__ import annotations

import collections
import datetime
import os
import random
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Sequence

SIZES = (8, 16, 32, 64)
PROJECTED = (1024, 16384)
SUBGROUP = 8
IDLE_GROUPS = 4
DIAGNOSIS_SPREAD_S = 0.2

# What ProcessGroupNCCL costs for the same events, per rank (its source: one `set` of the
# unique id by the root and one blocking `get` by every other rank; no diagnosis; its
# heartbeat monitor `check`s the store for a dump signal every TORCH_NCCL_COORD_CHECK_MILSEC
# = 1000 ms).
PROCESS_GROUP_NCCL = {"creation": "~1", "subgroup creation": "~1", "timeout diagnosis": "0 (none)",
                      "idle minute": "60"}

_SERVER = ("import datetime, sys, torch.distributed as d\n"
           "s = d.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False, "
           "timeout=datetime.timedelta(seconds=300))\n"
           "print(s.port, flush=True)\n"
           "sys.stdin.read()\n")


class Counted:
    """A store that counts every call made on it (and on its clones) into ``tally``."""

    def __init__(self, store, tally: collections.Counter, lock: threading.Lock):
        self._store, self._tally, self._lock = store, tally, lock

    def __getattr__(self, name):
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            with self._lock:
                self._tally[name] += 1
            return attribute(*args, **kwargs)
        return call

    def clone(self):
        with self._lock:
            self._tally["clone"] += 1
        return Counted(self._store.clone(), self._tally, self._lock)


class Server:
    """A TCPStore server in a child process (its own cores' worth of scheduling)."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        return self

    def client(self, prefix: str = ""):
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        return dist.PrefixStore(prefix, store) if prefix else store

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(10)


def _ranks(server: Server, n: int, prefix: str):
    lock = threading.Lock()
    tallies = [collections.Counter() for _ in range(n)]
    return [Counted(server.client(prefix), tallies[r], lock) for r in range(n)], tallies


def _run_threads(body: Callable[[int], None], n: int, timeout: float = 120.0) -> None:
    errors: List[BaseException] = []

    def run(rank):
        try:
            body(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        raise errors[0]


def creation(server: Server, n: int, skew: float, group_of: Callable[[int], tuple], tag: str) -> List[int]:
    """Calls per rank to create one communicator per group (``group_of(rank)``: key, group
    rank, members), the ranks arriving spread over ``skew`` seconds."""
    from cupycoll.nccl import bootstrap

    stores, tallies = _ranks(server, n, f"{tag}/")
    delays = [random.Random(rank).uniform(0, skew) for rank in range(n)]
    ids: Dict[str, set] = collections.defaultdict(set)

    def rank(r):
        key, group_rank, members = group_of(r)
        time.sleep(delays[r])
        ids[key].add(bootstrap.StoreBootstrap(stores[r], group_rank, 60).unique_id(key, group_rank == 0, members))
    made = bootstrap.new_unique_id
    bootstrap.new_unique_id = lambda: os.urandom(128)
    try:
        _run_threads(rank, n)
    finally:
        bootstrap.new_unique_id = made
    assert all(len(v) == 1 for v in ids.values()), "the members of a communicator got different ids"
    return [sum(t.values()) for t in tallies]


def _recorders(n: int, group: str, behind: int):
    import torch
    from cupycoll.trace.recorder import Recorder

    out = []
    for rank in range(n):
        recorder = Recorder(group, list(range(n)), rank, size=64)
        for seq in range(1, 42):
            recorder.mark(recorder.record("all_reduce", ((4,),), (torch.float32,)), "completed")
        if rank != behind:
            recorder.record("all_reduce", ((1024,),), (torch.float32,))
        out.append(recorder)
    return out


def _settle(tallies, limit: float = 30.0) -> None:
    """Wait until every rank's listener waits for its bell (or looks at it: before torch
    2.8), so that their start, a connection each that the server accepts in a burst, is not
    what the next part counts."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and not all(t["wait"] or t["check"] for t in tallies):
        time.sleep(0.05)
    time.sleep(0.5)


def diagnosis(server: Server, n: int, tag: str) -> List[int]:
    """Calls per rank while every rank but the last diagnoses a timeout in #42 (the last one
    behind, answering through its listener), from the first asker to the last report."""
    from cupycoll.trace import exchange, listener

    stores, tallies = _ranks(server, n, f"{tag}/")
    recorders = _recorders(n, "g", behind=n - 1)
    for rank in range(n):
        listener.serve(stores[rank], recorders[rank])
    _settle(tallies)
    for tally in tallies:
        tally.clear()
    reports = {}

    def rank(r):
        if r == n - 1:
            return
        time.sleep(random.Random(r).uniform(0, DIAGNOSIS_SPREAD_S))
        reports[r] = exchange.diagnose_timeout(stores[r], recorders[r], timeout_s=30).message
    try:
        _run_threads(rank, n)
        time.sleep(1.0)  # what the exchange's threads still do after the reports
        counts = [sum(t.values()) for t in tallies]
    finally:
        for recorder in recorders:
            listener.unserve(recorder)
    behind = f"rank {n - 1} is behind"
    assert all(behind in message for message in reports.values()), next(iter(reports.values()))
    return counts


def idle(server: Server, n: int, seconds: float, tag: str) -> List[float]:
    """Calls per rank per minute with IDLE_GROUPS groups served and nothing wrong."""
    from cupycoll.trace import listener

    stores, tallies = _ranks(server, n, f"{tag}/")
    served = [rec for g in range(IDLE_GROUPS) for rec in _recorders(n, f"idle{g}", behind=-1)]
    for recorder in served:
        listener.serve(stores[recorder.rank], recorder)
    _settle(tallies)
    for tally in tallies:
        tally.clear()
    time.sleep(seconds)
    counts = [sum(t.values()) * 60.0 / seconds for t in tallies]
    for recorder in served:
        listener.unserve(recorder)
    return counts


def saturated_rate(server: Server, clients: int = 16, seconds: float = 3.0) -> float:
    """Store calls per second the server answers with ``clients`` callers as fast as it can."""
    stores = [server.client() for _ in range(clients)]
    done = threading.Event()
    counts = [0] * clients

    def hammer(i):
        store, key = stores[i], [f"saturate/{i}"]
        while not done.is_set():
            store.check(key)
            counts[i] += 1
    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    start, before = time.monotonic(), sum(counts)
    time.sleep(seconds)
    rate = (sum(counts) - before) / (time.monotonic() - start)
    done.set()
    for thread in threads:
        thread.join(5)
    return rate


def model(sizes: Sequence[int], values: Sequence[float]) -> tuple:
    """How the calls per rank grow with the world size: (a, b) of ``a + b * size`` fitted
    through the counts when they grow by more than a tenth over the measured sizes, else
    the constant (b = 0) of the largest size: a fitted slope of noise would project
    thousands of calls at 16,384 ranks from counts that do not grow."""
    a, b = fit(sizes, values)
    if abs(b) * (max(sizes) - min(sizes)) > 0.1 * max(values):
        return a, b
    return values[list(sizes).index(max(sizes))], 0.0


def fit(sizes: Sequence[int], values: Sequence[float]) -> tuple:
    """Least squares ``value = a + b * size``."""
    mean_x, mean_y = sum(sizes) / len(sizes), sum(values) / len(values)
    var = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, values)) / var if var else 0.0
    return mean_y - slope * mean_x, slope


def measure(sizes: Sequence[int] = SIZES, skew: float = 0.5, idle_s: float = 12.0,
            out: Callable[[str], None] = print) -> dict:
    """Run every part; the figures as a dict (and printed as tables through ``out``)."""
    import torch  # noqa: F401 - before the threads: its import is not thread-safe

    results: Dict[str, Dict[int, List[float]]] = collections.defaultdict(dict)
    with Server() as server:
        for n in sizes:
            results["creation"][n] = creation(server, n, skew, lambda r, n=n: ("world", r, n), f"c{n}")
            results["subgroup creation"][n] = creation(
                server, n, skew, lambda r: (f"sub{r // SUBGROUP}", r % SUBGROUP, SUBGROUP), f"s{n}")
            results["timeout diagnosis"][n] = diagnosis(server, n, f"d{n}")
            results["idle minute"][n] = idle(server, n, idle_s, f"i{n}")
            out(f"# {n} ranks measured")
        rate = saturated_rate(server)
    mean = {part: {n: sum(v) / len(v) for n, v in per.items()} for part, per in results.items()}
    top = {part: {n: max(v) for n, v in per.items()} for part, per in results.items()}
    out(f"\nstore calls per rank (mean, max), {skew:g} s arrival skew, {IDLE_GROUPS} groups per rank idle:")
    out("| | " + " | ".join(f"{n} ranks" for n in sizes) + " | ProcessGroupNCCL |")
    out("|---|" + "---|" * len(sizes) + "---|")
    for part in mean:
        cells = [f"{mean[part][n]:.1f} ({top[part][n]:.0f})" for n in sizes]
        out(f"| {part} | " + " | ".join(cells) + f" | {PROCESS_GROUP_NCCL[part]} |")
    out(f"\nthe server's saturated rate here: {rate:,.0f} calls/s")
    out("\nprojected (calls per rank a + b*N fitted where they grow, else constant):")
    out("| | " + " | ".join(f"{n:,} ranks: per rank, total, server time" for n in PROJECTED) + " |")
    out("|---|" + "---|" * len(PROJECTED))
    projection = {}
    for part in mean:
        a, b = model(list(sizes), [mean[part][n] for n in sizes])
        cells = []
        for n in PROJECTED:
            per_rank = max(0.0, a + b * n)
            total = per_rank * n
            if part == "idle minute":
                cells.append(f"{per_rank:.1f}/min, {total / 60:,.0f} calls/s, {total / 60 / rate:.1%} of the server")
            else:
                cells.append(f"{per_rank:.1f}, {total:,.0f}, {total / rate:.2f} s")
            projection.setdefault(part, {})[n] = {"per_rank": per_rank, "total": total}
        out(f"| {part} | " + " | ".join(cells) + " |")
    return {"mean": mean, "max": top, "rate": rate, "projection": projection}


def run(config) -> int:
    """The CLI's entry: ``--scenario store`` (``config``: cupycoll-bench's Config)."""
    measure(config.store_ranks, config.store_skew, config.store_idle)
    return 0


if __name__ == "__main__":
    measure()
