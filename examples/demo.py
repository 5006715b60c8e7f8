"""What ``make demo`` runs: examples/train_ddp.py on every GPU here, checked against nccl.

With one GPU, two ranks share it; with N >= 2 GPUs, one rank per GPU. Each run trains the
same model twice, on cupycoll and then on torch's own nccl backend, and fails if the final
parameters differ. Extra arguments go to train_ddp.py, e.g. ``--steps 200 --optimizer adam``;
``--help`` prints this usage and starts nothing. Without torch or without a GPU it says what
to install (the extra of the installed torch's CUDA major) and exits 1, with no traceback.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("cuda12", "cuda13")  # pyproject.toml's extras, one per CUDA major


def parse_args(argv: List[str]) -> List[str]:
    """The arguments for train_ddp.py; ``--help`` prints the usage and exits 0 here."""
    parser = argparse.ArgumentParser(
        prog="examples/demo.py", allow_abbrev=False,  # a prefix of --help may be train_ddp's
        description="DDP training on cupycoll on the GPUs present (one GPU: 2 ranks share it), "
                    "then the same steps on torch's nccl backend; fails if the parameters differ.",
        epilog="Other arguments go to examples/train_ddp.py (its --help lists them), "
               "e.g. --steps 200 --optimizer adam.")
    return parser.parse_known_args(argv)[1]


def install_hint(torch_cuda: Optional[str]) -> str:
    """What the demo still needs, for a torch built for CUDA ``torch_cuda`` (None: a CPU
    build): CuPy and NCCL through the extra of that CUDA major, as ``make install`` picks."""
    if torch_cuda is None:
        return ("a CUDA build of torch, then CuPy and NCCL for its CUDA major: "
                "pip install -e '.[cuda12]' (CUDA 12) or -e '.[cuda13]' (CUDA 13)")
    extra = "cuda" + torch_cuda.split(".")[0]
    if extra not in EXTRAS:
        return (f"a torch built for CUDA 12 or 13 (this one is CUDA {torch_cuda}), then CuPy and "
                f"NCCL for it: pip install -e '.[cuda12]' or -e '.[cuda13]'")
    return f"CuPy and NCCL for this torch's CUDA {torch_cuda}: pip install -e '.[{extra}]'"


def main(argv: Optional[List[str]] = None) -> int:
    passed = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError:  # a new shell without the venv, or a machine without torch
        print(f"make demo needs torch, CuPy and NCCL, and {sys.executable} has no torch.\n"
              "Install them with `make install` (a .venv that make demo then uses), or "
              "pip install -e '.[cuda12]' (or '.[cuda13]': the CUDA major of your torch build).",
              file=sys.stderr)
        return 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU")
        print(f"make demo needs an NVIDIA GPU, and found none ({why}; torch {torch.__version__}).\n"
              f"Besides a GPU it needs {install_hint(torch.version.cuda)}.\n"
              f"Without a GPU, the CPU variant: {shlex.quote(sys.executable)} -m torch.distributed.run "
              "--standalone --nproc-per-node 2 examples/train_ddp.py --device cpu --compare gloo",
              file=sys.stderr)
        return 1
    if gpus == 1:
        ranks, extra = 2, ["--share-gpu"]
        print("1 GPU: 2 ranks share it (each rank gets its own NCCL_HOSTID, so NCCL treats "
              "them as two hosts and connects them over sockets on lo)")
    else:
        ranks, extra = gpus, []
        print(f"{gpus} GPUs: one rank per GPU")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), str(ROOT / "examples" / "train_ddp.py"),
               *extra, "--compare", "nccl", *passed]
    print("+", shlex.join(command), flush=True)
    # So that the demo also runs from a checkout that was not pip-installed.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    returncode = subprocess.call(command, env=dict(os.environ, PYTHONPATH=pythonpath))
    return returncode if returncode >= 0 else 128 - returncode  # killed by a signal


if __name__ == "__main__":
    sys.exit(main())
