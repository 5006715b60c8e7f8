"""Options / environment precedence, and the two registration paths."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import cupycoll
from cupycoll.issue import Call
from cupycoll import _registration, compat, config, logs
from cupycoll.errors import CupycollTypeError, CupycollValueError, NcclError
from installed import cupycoll_entry_points
from shapes import backend_shape, cupycoll_group_type, shell_of


SECONDS = datetime.timedelta(seconds=1)


def test_precedence_options_then_env_then_default():
    env = {"CUPYCOLL_TIMEOUT": "12", "CUPYCOLL_COMM_SPLIT": "0"}
    s = config.resolve(cupycoll.Options(timeout=3, comm_split=True), 99 * SECONDS, env)
    assert s.timeout == 3 * SECONDS and s.comm_split is True
    s = config.resolve(cupycoll.Options(), None, env)
    assert s.timeout == 12 * SECONDS and s.comm_split is False
    s = config.resolve(None, 99 * SECONDS, {})
    assert s.timeout == 99 * SECONDS and s.comm_split is True
    assert config.resolve(None, None, {}).timeout == config.DEFAULT_TIMEOUT


def test_an_explicit_init_timeout_beats_the_environment():
    # init_process_group(timeout=99 s) is an explicit argument: CUPYCOLL_TIMEOUT must not win.
    env = {"CUPYCOLL_TIMEOUT": "12"}
    assert config.resolve(None, 99 * SECONDS, env).timeout == 99 * SECONDS
    # torch passes its default when the caller gave none: then the variable applies...
    torch_default = dist.distributed_c10d._get_default_timeout(dist.Backend("cupycoll"))
    assert torch_default in config.torch_default_timeouts()
    assert config.resolve(None, torch_default, env).timeout == 12 * SECONDS
    # ...and without it cupycoll's default (10 min), not torch's 30.
    assert config.resolve(None, torch_default, {}).timeout == config.DEFAULT_TIMEOUT
    # torch's nccl default (10 min on CUDA builds) is never handed to cupycoll: explicit here
    assert config.resolve(None, datetime.timedelta(minutes=10), env).timeout == datetime.timedelta(minutes=10)


@pytest.mark.parametrize("text,value", [("t", True), ("Y", True), ("f", False), ("n", False)])
def test_torch_boolean_spellings_are_accepted(text, value):
    # torch's getCvarBool reads y/t and n/f: TORCH_NCCL_BLOCKING_WAIT=t must not break init
    assert config.resolve(None, None, {"TORCH_NCCL_BLOCKING_WAIT": text}).blocking_wait is value


def test_an_explicit_init_timeout_reaches_a_real_group(monkeypatch):
    monkeypatch.setenv("CUPYCOLL_TIMEOUT", "12")
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=77))
    try:
        assert shell_of(dist.group.WORLD).settings.timeout == 77 * SECONDS
        sub = dist.new_group([0], backend="cupycoll")
        assert shell_of(sub).settings.timeout == 12 * SECONDS  # no timeout given to new_group
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("field,variable,torch_variable,torch_value,expected", [
    ("nonblocking", "CUPYCOLL_NONBLOCKING", "TORCH_NCCL_USE_COMM_NONBLOCKING", "1", True),
    ("blocking_wait", "CUPYCOLL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT", "1", True),
    ("on_timeout", "CUPYCOLL_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "terminate"),
    ("on_timeout", "CUPYCOLL_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "terminate"),
])
def test_torch_variables_apply_below_cupycoll_ones(field, variable, torch_variable, torch_value, expected):
    default = getattr(config.resolve(None, None, {}), field)
    assert default != expected
    assert getattr(config.resolve(None, None, {torch_variable: torch_value}), field) == expected
    cupycoll_value = {True: "0", False: "1", "terminate": "raise", "raise": "terminate"}[expected]
    both = {torch_variable: torch_value, variable: cupycoll_value}
    assert getattr(config.resolve(None, None, both), field) == default  # CUPYCOLL_* wins
    explicit = cupycoll.Options(**{field: default})
    assert getattr(config.resolve(explicit, None, {torch_variable: torch_value}), field) == default


def test_torch_error_handling_modes_that_keep_the_process():
    for mode in ("0", "2"):
        env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode}
        assert config.resolve(None, None, env).on_timeout == "raise"
        env["CUPYCOLL_ON_TIMEOUT"] = "terminate"
        assert config.resolve(None, None, env).on_timeout == "terminate"


def test_blocking_wait_setting_reaches_the_works(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    group = shell_of(dist.group.WORLD)
    try:
        assert group.settings.blocking_wait is True
        # A send to a peer is queued, not issued: the Work exists without a GPU.
        work = group._issuer.issue(Call(op="send", device=torch.device("cuda", 0), outputs=[], keep=None,
                                        async_op=True, entry=None, peer=0))
        assert work._blocking_wait is True
    finally:
        group._issuer.drop()
        dist.destroy_process_group()


@pytest.mark.parametrize("value", [True, 1, "1", "true", "Yes", " on "])
def test_every_boolean_parses_alike_true(value):
    for field in ("comm_split", "nonblocking", "blocking_wait"):
        assert getattr(cupycoll.Options(**{field: value}), field) is True


@pytest.mark.parametrize("value", [False, 0, "0", "false", "No", "off"])
def test_every_boolean_parses_alike_false(value):
    for field in ("comm_split", "nonblocking", "blocking_wait"):
        assert getattr(cupycoll.Options(**{field: value}), field) is False
    assert config.resolve(None, None, {"CUPYCOLL_COMM_SPLIT": str(value)}).comm_split is False


@pytest.mark.parametrize("kwargs,error,match", [
    ({"comm_split": "maybe"}, CupycollValueError, "Options.comm_split='maybe'"),
    ({"nonblocking": 2}, CupycollValueError, "Options.nonblocking=2"),
    ({"comm_split": [1]}, CupycollTypeError, "Options.comm_split"),
    ({"ring_scratch_bytes": 1.5}, CupycollValueError, "Options.ring_scratch_bytes=1.5"),
    ({"ring_scratch_bytes": "1.5"}, CupycollValueError, "whole number"),
    ({"ring_scratch_bytes": 0}, CupycollValueError, "positive"),
    ({"ring_scratch_bytes": True}, CupycollTypeError, "bool"),
    ({"timeout": -1}, CupycollValueError, "must be positive"),
    ({"timeout": "soon"}, CupycollValueError, "Options.timeout='soon'"),
    ({"timeout": [3]}, CupycollTypeError, "Options.timeout"),
    ({"watchdog_interval": 0}, CupycollValueError, "positive"),
    ({"watchdog_interval": 1e-9}, CupycollValueError, "from 0.001 to 60"),
    ({"trace_dir": __file__}, CupycollValueError, "exists and is not a folder"),
    ({"on_timeout": "explode"}, CupycollValueError, "raise, terminate"),
    ({"algorithm": 3}, CupycollTypeError, "auto, nccl, ring"),
])
def test_options_validate_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        cupycoll.Options(**kwargs)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(cupycoll.Options)])
def test_one_rule_for_every_option_a_type_it_never_takes_is_a_type_error_a_value_that_does_not_parse_a_value_error(field):
    for never in ([1], object(), {"a": 1}):
        with pytest.raises(CupycollTypeError, match=f"Options.{field}"):
            cupycoll.Options(**{field: never})
    if field != "trace_dir":  # any text is a path
        with pytest.raises(CupycollValueError, match=f"Options.{field}='not a value'"):
            cupycoll.Options(**{field: "not a value"})
    if field in ("timeout", "watchdog_interval", "ring_scratch_bytes", "trace_buffer"):
        with pytest.raises(CupycollTypeError, match=f"Options.{field}"):
            cupycoll.Options(**{field: True})  # a bool is never a number of seconds or bytes


def test_a_misspelt_or_unread_setting_is_named_once(caplog, monkeypatch):
    monkeypatch.setattr(config, "_WARNED", set())
    env = {"CUPYCOLL_TIMOUT": "5", "TORCH_NCCL_HIGH_PRIORITY": "1", "CUPYCOLL_TIMEOUT": "7",
           "TORCH_NCCL_BLOCKING_WAIT": "0", "CUPYCOLL_BENCH_DEVICE": "cpu", "NCCL_DEBUG": "WARN"}
    with caplog.at_level("WARNING", logger="cupycoll"):
        config.resolve(None, None, env)
        config.resolve(None, None, env)  # once per process and name
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "CUPYCOLL_TIMOUT is set, but cupycoll reads no such variable: did you mean CUPYCOLL_TIMEOUT?",
        "TORCH_NCCL_HIGH_PRIORITY is set; it applies to torch's nccl backend only, cupycoll does not read it "
        "(of torch's NCCL settings cupycoll reads " + ", ".join(
            n for n in config.ENVIRONMENT if n.startswith("TORCH_NCCL_")) + ")"], messages


def test_options_normalize():
    o = cupycoll.Options(timeout=2.5, ring_scratch_bytes="4096", algorithm=" RING ")
    assert o.timeout == datetime.timedelta(seconds=2.5)
    assert o.ring_scratch_bytes == 4096 and o.algorithm == "ring"
    assert cupycoll.Options(ring_scratch_bytes=8.0).ring_scratch_bytes == 8


def test_pg_options_of_another_type():
    with pytest.raises(CupycollValueError, match="cupycoll.Options"):
        config.resolve({"timeout": 3}, None, {})


def test_nccl_library_from_env():
    assert config.resolve(None, None, {"CUPYCOLL_NCCL_LIBRARY": "/x/libnccl.so.2"}).nccl_library == "/x/libnccl.so.2"
    assert config.resolve(None, None, {}).nccl_library is None


@pytest.mark.parametrize("env,match", [
    ({"CUPYCOLL_TIMEOUT": "soon"}, "CUPYCOLL_TIMEOUT='soon'"),
    ({"CUPYCOLL_TIMEOUT": "-1"}, "must be positive"),
    ({"CUPYCOLL_COMM_SPLIT": "maybe"}, "CUPYCOLL_COMM_SPLIT='maybe'"),
    ({"CUPYCOLL_RING_SCRATCH_BYTES": "1.5"}, "CUPYCOLL_RING_SCRATCH_BYTES='1.5'"),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "7"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING='7'"),
    ({"TORCH_NCCL_BLOCKING_WAIT": "sometimes"}, "TORCH_NCCL_BLOCKING_WAIT"),
    ({"CUPYCOLL_WATCHDOG_INTERVAL": "1e-9"}, "from 0.001 to 60"),
    ({"CUPYCOLL_TRACE_DIR": __file__}, "CUPYCOLL_TRACE_DIR=.* exists and is not a folder"),
    ({"CUPYCOLL_LOG_LEVEL": "loud"}, "CUPYCOLL_LOG_LEVEL='loud': expected one of debug, info"),
])
def test_bad_environment(env, match):
    with pytest.raises(CupycollValueError, match=match):
        config.resolve(None, None, env)


USAGE = os.path.join(os.path.dirname(config.__file__), "..", "docs", "usage.md")


def _documented_variables():
    """The variables of docs/usage.md's configuration table."""
    section = open(USAGE, encoding="utf-8").read().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = set()
    for row in rows:
        name = row.split("`")[1]
        if name.startswith(("CUPYCOLL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_GLOO_", "TORCHELASTIC_")):
            names.add(name)
    return names


