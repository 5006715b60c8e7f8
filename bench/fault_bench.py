"""Fault-handling costs: the watchdog's overhead per collective, and how fast faults end.

``python -m bench.fault_bench`` (in a checkout) on a GPU machine prints:

* **watchdog overhead**: the calling thread's CPU time per call (``time.thread_time``) of a
  1-element all_reduce (sync and async_op) on a one-rank group whose calls are watched as
  usual and on one made with ``Options(watch_calls=False)`` (its calls record no completion
  event and nothing is put in flight in the watch), in ``--rounds`` (>= 15) rounds that
  alternate the two groups and which goes first; the figure is the median of the rounds'
  differences (watched - unwatched, each round's pair measured side by side, so drift
  cancels), with their interquartile range and range. Target: <= 1 µs per synchronous
  call; an asynchronous Work keeps its own event, so its figure has no target. Thread CPU
  leaves out what other processes and the watchdog's own thread take; the queue is drained
  between chunks of calls, outside the timing. ``--device cpu`` runs this part on the CPU
  route (gloo), where no call is watched: the two groups run the same path, so the figure
  shows what the method resolves (its spread around 0) on a machine without a GPU;
* then, per communicator mode (blocking, nonblocking), two ranks on one GPU (NCCL_HOSTID),
  each trial on a fresh group:
  - **abort latency**: rank 1 skips an all_reduce, so rank 0's is stuck on the GPU; another
    thread of rank 0 calls ``group.abort()``: how long ``abort()`` takes and how long until
    the stuck ``synchronize()`` returns (target: <= 2 s);
  - **hung peer -> error**: the same stuck all_reduce with a short group timeout and no
    abort: seconds from issuing it until ``Work.wait()`` raises, and past the timeout
    (target: within timeout + 5 s); also when the stuck ``synchronize()`` was released;
  - **killed peer -> error**: both ranks run all_reduce steps; rank 0 SIGKILLs rank 1 from
    a thread: seconds from the kill until rank 0's next call raises, and whether NCCL
    noticed first or the timeout did (bound: timeout + 5 s).

``--json PATH`` writes the figures, rewritten after every part so that a run stopped from
outside keeps what it measured; ``--parts`` and ``--modes`` pick. Deliberately left out:
multi-GPU transports and fault kinds other than a stuck or dead peer (those are in the GPU
test tier).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import threading
import time

from .launch import free_port


# The target and the rounds below which the spread of the rounds' differences is too wide to
# judge a figure of 1 µs (tools/verify_figures.py keeps the same target; a test keeps them equal).
WATCHDOG_TARGET_US = 1.0
WATCHDOG_ROUNDS = 15
CHUNK_CALLS = 256  # calls between two drains of the queue: host time, not back-pressure


def thread_cpu_per_call(call, calls: int, settle, chunk: int = CHUNK_CALLS,
                        clock=time.thread_time_ns) -> float:
    """µs of this thread's CPU per ``call`` over ``calls`` calls, in chunks of at most ``chunk``
    with ``settle()`` (draining the queue) after each, outside the timing. ``clock``: ns."""
    spent = done = 0
    while done < calls:
        n = min(chunk, calls - done)
        start = clock()
        for _ in range(n):
            call()
        spent += clock() - start
        done += n
        settle()
    return spent / max(1, calls) / 1e3


def alternated_rounds(calls: dict, rounds: int, per_round: int, settle, clock=time.thread_time_ns) -> dict:
    """{name: [µs per call in each round]} for the calls of ``calls`` (name -> call), each round
    timing every call once, the order reversed every other round so that neither always goes
    first (a cache or clock warmed by the one before)."""
    names = list(calls)
    figures = {name: [] for name in names}
    for index in range(rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            figures[name].append(thread_cpu_per_call(calls[name], per_round, settle, clock=clock))
    return figures


def spread(values) -> dict:
    """Median, quartiles (inclusive method) and range of ``values``."""
    values = sorted(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": values[0], "max": values[-1],
            "n": len(values)}


def watchdog_cost(figures: dict) -> dict:
    """What the watchdog costs a call, from :func:`alternated_rounds`' figures of the watched
    ("tracked") and unwatched ("untracked") group: the median of the rounds' differences."""
    differences = [w - u for w, u in zip(figures["tracked"], figures["untracked"])]
    gap = spread(differences)
    return {"tracked_us": statistics.median(figures["tracked"]),
            "untracked_us": statistics.median(figures["untracked"]),
            "watchdog_us": gap["median"], "spread_us": gap, "rounds": len(differences),
            "differences_us": differences, "clock": "the calling thread's CPU time (time.thread_time_ns)"}


