"""The calls the Probe times under ``torch.compile``, shared by its timer
(:mod:`loka.probe.measure`) and the processes that compile them ahead
(:mod:`loka.probe.precompile`), so that both compile the very same graphs."""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from ..config import Role
from ..kernels.registry import Kernel

__all__ = ["COMPILE_ENTRIES", "compiled_call", "linear_dims", "one_line"]

COMPILE_ENTRIES = 256
"""Dynamo's recompile limit while the Probe times compiled kernels"""


def compiled_call(kern: Kernel, dtype: torch.dtype) -> Callable:
    """``call(a, b)``: the kernel under ``torch.compile``, as it runs inside a compiled
    model, where Inductor fuses its PyTorch quantization; one compiled function, specialized
    to each shape as a compiled model is: compiled once with dynamic shapes, the same
    kernels time far slower (Inductor's dynamic-shape code for their quantization passes;
    the Probe reports in bench/results/archive/2026-12-03-h200-wukong/ and
    bench/results/archive/2026-12-03-h200-wukong-merge/ compare the two)."""
    compiled = torch.compile(lambda a, b: kern(a, b, dtype), dynamic=False)

    def call(a, b):
        # one code object serves every shape, role layout and weight-q variant: each is a
        # guarded entry of its own, more than Dynamo's default limit
        with torch._dynamo.config.patch(recompile_limit=COMPILE_ENTRIES):
            return compiled(a, b)
    return call


def linear_dims(role: Role, shape: Tuple[int, int, int]) -> Tuple[int, int, int]:
    """(M, in_features, out_features) of the Linear whose ``role`` GEMM is ``shape``
    (the inverse of :func:`~loka.config.role_shape`)."""
    a, b, c = shape
    return {Role.FWD: (a, b, c), Role.DGRAD: (a, c, b), Role.WGRAD: (b, c, a)}[role]


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters of it): how the timer
    and the compiling children record a call that failed."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
