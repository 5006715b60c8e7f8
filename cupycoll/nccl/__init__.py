"""The NCCL layer: what talks to libnccl, and nothing of torch.

* :mod:`.bindings`: the ctypes bindings, one declarative table of NCCL's C functions;
* :mod:`.communicator`: one ``ncclComm_t`` on one device, made through the bindings (blocking
  or not), its children (split, shrink), its verbs on raw pointers;
* :mod:`.call_guard`: the NCCL calls under way on a communicator, which an abort waits for;
* :mod:`.group`: ncclGroupStart/End and which communicators a group used;
* :mod:`.bootstrap`: a communicator's unique id shared through torch's store.

Above it: the CUDA half of a group (:mod:`cupycoll.backend`); below it only errors, CuPy's
device context (:mod:`cupycoll._cuda`) and libnccl itself.
"""
