"""``make verify-gpu --quick``'s first real test: the basic CUDA collectives at world size 2.

Two ranks (sharing GPU 0 through distinct ``NCCL_HOSTID``s when there is one GPU) run on
the cupycoll backend, each result compared exactly with the value computed by hand:
all_reduce (fp32 sync, bf16 async), all_gather (into a tensor and into a list),
reduce_scatter, broadcast from rank 1, send/recv and a ``batch_isend_irecv`` exchange,
PREMUL_SUM with a scalar and a tensor factor, the ring algorithm's all_reduce (fp32,
bf16) and its BXOR. The group's timeout is short, so a hung call fails its check and the
later checks fail at once instead of hanging the probe.

``python -m tools.gpu_probe [--json PATH] [--timeout S]`` prints one line per check and
exits 0 when every check passed on both ranks. Each rank appends its results to a file as
it goes, so a probe stopped from outside still shows which check hung.

Left out: dtype x op coverage, sizes, faults, comparison with torch's nccl backend
(the GPU test tier and the benchmark do those).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.launch import free_port  # noqa: E402  (standard library only)

WORLD = 2
GROUP_TIMEOUT_S = 20.0


# -- rank side ------------------------------------------------------------------------
def _checks(rank, device):
    import torch
    import torch.distributed as dist

    import cupycoll

    peer = 1 - rank
    n = 1001

    def full(value, dtype=torch.float32, count=n):
        return torch.full((count,), value, dtype=dtype, device=device)

    def same(got, want):
        if not torch.equal(got.cpu(), want.cpu()):
            raise AssertionError(f"got {got[:4].tolist()}..., expected {want[:4].tolist()}...")

    def all_reduce_fp32():
        t = full(rank + 1.0)
        dist.all_reduce(t)
        same(t, full(3.0))

    def all_reduce_bf16_async():
        t = full(rank + 1.0, torch.bfloat16)
        dist.all_reduce(t, async_op=True).wait()
        same(t, full(3.0, torch.bfloat16))

    def all_gather_tensor():
        out = torch.empty(WORLD * n, dtype=torch.int32, device=device)
        dist.all_gather_into_tensor(out, full(rank + 7, torch.int32))
        same(out, torch.cat([full(7, torch.int32), full(8, torch.int32)]))

    def all_gather_list():
        outs = [torch.empty(n, device=device) for _ in range(WORLD)]
        dist.all_gather(outs, full(float(rank)))
        same(torch.cat(outs), torch.cat([full(0.0), full(1.0)]))

    def reduce_scatter():
        out = torch.empty(n, device=device)
        dist.reduce_scatter_tensor(out, torch.cat([full(1.0 + rank), full(10.0 + rank)]))
        same(out, full(3.0 if rank == 0 else 21.0))

    def broadcast_from_1():
        t = full(5.0 if rank == 1 else -1.0, torch.float16)
        dist.broadcast(t, src=1)
        same(t, full(5.0, torch.float16))

    def send_recv():
        got = torch.empty(n, device=device)
        if rank == 0:
            dist.send(full(42.0), dst=peer)
            dist.recv(got, src=peer)
        else:
            dist.recv(got, src=peer)
            dist.send(full(43.0), dst=peer)
        same(got, full(43.0 if rank == 0 else 42.0))

    def batch_isend_irecv():
        got = torch.empty(n, device=device)
        ops = [dist.P2POp(dist.isend, full(100.0 + rank), peer), dist.P2POp(dist.irecv, got, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        same(got, full(100.0 + peer))

    def premul_sum_scalar():
        t = full(rank + 1.0)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        same(t, full(6.0))

    def premul_sum_tensor_bf16():
        t = full(rank + 1.0, torch.bfloat16)
        factor = torch.tensor([4.0], dtype=torch.bfloat16, device=device)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        same(t, full(12.0, torch.bfloat16))

    def ring_all_reduce(dtype):
        def check():
            t = full(rank + 1.0, dtype, count=(1 << 20) + 3)
            with cupycoll.algorithm("ring"):
                dist.all_reduce(t)
            same(t, full(3.0, dtype, count=(1 << 20) + 3))
        return check

    def ring_bxor():
        t = full(0b0110 if rank == 0 else 0b0011, torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)  # only the ring has it: auto picks it
        same(t, full(0b0101, torch.int32))

    return [
        ("all_reduce fp32", all_reduce_fp32), ("all_reduce bf16 async", all_reduce_bf16_async),
        ("all_gather_into_tensor int32", all_gather_tensor), ("all_gather list", all_gather_list),
        ("reduce_scatter_tensor", reduce_scatter), ("broadcast fp16 from rank 1", broadcast_from_1),
        ("send/recv", send_recv), ("batch_isend_irecv", batch_isend_irecv),
        ("PREMUL_SUM scalar", premul_sum_scalar), ("PREMUL_SUM tensor bf16", premul_sum_tensor_bf16),
        ("ring all_reduce fp32", ring_all_reduce(torch.float32)),
        ("ring all_reduce bf16", ring_all_reduce(torch.bfloat16)), ("ring BXOR int32", ring_bxor),
    ]


def rank_main(results_path: str, on_cpu: bool = False) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    import cupycoll

    rank = int(os.environ["RANK"])
    if on_cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def record(entry):
        with open(results_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(dict(entry, rank=rank)) + "\n")

    start = time.monotonic()
    init = "init" if on_cpu else "init (eager, device_id)"
    try:
        dist.init_process_group("cupycoll", rank=rank, world_size=WORLD, device_id=None if on_cpu else device,
                                timeout=datetime.timedelta(seconds=60),
                                pg_options=cupycoll.Options(timeout=GROUP_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - nothing else can run; say why
        record({"check": init, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400],
                "seconds": time.monotonic() - start})
        return 1
    record({"check": init, "ok": True, "seconds": time.monotonic() - start})
    failed = 0
    for name, check in _checks(rank, device):
        start = time.monotonic()
        try:
            check()
            if not on_cpu:
                torch.cuda.synchronize(device)
            entry = {"check": name, "ok": True}
        except Exception as exc:  # noqa: BLE001 - recorded, then the next check
            failed += 1
            entry = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        record(dict(entry, seconds=time.monotonic() - start))
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        record({"check": "destroy_process_group", "ok": False, "error": str(exc)[:400]})
        failed += 1
    return 1 if failed else 0


# -- launcher -------------------------------------------------------------------------
def launch(json_path, timeout: float, on_cpu: bool = False) -> int:
    work = tempfile.mkdtemp(prefix="gpu-probe-")
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                   NCCL_HOSTID=f"verify-probe-{rank}", NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # cupycoll's gloo side group, on loopback too
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.gpu_probe", "--rank-results",
                                       os.path.join(work, f"rank{rank}.jsonl"), *(["--cpu"] if on_cpu else [])],
                                      cwd=ROOT, env=env))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for other in procs:
                other.kill()
            proc.wait()
    entries = []
    for rank in range(WORLD):
        path = os.path.join(work, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                entries += [json.loads(line) for line in fh if line.strip()]
    names = list(dict.fromkeys(e["check"] for e in entries))
    checks = []
    for name in names:
        mine = [e for e in entries if e["check"] == name]
        ok = len(mine) == WORLD and all(e["ok"] for e in mine)
        errors = sorted({f"rank {e['rank']}: {e['error']}" for e in mine if not e["ok"]})
        checks.append({"check": name, "ok": ok, "errors": errors,
                       "seconds": max(e.get("seconds", 0.0) for e in mine)})
        print(f"probe: {name:<32} {'ok' if ok else 'FAILED'} {max(e.get('seconds', 0) for e in mine):6.2f} s"
              + ("" if ok else f"  {'; '.join(errors) or 'not reached on every rank'}"), flush=True)
    codes = [p.returncode for p in procs]
    report = {"world_size": WORLD, "checks": checks, "exit_codes": codes, "timed_out": timed_out,
              "passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks)}
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    if timed_out:
        print(f"probe: error: the ranks did not finish within {timeout:g} s (last check reached: "
              f"{names[-1] if names else 'none'})", file=sys.stderr)
        return 1
    if any(codes) or report["failed"]:
        print(f"probe: error: {report['failed']} check(s) failed; rank exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the checks here")
    parser.add_argument("--timeout", type=float, default=90.0, help="stop both ranks after this many seconds")
    parser.add_argument("--cpu", action="store_true",
                        help="development mode: CPU tensors through cupycoll's gloo route (tests the "
                             "probe itself; PREMUL_SUM fails there, the ring is not used)")
    parser.add_argument("--rank-results", help=argparse.SUPPRESS)  # set by the launcher in each rank
    args = parser.parse_args(argv)
    if args.rank_results:
        return rank_main(args.rank_results, args.cpu)
    return launch(args.json, args.timeout, args.cpu)


if __name__ == "__main__":
    sys.exit(main())
