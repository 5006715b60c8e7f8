"""The torch that ``make install`` (and so ``make test``) installs into a venv that has
none: one line saying which torch, from where and why, then ``pip install`` of it.

The Makefile passes TORCH_SPEC and TORCH_INDEX and says which of them kept the Makefile's
default. Values a user or CI set are used as they are, unprobed. TORCH_INDEX's default,
torch's CPU wheel index on a machine without nvidia-smi, is first asked once, for at most
PROBE_TIMEOUT_S: pip handed an index it cannot reach retries every request to it for
minutes, then goes on without it and takes PyPI's newest torch, a CUDA build no CI leg
runs. So an index that does not answer is left out, and TORCH_SPEC's default becomes
``torch==FALLBACK_TORCH``, the torch of CI leg FALLBACK_LEG (tests/tooling/test_ci_matrix.py checks
that the two agree).

    python tools/install_torch.py --spec SPEC --index URL [--spec-is-default]
                                  [--index-is-default] [--dry-run]

``--dry-run`` prints the pip command instead of running it. The exit status is pip's.
Standard library only: it runs in the new venv before anything is installed there.

Left out: the CUDA extra (the Makefile picks it from the torch installed), and pip's own
configuration (its indexes, proxies and retries apply as they are).
"""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from typing import List, Optional, Tuple

PROBE_TIMEOUT_S = 5.0
FALLBACK_LEG = "today"
FALLBACK_TORCH = "2.13.0"


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None where ``url`` answers one HEAD request within ``timeout`` seconds; else why not.
    A status of 500 or more is no answer: pip retries those too. The request runs on a
    thread of its own, joined for ``timeout``: a name lookup is not bound by the socket's
    timeout, and a stuck one is what an offline machine's resolver does."""
    outcome: List[Optional[str]] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
                outcome.append(None)
        except urllib.error.HTTPError as exc:
            outcome.append(None if exc.code < 500 else f"HTTP {exc.code}")
        except urllib.error.URLError as exc:
            timed_out = isinstance(exc.reason, socket.timeout)
            outcome.append(f"no answer within {timeout:g} s" if timed_out else str(exc.reason))
        except socket.timeout:
            outcome.append(f"no answer within {timeout:g} s")
        except Exception as exc:  # noqa: BLE001 - whatever stops the request, pip would meet it too
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=ask, name="torch-index-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"no answer within {timeout:g} s"


def plan(spec: str, index: str, spec_is_default: bool, index_is_default: bool,
         timeout: float = PROBE_TIMEOUT_S) -> Tuple[List[str], str]:
    """pip's arguments after ``install``, and the line that says what they install and why."""
    if index and index_is_default:
        why_not = probe(index, timeout)
        if why_not is None:
            return (["--extra-index-url", index, spec],
                    f"installing {spec}, the CPU build from torch's wheel index {index} (no nvidia-smi on "
                    "this machine: about 200 MB against 5 GB for PyPI's CUDA build; TORCH_INDEX= turns it off)")
        if spec_is_default:
            spec = f"torch=={FALLBACK_TORCH}"
            what = f"{spec}, the torch of CI leg {FALLBACK_LEG!r},"
        else:
            what = spec
        return ([spec], f"torch's CPU wheel index {index} did not answer ({why_not}): installing {what} from "
                        "pip's own indexes (on PyPI a CUDA build, about 5 GB; set TORCH_SPEC or TORCH_INDEX for "
                        "another)")
    if index:
        return (["--extra-index-url", index, spec], f"installing {spec} with the extra index {index} (TORCH_INDEX)")
    why = "TORCH_INDEX is empty" if not index_is_default else "nvidia-smi found: PyPI's CUDA build"
    return ([spec], f"installing {spec} from pip's own indexes ({why})")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/install_torch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="the torch requirement (TORCH_SPEC)")
    parser.add_argument("--index", default="", help="an extra index for pip (TORCH_INDEX); empty: none")
    parser.add_argument("--spec-is-default", action="store_true", help="TORCH_SPEC is the Makefile's default")
    parser.add_argument("--index-is-default", action="store_true",
                        help="TORCH_INDEX is the Makefile's default: probe it, leave it out if it does not answer")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command instead of running it")
    args = parser.parse_args(argv)
    pip_args, line = plan(args.spec, args.index, args.spec_is_default, args.index_is_default)
    print(f"cupycoll: {line}", flush=True)
    # pip's own progress shows: the download is about 200 MB (CPU build) to 5 GB (CUDA build)
    command = [sys.executable, "-m", "pip", "install", *pip_args]
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
