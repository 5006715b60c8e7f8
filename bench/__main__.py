"""Entry point: ``python -m bench`` in a checkout, ``cupycoll-bench`` once installed."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
