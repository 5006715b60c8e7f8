"""What ``make demo`` runs: examples/train_ddp.py on every GPU here, checked against nccl.

With one GPU, two ranks share it; with N >= 2 GPUs, one rank per GPU. Each run trains the
same model twice, on cupycoll and then on torch's own nccl backend, and fails if the final
parameters differ. Extra arguments go to train_ddp.py, e.g. ``--steps 200 --optimizer adam``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

try:
    import torch
except ImportError:  # a new shell without the venv, or a machine without torch
    print(f"make demo needs torch, CuPy and NCCL, and {sys.executable} has no torch.\n"
          "Install them with `make install` (a .venv that make demo then uses), or "
          "pip install -e '.[cuda12]' (or '.[cuda13]': the CUDA major of your torch build).",
          file=sys.stderr)
    sys.exit(1)


def main() -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else "torch sees no CUDA GPU")
        print(f"make demo needs an NVIDIA GPU, and found none ({why}; torch {torch.__version__}).\n"
              "It needs a CUDA-enabled torch, CuPy and NCCL: pip install -e '.[cuda12]' "
              "(or '.[cuda13]' for CUDA 13).\n"
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
               *extra, "--compare", "nccl", *sys.argv[1:]]
    print("+", shlex.join(command), flush=True)
    # So that the demo also runs from a checkout that was not pip-installed.
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    returncode = subprocess.call(command, env=dict(os.environ, PYTHONPATH=pythonpath))
    return returncode if returncode >= 0 else 128 - returncode  # killed by a signal


if __name__ == "__main__":
    sys.exit(main())
