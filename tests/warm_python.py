"""Scripts run in a Python of their own without paying its start each time: one Python per
test process imports torch, cupycoll and the fault stand-ins once (seconds on a busy CI
machine), then forks a child for each script. The child is the script's process: its
output goes to files of its own, the script runs as ``__main__``, and it ends as
``python -c`` would (an uncaught exception: traceback and exit 1; at the end of the script:
atexit handlers, then exit 0; ``os._exit`` and signals as they come). Each child is forked
from the same state, in which no group, thread or communicator was ever made, so no script
sees another's.

What it leaves out: a script that needs an interpreter whose imports have not run yet (the
cost of ``import cupycoll``, what importing it starts) must use ``python -c`` itself.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional

TESTS = str(Path(__file__).resolve().parent)

# The server: reads one request a line (script, its output files, environment, folder,
# seconds), forks, and answers the child's exit status (None: killed at its limit). A child
# leaves the loop and runs its script at the top level, where an uncaught exception ends
# the process as it ends ``python -c``.
_SERVER = r"""
import json, os, signal, sys, time
sys.path.insert(0, {tests!r})
import torch, cupycoll, standins, faulty  # noqa: F401 - what the scripts import, once
for line in sys.stdin:
    source, out, err, env, cwd, limit = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        break
    deadline = time.monotonic() + limit
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            answer = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            answer = None
            break
        time.sleep(0.005)
    print(json.dumps(answer), flush=True)
else:
    sys.exit(0)  # the test process closed the pipe
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(os.open(out, os.O_WRONLY), 1)
os.dup2(os.open(err, os.O_WRONLY), 2)
os.environ.clear()
os.environ.update(env)
os.chdir(cwd)
del line, pid
exec(compile(source, "<string>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""

_lock = threading.Lock()
_server: Optional[subprocess.Popen] = None
_server_log: Optional[str] = None


def _start() -> subprocess.Popen:
    global _server, _server_log
    if _server is None or _server.poll() is not None:
        fd, _server_log = tempfile.mkstemp(prefix="warm-python-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            _server = subprocess.Popen([sys.executable, "-c", _SERVER.format(tests=TESTS)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, text=True)
    return _server


def _stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        try:
            server.stdin.close()
            server.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            server.kill()
            server.wait()
        server.stdout.close()
    if _server_log is not None and os.path.exists(_server_log):
        os.unlink(_server_log)


atexit.register(_stop)


def run(script: str, timeout: float) -> subprocess.CompletedProcess:
    """``script`` in a fork of the warm Python, with this process's environment and folder;
    its output captured as ``subprocess.run(..., capture_output=True, text=True)`` captures
    it. Past ``timeout`` seconds the child is killed and subprocess.TimeoutExpired raised."""
    argv = [sys.executable, "-c", script]
    files = [tempfile.mkstemp(prefix="warm-python-", suffix=suffix) for suffix in (".out", ".err")]
    for fd, _path in files:
        os.close(fd)
    out, err = (path for _fd, path in files)
    try:
        with _lock:
            server = _start()
            try:
                server.stdin.write(json.dumps([script, out, err, dict(os.environ), os.getcwd(), timeout]) + "\n")
                server.stdin.flush()
                reply = server.stdout.readline()
            except BaseException:
                _stop()  # interrupted mid-script: the next script gets a fresh server
                raise
            if not reply:
                log = Path(_server_log).read_text(encoding="utf-8", errors="replace")
                _stop()
                raise RuntimeError(f"the warm Python ended before it answered:\n{log[-8000:]}")
        returncode = json.loads(reply)
        stdout, stderr = (Path(path).read_text(encoding="utf-8", errors="replace") for path in (out, err))
    finally:
        for path in (out, err):
            os.unlink(path)
    if returncode is None:
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
