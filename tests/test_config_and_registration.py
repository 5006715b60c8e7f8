"""Options / environment precedence, and the two registration paths."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import cupycoll
from cupycoll import _registration, config
from cupycoll.errors import CupycollValueError, NcclError


def test_precedence_options_then_env_then_default():
    env = {"CUPYCOLL_TIMEOUT": "12", "CUPYCOLL_COMM_SPLIT": "0"}
    s = config.resolve(cupycoll.Options(timeout=3, comm_split=True), datetime.timedelta(seconds=99), env)
    assert s.timeout == datetime.timedelta(seconds=3) and s.comm_split is True
    s = config.resolve(cupycoll.Options(), datetime.timedelta(seconds=99), env)
    assert s.timeout == datetime.timedelta(seconds=12) and s.comm_split is False
    s = config.resolve(None, datetime.timedelta(seconds=99), {})
    assert s.timeout == datetime.timedelta(seconds=99) and s.comm_split is True
    assert config.resolve(None, None, {}).timeout == config.DEFAULT_TIMEOUT


def test_nccl_library_from_env():
    assert config.resolve(None, None, {"CUPYCOLL_NCCL_LIBRARY": "/x/libnccl.so.2"}).nccl_library == "/x/libnccl.so.2"
    assert config.resolve(None, None, {}).nccl_library is None


@pytest.mark.parametrize("env,match", [
    ({"CUPYCOLL_TIMEOUT": "soon"}, "CUPYCOLL_TIMEOUT='soon'"),
    ({"CUPYCOLL_TIMEOUT": "-1"}, "must be positive"),
    ({"CUPYCOLL_COMM_SPLIT": "maybe"}, "CUPYCOLL_COMM_SPLIT='maybe'"),
])
def test_bad_environment(env, match):
    with pytest.raises(CupycollValueError, match=match):
        config.resolve(None, None, env)


def test_every_variable_is_documented():
    source = open(config.__file__).read()
    for name in config.ENVIRONMENT:
        assert source.count(name) >= 3, name  # the table, the docstring and the reader
    readme = os.path.join(os.path.dirname(config.__file__), "..", "README.md")
    if os.path.exists(readme):
        text = open(readme).read()
        assert all(name in text for name in config.ENVIRONMENT)


def test_import_registers_idempotently():
    assert "CUPYCOLL" in dist.Backend._plugins
    plugin = dist.Backend._plugins["CUPYCOLL"]
    assert plugin.extended_api is True
    cupycoll.register()
    assert dist.Backend._plugins["CUPYCOLL"] is plugin


def test_autoload_never_raises(monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(_registration, "register", broken)
    assert _registration.autoload() is None


def _python(code, **env):
    full_env = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


def test_entry_point_is_cheap_and_registers():
    from importlib.metadata import entry_points

    if not any(ep.name == "cupycoll" for ep in entry_points(group="torch.backends")):
        pytest.skip("cupycoll is not pip-installed here, so its torch.backends entry point is absent")
    code = ("import sys, torch, torch.distributed as dist; "
            "print('CUPYCOLL' in dist.Backend._plugins, 'cupy' in sys.modules)")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
    off = _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.stdout.split() == ["False", "False"]


def test_import_cupycoll_does_not_import_cupy():
    result = _python("import sys, cupycoll; print('cupy' in sys.modules)", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_nccl_error_carries_status_and_function():
    err = NcclError(6, "ncclAllReduce", "remote process exited", last_error="peer 3 hung up")
    assert (err.status, err.status_name, err.function) == (6, "ncclRemoteError", "ncclAllReduce")
    assert "ncclAllReduce failed: ncclRemoteError (6)" in str(err) and "peer 3 hung up" in str(err)
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (again.status, again.function, again.last_error) == (6, "ncclAllReduce", "peer 3 hung up")


def test_destroyed_group_is_freed_without_the_cycle_collector():
    """A reference cycle would keep a destroyed group, and its gloo threads, alive until
    interpreter exit, where tearing gloo down aborted the process (seen with destroy + re-init)."""
    import gc
    import weakref

    gc.disable()
    try:
        dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
        group = weakref.ref(dist.group.WORLD)
        assert type(group()).__name__ == "ProcessGroupCupycoll"
        dist.destroy_process_group()
        assert group() is None
    finally:
        gc.enable()


def test_splitting_is_offered_only_to_new_cupycoll_groups():
    # torch reads supports_splitting while creating any subgroup of a bound default group;
    # a new nccl group must not get our handle as its split source.
    from cupycoll.process_group import _CudaBackendHandle

    handle = _CudaBackendHandle.__new__(_CudaBackendHandle)

    def _new_process_group_helper(backend):  # the name torch's helper has
        return handle.supports_splitting

    assert _new_process_group_helper("cupycoll") is True
    assert _new_process_group_helper("cpu:gloo,cuda:cupycoll") is True
    assert _new_process_group_helper("nccl") is False
    assert _new_process_group_helper("gloo") is False
    assert handle.supports_splitting is True  # asked outside group creation