def test_every_variable_is_documented_and_read():
    source = open(config.__file__, encoding="utf-8").read()
    docstring = config.__doc__
    read = {f.env for f in config._FIELDS.values()} | {f.torch_env for f in config._FIELDS.values() if f.torch_env}
    read |= {config._TIMEOUT_ENV, config._LIBRARY_ENV, config._SHAPE_ENV, config._TRACE_DIR_ENV,
             config._TORCH_DUMP_ENV, config._TORCH_DUMP_FILE_ENV, config._LOG_LEVEL_ENV, config._ERROR_FILE_ENV,
             config._GLOO_LAZY_ENV}
    assert read == set(config.ENVIRONMENT)  # what is read is listed, and nothing else
    for name in config.ENVIRONMENT:
        assert name in docstring, name
    assert _documented_variables() == set(config.ENVIRONMENT)
    assert "os.environ" in source


@pytest.fixture
def cupycoll_logger():
    """The ``cupycoll`` logger, its level and handlers restored after the test."""
    import logging

    logger = logging.getLogger("cupycoll")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logs._HANDLER.clear()


def test_log_level_sets_the_cupycoll_loggers_level_and_unset_leaves_it(cupycoll_logger):
    import logging

    cupycoll_logger.setLevel(logging.NOTSET)
    config.resolve(None, None, {})
    assert cupycoll_logger.level == logging.NOTSET
    config.resolve(None, None, {"CUPYCOLL_LOG_LEVEL": " Debug "})
    assert cupycoll_logger.level == logging.DEBUG
    config.resolve(None, None, {"CUPYCOLL_LOG_LEVEL": "error"})
    assert cupycoll_logger.level == logging.ERROR
    # pytest's own handler sits on the root logger: an application's configuration prints
    # the records, so cupycoll adds no handler of its own
    assert cupycoll_logger.handlers == [h for h in cupycoll_logger.handlers if h not in logs._HANDLER]


