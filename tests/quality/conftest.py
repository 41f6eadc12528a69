import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this folder runs with one intra-op thread (tests/conftest.py)."""
