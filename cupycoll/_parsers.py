"""The parsers of cupycoll's settings: one per type, each taking the Python value (from
:class:`cupycoll.Options`) or the environment's text, and raising a typed cupycoll error
that names the setting and the value.

Deliberately left out: which variable or field feeds which parser, precedence and defaults
(all in :mod:`cupycoll.config`, the only module that reads the environment).
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

from .errors import CupycollTypeError, CupycollValueError

# Bounds that keep every value usable by threading waits and timedelta (inf passes a
# "positive" check but kills the watchdog thread or overflows): a watchdog that polls less
# often than once a minute detects nothing in time anyway.
MAX_WATCHDOG_INTERVAL = 60.0
# Below a millisecond the watchdog thread polls without pause and takes the GIL from the
# threads that issue work; no fault needs detecting faster.
MIN_WATCHDOG_INTERVAL = 0.001
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0
MAX_TRACE_BUFFER = 1_000_000  # entries a group's recorder may keep: about 0.3 GB


# -- one parser per type: each takes the Python value or the environment's text ---------

# torch reads its TORCH_NCCL_* booleans with y/t and n/f too; so does cupycoll, for all of them.
_TRUE = ("1", "true", "yes", "on", "y", "t")
_FALSE = ("0", "false", "no", "off", "n", "f")


def parse_bool(name: str, value) -> bool:
    """True/False, 1/0, or their spellings in :data:`_TRUE` / :data:`_FALSE`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise CupycollValueError(f"{name}={value!r}: expected 0 or 1 (or true/false)")
    if isinstance(value, int):
        raise CupycollValueError(f"{name}={value!r}: expected 0 or 1 (or true/false)")
    raise CupycollTypeError(f"{name}={value!r}: expected a bool, got {type(value).__name__}")


def _number(name: str, value, what: str) -> float:
    if isinstance(value, bool):
        raise CupycollTypeError(f"{name}={value!r}: expected {what}, got a bool")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise CupycollValueError(f"{name}={value!r}: expected {what}") from None
    raise CupycollTypeError(f"{name}={value!r}: expected {what}, got {type(value).__name__}")


def parse_seconds(name: str, value) -> datetime.timedelta:
    """A positive, finite duration of at most :data:`MAX_TIMEOUT_SECONDS`: a ``timedelta``
    or a number of seconds."""
    seconds = (value.total_seconds() if isinstance(value, datetime.timedelta)
               else _number(name, value, "a timedelta or a number of seconds"))
    if not seconds > 0:  # also rejects NaN
        raise CupycollValueError(f"{name}={value!r}: the timeout must be positive")
    if not seconds <= MAX_TIMEOUT_SECONDS:  # inf: timedelta overflows, thread waits too
        raise CupycollValueError(
            f"{name}={value!r}: the timeout must be at most {MAX_TIMEOUT_SECONDS:g} s (one year)")
    return datetime.timedelta(seconds=seconds)


def parse_interval(name: str, value) -> float:
    """A poll interval: from :data:`MIN_WATCHDOG_INTERVAL` to :data:`MAX_WATCHDOG_INTERVAL`
    seconds."""
    number = float(_number(name, value, "a positive number of seconds"))
    if not MIN_WATCHDOG_INTERVAL <= number <= MAX_WATCHDOG_INTERVAL:  # also rejects NaN and inf
        raise CupycollValueError(
            f"{name}={value!r}: expected a positive number of seconds, from {MIN_WATCHDOG_INTERVAL:g} "
            f"to {MAX_WATCHDOG_INTERVAL:g}")
    return number


def parse_positive_int(name: str, value) -> int:
    """A positive whole number; 1.5 (or "1.5") is an error, never rounded."""
    number = _number(name, value, "a positive whole number")
    if not (number == number and abs(number) != float("inf")) or int(number) != number:
        raise CupycollValueError(f"{name}={value!r}: expected a positive whole number")
    if number < 1:
        raise CupycollValueError(f"{name}={value!r}: expected a positive whole number")
    return int(number)


def parse_nonnegative_int(name: str, value) -> int:
    """A whole number >= 0."""
    if not isinstance(value, bool) and (value == 0 or isinstance(value, str) and value.strip() == "0"):
        return 0
    try:
        return parse_positive_int(name, value)
    except CupycollValueError:
        raise CupycollValueError(f"{name}={value!r}: expected a whole number >= 0") from None


def parse_trace_buffer(name: str, value) -> int:
    """A flight-recorder size: a whole number from 0 to :data:`MAX_TRACE_BUFFER`."""
    size = parse_nonnegative_int(name, value)
    if size > MAX_TRACE_BUFFER:
        raise CupycollValueError(f"{name}={value!r}: at most {MAX_TRACE_BUFFER} entries per group "
                                 "(each costs about 300 bytes while the group lives)")
    return size


def parse_directory(name: str, value) -> str:
    """A folder path (it need not exist yet)."""
    if not isinstance(value, (str, os.PathLike)):
        raise CupycollTypeError(f"{name}={value!r}: expected a folder path, got {type(value).__name__}")
    path = os.fspath(value)
    if not path.strip():
        raise CupycollValueError(f"{name}={value!r}: expected a folder path")
    if "\0" in path:
        raise CupycollValueError(f"{name}={value!r}: a path cannot hold a NUL character")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CupycollValueError(f"{name}={value!r}: exists and is not a folder")
    return path


def torch_debug_detail(name: str, value) -> bool:
    # torch's TORCH_DISTRIBUTED_DEBUG is OFF, INFO or DETAIL; only DETAIL checks collectives.
    return str(value).strip().upper() == "DETAIL"


def parse_choice(choices) -> Callable[[str, object], str]:
    def parse(name: str, value) -> str:
        if not isinstance(value, str):
            raise CupycollTypeError(f"{name}={value!r}: expected one of {', '.join(choices)}")
        text = value.strip().lower()
        if text not in choices:
            raise CupycollValueError(f"{name}={value!r}: expected one of {', '.join(choices)}")
        return text
    return parse


def torch_error_handling(name: str, value) -> str:
    # torch's ErrorHandlingMode: 0 none, 1 tear down, 2 clean up only, 3 skip clean-up.
    # 1 and 3 end the process; 0 and 2 leave it to the caller, which is cupycoll's "raise"
    # (cupycoll always aborts the communicators of a faulted group).
    text = str(value).strip()
    if text not in ("0", "1", "2", "3"):
        raise CupycollValueError(f"{name}={value!r}: expected 0, 1, 2 or 3")
    return "terminate" if text in ("1", "3") else "raise"