def test_the_group_line_says_shape_timeout_routes_and_policy(cupycoll_logger, caplog):
    settings = config.resolve(cupycoll.Options(timeout=5, nonblocking=True, on_timeout="terminate"), None, {})
    with caplog.at_level("INFO", logger="cupycoll"):
        line = logs.log_group("7", 1, 3, "backend", settings)
    assert caplog.records[-1].getMessage() == line and caplog.records[-1].levelname == "INFO"
    assert line == ("process group '7': rank 1 of 3, backend shape, timeout 5 s; CUDA tensors to NCCL "
                    "(nonblocking communicators, algorithm auto), CPU tensors to gloo; a timeout or NCCL "
                    "error aborts the group and ends the process")


@pytest.mark.launches
def test_a_group_created_logs_its_line_at_info_when_the_log_level_asks_for_it():
    # No logging configured, as in a user's script: the first group is created without the
    # variable (nothing printed), the second with CUPYCOLL_LOG_LEVEL=info.
    code = ("import os, torch.distributed as dist, cupycoll\n"
            "dist.init_process_group('cupycoll', store=dist.HashStore(), rank=0, world_size=1)\n"
            "os.environ['CUPYCOLL_LOG_LEVEL'] = 'info'\n"
            "dist.new_group([0], pg_options=cupycoll.Options(timeout=30))\n"
            "dist.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k != "CUPYCOLL_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "process group" in line]
    shape = "backend" if backend_shape() else "process_group"
    assert lines == [f"INFO cupycoll: process group '1': rank 0 of 1, {shape} shape, timeout 30 s; CUDA "
                     "tensors to NCCL (blocking communicators, algorithm auto), CPU tensors to gloo; a "
                     "timeout or NCCL error aborts the group and raises"], result.stderr


