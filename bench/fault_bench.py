"""Fault-handling costs: the watchdog's overhead per collective, and abort latency.

``python -m bench.fault_bench`` (in a checkout) on a GPU machine prints:

* **watchdog overhead**: host µs per call of a 1-element all_reduce (sync and async_op) on
  a one-rank group, tracked by the watchdog as usual and with tracking switched off (the
  call then records no completion event and nothing is handed to the watchdog); the
  difference is what the watchdog costs the hot path (target: <= 2 µs);
* **abort latency**: two ranks on one GPU (NCCL_HOSTID), rank 1 skips an all_reduce so
  rank 0's is stuck on the GPU; another thread of rank 0 calls ``group.abort()``. Reported:
  how long ``abort()`` itself takes and how long until the stuck ``synchronize()`` returns,
  for blocking and nonblocking communicators; and the watchdog's detection latency
  (time past the timeout until the stuck collective is released).

``--json PATH`` also writes the figures. Deliberately left out: multi-GPU transports and
fault kinds other than a stuck peer (those are in the GPU test tier).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    import torch
    import torch.distributed as dist

    import cupycoll
    from cupycoll.process_group import ProcessGroupCupycoll

    torch.cuda.set_device(0)
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    x = torch.ones(1, device="cuda")
    tracked_track = ProcessGroupCupycoll._track

    def untracked(self, issues, stream, async_op):
        for issue in issues:
            issue.work._issued(stream, None, issue.keepalive if async_op else None)

    results = {}
    for label, async_op in (("sync", False), ("async", True)):
        call = (lambda: dist.all_reduce(x, async_op=True).wait()) if async_op else (lambda: dist.all_reduce(x))
        _host_us(call, 500)  # warm-up
        rounds = {"tracked": [], "untracked": []}
        for _ in range(5):  # alternate, so that drift hits both alike
            ProcessGroupCupycoll._track = tracked_track
            rounds["tracked"].append(_host_us(call, iterations // 5))
            ProcessGroupCupycoll._track = untracked
            rounds["untracked"].append(_host_us(call, iterations // 5))
        ProcessGroupCupycoll._track = tracked_track
        tracked, bare = statistics.median(rounds["tracked"]), statistics.median(rounds["untracked"])
        results[label] = {"tracked_us": tracked, "untracked_us": bare, "watchdog_us": tracked - bare}
    del group
    dist.destroy_process_group()
    results["cupycoll_version"] = cupycoll.__version__
    return results


def _abort_rank(rank: int, port: int, nonblocking: bool, queue) -> None:
    os.environ.update(NCCL_HOSTID=f"fault-bench-{rank}", NCCL_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore

    import cupycoll

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1 << 16, device="cuda")
    figures = {"abort_call_s": [], "release_s": [], "watchdog_release_past_timeout_s": []}
    for trial in range(6):
        by_watchdog = trial >= 4
        timeout = 2.0 if by_watchdog else 120.0
        dist.init_process_group(
            "cupycoll", store=PrefixStore(f"trial{trial}/", store), rank=rank, world_size=2,
            device_id=torch.device("cuda", 0),
            pg_options=cupycoll.Options(timeout=timeout, nonblocking=nonblocking, watchdog_interval=0.05))
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if rank == 0:
            group = dist.group.WORLD
            stamps = []

            def abort_later():
                time.sleep(0.5)
                stamps.append(time.monotonic())
                group.abort()
                stamps.append(time.monotonic())

            dist.all_reduce(x)  # rank 1 never issues its half
            issued = time.monotonic()
            if not by_watchdog:
                thread = threading.Thread(target=abort_later)
                thread.start()
            torch.cuda.synchronize()
            released = time.monotonic()
            if by_watchdog:
                figures["watchdog_release_past_timeout_s"].append(released - issued - timeout)
            else:
                thread.join()
                figures["abort_call_s"].append(stamps[1] - stamps[0])
                figures["release_s"].append(released - stamps[0])
            store.set(f"trial{trial}/released", "1")
        else:
            store.wait([f"trial{trial}/released"], datetime.timedelta(seconds=120))
        dist.destroy_process_group()
        store.add(f"trial{trial}/done", 1)
        while store.add(f"trial{trial}/done", 0) < 2:
            time.sleep(0.01)
    if rank == 0:
        queue.put({key: (statistics.median(v) if v else None) for key, v in figures.items()})


def abort_latency(nonblocking: bool) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_abort_rank, args=(rank, port, nonblocking, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        result = queue.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fault_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fault_bench: no CUDA GPU visible", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    report["watchdog_overhead"] = watchdog_overhead(args.iterations)
    for label in ("sync", "async"):
        o = report["watchdog_overhead"][label]
        print(f"watchdog overhead, 1-element all_reduce ({label}): tracked {o['tracked_us']:.2f} us/call, "
              f"untracked {o['untracked_us']:.2f} us/call, watchdog {o['watchdog_us']:+.2f} us "
              f"(target <= 2 us)")
    for mode, nonblocking in (("blocking", False), ("nonblocking", True)):
        figures = abort_latency(nonblocking)
        report[f"abort_{mode}"] = figures
        print(f"abort ({mode}): abort() call {figures['abort_call_s'] * 1e3:.1f} ms, stuck all_reduce released "
              f"{figures['release_s'] * 1e3:.1f} ms after abort(); watchdog released it "
              f"{figures['watchdog_release_past_timeout_s'] * 1e3:.0f} ms past the 2 s timeout")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
