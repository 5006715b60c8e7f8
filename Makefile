# The commands (docs/development.md explains each and its variables):
#   make test         install what the CPU tier needs (into .venv) and run it
#   make test-quick   the same install, then a first check of a few tests (about a minute)
#   make demo         DDP training on cupycoll on the GPUs present
#   make bench        cupycoll-bench on the GPUs present, or on 2 CPU ranks without one
# and, on a GPU machine:
#   make test-gpu     the GPU tier, with what is already installed (installs nothing)

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# The python of the targets that install nothing (demo, test-gpu*, verify-gpu): the venv
# `make test` built when it exists, else the machine's (the GPU machine has no venv).
RUN_PY      ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
# The torch installed when the venv sees none (an installed torch >= 2.7.1 is kept). On a
# machine without an NVIDIA driver, TORCH_INDEX adds torch's CPU wheel index, so pip takes
# the CPU build (about 200 MB) over PyPI's CUDA build (about 5 GB); TORCH_INDEX= turns it off.
# tools/install_torch.py says in one line which torch it installs; it probes the default
# index first and, where it does not answer, leaves it out and installs the torch of a CI
# leg instead of the default TORCH_SPEC. Values the caller sets (command line, environment)
# are used as given.
TORCH_SPEC  ?= torch>=2.7.1
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
# cuda12 or cuda13. Empty: the CUDA major of the venv's torch build (cuda12 for a CPU
# build), so that torch, CuPy and NCCL agree.
CUDA_EXTRA  ?=
# More requirements installed with cupycoll, e.g. CI's oldest leg: "cupy-cuda12x==13.0.0".
PIP_PINS    ?=
PYTEST_ARGS ?=
# torchft for the tests of cupycoll.torchft (tests/test_torchft.py and the torchft example's;
# they skip without it), with the parameterized its own tests import: `make test` installs it
# into the venv where this names it (CI's today leg: .ci/run), e.g. TORCHFT_SPEC=torchft==0.2.0.
TORCHFT_SPEC ?=
TURN        := $(if $(shell command -v flock 2>/dev/null),flock pyproject.toml)
# Worker processes for the CPU tier (pytest-xdist; 0: in pytest's own process). A worker
# whose test waits on a timeout, a deadline or its rank processes leaves its core idle: with
# two on a 2-core machine the tier used about two thirds of both cores, so a third worker
# fills what they leave (the CI machine has 2 cores and allows 30 minutes at most).
# worksteal: a worker that runs out takes the other's queued tests, so a leg does not end on
# one busy worker.
TEST_WORKERS ?= 3
# Which tests `make test` runs (pytest -m). CI's legs but one add "and not any_stack": those
# tests' subject is the same on every stack (pyproject.toml's markers).
TEST_MARKS ?= not gpu
# The most seconds one CPU test may take (the slowest takes about 60 on a 2-core machine): a
# test past it fails with the stacks of every thread (pytest-timeout; faulthandler prints them
# 20 s earlier, also from a thread stuck in C), and the run goes on, instead of one hung test
# holding the whole run.
TEST_TIMEOUT ?= 300
# The venv sees the machine's packages (--system-site-packages), pytest plugins among them:
# autoloading is off, and the tier's two plugins are named (pytest-xdist, pytest-timeout).
PYTEST = PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PY) -m pytest -p xdist.plugin -p pytest_timeout \
	-n $(TEST_WORKERS) --dist worksteal --timeout $(TEST_TIMEOUT) -o faulthandler_timeout=$$(( $(TEST_TIMEOUT) - 20 ))
# make test-quick: registration and both routes' logic (the CUDA path on stand-ins), every
# collective on 2 CPU ranks against gloo, DDP on the CPU route against gloo. Test ids;
# tests/tooling/test_makefile.py checks that each still names a test.
QUICK_TESTS ?= tests/test_collectives.py \
	"tests/multiproc/test_multiprocess_cpu.py::test_all_apis_match_gloo[2-cuda:cupycoll]" \
	"tests/multiproc/test_examples.py::test_train_ddp_on_cpu_matches_gloo[cupycoll]"
# make bench: the benchmark's arguments (bench/README.md). Without nvidia-smi it runs on 2 CPU
# ranks over gloo (--device cpu, development mode: its figures say nothing of a GPU).
BENCH_ARGS  ?= all_reduce -b 1K -e 16M -f 4
BENCH_DEVICE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,--device cpu)

