"""CPU tier: the benchmark's tables, JSON and CSV files, and plots from a stored JSON.

Also one end-to-end run of the whole pipeline without a GPU: ``--device cpu`` (a
development mode where the candidates are torch's gloo and cupycoll's CPU route) starts 2
ranks, sweeps every collective with checks on, and writes JSON, CSV and a plot.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import catalog, metrics, output  # noqa: E402
from mp import run_python  # noqa: E402

pytestmark = [pytest.mark.any_stack, pytest.mark.launches]  # its subject is the same on every stack: one CI leg runs it


def run_bench(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess:
    return run_python("-m", "bench", *args, timeout=timeout)

CANDIDATES = ["cupycoll:nccl", "cupycoll:ring", "torch:nccl"]


def synthetic_rows():
    """Rows shaped like a real 8-rank run: three candidates, two collectives, a scenario."""
    rows = []
    world = 8
    for collective in ("all_reduce", "all_gather"):
        for k, size in enumerate([8 << i for i in range(0, 25, 2)]):
            lay = metrics.layout(collective, size, 4, world)
            if lay.count == 0:
                continue
            for j, cand in enumerate(CANDIDATES):
                base = {"kind": "sweep", "collective": collective, "size": lay.size, "count": lay.count,
                        "type": "float", "redop": "sum" if collective == "all_reduce" else "none",
                        "root": -1, "placement": "in-place", "candidate": cand, "world_size": world}
                if cand == "cupycoll:ring" and collective == "all_gather":
                    rows.append(dict(base, status="n/a", note="the ring implements all_reduce and "
                                                              "reduce_scatter only"))
                    continue
                t = 10.0 + lay.size / (50e3 * (1 + 0.3 * j))
                rows.append(dict(base, status="ok", time_us=t, algbw_gbps=metrics.algbw(lay.size, t),
                                 busbw_gbps=metrics.busbw(collective, lay.size, t, world), wrong=0,
                                 host_us=5.0 + j + 0.01 * k, speedup=None))
    rows.append({"kind": "scenario", "scenario": "coalescing", "case": "flat", "candidate": "torch:nccl",
                 "status": "ok", "gpu_us": 1500.0, "cpu_us": 12.0, "gpu_ratio": 1.0, "cpu_ratio": 1.0,
                 "iterations": 30, "world_size": world})
    rows.append({"kind": "scenario", "scenario": "coalescing", "case": "flat", "candidate": "cupycoll:nccl",
                 "status": "ok", "gpu_us": 1510.0, "cpu_us": 30.0, "gpu_ratio": 1.0067, "cpu_ratio": 2.5,
                 "iterations": 30, "world_size": world})
    rows.append({"kind": "target", "scenario": "coalescing", "target": "coalesced sync: CPU time",
                 "candidate": "cupycoll:nccl", "value": 0.8, "limit": 1.0, "status": "PASS"})
    return rows


META = {"tool": "cupycoll-bench", "gpu": "NVIDIA H200", "world_size": 8, "transport": "real GPUs",
        "git_commit": "0123456789abcdef", "command": "cupycoll-bench all_reduce -b 8 -e 128M -f 2",
        "torch": "2.11.0", "cupy": "14.2.0", "torch_nccl": "2.27.3", "cupy_nccl": "2.27.3",
        "driver_version": "570.00", "ranks": [{"rank": 0, "device": "cuda:0"}]}


def test_json_round_trip(tmp_path):
    rows = synthetic_rows()
    rows[0]["time_us"] = float("nan")  # JSON has no NaN: it must come back as null
    path = tmp_path / "r.json"
    output.write_json(str(path), META, rows)
    document = output.read_json(str(path))
    assert document["schema"] == output.SCHEMA
    assert document["meta"] == META
    assert len(document["rows"]) == len(rows)
    assert document["rows"][0]["time_us"] is None
    for got, want in zip(document["rows"][1:], rows[1:]):
        assert got == want
    json.loads(path.read_text(encoding="utf-8"))  # strict JSON


def test_csv_round_trip(tmp_path):
    rows = synthetic_rows()
    path = tmp_path / "r.csv"
    output.write_csv(str(path), META, rows)
    meta, back = output.read_csv(str(path))
    assert meta["gpu"] == "NVIDIA H200" and meta["git_commit"] == "0123456789abcdef"
    assert meta["command"] == META["command"]
    assert json.loads(meta["ranks"]) == META["ranks"]
    assert len(back) == len(rows)
    for got, want in zip(back, rows):
        for key, value in want.items():
            if isinstance(value, float):
                assert got[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert got[key] == value, key
    header = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")][0]
    assert header.split(",")[:3] == ["kind", "collective", "scenario"]


def test_the_header_says_how_much_ring_scratch_the_run_allowed(monkeypatch):
    from bench import meta

    monkeypatch.setenv("CUPYCOLL_RING_SCRATCH_BYTES", str(64 << 20))
    text = meta.ring_scratch(["cupycoll:nccl", "cupycoll:ring"])
    assert f"at most {64 << 20} bytes (64 MiB) per communicator" in text
    assert "CUPYCOLL_RING_SCRATCH_BYTES" in text
    assert meta.ring_scratch(["cupycoll:nccl", "torch:nccl"]).startswith("not used")
    header = output.describe_meta(dict(META, ring_scratch=text))
    assert any(line.startswith("#  ring_scratch") and "64 MiB" in line for line in header)


def test_table_puts_candidates_side_by_side():
    header = output.table_header("all_reduce", CANDIDATES, "torch:nccl", 8, "real GPUs", "GPU time")
    text = "\n".join(header)
    for name in CANDIDATES:
        assert name in text
    assert "speedup = torch:nccl time / candidate time" in text
    for column in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "host"):
        assert column in text
    point = {"size": 1 << 20, "count": 262144, "type": "float", "redop": "sum", "root": -1,
             "placement": "in-place"}
    cells = {
        "cupycoll:nccl": {"status": "ok", "time_us": 50.0, "algbw_gbps": 20.97, "busbw_gbps": 36.7,
                          "wrong": 0, "host_us": 9.5, "speedup": 1.1},
        "cupycoll:ring": {"status": "n/a"},
        "torch:nccl": {"status": "ok", "time_us": 55.0, "algbw_gbps": 19.07, "busbw_gbps": 33.4,
                       "wrong": 0, "host_us": 6.5, "speedup": 1.0},
    }
    line = output.table_line(point, cells, CANDIDATES, "torch:nccl")
    assert "1048576" in line and "262144" in line and "50.00" in line and "1.10" in line
    assert "n/a" in line and "base" in line
    # the cells line up under the header's candidate columns
    assert len(line.split("|")) == len(header[3].split("|")) == len(CANDIDATES) + 1


def test_a_time_sliced_point_is_marked_at_the_end_of_its_line_and_explained_under_the_table():
    point = {"size": 1024, "count": 256, "type": "float", "redop": "sum", "root": -1, "placement": "in-place"}
    cell = {"status": "ok", "time_us": 4610.0, "algbw_gbps": 0.0, "busbw_gbps": 0.0, "wrong": 0, "host_us": 30.0,
            "speedup": 1.0}
    plain = output.table_line(point, {"torch:nccl": cell}, ["torch:nccl"], "torch:nccl")
    sliced = output.table_line(point, {"torch:nccl": dict(cell, time_sliced=True)}, ["torch:nccl"], "torch:nccl")
    assert sliced == plain + "  " + output.SLICED_MARK  # the columns stay where they were
    rows = [dict(point, kind="sweep", collective="all_reduce", candidate=name, time_sliced=True, **cell)
            for name in ("cupycoll:nccl", "torch:nccl")]
    big = dict(rows[0], size=16 << 20)
    del big["time_sliced"]
    note = [line for line in output.table_footer(rows + [big], CANDIDATES) if "time-sliced" in line]
    assert len(note) == 1 and note[0].startswith("# 1 points marked time-sliced")  # one point, two candidates
    assert "below 16 MiB" in note[0]
    assert not [line for line in output.table_footer([big], CANDIDATES) if "time-sliced" in line]
    # nccl-tests' own layout keeps its lines as nccl-tests prints them: only the note says it
    assert [line for line in output.table_footer(rows, CANDIDATES, bandwidth=False) if "time-sliced" in line]


def test_the_coalescing_scenario_on_cpu_times_torchs_front_beside_both_candidates(tmp_path):
    js = tmp_path / "s.json"
    proc = run_bench("--device", "cpu", "--ranks", "2", "--scenario", "coalescing", "--coalesce-bytes", "64K",
                     "--coalesce-ops", "8", "--scenario-iters", "3", "--overhead-calls", "20", "--warmup_iters",
                     "1", "--json", str(js))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [r for r in output.read_json(str(js))["rows"] if r["kind"] == "scenario"]
    front = {r["case"]: r for r in rows if r["candidate"] == "torch front"}
    assert list(front) == ["flat", "coalesced sync", "coalesced async", "uncoalesced", "1-element sync",
                           "1-element async"]
    assert all(r["status"] == "ok" and r["cpu_us"] > 0 and r.get("gpu_us") is None for r in front.values())
    assert front["coalesced sync"]["parts"] == 8 and front["1-element sync"]["parts"] == 1
    for r in rows:
        if r["candidate"] != "torch front" and r["status"] == "ok":  # gloo has no coalescing: those are n/a
            assert r["own_cpu_us"] == pytest.approx(r["cpu_us"] - front[r["case"]]["cpu_us"]), r
            assert r["own_ratio"] is not None
    assert {r["case"] for r in rows if r["status"] == "ok" and r["candidate"] == "cupycoll:gloo"} == {
        "flat", "uncoalesced", "1-element sync", "1-element async"}
    assert "# own share = CPU time less" in proc.stdout and proc.stdout.count("# target:") == 4
    assert "time-sliced" not in proc.stdout  # CPU ranks share no GPU


def test_cputime_heads_the_time_column_with_C1():
    def column_names(lines):
        return lines[-2][1:].replace("|", " ").split()

    gpu = output.table_header("all_reduce", CANDIDATES, "torch:nccl", 8, "real GPUs", "GPU time")
    cpu = output.table_header("all_reduce", CANDIDATES, "torch:nccl", 8, "real GPUs", "CPU time", cputime=True)
    assert column_names(gpu).count("time") == 3 and "cputime" not in "\n".join(gpu)
    assert column_names(cpu).count("cputime") == 3 and "time" not in column_names(cpu)
    # the cells still line up under the renamed header
    assert [len(part) for part in cpu[-2].split("|")] == [len(part) for part in gpu[-2].split("|")]


def test_footer_counts_wrong_values_and_reasons():
    rows = [r for r in synthetic_rows() if r.get("collective") == "all_gather"]
    lines = output.table_footer(rows, CANDIDATES)
    assert lines[0] == "# Out of bounds values : 0 OK"
    assert any("cupycoll:ring n/a" in line and "reduce_scatter only" in line for line in lines)
    rows[0]["wrong"] = 3
    assert "3 FAILED" in output.table_footer(rows, CANDIDATES)[0]


def test_not_checked_note_only_with_c0():
    rows = [dict(r, status="n/a", note="x") for r in synthetic_rows() if r.get("kind") == "sweep"]
    assert "not checked" not in output.table_footer(rows, CANDIDATES, checked=True)[0]
    assert "(not checked: -c 0)" in output.table_footer(rows, CANDIDATES, checked=False)[0]


def parse_nccl_tests(text: str, time: str = "time"):
    """Read a table the way scripts written for nccl-tests do: the data lines are the ones
    not starting with '#', whitespace-separated; the column groups are named by the header,
    whose time columns are ``time``, or ``cputime`` under -C 1."""
    header = next(line for line in text.splitlines() if line.startswith("#") and "redop" in line)
    names = header[1:].split()
    assert names == ["size", "count", "type", "redop", "root"] + [time, "algbw", "busbw", "#wrong"] * 2
    groups = next(line for line in text.splitlines() if "out-of-place" in line and " in-place" in line)
    assert groups.index("out-of-place") < groups.index("in-place")
    points = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split()
        assert len(fields) == 13, line
        points.append({"size": int(fields[0]), "count": int(fields[1]), "type": fields[2], "redop": fields[3],
                       "root": int(fields[4]), "oop": fields[5:9], "ip": fields[9:13]})
    avg = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("# Avg bus bandwidth")]
    return points, avg


def test_nccl_tests_table_reads_like_nccl_tests():
    rows = [r for r in synthetic_rows() if r.get("collective") == "all_gather"]
    rows += [dict(r, placement="out-of-place", time_us=r.get("time_us", 0) * 2) for r in rows]
    text = "\n".join(output.nccl_tests_tables("all_gather", rows, ["cupycoll:nccl"], 8, "real GPUs",
                                               "GPU time", ("out-of-place", "in-place")))
    points, avg = parse_nccl_tests(text)
    mine = [r for r in rows if r["candidate"] == "cupycoll:nccl" and r["placement"] == "in-place"]
    assert [p["size"] for p in points] == [r["size"] for r in mine]
    for point, row in zip(points, mine):
        assert float(point["ip"][0]) == pytest.approx(row["time_us"], abs=0.01)
        assert float(point["oop"][0]) == pytest.approx(2 * row["time_us"], abs=0.01)
        assert float(point["ip"][2]) == pytest.approx(row["busbw_gbps"], abs=0.006) and point["ip"][3] == "0"
    assert len(avg) == 1 and avg[0] > 0


def test_nccl_tests_table_heads_cputime_with_C1():
    rows = [r for r in synthetic_rows() if r.get("collective") == "all_gather"]
    text = "\n".join(output.nccl_tests_tables("all_gather", rows, ["cupycoll:nccl"], 8, "real GPUs",
                                               "CPU time", ("out-of-place", "in-place"), cputime=True))
    points, _ = parse_nccl_tests(text, time="cputime")
    assert len(points) == len([r for r in rows if r["candidate"] == "cupycoll:nccl"])


def test_nccl_tests_table_prints_every_cycle():
    rows = [r for r in synthetic_rows() if r.get("collective") == "all_gather" and r["candidate"] == "torch:nccl"]
    cycles = [dict(r, cycle=1) for r in rows] + [dict(r, cycle=2, time_us=r["time_us"] * 3) for r in rows]
    text = "\n".join(output.nccl_tests_tables("all_gather", cycles, ["torch:nccl"], 8, "real GPUs",
                                               "GPU time", ("out-of-place", "in-place")))
    points, _ = parse_nccl_tests(text)
    assert [p["size"] for p in points] == [r["size"] for r in rows] * 2  # cycle 1's lines, then cycle 2's
    times = [float(p["ip"][0]) for p in points]
    assert times[len(rows):] == pytest.approx([3 * t for t in times[:len(rows)]], abs=0.02)


def _png_facts(path: Path):
    data = path.read_bytes()
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    colours = {tuple(round(float(c), 2) for c in px) for px in pixels.reshape(-1, pixels.shape[-1])[::37]}
    return data[:8], len(data), len(colours)


def test_plot_from_a_stored_json(tmp_path):
    source = tmp_path / "results.json"
    output.write_json(str(source), META, synthetic_rows())
    png = tmp_path / "out.png"
    proc = run_bench("plot", str(source), "--plot", str(png), timeout=120)  # the main command's name
    assert proc.returncode == 0, proc.stderr
    signature, size, colours = _png_facts(png)
    assert signature == b"\x89PNG\r\n\x1a\n"
    assert size > 10_000
    assert colours > 2  # lines in several colours, not a blank canvas


def test_plot_of_results_without_measurements_exits_2(tmp_path):
    source = tmp_path / "empty.json"
    output.write_json(str(source), META, [r for r in synthetic_rows() if r.get("status") == "n/a"])
    proc = run_bench("plot", str(source), "-o", str(tmp_path / "x.png"), timeout=120)
    assert proc.returncode == 2 and "no measured rows" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pipeline_on_cpu_in_nccl_tests_format(tmp_path):
    """-r all, -C 1, -N 2, -a 3, -m 2, -z 1, -c 0, -t 1, -G 0, -J/-F: a table nccl-tests' readers parse."""
    js = tmp_path / "r.json"
    proc = run_bench("--device", "cpu", "broadcast", "-b", "64", "-e", "256", "-f", "4", "-n", "2", "-w", "1",
                     "--ranks", "2", "--format", "nccl-tests", "-r", "all", "-C", "1", "-N", "2", "-a", "3",
                     "-m", "2", "-z", "1", "-c", "0", "-t", "1", "-G", "0", "-T", "120", "-J", str(js),
                     "-F", str(tmp_path / "r.csv"), "--backends", "cupycoll:gloo")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    points, avg = parse_nccl_tests(proc.stdout, time="cputime")
    assert [(p["size"], p["root"]) for p in points] == [(64, 0), (64, 1), (256, 0), (256, 1)] * 2  # 2 cycles
    assert all(p["oop"] == ["N/A"] * 4 and float(p["ip"][0]) > 0 and p["ip"][3] == "N/A" for p in points)
    assert len(avg) == 1 and "(not checked: -c 0)" in proc.stdout
    document = output.read_json(str(js))
    meta = document["meta"]
    assert sorted(r["cycle"] for r in document["rows"]) == [1, 1, 1, 1, 2, 2, 2, 2]
    assert meta["run_cycles"] == 2
    assert (meta["report_cputime"], meta["average"], meta["agg_iters"], meta["blocking"]) == (True, 3, 2, True)
    assert meta["root"] == "all" and meta["timeout_s"] == 120 and "CPU time" in meta["timer"]
    assert (tmp_path / "r.csv").stat().st_size > 0


