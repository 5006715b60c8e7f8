"""How the watchdog's thread interacts with a CUDA graph capture on another thread (the device
it queries under is the group's: :meth:`cupycoll.faults.watchdog.Watch.on_device`).

* :func:`use_thread_local_capture_mode`: in the default (global) capture mode a thread may
  not query events while *any* thread captures a CUDA graph in global mode; the query fails
  and invalidates that capture. The watchdog thread switches itself to thread-local mode
  once, at its start. Neither CuPy (13, 14: only the mode constants) nor torch (2.7.1 to
  2.15) exposes ``cudaThreadExchangeStreamCaptureMode``, so this calls the driver's
  ``cuThreadExchangeStreamCaptureMode`` (what the runtime function forwards to: the mode is
  per thread in the driver, whichever runtime torch or CuPy linked, and a driver call never
  creates a context). Without a driver it does nothing.
* :func:`query`: a query refused because of a capture (torch's or CuPy's exception
  for cudaErrorStreamCaptureUnsupported/Invalidated/Implicit, :func:`is_capture_error`)
  means "not done yet", not a fault of the group.

Deliberately left out: skipping Works issued during a capture (the backend's, at issue).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)  # a child of "cupycoll"

# CUstreamCaptureMode / cudaStreamCaptureMode (the same values): GLOBAL 0, THREAD_LOCAL 1.
CAPTURE_MODE_THREAD_LOCAL = 1

# cudaError_t values (driver_types.h) and the runtime's texts for them, which torch's error
# message carries ("CUDA error: <text>"; its AcceleratorError also has .error_code, CuPy's
# CUDARuntimeError .status).
CAPTURE_ERRORS = {
    900: "operation not permitted when stream is capturing",  # cudaErrorStreamCaptureUnsupported
    901: "operation failed due to a previous error during capture",  # ...Invalidated
    906: "operation would make the legacy stream depend on a capturing blocking stream",  # ...Implicit
}
_CAPTURE_ERROR_NAMES = ("cudaErrorStreamCaptureUnsupported", "cudaErrorStreamCaptureInvalidated",
                        "cudaErrorStreamCaptureImplicit")


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def use_thread_local_capture_mode() -> bool:
    """Put the calling thread in thread-local stream capture mode; False where that cannot
    be done: no driver (no GPU) or no such function (logged at DEBUG), or the driver refused
    (logged as a warning: graph captures on other threads are then at risk)."""
    try:
        exchange = _driver().cuThreadExchangeStreamCaptureMode
        mode = ctypes.c_int(CAPTURE_MODE_THREAD_LOCAL)
        status = exchange(ctypes.pointer(mode))  # mode now holds the previous one
    except (OSError, AttributeError) as exc:
        logger.debug("stays in global capture mode (%r)", exc)
        return False
    if status != 0:  # a driver is there but refused: graph captures elsewhere are at risk
        logger.warning("cuThreadExchangeStreamCaptureMode returned %s; the "
                       "watchdog stays in global capture mode, and its event queries may "
                       "invalidate a CUDA graph captured on another thread", status)
        return False
    return True


def is_capture_error(exc: BaseException) -> bool:
    """Was a CUDA call refused because a stream capture is under way (or was invalidated)?"""
    for attribute in ("error_code", "status"):  # torch >= 2.8's AcceleratorError; CuPy's
        code = getattr(exc, attribute, None)
        if isinstance(code, int) and code in CAPTURE_ERRORS:
            return True
    text = str(exc)
    return (any(message in text for message in CAPTURE_ERRORS.values())
            or any(name in text for name in _CAPTURE_ERROR_NAMES))


def query(event) -> bool:
    """``event.query()``: has the GPU passed it? A query refused because another thread is
    capturing a CUDA graph (or its capture was invalidated) says nothing of the event: not
    yet."""
    try:
        return event.query()
    except Exception as exc:  # noqa: BLE001 - anything else is for the caller to judge
        if is_capture_error(exc):
            return False
        raise
