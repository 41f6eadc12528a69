"""Whole-step timing for :func:`~loka.dispatch.optimize.optimize`: the default timer
(:func:`step_timer`, compiled steps under the caller's Inductor options, back to back or each
from an idle GPU), the check of those options, and the wrapper that keeps what the timer
reported of the steps without FP8 (the host's time, the step from an idle GPU)."""

from __future__ import annotations

import contextlib
import gc
import json
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..timing import time_steps
from .linear import Linear

__all__ = ["step_timer", "check_compile_options"]


def _fp8_linears(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if isinstance(m, Linear) and not m._all_baseline)


def check_compile_options(options: Optional[Mapping[str, object]],
                          compile: bool = True) -> Dict[str, object]:
    """``options`` checked as ``torch._inductor.config`` settings (e.g. ``{"cpp_wrapper":
    True}``, ``{"triton.cudagraphs": False}``) for steps timed compiled (``compile``): a
    dict of them, empty for None; ValueError naming the first key that is not one of its
    options (the module's other attributes, ``os`` or ``patch``, are not), or where
    ``compile`` is False and there are options."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"compile_options must map option names to values, got "
                         f"{type(options).__name__}")
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    for key in options:
        if not isinstance(key, str) or key not in known:
            raise ValueError(f"compile_options: {key!r} is not an option of "
                             "torch._inductor.config")
    if options and not compile:
        raise ValueError("compile_options set options of compiled steps: compile=False "
                         "times eager ones")
    return dict(options)


def _inductor_patch(options: Mapping[str, object]):
    """``torch._inductor.config.patch(options)``; a context that changes nothing without
    options (Inductor's config is then not even imported)."""
    if not options:
        return contextlib.nullcontext()
    from torch._inductor import config as inductor_config
    return inductor_config.patch(options)


def _recorded(options: Mapping[str, object]) -> Dict[str, object]:
    """``options`` as a plan records them: JSON values as they are, others (a custom pass)
    by their ``repr``."""
    out = {}
    for key, value in options.items():
        try:
            json.dumps(value, allow_nan=False)
            out[key] = value
        except (TypeError, ValueError):
            out[key] = repr(value)
    return out


def step_timer(batch, loss_fn: Optional[Callable[[nn.Module, object], torch.Tensor]] = None, *,
               inference: bool = False,
               forward: Optional[Callable[[nn.Module, object], object]] = None,
               compile: bool = True,
               compile_mode: Optional[str] = None, steps: int = 10, warmup: int = 3,
               device: "torch.device | str | None" = None,
               compile_options: Optional[Mapping[str, object]] = None,
               synchronized: bool = False) -> Callable[[nn.Module], float]:
    """A ``time_step(model) -> median ms`` for whole-step tuning; after each call
    ``time_step.last`` holds that timing's ``median_ms``, ``host_ms`` (the host's time to
    issue one step, :func:`loka.timing.time_steps`), ``synchronized_ms`` (a few steps each
    from an idle device), ``device`` and ``synchronized``.

    Each call compiles the model afresh (``torch.compile``, ``compile_mode`` e.g.
    ``"reduce-overhead"`` for CUDA graphs, ``compile_options`` Inductor settings for its
    compiles, e.g. ``{"cpp_wrapper": True}``, whose launches cost the host less; Dynamo's
    caches are reset so that a model whose Linears were swapped compiles as it now is),
    runs ``warmup`` steps, then times ``steps`` steps with :func:`loka.timing.time_steps`,
    back to back, or each from an idle GPU with ``synchronized`` (as a caller that waits for
    each result). A training step is the forward, ``loss_fn(model, batch)`` and the
    backward, gradients dropped; the weights are not changed. Serving (``inference``) times
    ``forward(model, batch)`` (default ``model(batch)``) under ``torch.no_grad``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"step_timer needs steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    if not inference and loss_fn is None:
        raise ValueError("step_timer needs a loss_fn to time training steps")
    options = check_compile_options(compile_options, compile)

    def timed(model: nn.Module) -> float:
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        torch._dynamo.reset()
        run = torch.compile(model, mode=compile_mode) if compile else model
        if inference:
            def step():
                with torch.no_grad():
                    return run(batch) if forward is None else forward(run, batch)
        else:
            def step():
                loss = loss_fn(run, batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
        with _inductor_patch(options):  # read while the warm-up steps compile
            t = time_steps(step, dev, steps, warmup, host=True, synchronized=synchronized)
        time_step.last = {"median_ms": float(t["median_ms"]), "host_ms": float(t["host_ms"]),
                          "synchronized_ms": float(t["synchronized_ms"]),
                          "device": dev.type, "synchronized": bool(synchronized)}
        return float(t["median_ms"])

    def time_step(model: nn.Module) -> float:
        was_training = model.training
        model.train(not inference)
        try:
            return timed(model)
        finally:
            model.train(was_training)
            gc.collect()  # compiled callables sit in reference cycles: free this trial's graph
    time_step.last = None
    return time_step


def _recording(time_step: Callable[[nn.Module], float], seen: List[Tuple[float, float]]):
    """``time_step``, keeping (host ms, step ms) of each timing of the model without FP8
    on a GPU that the timer reports (``time_step.last``)."""
    def timed(model: nn.Module) -> float:
        ms = time_step(model)
        last = timed.last = getattr(time_step, "last", None)
        if (isinstance(last, dict) and last.get("device") == "cuda"
                and last.get("host_ms") is not None and not _fp8_linears(model)):
            seen.append((float(last["host_ms"]), float(ms)))
        return ms
    timed.last = None
    return timed


def _awaited_ms(time_step) -> Optional[float]:
    """The last timing's step from an idle GPU where the timer measured it beside steps
    issued back to back (``synchronized_ms`` of a CUDA timing that was not synchronized)."""
    last = getattr(time_step, "last", None)
    if (isinstance(last, dict) and last.get("device") == "cuda"
            and not last.get("synchronized") and last.get("synchronized_ms") is not None):
        return float(last["synchronized_ms"])
    return None
