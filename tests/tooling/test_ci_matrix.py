"""The CI version matrix is written in four places that must agree: the legs of ``.ci/run``
(each leg's ``leg`` line, and the table in its header comment), the table of
docs/compatibility.md, the floors and Python classifiers in ``pyproject.toml``, and the torch
that ``tools/install_torch.py`` falls back to (a CI leg's). Read from the files (nothing is
installed or run), so a version changed in one place and not the others fails here, on every
CI leg.

Left out: whether a leg installs what it declares (``.ci/run`` checks that itself when it
runs) and that page's prose beyond the floors it names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

ROOT = Path(__file__).resolve().parents[2]
LEGS = ("today", "gpu-twin", "newest", "oldest")
COMPATIBILITY = "docs/compatibility.md"


def _version(text: str) -> Tuple[int, ...]:
    """``"14.2"`` -> ``(14, 2, 0)``: trailing zeros do not count (``>=14.2`` is 14.2.0)."""
    parts = [int(p) for p in text.split(".")]
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


# ----------------------------------------------------------------------------- parsers


def ci_legs(text: str) -> Dict[str, dict]:
    """The ``leg`` lines of .ci/run: name -> python, torch, extra, CuPy and NCCL pins."""
    legs = {}
    # one leg per case arm; a backslash continues the line (the environment for pip)
    joined = text.replace("\\\n", " ")
    for match in re.finditer(r"^\s*([\w-]+)\)\s+leg\s+(.*?)\s*;;", joined, re.M):
        arm, args = match.group(1), match.group(2).split()
        name, python, torch, extra, cupy, nccl = args[:6]
        assert name == arm, f"case arm {arm!r} runs leg {name!r}"
        assert all("=" in a and "==" not in a for a in args[6:]), f"leg {name}: {args[6:]}"
        assert name not in legs, f"leg {name} defined twice"
        legs[name] = {"python": python, "torch": torch, "extra": extra,
                      "cupy": tuple(cupy.split("==")), "nccl": tuple(nccl.split("=="))}
    return legs


def ci_header_rows(text: str) -> Dict[str, str]:
    """The header comment's table of .ci/run: leg name -> its row, continuation lines
    included."""
    rows: Dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith("#"):
            if rows:
                break
            continue
        match = re.match(r"#   ([\w-]+)\s{2,}(\S.*)$", line)
        if match and match.group(1) in LEGS:
            current = match.group(1)
            rows[current] = match.group(2)
        elif current and re.match(r"#\s{20,}\S", line):
            rows[current] += " " + line.lstrip("# ").strip()
        else:
            current = None
    return rows


def doc_rows(text: str) -> Dict[str, dict]:
    """docs/compatibility.md's table of CI legs: leg -> python, torch, CuPy and NCCL as written."""
    section = text.split("\n## What CI tests\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.match(r"`([\w-]+)`", cells[0]) if len(cells) == 5 else None
        if not match:
            continue
        torch = re.match(r"[\d.]+", cells[2]).group(0)  # "2.13.0+cpu", "2.11.0, CUDA 13.0"
        cupy_package, cupy_version = cells[3].split()
        nccl = re.fullmatch(r"([\d.]+) \(([\w-]+)\)", cells[4])
        assert nccl, f"docs/compatibility.md row {match.group(1)}: NCCL cell {cells[4]!r}"
        rows[match.group(1)] = {"python": cells[1], "torch": torch,
                                "cupy": (cupy_package, cupy_version),
                                "nccl": (nccl.group(2), nccl.group(1))}
    return rows


def pyproject_floors(text: str) -> Dict[str, object]:
    """requires-python, torch's floor, each CUDA extra's package floors, and the Python
    versions the classifiers name."""

    def array(key: str) -> List[str]:
        match = re.search(rf"^{re.escape(key)} = \[(.*?)\]", text, re.M | re.S)
        assert match, f"pyproject.toml has no {key} = [...]"
        return re.findall(r'"([^"]+)"', match.group(1))

    def floors(requirements: List[str]) -> Dict[str, str]:
        return dict(re.fullmatch(r"([\w-]+)>=([\d.]+)", r).groups()
                    for r in requirements if ">=" in r)

    python = re.search(r'^requires-python = ">=([\d.]+)"', text, re.M)
    assert python, "pyproject.toml has no requires-python floor"
    return {"python": python.group(1), "torch": floors(array("dependencies"))["torch"],
            "cuda12": floors(array("cuda12")), "cuda13": floors(array("cuda13")),
            "classifiers": re.findall(r"^Programming Language :: Python :: (\d+\.\d+)$",
                                      "\n".join(array("classifiers")), re.M)}


def torchft_leg(text: str) -> Tuple[str, str]:
    """.ci/run's leg that installs torchft, and the pin it installs."""
    leg = re.search(r"^TORCHFT_LEG=([\w-]+)$", text, re.M)
    pin = re.search(r"^TORCHFT_PIN=(\S+)$", text, re.M)
    assert leg and pin, ".ci/run has no TORCHFT_LEG / TORCHFT_PIN"
    return leg.group(1), pin.group(1)


def install_fallback(text: str) -> Tuple[str, str]:
    """tools/install_torch.py's fallback: (CI leg, torch version)."""
    leg = re.search(r'^FALLBACK_LEG = "([\w-]+)"', text, re.M)
    torch = re.search(r'^FALLBACK_TORCH = "([\d.]+)"', text, re.M)
    assert leg and torch, "tools/install_torch.py has no FALLBACK_LEG / FALLBACK_TORCH"
    return leg.group(1), torch.group(1)


@pytest.fixture(scope="module")
def matrix():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    return {"legs": ci_legs(run), "header": ci_header_rows(run),
            "doc": doc_rows((ROOT / COMPATIBILITY).read_text(encoding="utf-8")),
            "floors": pyproject_floors((ROOT / "pyproject.toml").read_text(encoding="utf-8")),
            "fallback": install_fallback((ROOT / "tools" / "install_torch.py").read_text(encoding="utf-8"))}


# ------------------------------------------------------------------------------- checks


def check_doc(doc: Dict[str, dict], legs: Dict[str, dict]) -> None:
    assert sorted(doc) == sorted(legs)
    for name, leg in legs.items():
        expected = {k: leg[k] for k in ("python", "torch", "cupy", "nccl")}
        assert doc[name] == expected, f"docs/compatibility.md row {name} differs from .ci/run"


def check_header(header: Dict[str, str], legs: Dict[str, dict]) -> None:
    assert sorted(header) == sorted(legs)
    for name, leg in legs.items():
        row = header[name]
        python, torch = row.split()[:2]
        assert (python, torch.split("+")[0]) == (leg["python"], leg["torch"]), (name, row)
        assert f"{leg['extra']} extra" in row, (name, row)
        for package, version in (leg["cupy"], leg["nccl"]):
            assert f"{package} {version}" in row, (name, package, version, row)


def check_floors(floors: Dict[str, object], legs: Dict[str, dict]) -> None:
    for key in ("python", "torch"):
        lowest = min((leg[key] for leg in legs.values()), key=_version)
        assert floors[key] == lowest == legs["oldest"][key], (key, floors[key], lowest)
    for extra in ("cuda12", "cuda13"):
        users = [leg for leg in legs.values() if leg["extra"] == extra]
        assert users, f"no CI leg installs the {extra} extra"
        for kind in ("cupy", "nccl"):
            packages = {leg[kind][0] for leg in users}
            assert len(packages) == 1, (extra, packages)
            package = packages.pop()
            lowest = min((leg[kind][1] for leg in users), key=_version)
            assert package in floors[extra], f"{extra} has no floor for {package}"
            floor = floors[extra][package]
            assert _version(floor) == _version(lowest), (
                f"{extra}: {package}>={floor}, but the lowest a leg runs is {lowest}")


def check_classifiers(floors: Dict[str, object], legs: Dict[str, dict]) -> None:
    """One classifier per Python minor from requires-python's floor to the newest a leg runs."""
    newest = max((leg["python"] for leg in legs.values()), key=_version)
    major, low = _version(floors["python"])[:2]
    high = _version(newest)[1]
    expected = [f"{major}.{minor}" for minor in range(low, high + 1)]
    assert floors["classifiers"] == expected, (floors["classifiers"], expected)


def check_fallback(fallback: Tuple[str, str], legs: Dict[str, dict]) -> None:
    leg, torch = fallback
    assert leg in legs, f"tools/install_torch.py falls back to leg {leg!r}, which .ci/run does not run"
    assert torch == legs[leg]["torch"], (
        f"tools/install_torch.py falls back to torch {torch}, leg {leg} runs {legs[leg]['torch']}")


def test_one_leg_installs_a_pinned_torchft_and_hands_it_to_make_test():
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    leg, pin = torchft_leg(run)
    assert leg in ci_legs(run) and re.fullmatch(r"torchft==\d+\.\d+\.\d+", pin), (leg, pin)
    # make_vars passes the pin as TORCHFT_SPEC on that leg alone
    make_vars = run.split("make_vars() {", 1)[1].split("\n}", 1)[0]
    assert '[ "$1" != "$TORCHFT_LEG" ] || torchft=$TORCHFT_PIN' in make_vars
    assert 'TORCHFT_SPEC="$torchft"' in make_vars and "local marks=\"not gpu\" torchft=" in make_vars
    # the version docs/usage.md says was checked is the one CI installs
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    assert f"torchft {pin.split('==')[1]}" in usage and f"`{leg}` leg" in usage


def test_ci_runs_the_four_legs(matrix):
    assert sorted(matrix["legs"]) == sorted(LEGS)
    default = re.search(r"LEGS=\$\{CI_LEGS:-([^}]*)\}", (ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert default and sorted(default.group(1).split()) == sorted(LEGS)


def test_each_leg_pins_packages_of_its_cuda_extra(matrix):
    for name, leg in matrix["legs"].items():
        major = re.fullmatch(r"cuda(\d+)", leg["extra"]).group(1)
        assert leg["cupy"][0] == f"cupy-cuda{major}x", (name, leg)
        assert leg["nccl"][0] == f"nvidia-nccl-cu{major}", (name, leg)
        for version in (leg["cupy"][1], leg["nccl"][1]):
            assert re.fullmatch(r"\d+\.\d+\.\d+", version), (name, leg)


def test_the_documented_table_is_the_ci_legs(matrix):
    check_doc(matrix["doc"], matrix["legs"])


def test_ci_header_table_is_the_ci_legs(matrix):
    check_header(matrix["header"], matrix["legs"])


def test_floors_are_the_lowest_versions_a_leg_runs(matrix):
    check_floors(matrix["floors"], matrix["legs"])


def test_python_classifiers_span_the_python_legs(matrix):
    check_classifiers(matrix["floors"], matrix["legs"])


def test_the_install_fallback_is_a_legs_torch(matrix):
    check_fallback(matrix["fallback"], matrix["legs"])


# ------------------------------------------- a change in one place alone is caught


def _changed(path: str, old: str, new: str) -> str:
    text = (ROOT / path).read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{path} no longer has {old!r}: update this test"
    return text.replace(old, new)


def test_a_bump_in_the_docs_alone_is_caught(matrix):
    bumped = doc_rows(_changed(COMPATIBILITY, "| cupy-cuda13x 14.2.0 | 2.30.7",
                               "| cupy-cuda13x 14.3.0 | 2.30.7"))
    with pytest.raises(AssertionError, match="docs/compatibility.md row newest"):
        check_doc(bumped, matrix["legs"])


def test_a_ci_bump_alone_is_caught(matrix):
    run = _changed(".ci/run", "cupy-cuda12x==13.0.0 nvidia-nccl-cu12==2.26.2 ;;",
                   "cupy-cuda12x==13.6.0 nvidia-nccl-cu12==2.26.2 ;;")
    legs = ci_legs(run)
    assert legs["oldest"]["cupy"] == ("cupy-cuda12x", "13.6.0")
    for check, data in ((check_doc, matrix["doc"]), (check_header, ci_header_rows(run)),
                        (check_floors, matrix["floors"])):
        with pytest.raises(AssertionError):
            check(data, legs)


def test_an_untested_floor_is_caught(matrix):
    lowered = _changed("pyproject.toml", '"cupy-cuda13x>=14.2"', '"cupy-cuda13x>=14"')
    with pytest.raises(AssertionError, match="cupy-cuda13x>=14, but the lowest a leg runs is 14.2"):
        check_floors(pyproject_floors(lowered), matrix["legs"])


def test_a_python_floor_bump_without_its_classifiers_is_caught(matrix):
    floors = pyproject_floors(_changed("pyproject.toml", 'requires-python = ">=3.10"',
                                       'requires-python = ">=3.11"'))
    with pytest.raises(AssertionError):
        check_floors(floors, matrix["legs"])
    with pytest.raises(AssertionError):
        check_classifiers(floors, matrix["legs"])


def test_a_bump_of_the_fallback_legs_torch_alone_is_caught(matrix):
    leg, torch = matrix["fallback"]
    arm = re.search(rf"^\s*{re.escape(leg)}\)\s+leg {re.escape(leg)} \S+ {re.escape(torch)} ",
                    (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    assert arm, f"no leg line for {leg} with torch {torch}: update this test"
    bumped = ci_legs(_changed(".ci/run", arm.group(0), arm.group(0).replace(f" {torch} ", " 9.9.9 ")))
    with pytest.raises(AssertionError, match="falls back to torch"):
        check_fallback(matrix["fallback"], bumped)
