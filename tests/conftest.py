import os

import pytest
import torch

# Deterministic, small thread count: CI has 2 cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
