import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # the CI box has 2 shared cores: one intra-op thread avoids oversubscription stalls
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
