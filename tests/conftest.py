import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Deterministic, small thread count: CI has 2 cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Tests check numerics, not speed: on a GPU, LoKA's Triton kernels run their first surviving
# config instead of autotuning every shape (minutes over the kernel tests)
os.environ.setdefault("LOKA_TRITON_AUTOTUNE", "0")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the folders' conftest.py files and test_train.py
    ask for it): the CI box has 2 shared cores, and one thread avoids oversubscription
    stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def run_under_interpreter():
    """``run(test_file, select, min_passed)``: run the tests of ``test_file`` chosen by
    ``-k select`` in a fresh process under Triton's CPU interpreter (which Triton picks when
    it is first imported), and check that they pass, at least ``min_passed`` of them."""

    def run(test_file: str, select: str, min_passed: int) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
             "-k", select], cwd=ROOT,
            env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert int(re.search(r"(\d+) passed", out).group(1)) >= min_passed, out[-2000:]

    return run
