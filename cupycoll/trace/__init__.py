"""The flight recorder and the timeout diagnosis: which rank hangs, and where.

* :mod:`.recorder`: the ring buffer of what every group was asked to do;
* :mod:`.dumps`: the recorders written as JSON, and read back;
* :mod:`.group`: one group's recorder, diagnosis and mismatch check, as the shell uses them;
* :mod:`.gloo_work`: gloo's Works, wrapped to keep the recorder and name the rank behind;
* :mod:`.exchange`: the store exchange, on a timeout, that gathers where every rank is;
* :mod:`.listener`: one thread per rank that answers for it and hands on published faults;
* :mod:`.news`: a group's news, its members' bells, published faults and the keys' end;
* :mod:`.records`: a rank's record, and what a peer wrote, checked;
* :mod:`.diagnosis`: the message that says which rank is behind, and where;
* :mod:`.mismatch`: the opt-in check that all ranks make the same call;
* :mod:`.analyze`: ``python -m cupycoll.trace DIR``, which reads the ranks' dumps.
"""
