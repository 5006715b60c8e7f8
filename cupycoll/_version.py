"""The package version: the one place it is written.

pyproject.toml reads it (``[tool.setuptools.dynamic]``, statically, without importing the
package), ``cupycoll.__version__`` re-exports it and ``cupycoll-bench --version`` prints it.
"""

__version__ = "0.1.0"