@pytest.mark.launches
def test_python_m_cupycoll_prints_the_version_and_where_the_commands_are():
    version = subprocess.run([sys.executable, "-m", "cupycoll", "--version"], capture_output=True, text=True,
                             timeout=120, cwd=CHECKOUT)
    assert (version.returncode, version.stdout) == (0, f"cupycoll {cupycoll.__version__}\n"), version.stderr
    usage = subprocess.run([sys.executable, "-m", "cupycoll"], capture_output=True, text=True, timeout=120,
                           cwd=CHECKOUT)
    assert usage.returncode == 0 and "python -m cupycoll.trace" in usage.stdout and "cupycoll-bench" in usage.stdout


def test_no_other_module_reads_the_environment_for_settings():
    package = os.path.dirname(config.__file__)
    for name in os.listdir(package):
        if name.endswith(".py") and name != "config.py":
            text = open(os.path.join(package, name), encoding="utf-8").read()
            for variable in config.ENVIRONMENT:
                assert f'"{variable}"' not in text, (name, variable)


def test_backend_errors_are_torch_dist_backend_errors():
    from cupycoll.errors import CollectiveTimeoutError, CommunicatorAbortedError

    for error in (NcclError(6, "ncclAllReduce"), CollectiveTimeoutError("late"), CommunicatorAbortedError("gone")):
        assert isinstance(error, dist.DistBackendError) and isinstance(error, cupycoll.CupycollError)
        with pytest.raises(dist.DistBackendError):
            raise error
    assert isinstance(CollectiveTimeoutError("late"), TimeoutError)
    assert not isinstance(CupycollValueError("x"), dist.DistBackendError)


