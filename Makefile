# Two commands on a fresh machine: `make demo` and `make test`. Both create the
# virtualenv first. torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast bench plots clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[all]'
	touch $@

demo: setup
	$(BIN)/kvports compare

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

# docs/BENCH.md. On a machine shared with other work, OMP_NUM_THREADS=1 make bench.
bench: setup
	$(BIN)/kvports bench --preset seed

# The tables and the PNGs in docs/img, regenerated.
plots: setup
	$(BIN)/kvports bench --preset seed --new-tokens 500 --plot docs/img
	$(BIN)/kvports bench --preset gpt2-small --new-tokens 32 --plot docs/img

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
