# The two commands the README promises:
#   make test   install what the CPU test suite needs (into .venv) and run it
#   make demo   DDP training on cupycoll on the GPUs present
# and, on a GPU machine:
#   make test-gpu   the GPU tier, with what is already installed (installs nothing)

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
CUDA_EXTRA  ?= cuda12
# CI pins the CPU build it has on disk; elsewhere any torch >= 2.4 already installed is kept.
TORCH_SPEC  ?= torch>=2.4
PYTEST_ARGS ?=

.PHONY: install test test-gpu demo bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	@# An existing CuPy (e.g. cupy-cuda13x on a GPU machine) is kept: no second CuPy on top.
	if $(PY) -c "import cupy" 2>/dev/null; then \
		$(PY) -m pip install --quiet -e ".[test]"; \
	else \
		$(PY) -m pip install --quiet -e ".[test,$(CUDA_EXTRA)]"; \
	fi
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -m gpu -rs $(PYTEST_ARGS)

demo:
	PYTHONPATH=$(CURDIR) $(PYTHON) examples/demo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
