"""What pip installed of cupycoll, for the tests that need its entry points.

Left out: anything about the checkout itself (tests run from it, installed or not).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import List


def cupycoll_entry_points(group: str) -> List:
    """The entry points named "cupycoll" in ``group``; empty when cupycoll is not pip-installed."""
    found = entry_points(group=group)
    return [ep for ep in found if ep.name == "cupycoll"]
