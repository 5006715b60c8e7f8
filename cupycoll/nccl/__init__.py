"""The NCCL layer: what talks to libnccl, and nothing of torch.

* :mod:`.header`: NCCL's declarations as ctypes: types, ``ncclConfig_t``, constants, one
  declarative table of NCCL's C functions;
* :mod:`.bindings`: the library found, loaded once and bound from that table;
* :mod:`.communicator`: one ``ncclComm_t`` on one device, made through the bindings (blocking
  or not), its verbs on raw pointers;
* :mod:`.children`: a communicator's children (split, shrink);
* :mod:`.call_guard`: the NCCL calls under way on a communicator, which an abort waits for;
* :mod:`.group`: ncclGroupStart/End and which communicators a group used;
* :mod:`.communicators`: a group's communicators, which its backend and its lifetime hold;
* :mod:`.bootstrap`: a communicator's unique id shared through torch's store.

Above it: the CUDA half of a group (:mod:`cupycoll.backend`); below it only errors, CuPy's
device context (:mod:`cupycoll._cuda`) and libnccl itself.
"""