.PHONY: install test test-quick test-torch-suite test-gpu test-gpu-quick demo bench verify-gpu verify-gpu-lease clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) tools/install_torch.py --spec "$(TORCH_SPEC)" \
		--index "$(TORCH_INDEX)" $(if $(filter file,$(origin TORCH_SPEC)),--spec-is-default) \
		$(if $(filter file,$(origin TORCH_INDEX)),--index-is-default)
	@# An existing CuPy (e.g. cupy-cuda13x on a GPU machine) is kept: no second CuPy on top.
	@# The editable install writes cupycoll.egg-info into the checkout: two venvs installed
	@# at once from one checkout (CI builds two) take turns, holding a lock on pyproject.toml.
	@# pip shows its progress: the CUDA extra is about 1 GB (CuPy, NCCL, NVRTC).
	extra="$(CUDA_EXTRA)"; \
	[ -n "$$extra" ] || extra=$$($(PY) -c "import torch; print('cuda' + (torch.version.cuda or '12').split('.')[0])"); \
	if $(PY) -c "import cupy" 2>/dev/null; then extras="test"; else extras="test,$$extra"; fi; \
	$(TURN) $(PY) -m pip install -e ".[$$extras]" $(PIP_PINS)
	touch $@

install: $(VENV)/.installed

$(VENV)/.torchft: $(VENV)/.installed
	$(PY) -m pip install "$(TORCHFT_SPEC)" "parameterized==0.9.0"
	touch $@

test: $(VENV)/.installed $(if $(TORCHFT_SPEC),$(VENV)/.torchft)
	$(PYTEST) -m "$(TEST_MARKS)" $(PYTEST_ARGS)

test-quick: $(VENV)/.installed
	$(PYTEST) -m "$(TEST_MARKS)" $(QUICK_TESTS) $(PYTEST_ARGS)

# torch's whole DistributedTest suite against cupycoll's CPU route at world size 2 (about 280
# tests, each spawning its ranks: most of an hour on 2 cores); `make test` runs the part that
# tests/multiproc/test_torch_suite.py chooses. Under unittest, as torch runs it;
# TORCH_SUITE_ARGS: its arguments, e.g. "-k barrier" or "TestCupycollCpuRoute.test_barrier".
TORCH_SUITE_ARGS ?=
test-torch-suite: $(VENV)/.installed
	BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=$$(mktemp -d) PYTHONPATH=tests/workers:$(CURDIR) \
		$(PY) tests/workers/torch_suite.py $(TORCH_SUITE_ARGS)

# The GPU tier in parts (tests/gpu/tier.py): semantics, api, ring, faults, bench, in that
# order, each one pytest command with -x under its own time budget (<= 9 min); a failing part
# stops itself, not the tier. The budgets add up to more than one 540 s device command: --run
# starts a part only while its budget fits in what is left (tier.py --budget, default 540) and
# names each part it skipped (exit 3): run those with `make test-gpu-PART`, one per command.
# test-gpu-quick: semantics only; test-gpu-PART: one part.
test-gpu:
	PYTHONPATH=$(CURDIR) $(RUN_PY) tests/gpu/tier.py --run

test-gpu-quick:
	PYTHONPATH=$(CURDIR) $(RUN_PY) tests/gpu/tier.py --run semantics

test-gpu-%:
	PYTHONPATH=$(CURDIR) $(RUN_PY) tests/gpu/tier.py --run $*

demo:
	@PYTHONPATH=$(CURDIR) $(RUN_PY) examples/demo.py

bench:
	PYTHONPATH=$(CURDIR) $(RUN_PY) -m bench $(BENCH_DEVICE) $(BENCH_ARGS)

# The GPU proof (tools/verify_gpu.py): environment, GPU tier, demo, benchmarks, faults, each
# under its time limit, <= 9 min in all; results (<= 8 files) in verify-gpu-out/.
# VERIFY_ARGS="--quick" (<= 3 min), "--stage bench,faults", "--out DIR", "--list".
# verify-gpu-lease: the one command of a 15-minute GPU lease (<= 570 s; see
# docs/gpu-verification.md), e.g. VERIFY_ARGS="--out DIR".
VERIFY_ARGS ?=
verify-gpu:
	PYTHONPATH=$(CURDIR) $(RUN_PY) -m tools.verify_gpu $(VERIFY_ARGS)

verify-gpu-lease:
	PYTHONPATH=$(CURDIR) $(RUN_PY) -m tools.verify_gpu --lease $(VERIFY_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
