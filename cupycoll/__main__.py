"""``python -m cupycoll``: the package's version (``--version``) and where its commands are.

cupycoll is used through ``torch.distributed`` (README); its commands are
``python -m cupycoll.trace`` and ``cupycoll-bench``. Left out: anything that starts a group.
"""

import argparse
import sys

from ._version import __version__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupycoll",
        description='A torch.distributed backend: dist.init_process_group("cpu:gloo,cuda:cupycoll") '
                    "after `import cupycoll`. Commands: `python -m cupycoll.trace DIR` (compare the "
                    "ranks' flight-recorder dumps), `cupycoll-bench` (benchmarks; `python -m bench` "
                    "in a checkout).")
    parser.add_argument("--version", action="version", version=f"cupycoll {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
