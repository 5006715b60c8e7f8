"""Faults: how a CUDA group notices trouble and ends.

* :mod:`.watchdog`: a group's watch: its calls in flight, and what is stuck or failed there;
* :mod:`.watchdog_thread`: one thread per process that has every group check its watch for
  timeouts and NCCL's async errors, and decide;
* :mod:`.watchdog_cuda`: its CUDA event queries (on the group's device, safe during a graph
  capture);
* :mod:`.heartbeat`: the monitor of the watchdog's own heartbeat;
* :mod:`.lifecycle`: a group's lifetime, the one thing that decides how it ends: its state,
  its fault, abort, shutdown, replacement by a shrink;
* :mod:`.reports`: what is told of a fault (a timeout explained, published, dumped, logged);
* :mod:`.teardown`: the steps of a group's end and of its shutdown;
* :mod:`.last_words`: the process's exit 70 after a fault, and the bounded calls on the way;
* :mod:`.all_groups`: every live group of the process: ``abort_all``, the aborts at exit.

Which rank is behind when a collective times out is the flight recorder's (:mod:`cupycoll.trace`).
"""
