"""The flight recorder's dumps: every recorder of the process written as one JSON document,
and one read back.

:func:`dump_trace` writes what :func:`trace_payload` gathers (each recorder's
:meth:`~cupycoll.trace.recorder.Recorder.info` and snapshot, with who, where and when) to a
file, ``cupycoll_trace_rank<R>.json`` in a folder; :func:`dump_on_timeout` is the fault
path's, into ``CUPYCOLL_TRACE_DIR``, and never raises. :func:`load_dump` reads one back,
checking its format and version: ``python -m cupycoll.trace DIR``
(:mod:`cupycoll.trace.analyze`) compares the ranks' dumps.

Deliberately left out: the recording itself (:mod:`cupycoll.trace.recorder`), comparing
dumps (:mod:`cupycoll.trace.analyze`), and torch's flight-recorder format.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import time
from typing import Optional

from ..errors import CupycollTypeError, CupycollValueError
from .recorder import recorders

logger = logging.getLogger(__name__)  # a child of "cupycoll"

FORMAT = "cupycoll-trace"
FORMAT_VERSION = 1


def process_rank() -> int:
    """This process's global rank: torch's when initialized, else $RANK, else -1."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - a dump must not fail over a rank number
        pass
    try:
        return int(os.environ.get("RANK", "-1"))
    except ValueError:
        return -1


def trace_payload(rank: Optional[int] = None, reason: str = "") -> dict:
    """Every recorder of the process, with who, where and when, as one JSON-ready dict."""
    from .._version import __version__

    torch_module = sys.modules.get("torch")
    groups = []
    for recorder in recorders():
        group = recorder.info()
        group["entries"] = recorder.snapshot()
        groups.append(group)
    return {"format": FORMAT, "version": FORMAT_VERSION,
            "rank": process_rank() if rank is None else int(rank),
            "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
            "reason": reason, "cupycoll": __version__,
            "torch": getattr(torch_module, "__version__", None),
            "python": sys.version.split()[0], "groups": groups}


def dump_file_name(rank: int) -> str:
    return f"cupycoll_trace_rank{rank}.json"


def dump_trace(path: str, rank: Optional[int] = None, reason: str = "on demand") -> str:
    """Write the process's recorders as JSON to ``path`` (a file; or an existing folder, in
    which it writes ``cupycoll_trace_rank<R>.json``). Returns the file written.

    Written to a temporary file of its own (``tempfile.mkstemp``: created exclusively, mode
    0600, never through a name another user planted) and renamed, so that a reader never sees
    half a dump; a final path that is a symbolic link is refused (CupycollValueError)."""
    if not isinstance(path, (str, os.PathLike)):
        raise CupycollTypeError(f"path={path!r}: expected a file or folder path")
    payload = trace_payload(rank, reason)
    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        path = os.path.join(path, dump_file_name(payload["rank"]))
    if os.path.islink(path):
        raise CupycollValueError(f"{path}: a symbolic link; the trace is not written through one")
    folder = os.path.dirname(path) or "."
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as fh:
            json.dump(payload, fh)
        os.replace(temporary, path)  # a rename replaces a name, it never follows one
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    return path


def dump_on_timeout(directory: Optional[str], rank: Optional[int] = None,
                    reason: str = "timeout") -> Optional[str]:
    """The fault path's dump into ``directory`` (CUPYCOLL_TRACE_DIR), made with mode 0700
    when it does not exist; None when unset. Never raises: a full disk must not hide the
    fault being reported."""
    if not directory:
        return None
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return dump_trace(directory, rank, reason)
    except Exception as exc:  # noqa: BLE001
        logger.warning("writing the trace to %s failed: %s", directory, exc)
        return None


def load_dump(path: str) -> dict:
    """Read one dump file; CupycollValueError if it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            payload = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CupycollValueError(f"{path}: cannot read a cupycoll trace: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CupycollValueError(f"{path}: not a cupycoll trace (no \"format\": \"{FORMAT}\")")
    if payload.get("version") != FORMAT_VERSION:
        raise CupycollValueError(f"{path}: trace format version {payload.get('version')!r}, "
                                 f"this cupycoll reads {FORMAT_VERSION}")
    if not isinstance(payload.get("groups"), list) or not isinstance(payload.get("rank"), int):
        raise CupycollValueError(f"{path}: a cupycoll trace without its rank or groups")
    return payload
