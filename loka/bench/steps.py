"""The timed callables of a benchmark row: one full training step (forward, BCE loss,
backward, optimizer) or one inference forward, compiled as the run says and, with
``+graphs`` on CUDA, captured whole in one CUDA graph; and the peak memory they report."""

from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch
from torch import nn

from ..data.batch import Batch
from ..timing import CapturedStep
from ..train import loss_fn
from .config import BenchConfig

__all__ = ["GraphedStep", "GraphedForward", "make_step", "make_forward", "make_optimizer",
           "peak_memory_gb", "capture_peak", "release_memory"]


def make_optimizer(model: nn.Module, device: torch.device, capturable: bool) -> torch.optim.Optimizer:
    """AdamW (lr 1e-3; fused on CUDA, and capturable for a graphed step)."""
    kw = {"lr": 1e-3}
    if device.type == "cuda":
        kw["fused"] = True
        if capturable:
            kw["capturable"] = True
    return torch.optim.AdamW(model.parameters(), **kw)


def maybe_compile(model: nn.Module, cfg: BenchConfig):
    return torch.compile(model) if cfg.compile else model


def release_memory(device: torch.device) -> None:
    """Frees what finished work left: reference cycles (hooks, optimizers, compiled
    callables) and, on CUDA, the allocator's cache and cuBLAS's workspaces, one per stream
    it ran on (side streams of graph captures and timings), so that none of it counts in
    the next row's peak."""
    gc.collect()
    if device.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def capture_peak(owner):
    """Records in ``owner.capture_peak_bytes`` the allocator's peak while a CUDA graph is
    captured. A replay reuses the graph's private pool without the caching allocator seeing
    it, so the peak of replayed steps counts only what stays allocated between steps
    (weights, optimizer state, static outputs), not the activations of a step; the peak of
    the capture does count them (one step's allocations, made through the allocator)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        owner.capture_peak_bytes = torch.cuda.max_memory_allocated()


def peak_memory_gb(peak_bytes: int, step=None) -> float:
    """Peak GPU memory of a benchmarked step in GiB: ``peak_bytes`` (the allocator's peak
    since the last reset) or, for a step replayed from a CUDA graph, the larger of that and
    the peak while the graph was captured (see :func:`capture_peak`)."""
    return max(int(peak_bytes), int(getattr(step, "capture_peak_bytes", 0))) / 2 ** 30


class _Captured(CapturedStep):
    """A :class:`loka.timing.CapturedStep` of ``step`` on ``model``'s device, captured at
    once, its peak recorded (:func:`capture_peak`)."""

    def __init__(self, step, model, warmup: int):
        super().__init__(step, next(model.parameters()).device, warmup)
        self.warm_up()
        with capture_peak(self):  # one step's allocations, through the allocator
            self.record()


class GraphedStep(_Captured):
    """A whole training step (forward, loss, backward, optimizer) captured in one CUDA
    graph: the step never waits on the host. The batch is captured as it is; the optimizer
    must be capturable."""

    def __init__(self, model, opt, batch, warmup: int = 3):
        def step():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            opt.step()
            return loss
        super().__init__(step, model, warmup)


class GraphedForward(_Captured):
    """An inference forward (under ``torch.inference_mode``) captured in one CUDA graph."""

    def __init__(self, model, batch, warmup: int = 3):
        def forward():
            with torch.inference_mode():
                return model(batch)
        super().__init__(forward, model, warmup)


def make_step(model: nn.Module, batch: Batch, cfg: BenchConfig, device: torch.device,
              graphs: bool) -> Callable[[], object]:
    """One full training step of ``model`` as the benchmark runs it (compiled unless
    ``cfg.compile`` is off; on CUDA with ``graphs``, captured in one CUDA graph)."""
    compiled = maybe_compile(model, cfg)
    opt = make_optimizer(model, device, capturable=graphs)
    if graphs:
        return GraphedStep(compiled, opt, batch)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(compiled, batch)
        loss.backward()
        opt.step()
        return loss
    return step


def make_forward(model: nn.Module, batch: Batch, cfg: BenchConfig, device: torch.device,
                 graphs: bool) -> Callable[[], object]:
    """One inference forward as the benchmark runs it (compiled unless ``cfg.compile`` is
    off; on CUDA with ``graphs``, captured in one CUDA graph)."""
    compiled = maybe_compile(model, cfg)
    if graphs:
        return GraphedForward(compiled, batch)

    def step():
        with torch.inference_mode():
            return compiled(batch)
    return step