def watchdog_overhead(iterations: int = 6000, rounds: int = WATCHDOG_ROUNDS, device: str = "cuda") -> dict:
    """:func:`watchdog_cost` of a synchronous and an asynchronous 1-element all_reduce, on a
    group whose calls are watched and on one whose are not (``Options(watch_calls=False)``),
    ``iterations`` calls of each over ``rounds`` alternated rounds in one process."""
    import torch
    import torch.distributed as dist

    import cupycoll

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": torch.device("cuda", 0)} if cuda else {}))
    groups = {"tracked": dist.group.WORLD,
              "untracked": dist.new_group([0], pg_options=cupycoll.Options(watch_calls=False))}
    x = torch.ones(1, device=device)
    settle = torch.cuda.synchronize if cuda else (lambda: None)

    def call_on(group, async_op):
        if async_op:
            return lambda: dist.all_reduce(x, group=group, async_op=True).wait()
        return lambda: dist.all_reduce(x, group=group)

    per_round = max(1, iterations // rounds)
    results = {}
    for label, async_op in (("sync", False), ("async", True)):
        calls = {name: call_on(group, async_op) for name, group in groups.items()}
        for call in calls.values():
            thread_cpu_per_call(call, min(500, per_round), settle)  # warm-up
        results[label] = watchdog_cost(alternated_rounds(calls, rounds, per_round, settle))
        results[label]["calls_per_round"] = per_round
    del groups
    dist.destroy_process_group()
    results["device"] = device
    results["cupycoll_version"] = cupycoll.__version__
    return results


def describe_watchdog(label: str, o: dict) -> str:
    """One line of the watchdog part's figure, its spread and its target."""
    s = o["spread_us"]
    target = (f"target <= {WATCHDOG_TARGET_US:g} us a synchronous call" if label == "sync"
              else "no target: an asynchronous Work keeps its own event")
    return (f"watchdog overhead, 1-element all_reduce ({label}), the calling thread's CPU per call: "
            f"tracked {o['tracked_us']:.2f} us, untracked {o['untracked_us']:.2f} us, watchdog "
            f"{o['watchdog_us']:+.2f} us (median of {o['rounds']} rounds' differences; interquartile "
            f"{s['q1']:+.2f} to {s['q3']:+.2f}, range {s['min']:+.2f} to {s['max']:+.2f}) ({target})")


PARTS = ("watchdog", "abort", "hung", "killed")
MODES = ("blocking", "nonblocking")
ABORT_TIMEOUT_S = 120.0   # long: the abort, not the watchdog, must be what frees the stuck call
HUNG_TIMEOUT_S = 2.0
KILLED_TIMEOUT_S = 5.0
ABORT_AFTER_S = 0.5


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _trial(rank, store, trial, kind, nonblocking, x, figures, peer_pid):
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    import cupycoll

    timeout = {"abort": ABORT_TIMEOUT_S, "hung": HUNG_TIMEOUT_S, "killed": KILLED_TIMEOUT_S}[kind]
    dist.init_process_group(
        "cupycoll", store=PrefixStore(f"trial{trial}/", store), rank=rank, world_size=2,
        device_id=torch.device("cuda", 0),
        pg_options=cupycoll.Options(timeout=timeout, nonblocking=nonblocking, watchdog_interval=0.05))
    dist.all_reduce(x)  # a healthy collective first: the fault is in a working group
    torch.cuda.synchronize()
    group = dist.group.WORLD
    if kind == "killed":
        if rank == 0:
            stamps = []

            def kill_later():
                time.sleep(ABORT_AFTER_S)
                stamps.append(time.monotonic())
                os.kill(peer_pid, signal.SIGKILL)

            thread = threading.Thread(target=kill_later, daemon=True)
            thread.start()
            try:
                for _ in range(1_000_000):  # until the dead peer makes a call raise
                    dist.all_reduce(x)
                    torch.cuda.synchronize()
                    if stamps and time.monotonic() - stamps[0] > KILLED_TIMEOUT_S + 30:
                        break
            except Exception as exc:  # noqa: BLE001 - the fault under test
                seconds = time.monotonic() - stamps[0]
                figures["killed_error_s"].append(seconds)
                figures["killed_error"].append(_error_text(exc))
            thread.join()
            figures["killed_runs"].append(1)
        else:
            while True:  # until rank 0 kills this process
                dist.all_reduce(x)
                torch.cuda.synchronize()
        return  # the group is dead; the process ends soon after (no orderly teardown)
    if rank == 0:
        if kind == "abort":
            stamps = []

            def abort_later():
                time.sleep(ABORT_AFTER_S)
                stamps.append(time.monotonic())
                group.abort()
                stamps.append(time.monotonic())

            dist.all_reduce(x)  # rank 1 never issues its half
            thread = threading.Thread(target=abort_later)
            thread.start()
            torch.cuda.synchronize()
            released = time.monotonic()
            thread.join()
            figures["abort_call_s"].append(stamps[1] - stamps[0])
            figures["abort_latency_s"].append(released - stamps[0])
        else:
            issued = time.monotonic()
            work = dist.all_reduce(x, async_op=True)  # rank 1 never issues its half
            try:
                work.wait()
                torch.cuda.synchronize()  # ends when the watchdog's abort ends the kernel
                figures["watchdog_release_past_timeout_s"].append(time.monotonic() - issued - timeout)
                work.wait()  # the fault, now on the Work
                figures["hung_error"].append("no error raised")
            except Exception as exc:  # noqa: BLE001 - the fault under test
                figures["hung_error_s"].append(time.monotonic() - issued)
                figures["hung_error"].append(_error_text(exc))
        store.set(f"trial{trial}/released", "1")
    else:
        # A hung peer is alive and busy elsewhere (not inside the store: a blocking store.wait
        # holds the store client its diagnosis responder answers through), so it polls.
        deadline = time.monotonic() + 300
        while not store.check([f"trial{trial}/released"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        # The peer's communicator is gone: an orderly finalize could wait on it (up to the
        # 120 s timeout of the abort trials), so this side aborts too.
        group.abort()
    dist.destroy_process_group()
    store.add(f"trial{trial}/done", 1)
    while store.add(f"trial{trial}/done", 0) < 2:
        time.sleep(0.01)


def _fault_rank(rank: int, port: int, nonblocking: bool, kinds, queue) -> None:
    os.environ.update(NCCL_HOSTID=f"fault-bench-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # cupycoll's gloo side group
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=300))
    store.set(f"pid{rank}", str(os.getpid()))
    peer_pid = int(store.get(f"pid{1 - rank}"))
    x = torch.ones(1 << 16, device="cuda")
    keys = ("abort_call_s", "abort_latency_s", "hung_error_s", "hung_error", "watchdog_release_past_timeout_s",
            "killed_error_s", "killed_error", "killed_runs")
    figures = {key: [] for key in keys}
    for trial, kind in enumerate(kinds):
        _trial(rank, store, trial, kind, nonblocking, x, figures, peer_pid)
        if rank == 0:  # after every trial: a later one that fails or hangs keeps these
            queue.put(("trial", figures))
    if rank == 0:
        queue.put(("done", figures))
        queue.close()
        queue.join_thread()  # the figures are in the pipe before the process ends
        os._exit(0)  # a killed peer's group cannot be torn down in order; nothing left to do


def _summarize(figures: dict) -> dict:
    def median(key):
        values = figures.get(key) or []
        return statistics.median(values) if values else None

    result = {key: median(key) for key in ("abort_call_s", "abort_latency_s", "hung_error_s",
                                            "watchdog_release_past_timeout_s", "killed_error_s")}
    result["trials"] = {key: len(v) for key, v in figures.items() if v and not key.endswith("_error")}
    if figures.get("hung_error_s"):
        result["hung_timeout_s"] = HUNG_TIMEOUT_S
        result["hung_error_past_timeout_s"] = result["hung_error_s"] - HUNG_TIMEOUT_S
    if figures.get("hung_error"):
        result["hung_error"] = figures["hung_error"][0]
    if figures.get("killed_error_s"):
        result["killed_timeout_s"] = KILLED_TIMEOUT_S
        result["killed_error_past_timeout_s"] = result["killed_error_s"] - KILLED_TIMEOUT_S
        result["killed_detected_by"] = ("NCCL, before the timeout" if result["killed_error_s"] < KILLED_TIMEOUT_S
                                        else "the watchdog's timeout")
        result["killed_error"] = figures["killed_error"][0]
    elif figures.get("killed_runs"):
        result["killed_error"] = f"no error within {KILLED_TIMEOUT_S + 30:g} s of the kill"
    return result


def peer_faults(nonblocking: bool, parts, trials: int, timeout: float = 120.0) -> dict:
    """Run the abort / hung / killed trials of one communicator mode; medians per figure.
    A rank that dies or a mode that outlasts ``timeout`` ends it at once, with the trials
    done so far and ``error`` saying why."""
    import queue as queues

    import torch.multiprocessing as mp

    kinds = [k for k in ("abort", "hung") if k in parts for _ in range(trials)]
    if "killed" in parts:
        kinds.append("killed")  # last: it ends rank 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_fault_rank, args=(rank, port, nonblocking, kinds, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    latest, done, error = None, False, None
    deadline = time.monotonic() + timeout
    try:
        while not done:
            try:
                message, latest = queue.get(timeout=0.5 if procs[0].is_alive() else 2.0)
                done = message == "done"
                continue
            except queues.Empty:
                pass
            if not procs[0].is_alive():
                error = f"rank 0 exited with status {procs[0].exitcode} before the last trial (its output is above)"
            elif procs[1].exitcode not in (None, 0, -signal.SIGKILL):
                error = f"rank 1 exited with status {procs[1].exitcode} (its output is above)"
            elif time.monotonic() > deadline:
                error = f"the trials did not finish within {timeout:g} s"
            if error:
                break
    finally:
        for proc in procs:
            proc.join(10 if done else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    result = _summarize(latest or {})
    if error:
        result["error"] = error
    return result


def _write(path, report) -> None:
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=2)
    os.replace(tmp, path)


def _comma_list(allowed):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return names
    return parse


def _seconds(value) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=6000,
                        help="calls timed for the watchdog overhead, per group and form, over all rounds")
    parser.add_argument("--rounds", type=int, default=WATCHDOG_ROUNDS,
                        help=f"alternated rounds of the watchdog overhead (default and least {WATCHDOG_ROUNDS})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the watchdog part alone, on the CPU route (no call is watched there: the "
                             "figure shows the method's spread)")
    parser.add_argument("--trials", type=int, default=3, help="abort and hung trials per mode (medians)")
    parser.add_argument("--parts", type=_comma_list(PARTS), default=list(PARTS),
                        help=f"comma list of {', '.join(PARTS)} (default all)")
    parser.add_argument("--modes", type=_comma_list(MODES), default=list(MODES),
                        help="comma list of blocking, nonblocking (default both)")
    parser.add_argument("--json", help="also write the figures to this file (after every part)")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.rounds < WATCHDOG_ROUNDS:
        parser.error(f"--rounds must be at least {WATCHDOG_ROUNDS}: the spread of fewer rounds is too wide to "
                     f"judge {WATCHDOG_TARGET_US:g} us")
    if args.iterations < args.rounds:
        parser.error("--iterations must be at least --rounds (one call per round)")
    if args.device == "cpu" and args.parts != ["watchdog"]:
        parser.error("--device cpu runs the watchdog part alone (--parts watchdog): the peer faults need a GPU")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("fault_bench: no CUDA GPU visible (--device cpu --parts watchdog runs without one)",
              file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {"gpu": gpu, "torch": torch.__version__, "modes": {}, "errors": {}}
    failed = False
    if "watchdog" in args.parts:
        try:
            report["watchdog_overhead"] = watchdog_overhead(args.iterations, args.rounds, args.device)
            for label in ("sync", "async"):
                print(describe_watchdog(label, report["watchdog_overhead"][label]), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
            report["errors"]["watchdog"] = _error_text(exc)
            print(f"fault_bench: error: watchdog overhead: {_error_text(exc)}", file=sys.stderr, flush=True)
            failed = True
        _write(args.json, report)
    peers = [p for p in args.parts if p != "watchdog"]
    for mode in args.modes if peers else []:
        try:
            f = report["modes"][mode] = peer_faults(mode == "nonblocking", peers, args.trials)
        except Exception as exc:  # noqa: BLE001
            report["errors"][mode] = _error_text(exc)
            print(f"fault_bench: error: {mode}: {report['errors'][mode]}", file=sys.stderr, flush=True)
            failed = True
            _write(args.json, report)
            continue
        if f.get("error"):
            report["errors"][mode] = f["error"]
            print(f"fault_bench: error: {mode}: {f['error']}; the figures below are from the trials "
                  "before it", file=sys.stderr, flush=True)
            failed = True
        if "abort" in peers:
            print(f"abort ({mode}): abort() call {_seconds(f['abort_call_s'])}, stuck all_reduce released "
                  f"{_seconds(f['abort_latency_s'])} after abort() (target <= 2 s)", flush=True)
        if "hung" in peers:
            print(f"hung peer ({mode}): error {_seconds(f['hung_error_s'])} after the call, "
                  f"{_seconds(f.get('hung_error_past_timeout_s'))} past the {HUNG_TIMEOUT_S:g} s timeout "
                  f"(target <= 5 s past); {f.get('hung_error', '')}", flush=True)
        if "killed" in peers:
            print(f"killed peer ({mode}): error {_seconds(f['killed_error_s'])} after the SIGKILL, "
                  f"timeout {KILLED_TIMEOUT_S:g} s, detected by {f.get('killed_detected_by', '-')}; "
                  f"{f.get('killed_error', '')}", flush=True)
        _write(args.json, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
