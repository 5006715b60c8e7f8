"""``torch.compile`` over cupycoll groups, CPU route, on the torch that runs the suite: a
compiled DDP model, a compiled FSDP2 model and a compiled function of functional
collectives train as they do on plain gloo, on both backend strings (two ranks in
processes, tests/workers/compile_worker.py). The group's methods run eagerly inside a
compiled region (cupycoll.compat.run_eagerly_under_compile); the CUDA route's compiled DDP
is the GPU tier's.
"""

from __future__ import annotations

import json

import pytest
import torch

from cupycoll import compat
from mp import start_ranks, wait_all

pytestmark = pytest.mark.launches

CASES = ("ddp", "fsdp2", "functional")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, once_per_run):
    """``trained(backend)``: backend -> rank -> case -> {"params"} or {"error"}, for gloo and
    ``backend``. gloo's and "cupycoll"'s two ranks each run side by side when a test first
    needs them; the second backend string's (its tests run on one CI leg), after them."""
    def slug(backend):
        return "compile-" + backend.replace(":", "-").replace(",", "-")

    def launch(*backends):
        outs = [tmp_path_factory.mktemp(slug(b)) for b in backends]
        wait_all([start_ranks("compile_worker.py", 2, args=[b, str(out)], timeout=240)
                  for b, out in zip(backends, outs)])
        return {backend: {rank: json.loads((out / f"rank{rank}.json").read_text(encoding="utf-8"))
                          for rank in range(2)}
                for backend, out in zip(backends, outs)}

    def run(backend):
        runs = dict(once_per_run("compile-gloo-cupycoll", lambda: launch("gloo", "cupycoll")))
        if backend not in runs:
            runs.update(once_per_run(slug(backend), lambda: launch(backend)))
        return runs
    return run


def _gloo_reference(trained, case: str, rank: int) -> dict:
    if case == "fsdp2" and not compat.GLOO_REDUCE_SCATTER_HONOURS_OP:
        # FSDP2 averages gradients with reduce_scatter_tensor(op=AVG), which gloo sums there
        # (cupycoll's CPU route does not): plain gloo's DDP run is the reference, the same
        # model, data and steps with gradients averaged over the two ranks.
        return trained["gloo"][rank]["ddp"]
    return trained["gloo"][rank][case]


# Every leg compiles on "cupycoll"; the other string differs in routing alone, which every
# leg's registration-forms test checks, so its compiled training runs on one leg.
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["cupycoll", pytest.param("cpu:gloo,cuda:cupycoll", marks=pytest.mark.any_stack)])
def test_compiled_training_on_cupycoll_equals_gloo(trained, backend, case):
    trained = trained(backend)
    gloo = [_gloo_reference(trained, case, rank) for rank in range(2)]
    if "error" in gloo[0]:
        pytest.skip(f"torch {torch.__version__} cannot run this on gloo either: {gloo[0]['error'][:200]}")
    for rank in range(2):
        got = trained[backend][rank][case]
        assert "error" not in got, (backend, case, rank, got["error"] if "error" in got else None)
        assert got["params"] == gloo[rank]["params"], (backend, case, rank)
    assert trained[backend][0][case] == trained[backend][1][case]  # the ranks agree


def test_every_method_torch_can_call_runs_eagerly():
    import torch._dynamo  # noqa: F401 - what compiling imports; the methods are wrapped by then

    from cupycoll.process_group import ProcessGroupCupycoll

    overrides = [name for name, value in vars(ProcessGroupCupycoll).items()
                 if callable(value) and not name.startswith("__") and hasattr(torch.distributed.ProcessGroup, name)]
    assert {"allreduce", "broadcast", "_allgather_base", "barrier", "send"} <= set(overrides)
    for name in overrides:  # each one wrapped by torch.compiler.disable (functools.wraps)
        assert getattr(vars(ProcessGroupCupycoll)[name], "__wrapped__", None) is not None, name
