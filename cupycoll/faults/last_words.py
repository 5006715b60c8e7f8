"""The process's end after a fault (exit 70), and the bounded calls on the way to it.

:func:`terminate` ends the process when a fault must not be survived: the ``terminate``
policy, a blocking call stuck inside NCCL that no abort can end, a stuck watchdog (its
heartbeat monitor), an end past its deadline. First its last words, on a thread waited for
at most :data:`cupycoll.bounds.DUMP_WAIT_S`: the flight recorder (the group's ``dump``) and
torchrun's error file (``TORCHELASTIC_ERROR_FILE``, :func:`write_error_file`); then one
line on stderr; then ``os._exit(70)``, whatever happened before it.

:func:`bounded_call` runs a step that may block (a store, a folder, a logging handler) on a
daemon thread of its own, so that its caller waits for it only as long as it may: the
lifetime's publish, dump and log after a fault (:mod:`cupycoll.faults.lifecycle`) and the
last words here. What fails there is one line on stderr, never raised.

Deliberately left out: deciding that the process ends (the lifetime's, and the heartbeat
monitor's), and the interpreter's own teardown (``atexit`` hooks do not run on this exit).
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from typing import Optional

from .. import bounds, config

TERMINATE_EXIT_CODE = 70  # EX_SOFTWARE: an internal error ended the job on purpose


class _Ran:
    """What :func:`bounded_call` hands back when no thread could start: the call ran."""

    def join(self, timeout: Optional[float] = None) -> None:
        return None


def bounded_call(function, args: tuple, name: str):
    """``function(*args)`` on a daemon thread of its own, started now (its error logged, never
    raised): the caller joins it for as long as it may wait. Runs inline at interpreter exit,
    where no thread starts."""
    def run() -> None:
        try:
            function(*args)
        except Exception as exc:  # noqa: BLE001 - what follows must not depend on it
            _write_line(f"cupycoll: {name} failed: {exc!r}")
    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # Python 3.12+ at interpreter exit: no new threads
        run()
        return _Ran()
    return thread


def _write_line(text: str) -> None:
    """One line to stderr in one ``os.write``: no logging handler, no Python buffer."""
    try:
        os.write(2, (text.replace("\n", "\\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def write_error_file(path: str, fault: BaseException) -> None:
    """torchrun's error file (``TORCHELASTIC_ERROR_FILE``): the fault in the JSON layout of
    torch.distributed.elastic's ``ErrorHandler.record_exception``, so the agent's summary
    names it rather than a bare exit status. Written to a temporary name and renamed."""
    stack = "".join(traceback.format_exception(type(fault), fault, fault.__traceback__))
    data = {"message": {"message": f"{type(fault).__name__}: {fault}",
                        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(temporary, path)


def _last_words(group, fault: BaseException) -> None:
    dump = getattr(group, "dump", None)
    if callable(dump):
        try:
            dump(f"exit {TERMINATE_EXIT_CODE}: {fault}")
        except Exception as exc:  # noqa: BLE001 - the error file comes anyway
            _write_line(f"cupycoll: writing the flight recorder failed: {exc!r}")
    path = config.elastic_error_file()
    if path:
        write_error_file(path, fault)


def terminate(group, fault: BaseException) -> None:
    """End the process (exit 70) after ``fault`` in ``group`` (anything with a ``name``):
    first the flight recorder (``group.dump``, when it has one) and torchrun's error file,
    on a thread waited for at most :data:`cupycoll.bounds.DUMP_WAIT_S`, then one line on
    stderr, then the exit, whatever happened before it."""
    try:
        try:
            name = getattr(group, "name", "?")
        except Exception:  # noqa: BLE001 - a name is not worth staying alive for
            name = "?"
        bounded_call(_last_words, (group, fault), "cupycoll-exit").join(bounds.DUMP_WAIT_S)
        _write_line(f"watchdog: terminating the process after a fault in process group {name!r}: {fault}")
    finally:
        os._exit(TERMINATE_EXIT_CODE)
