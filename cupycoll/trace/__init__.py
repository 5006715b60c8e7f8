"""The flight recorder and the timeout diagnosis: which rank hangs, and where.

* :mod:`.recorder`: the ring buffer of what every group was asked to do, and its dumps;
* :mod:`.group`: one group's recorder, diagnosis and mismatch check, as the shell uses them;
* :mod:`.diagnosis`: the store exchange, on a timeout, that says where every rank is;
* :mod:`.mismatch`: the opt-in check that all ranks make the same call;
* :mod:`.analyze`: ``python -m cupycoll.trace DIR``, which reads the ranks' dumps.
"""
