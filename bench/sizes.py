"""Message sizes: parsing "64M"-style arguments, generating the sweep, printing sizes.

Pure Python (no torch), so that the command line can reject a bad size before anything
heavy is imported. Sizes follow nccl-tests: the suffixes K, M and G are binary (KiB, MiB,
GiB), fractions are allowed ("1.5M"), and the sweep multiplies by ``-f`` when it is above 1,
else adds ``-i`` bytes. What a size means for each collective (total or per rank) is
:mod:`metrics`' business, not this module's.
"""

from __future__ import annotations

import re
from typing import List, Optional

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
# A number, an optional K/M/G, and an optional trailing "B" ("64MB" reads as 64M).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)

# A sweep longer than this is almost certainly a typo (e.g. -i 1 from 8 B to 1 G).
MAX_SWEEP_POINTS = 10_000


class SizeError(ValueError):
    """A size argument that cannot be used; the message is meant for the user."""


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in ``text``: "8", "1K", "64M", "1G", "1.5M", "64MB". Raises :class:`SizeError`."""
    match = _SIZE.match(str(text))
    if not match:
        raise SizeError(f"{what} {text!r} is not a size (examples: 8, 1K, 64M, 1G)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.lower()])


def sweep(minbytes: int, maxbytes: int, stepfactor: float = 1, stepbytes: Optional[int] = None) -> List[int]:
    """The sizes nccl-tests visits: from ``minbytes`` up to ``maxbytes`` inclusive, times
    ``stepfactor`` when it is above 1, otherwise plus ``stepbytes``."""
    if minbytes < 1:
        raise SizeError(f"minbytes must be at least 1 byte (got {minbytes})")
    if minbytes > maxbytes:
        raise SizeError(f"minbytes {format_bytes(minbytes)} is larger than maxbytes {format_bytes(maxbytes)}")
    if stepfactor > 1:
        step = None
    elif minbytes == maxbytes:
        return [minbytes]
    elif not stepbytes or stepbytes < 1:
        raise SizeError("the sweep needs -f above 1 or -i of at least 1 byte")
    else:
        step = stepbytes
    sizes = []
    size = minbytes
    while size <= maxbytes:
        sizes.append(int(size))
        if len(sizes) > MAX_SWEEP_POINTS:
            raise SizeError(f"the sweep has more than {MAX_SWEEP_POINTS} sizes; use a larger -f or -i")
        size = size * stepfactor if step is None else size + step
        # A fractional factor can stall on tiny sizes (int(1 * 1.5) == 1): always advance.
        if int(size) <= sizes[-1]:
            size = sizes[-1] + 1
    return sizes


def format_bytes(n: float) -> str:
    """Short binary form for labels: 8 B, 1 KiB, 1.5 MiB, 2 GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{int(n)} B"
