"""tools/install_torch.py: which torch ``make install`` installs, from where, and the one
line that says so, against real local endpoints (a closed port, a socket that never
answers, small HTTP servers). pip itself is not run: ``--dry-run`` prints its command.
"""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import install_torch  # noqa: E402
from tools.install_torch import FALLBACK_TORCH, plan  # noqa: E402

pytestmark = pytest.mark.any_stack  # its subject is the same on every stack: one CI leg runs it

DEFAULT_SPEC = "torch>=2.7.1"


@pytest.fixture(autouse=True)
def no_proxy_for_this_machine(monkeypatch):
    # the probe honours proxy settings, as pip does; the local endpoints are reached directly
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "127.0.0.1")


@pytest.fixture
def closed_url():
    """An index on a port nothing listens on: refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


@pytest.fixture
def silent_url():
    """An index that takes the connection and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"


def _server(status):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def answering_url():
    server = _server(200)
    yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    server.shutdown()


def test_an_index_that_answers_is_used(answering_url):
    args, line = plan(DEFAULT_SPEC, answering_url, spec_is_default=True, index_is_default=True)
    assert args == ["--extra-index-url", answering_url, DEFAULT_SPEC]
    assert f"installing {DEFAULT_SPEC}, the CPU build from torch's wheel index {answering_url}" in line


def test_an_unreachable_index_is_left_out_for_a_ci_legs_torch(closed_url):
    args, line = plan(DEFAULT_SPEC, closed_url, spec_is_default=True, index_is_default=True)
    assert args == [f"torch=={FALLBACK_TORCH}"]
    assert line.startswith(f"torch's CPU wheel index {closed_url} did not answer (")
    assert f"installing torch=={FALLBACK_TORCH}, the torch of CI leg 'today'," in line


def test_an_index_that_does_not_answer_in_time_is_left_out(silent_url):
    start = time.monotonic()
    args, line = plan(DEFAULT_SPEC, silent_url, spec_is_default=True, index_is_default=True, timeout=0.5)
    assert time.monotonic() - start < 3
    assert args == [f"torch=={FALLBACK_TORCH}"]
    assert "did not answer (no answer within 0.5 s)" in line


def test_a_server_error_is_no_answer():
    server = _server(503)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        assert install_torch.probe(url) == "HTTP 503"
    finally:
        server.shutdown()
    server = _server(404)  # an answer: pip finds no torch there and goes on without retrying
    try:
        assert install_torch.probe(f"http://127.0.0.1:{server.server_address[1]}/whl/cpu") is None
    finally:
        server.shutdown()


def test_a_torch_spec_that_was_set_is_kept_when_the_index_is_left_out(closed_url):
    args, line = plan("torch==2.11.0", closed_url, spec_is_default=False, index_is_default=True)
    assert args == ["torch==2.11.0"]
    assert "installing torch==2.11.0 from pip's own indexes" in line


def test_an_index_that_was_set_is_used_unprobed(closed_url):
    args, line = plan("torch==2.7.1", closed_url, spec_is_default=False, index_is_default=False)
    assert args == ["--extra-index-url", closed_url, "torch==2.7.1"]
    assert "did not answer" not in line


def test_an_empty_index_that_was_set_installs_the_spec_as_given():
    # CI's legs: TORCH_INDEX= TORCH_SPEC=torch==X
    args, line = plan("torch==2.7.1", "", spec_is_default=False, index_is_default=False)
    assert args == ["torch==2.7.1"]
    assert line == "installing torch==2.7.1 from pip's own indexes (TORCH_INDEX is empty)"
    # the default on a machine with nvidia-smi is empty too, for another reason
    assert plan(DEFAULT_SPEC, "", True, True)[1].endswith("(nvidia-smi found: PyPI's CUDA build)")


def test_the_script_prints_one_line_then_pip_runs_without_the_unreachable_index(closed_url):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "install_torch.py"), "--spec", DEFAULT_SPEC,
                           "--index", closed_url, "--spec-is-default", "--index-is-default", "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    said, command = proc.stdout.splitlines()
    assert said.startswith("cupycoll: torch's CPU wheel index") and f"torch=={FALLBACK_TORCH}" in said
    assert command.endswith(f"-m pip install torch=={FALLBACK_TORCH}")  # not --quiet: its progress shows
    assert proc.stderr == ""
