"""The package's size as the docs quote it: ``python -m tools.size [--json FILE]``.

Counts the lines of every ``.py`` under ``cupycoll/`` and of the ring's CUDA C++
(``cupycoll/ring/cuda/*.cu*``): in all and non-blank, and per Python module, the largest
first, against :data:`MODULE_LINES`, the most a module may have (the house keeps modules
small enough to read in one sitting; a module past it is split by what it does).

Deliberately left out: tests, tools and the benchmark; what a line holds (code, docstring or
comment).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupycoll"

#: The most lines a package module may have.
MODULE_LINES = 430


def _files() -> List[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE / "ring" / "cuda").glob("*.cu*"))


def measure() -> dict:
    """Lines in all and non-blank, and each Python module's lines (by dotted name)."""
    lines = nonblank = 0
    modules: Dict[str, int] = {}
    for path in _files():
        text = path.read_text(encoding="utf-8").splitlines()
        lines += len(text)
        nonblank += sum(1 for line in text if line.strip())
        if path.suffix == ".py":
            name = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
            modules[name] = len(text)
    largest = dict(sorted(modules.items(), key=lambda item: -item[1]))
    return {"lines": lines, "nonblank": nonblank, "modules": largest, "module_limit": MODULE_LINES,
            "over_limit": {name: n for name, n in largest.items() if n > MODULE_LINES}}


def about(lines: int) -> str:
    """``lines`` as the README rounds it: to the nearest thousand, e.g. "12,000"."""
    return f"{round(lines / 1000) * 1000:,}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.size", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    args = parser.parse_args(argv)
    figures = measure()
    print(f"cupycoll: {figures['lines']:,} lines ({figures['nonblank']:,} non-blank), about {about(figures['lines'])}")
    print(f"largest modules (limit {MODULE_LINES} lines):")
    for name, count in list(figures["modules"].items())[:8]:
        print(f"  {name}: {count}")
    if figures["over_limit"]:
        print("over the limit: " + ", ".join(f"{n} ({c})" for n, c in figures["over_limit"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if figures["over_limit"] else 0


if __name__ == "__main__":
    sys.exit(main())
