"""``python -m cupycoll.trace DIR``: see :mod:`cupycoll.trace.analyze`."""

import sys

from .analyze import main

sys.exit(main())
