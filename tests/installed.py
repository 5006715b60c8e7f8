"""What pip installed of cupycoll, for the tests that need its entry points.

Left out: anything about the checkout itself (tests run from it, installed or not).
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from typing import List


def cupycoll_entry_points(group: str) -> List:
    """The entry points named "cupycoll" in ``group``; empty when cupycoll is not pip-installed."""
    # Python 3.10 added entry_points(group=...); 3.9 returns a dict of groups.
    found = entry_points(group=group) if sys.version_info >= (3, 10) else entry_points().get(group, ())
    return [ep for ep in found if ep.name == "cupycoll"]
