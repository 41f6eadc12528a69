"""Helpers several test files share."""

import functools
import re
from typing import List, Tuple

import pytest
import torch

from loka.kernels import registry


def need_kernel(name: str, device: str = "cpu") -> None:
    """Skip the calling test where kernel ``name`` cannot run on ``device``, with the
    registry's reason: e.g. the rowwise ``cublas-*`` kernels on the CPU of a torch build
    whose CPU ``_scaled_mm`` takes per-tensor scales only (torch 2.11's)."""
    ok = registry.get(name).device_ok(device)
    if not ok:
        pytest.skip(f"{name} on {device}: {ok.reason}")


class LinearChain(torch.nn.Module):
    """n Linears (64 -> 64, no bias) of the user's own stacking, each followed by its own
    activation: the smallest model whose compiled step has one site per Linear."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def guard_leaves(model: torch.nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """Compile ``model``, call it once without gradients, and count the leaves of its one
    cached frame's guard tree and its Python-level (LAMBDA) guards."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model)(x)
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    assert len(entries) == 1
    text = str(entries[0].guard_manager)
    leaves = [ln for ln in text.splitlines()
              if re.search(r"\+- [A-Z_]+:", ln) and "GuardManager" not in ln]
    return len(leaves), text.count("LAMBDA_GUARD")


def spy_function_calls(monkeypatch) -> List[int]:
    """A list that grows by one at every call of loka.Linear's autograd Function."""
    from loka.dispatch import linear as L
    calls: List[int] = []
    real = L._LinearFunction.apply

    def spy(*args):
        calls.append(1)
        return real(*args)
    monkeypatch.setattr(L._LinearFunction, "apply", spy)
    return calls


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_scales_operands() -> bool:
    """Whether this CPU build's ``torch._scaled_mm`` (oneDNN) applies the scales to the
    operands before it accumulates, as it does on CPUs with AMX, instead of to the float32
    accumulator as cuBLAS does: then +x and -x whose scaled products overflow float32 sum
    to inf - inf = NaN where cuBLAS gives 0. Third-party kernels (torchao's) inherit it.
    Asked once per process."""
    a = torch.tensor([[448.0, -448.0] * 8] * 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t().contiguous().t()
    out = torch._scaled_mm(a, b, scale_a=torch.tensor(1e36), scale_b=torch.tensor(1.0),
                           out_dtype=torch.float32)
    return bool(out.isnan().any())


def assert_finite_operands(kern, a: torch.Tensor, b: torch.Tensor) -> None:
    """The FP8 operands ``kern`` makes of ``a`` (M, K) and ``b`` (K, N) have finite,
    positive scales and no NaN."""
    for q in (kern.quantize_a(a), kern.quantize_b(b)):
        assert torch.isfinite(q.scale).all() and bool((q.scale > 0).all())
        assert not q.data.float().isnan().any()
