"""Fault-handling costs: the watchdog's overhead per collective, and how fast faults end.

``python -m bench.fault_bench`` (in a checkout) on a GPU machine prints:

* **watchdog overhead**: host µs per call of a 1-element all_reduce (sync and async_op) on
  a one-rank group whose calls are watched as usual and on one made with
  ``Options(watch_calls=False)`` (its calls record no completion event and nothing is put in
  flight in the watch); the difference is what the watchdog costs the hot path (target:
  <= 2 µs);
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


def _host_us(call, iterations: int) -> float:
    import torch

    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
        if len(samples) % 256 == 0:
            torch.cuda.synchronize()  # keep the queue short: host time, not back-pressure
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def watchdog_overhead(iterations: int = 5000) -> dict:
    """Host µs per all_reduce on a group whose calls are watched and on one whose are not
    (``Options(watch_calls=False)``), alternated in one process; their difference is what
    the watchdog costs a call."""
    import torch
    import torch.distributed as dist

    import cupycoll

    torch.cuda.set_device(0)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    groups = {"tracked": dist.group.WORLD,
              "untracked": dist.new_group([0], pg_options=cupycoll.Options(watch_calls=False))}
    x = torch.ones(1, device="cuda")

    def call_on(group, async_op):
        if async_op:
            return lambda: dist.all_reduce(x, group=group, async_op=True).wait()
        return lambda: dist.all_reduce(x, group=group)

    results = {}
    for label, async_op in (("sync", False), ("async", True)):
        calls = {name: call_on(group, async_op) for name, group in groups.items()}
        for call in calls.values():
            _host_us(call, 500)  # warm-up
        rounds = {"tracked": [], "untracked": []}
        for _ in range(5):  # alternate, so that drift hits both alike
            for name, call in calls.items():
                rounds[name].append(_host_us(call, iterations // 5))
        tracked, bare = statistics.median(rounds["tracked"]), statistics.median(rounds["untracked"])
        results[label] = {"tracked_us": tracked, "untracked_us": bare, "watchdog_us": tracked - bare}
    del groups
    dist.destroy_process_group()
    results["cupycoll_version"] = cupycoll.__version__
    return results


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
    parser.add_argument("--iterations", type=int, default=5000, help="calls timed for the watchdog overhead")
    parser.add_argument("--trials", type=int, default=3, help="abort and hung trials per mode (medians)")
    parser.add_argument("--parts", type=_comma_list(PARTS), default=list(PARTS),
                        help=f"comma list of {', '.join(PARTS)} (default all)")
    parser.add_argument("--modes", type=_comma_list(MODES), default=list(MODES),
                        help="comma list of blocking, nonblocking (default both)")
    parser.add_argument("--json", help="also write the figures to this file (after every part)")
    args = parser.parse_args(argv)
    if args.iterations < 5 or args.trials < 1:
        parser.error("--iterations must be at least 5 and --trials at least 1")
    import torch

    if not torch.cuda.is_available():
        print("fault_bench: no CUDA GPU visible", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "modes": {}, "errors": {}}
    failed = False
    if "watchdog" in args.parts:
        try:
            report["watchdog_overhead"] = watchdog_overhead(args.iterations)
            for label in ("sync", "async"):
                o = report["watchdog_overhead"][label]
                print(f"watchdog overhead, 1-element all_reduce ({label}): tracked {o['tracked_us']:.2f} us/call, "
                      f"untracked {o['untracked_us']:.2f} us/call, watchdog {o['watchdog_us']:+.2f} us "
                      f"(target <= 2 us)", flush=True)
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
