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
# torchrec for the integration tests on a CPU build of torch: the torchrec / FBGEMM pair
# built for torch 2.13, FBGEMM's CPU wheel, installed without dependencies so that pip
# leaves torch alone (torchrec's own requirement is FBGEMM's CUDA wheel), then the rest of
# torchrec's dependencies (README, "Optional dependencies")
TORCHREC_CPU ?= torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
TORCHREC_DEPS ?= tensordict==0.15.3 torchmetrics==1.0.3 pyre-extensions lightning-utilities typing-inspect

.PHONY: setup demo test test-fast bench-cpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q $(TRITON)
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -c "import torchrec" 2>/dev/null || ! $(BIN)/python -c "import torch, sys; sys.exit(torch.version.cuda is not None)" || \
		($(BIN)/pip install -q --no-deps $(TORCHREC_CPU) && $(BIN)/pip install -q $(TORCHREC_DEPS))
	touch $(STAMP)

demo: setup
	$(BIN)/loka demo

# test files run in parallel, one worker per core up to four (pytest-xdist; a file's tests
# stay in one worker, so module fixtures are built once)
TEST_JOBS ?= $(shell $(PY) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(); print(max(1, min(4, n or 1)))")

test: setup
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow"

bench-cpu: setup
	$(BIN)/loka bench --device cpu --preset tiny

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
