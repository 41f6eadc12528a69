import pytest
import torch
from torch import nn

import loka


class Counting(nn.Module):
    """Two sites: ``a``, an ``nn.Linear`` (16 -> 16), then ``b``, a ``loka.Linear`` (16 -> 8)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = loka.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.fixture
def counting():
    """``counting()``: a fresh :class:`Counting` model (tests of the hooks and the report)."""
    return Counting