def _documented_error_table():
    """docs/usage.md's errors table as {class name: the names in "also an instance of"}."""
    section = open(USAGE, encoding="utf-8").read().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    table = {}
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3, row
        bases = [name.rsplit(".", 1)[-1] for name in re.findall(r"`([\w.]+)`", cells[2])]
        for name in re.findall(r"`(\w+)`", cells[0]):
            assert name not in table, f"{name} has two rows"
            table[name] = bases
    return table


def test_every_exported_error_is_in_the_documented_errors_table_and_nothing_else():
    from cupycoll import errors

    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__}
    exported = {name for name in cupycoll.__all__ if name not in cupycoll._LAZY
                and isinstance(getattr(cupycoll, name), type) and issubclass(getattr(cupycoll, name), BaseException)}
    assert exported == defined  # every public class of errors.py is exported, and only those
    table = _documented_error_table()
    assert set(table) == exported
    for name, documented in table.items():
        # "also an instance of" lists exactly the class's bases from outside the family
        outside = {base.__name__ for base in getattr(cupycoll, name).__bases__
                   if not issubclass(base, cupycoll.CupycollError)}
        assert set(documented) == outside, name


@pytest.mark.parametrize("torch_cuda, cupy_major, expected", [
    (None, 12, None),             # a CPU (or ROCm) torch build: nothing to agree with
    ("12.1", 12, None),
    ("13.0", 13, None),
    ("12.8", None, None),         # CuPy's major unknown (a ROCm CuPy)
    ("13.0", 12, ("CUDA 13 build", "built for CUDA 12", "cupy-cuda12x", "pip install 'cupycoll[cuda13]'",
                  "pip install -e '.[cuda13]'")),
    ("12.6", 13, ("CUDA 12 build", "built for CUDA 13", "pip install 'cupycoll[cuda12]'",
                  "pip install -e '.[cuda12]'")),
])
def test_mixed_cuda_stack_warning_names_both_majors_and_the_extra(torch_cuda, cupy_major, expected):
    from cupycoll import _cuda

    message = _cuda.mixed_stack_warning(torch_cuda, cupy_major)
    if expected is None:
        assert message is None
    else:
        for part in expected:
            assert part in message, (part, message)


def test_mixed_cuda_stack_without_an_extra_names_no_extra():
    from cupycoll import _cuda

    message = _cuda.mixed_stack_warning("14.0", 13)
    assert "CUDA 14 build" in message and "cupycoll[" not in message


def _cupy_wheel_major():
    import importlib.metadata

    names = [(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()]
    majors = [int(m.group(1)) for m in (re.fullmatch(r"cupy-cuda(\d+)x", n) for n in names) if m]
    return majors[0] if len(majors) == 1 else None


def test_cupy_cuda_major_needs_no_gpu_and_matches_the_wheel(monkeypatch):
    cupy = pytest.importorskip("cupy")
    from cupycoll import _cuda

    wheel = _cupy_wheel_major()
    if wheel is None:
        pytest.skip("no single cupy-cudaNNx wheel installed")
    assert _cuda.cupy_cuda_major(cupy) == wheel

    def fails():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver
    monkeypatch.setattr(cupy.cuda.runtime, "runtimeGetVersion", fails)
    assert _cuda.cupy_cuda_major(cupy) == wheel  # from the wheel's name instead


def test_the_installed_stack_is_consistent_and_does_not_warn():
    import warnings

    cupy = pytest.importorskip("cupy")
    from cupycoll import _cuda

    # Every CI leg installs torch and CuPy for one CUDA major (or a CPU torch build)
    if torch.version.cuda:
        assert int(torch.version.cuda.split(".")[0]) == _cuda.cupy_cuda_major(cupy)
    _cuda._warn_on_mixed_stack.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _cuda._warn_on_mixed_stack() is None
    finally:
        _cuda._warn_on_mixed_stack.cache_clear()


def test_a_mixed_stack_warns_once(monkeypatch):
    cupy = pytest.importorskip("cupy")
    from cupycoll import _cuda

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_cuda, "cupy_cuda_major", lambda module: 12)
    _cuda._warn_on_mixed_stack.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"CUDA 13 build.*built for CUDA 12") as caught:
            _cuda._cupy_ready_to_compile()
            _cuda._cupy_ready_to_compile()
        assert len([w for w in caught if "CUDA 13 build" in str(w.message)]) == 1
    finally:
        _cuda._warn_on_mixed_stack.cache_clear()


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


