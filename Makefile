# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.loka-installed
# A CPU build of torch lies on this machine kind's disk; install it first so that the
# `torch>=2.11` requirement does not pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
# Triton on a machine without a GPU still runs LoKA's kernels under its interpreter and
# compiles them for Hopper (tests/kernels/test_triton_aot.py): the version the GPU machine
# has, installed only where no Triton is importable (a CUDA torch brings its own).
TRITON ?= triton==3.6.0

.PHONY: setup demo test test-fast bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q $(TRITON)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/loka demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow"

bench-cpu: setup
	$(BIN)/loka bench --device cpu --preset tiny

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