def test_nothing_measured_says_so_and_fails(tmp_path):
    proc = run_bench("--device", "cpu", "all_reduce", "-b", "64", "-e", "64", "-n", "1", "-w", "0",
                     "--ranks", "1", "-o", "mulsum")  # gloo has no PreMulSum: every cell n/a
    assert proc.returncode == 1
    assert "nothing was measured" in proc.stderr and "Traceback" not in proc.stderr
    assert "not checked" not in proc.stdout


def test_whole_pipeline_on_cpu(tmp_path):
    """--device cpu, 2 ranks: every collective, checks on, all three output files."""
    js, cs, png = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
    proc = run_bench("--device", "cpu", "all", "-b", "64", "-e", "256", "-f", "4", "-n", "2", "-w", "1",
                     "--ranks", "2", "--json", str(js), "--csv", str(cs), "--plot", str(png),
                     "--scenario", "overhead", "--overhead-calls", "10")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    document = output.read_json(str(js))
    meta, rows = document["meta"], document["rows"]
    assert meta["world_size"] == 2 and meta["command"].endswith("--overhead-calls 10")
    assert meta["git_commit"] and meta["torch"] and "ranks" in meta
    swept = [r for r in rows if r["kind"] == "sweep"]
    for collective in catalog.COLLECTIVES:
        mine = [r for r in swept if r["collective"] == collective]
        assert {r["candidate"] for r in mine} == {"cupycoll:gloo", "torch:gloo"}, collective
        assert all(r["status"] == "ok" and r["wrong"] == 0 for r in mine), mine
        assert all(r["time_us"] > 0 and r["busbw_gbps"] >= 0 for r in mine)
    baseline_rows = [r for r in swept if r["candidate"] == "torch:gloo"]
    assert all(r["speedup"] == pytest.approx(1.0) for r in baseline_rows)
    overhead = [r for r in rows if r.get("scenario") == "overhead"]
    cases = ("1-element sync", "1-element async", "shard all_gather sync",
             "shard reduce_scatter sync")
    assert {(r["case"], r["candidate"]) for r in overhead} == {
        (case, cand) for case in cases for cand in ("cupycoll:gloo", "torch:gloo")}
    assert all(r["status"] == "ok" and r["cpu_us"] > 0 for r in overhead), overhead
    _, csv_rows = output.read_csv(str(cs))
    assert len(csv_rows) == len(rows)
    assert png.stat().st_size > 10_000
    assert "# Out of bounds values : 0 OK" in proc.stdout
    assert "all_to_all" in proc.stdout and "sendrecv" in proc.stdout
    assert not any(math.isnan(r["time_us"]) for r in swept)
    assert "cycle" not in swept[0]  # recorded only when -N asks for several
    table = proc.stdout.split("# all_reduce:")[1].split("\n#\n")[0]
    assert "cupycoll:gloo" in table and "nccl" not in table  # on CPU no label says nccl