@pytest.mark.launches
def test_entry_point_is_cheap_and_registers():
    if not cupycoll_entry_points("torch.backends"):
        pytest.skip("cupycoll is not pip-installed here, so its torch.backends entry point is absent")
    code = ("import sys, torch, torch.distributed as dist; "
            "print('CUPYCOLL' in dist.Backend._plugins, 'cupy' in sys.modules)")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
    off = _python(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.stdout.split() == ["False", "False"]


def test_import_torch_does_not_import_the_process_group():
    # the entry point runs during ``import torch``: it must not pay for the process group
    code = ("import sys, torch, cupycoll; print('cupycoll.process_group' in sys.modules); "
            "cupycoll.ProcessGroupCupycoll; print('cupycoll.process_group' in sys.modules)")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]  # loaded on first access (PEP 562)


def test_the_cuda_backend_is_what_torch_expects():
    dist.init_process_group("cupycoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        backend = group._get_backend(torch.device("cuda"))
        if backend_shape():  # a c10d Backend in torch's ProcessGroup: torch's coalescing calls reach it
            assert backend is shell_of(group) and backend.getBackendName() == cupycoll.BACKEND_NAME
            assert backend.supports_coalescing is True and backend._supports_time_estimate is False
        else:  # the adapter routes coalescing itself; torch only reads its CUDA backend
            assert backend is group._cuda and backend.name() == cupycoll.BACKEND_NAME
            assert backend.supports_coalescing is False and backend.supports_time_estimate is False
        assert callable(backend.eager_connect_single_device) and callable(backend.perform_nocolor_split)
        from cupycoll import process_group
        assert cupycoll.BACKEND_NAME is config.BACKEND_NAME is process_group.BACKEND_NAME
    finally:
        dist.destroy_process_group()


def test_eager_connect_binds_the_group_torch_keeps(monkeypatch):
    # torch sets bound_device_id on the ProcessGroup it built, then keeps ours instead: the
    # backend's eager connect must bind ours, or subgroups are never split from it
    from standins import CpuAsCudaGroup

    cuda0 = torch.device("cuda", 0)
    group = CpuAsCudaGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    connected = []
    monkeypatch.setattr(group._cuda, "comm_for", connected.append)
    group._get_backend(cuda0).eager_connect_single_device(cuda0)
    assert group.bound_device == cuda0 and connected == [cuda0]
    # torch sees the binding where its split_group can split a Python group: elsewhere its
    # DeviceMesh would take that path and refuse the group
    assert getattr(group, "bound_device_id", None) == (cuda0 if compat.SPLIT_GROUP_REACHES_PYTHON_GROUPS else None)


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
        assert type(dist.group.WORLD).__name__ == cupycoll_group_type()
        group = weakref.ref(shell_of(dist.group.WORLD))
        dist.destroy_process_group()
        assert group() is None
    finally:
        gc.enable()


def test_splitting_is_offered_only_to_new_cupycoll_groups():
    # torch reads supports_splitting while creating any subgroup of a bound default group;
    # a new nccl group must not get our backend as its split source.
    from cupycoll.backend import CudaBackend

    handle = CudaBackend.__new__(CudaBackend)

    def _new_process_group_helper(backend):  # the name torch's helper has
        return handle.supports_splitting

    assert _new_process_group_helper("cupycoll") is True
    assert _new_process_group_helper("cpu:gloo,cuda:cupycoll") is True
    assert _new_process_group_helper("nccl") is False
    assert _new_process_group_helper("gloo") is False
    assert handle.supports_splitting is True  # asked outside group creation


def test_version_and_license_are_declared_once():
    tomllib = pytest.importorskip("tomllib")
    root = os.path.join(os.path.dirname(cupycoll.__file__), "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = attr.rpartition(".")
    import importlib

    assert getattr(importlib.import_module(module), name) == cupycoll.__version__
    assert project["project"]["license"] == "MIT" and project["project"]["license-files"] == ["LICENSE"]
    with open(os.path.join(root, "LICENSE")) as f:
        assert f.readline().strip() == "MIT License"
    source = open(cupycoll.__file__, encoding="utf-8").read()
    assert '__version__ = "' not in source  # re-exported, not written again


def test_installed_metadata_matches_the_checkout():
    from importlib import metadata

    try:
        dist_version = metadata.version("cupycoll")
    except metadata.PackageNotFoundError:
        pytest.skip("cupycoll is not pip-installed here")
    assert dist_version == cupycoll.__version__


REPOSITORY = "https://github.com/cupycoll/cupycoll"
CHECKOUT = Path(cupycoll.__file__).resolve().parent.parent


def _metadata_of_this_checkout():
    """The metadata pip installed for cupycoll, where pip installed it from this checkout:
    the dist-info of the install (its direct_url.json names the checkout), or the egg-info
    that the editable install wrote into the checkout, found first from the checkout."""
    from importlib import metadata

    try:
        dist = metadata.distribution("cupycoll")
    except metadata.PackageNotFoundError:
        pytest.skip("cupycoll is not pip-installed here")
    origin = json.loads(dist.read_text("direct_url.json") or "{}").get("url")
    if origin != CHECKOUT.as_uri() and Path(dist.locate_file("")).resolve() != CHECKOUT:
        pytest.skip(f"the cupycoll installed here comes from {origin or dist.locate_file('')}, not this checkout")
    return dist.metadata


def test_the_package_index_page_has_license_classifiers_keywords_authors_and_urls():
    meta = _metadata_of_this_checkout()
    assert meta["License-Expression"] == "MIT" and meta.get_all("License-File") == ["LICENSE"]
    assert "License" not in meta  # the free-text field the SPDX expression replaces
    classifiers = meta.get_all("Classifier")
    for wanted in ("Environment :: GPU :: NVIDIA CUDA", "Operating System :: POSIX :: Linux",
                   "Programming Language :: Python :: 3.10", "Programming Language :: Python :: 3.12",
                   "Topic :: System :: Distributed Computing"):
        assert wanted in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    # a License classifier beside the expression is an error for setuptools >= 77
    assert not any(c.startswith("License :: ") for c in classifiers)
    assert {"nccl", "cupy", "torch.distributed"} <= set(meta["Keywords"].split(","))
    assert meta["Author"] == "cupycoll developers"
    urls = dict(entry.split(", ", 1) for entry in meta.get_all("Project-URL"))
    assert urls == {"Homepage": REPOSITORY, "Documentation": f"{REPOSITORY}/blob/main/README.md",
                    "Source": REPOSITORY, "Issues": f"{REPOSITORY}/issues"}


def test_readme_links_name_files_of_the_checkout_relative_to_it():
    # Read in the checkout (or its repository's page), the README links to the docs beside it;
    # tests/tooling/test_docs.py checks that each such file exists.
    text = (CHECKOUT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert "docs/design.md" in links
    for link in links:
        assert not link.startswith(REPOSITORY), f"README links to {link!r}: a file of this checkout, by URL"


def test_the_shape_defaults_to_the_backend_only_where_its_works_tell_the_truth_and_names_a_bad_value():
    assert config.shape(True, {}) == "backend" and config.shape(False, {}) == "process_group"
    # no torch release yet passes a Python Backend's Work state on (compat's gate)
    assert compat.BACKEND_SHAPE_BY_DEFAULT is False
    assert config.shape(compat.BACKEND_SHAPE_BY_DEFAULT, {}) == "process_group"
    assert config.shape(False, {"CUPYCOLL_SHAPE": " Backend "}) == "backend"
    assert config.shape(True, {"CUPYCOLL_SHAPE": "process_group"}) == "process_group"
    with pytest.raises(CupycollValueError, match="CUPYCOLL_SHAPE='c10d': expected one of process_group, backend"):
        config.shape(True, {"CUPYCOLL_SHAPE": "c10d"})


def test_the_backend_shape_on_a_torch_without_the_trampoline_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("CUPYCOLL_SHAPE", "backend")
    monkeypatch.setattr(compat, "PY_BACKEND", False)
    with pytest.raises(CupycollValueError, match=rf"needs torch 2.14 or later .*this is torch {re.escape(torch.__version__)}"):
        _registration._create(None, None)  # refused before the options are read
