"""Faults: how a CUDA group notices trouble and ends.

* :mod:`.watchdog`: one thread per process that polls every group's Works for timeouts and
  NCCL's async errors, and hands a fault to the group;
* :mod:`.watchdog_cuda`: its CUDA event queries (on the group's device, safe during a graph
  capture);
* :mod:`.heartbeat`: the monitor of the watchdog's own heartbeat;
* :mod:`.lifecycle`: a group's lifetime: its state, the Works it watches, abort, shutdown,
  replacement by a shrink, and the aborts at exit.

Which rank is behind when a collective times out is the flight recorder's (:mod:`cupycoll.trace`).
"""
