"""Hard Swish in place of Swish/SiLU: ``x * relu6(x + 3) / 6``, piecewise polynomial, so it
fuses into a GEMM epilogue without a transcendental, and it is exactly linear for x > 3."""

from __future__ import annotations

from typing import List, Tuple

import torch.nn as nn

from ._swap import ModuleChange, swap_modules

HardSwish = nn.Hardswish
"""The paper's name for ``torch.nn.Hardswish``."""


def swap_activations(model: nn.Module) -> Tuple[List[ModuleChange], List[Tuple[str, str]]]:
    """Replace every ``nn.SiLU`` (Swish) by ``nn.Hardswish``, in place."""
    return swap_modules(model, lambda m: isinstance(m, nn.SiLU), lambda m: nn.Hardswish())
