"""Whole-step timing for :func:`~loka.dispatch.optimize.optimize`: the default timer
(:func:`step_timer`, compiled steps under the caller's Inductor options, back to back or each
from an idle GPU), the check of those options, the wrapper that keeps what the timer
reported of the steps without FP8 (the host's time, the step from an idle GPU), and the
final A/B rounds' timing (:class:`PairedSteps`, a model and its planned copy alive together,
or rounds that apply and remove the plan)."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import statistics
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..timing import CapturedStep, time_steps
from .linear import Linear
from .schema import Plan
from .swap import apply, restore_on_exit, root_module, unapply

__all__ = ["step_timer", "check_compile_options", "PairedSteps"]


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


def check_capture(capture: bool, compile: bool, compile_mode: Optional[str],
                  options: Mapping[str, object]) -> bool:
    """Do the compiled steps use Inductor's CUDA graphs (``compile_mode`` "reduce-overhead"
    or "max-autotune", or the ``triton.cudagraphs`` option)? ValueError where ``capture``
    would put them inside a captured whole step."""
    trees = compile and (compile_mode in ("reduce-overhead", "max-autotune")
                         or bool(options.get("triton.cudagraphs")))
    if capture and trees:
        raise ValueError("capture takes each whole step in one CUDA graph of its own: compile "
                         "without Inductor's CUDA graphs (compile_mode None or "
                         "'max-autotune-no-cudagraphs', no triton.cudagraphs)")
    return trees


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
               synchronized: bool = False,
               capture: bool = False) -> Callable[[nn.Module], float]:
    """A ``time_step(model) -> median ms`` for whole-step tuning; after each call
    ``time_step.last`` holds that timing's ``median_ms``, ``host_ms`` (the host's time to
    issue one step, :func:`loka.timing.time_steps`), ``synchronized_ms`` (a few steps each
    from an idle device), ``device``, ``synchronized`` and ``captured``.

    Each call compiles the model afresh (``torch.compile``, ``compile_mode`` e.g.
    ``"reduce-overhead"`` for CUDA graphs, ``compile_options`` Inductor settings for its
    compiles, e.g. ``{"cpp_wrapper": True}``, whose launches cost the host less; Dynamo's
    caches are reset so that a model whose Linears were swapped compiles as it now is),
    runs ``warmup`` steps, then times ``steps`` steps with :func:`loka.timing.time_steps`,
    back to back, or each from an idle GPU with ``synchronized`` (as a caller that waits for
    each result). A training step is the forward, ``loss_fn(model, batch)`` and the
    backward, gradients dropped; the weights are not changed. Serving (``inference``) times
    ``forward(model, batch)`` (default ``model(batch)``) under ``torch.no_grad``. With
    ``capture`` (CUDA only) each step is captured whole in one CUDA graph after its warm-up
    and replayed (:class:`loka.timing.CapturedStep`), as a loop that captures its whole step
    runs it: the host's cost per step is one replay, whatever the plan adds to the compiled
    code (Inductor's own CUDA graphs, ``compile_mode="reduce-overhead"``, are then refused:
    a graph inside a graph).

    ``time_step.pair(baseline, planned)`` is a context that compiles both models' steps
    once, as above, and keeps them alive together: a :class:`PairedSteps` whose
    ``round(plan_first)`` times one right after the other (``loka.optimize``'s A/B rounds;
    with CUDA graphs each call marks a new step, as two graphed callables in turn need).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"step_timer needs steps >= 1 and warmup >= 0, got {steps}, {warmup}")
    if not inference and loss_fn is None:
        raise ValueError("step_timer needs a loss_fn to time training steps")
    options = check_compile_options(compile_options, compile)
    trees = check_capture(capture, compile, compile_mode, options)

    def make_step(model: nn.Module, run) -> Callable[[], object]:
        if inference:
            def step():
                with torch.no_grad():
                    return run(batch) if forward is None else forward(run, batch)
        else:
            def step():
                loss = loss_fn(run, batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
        step.model = model  # what it runs, for whoever times it
        if capture:
            return CapturedStep(step, dev_of(model), warmup=max(1, warmup))
        return step

    def dev_of(model: nn.Module) -> torch.device:
        return torch.device(device) if device is not None else next(model.parameters()).device

    def timed(model: nn.Module) -> float:
        dev = dev_of(model)
        torch._dynamo.reset()
        run = torch.compile(model, mode=compile_mode) if compile else model
        step = make_step(model, run)
        with _inductor_patch(options):  # read while the warm-up steps compile
            # (captured: the first call captures, never a timed one)
            t = time_steps(step, dev, steps, max(1, warmup) if capture else warmup,
                           host=True, synchronized=synchronized)
        time_step.last = {"median_ms": float(t["median_ms"]), "host_ms": float(t["host_ms"]),
                          "synchronized_ms": float(t["synchronized_ms"]),
                          "device": dev.type, "synchronized": bool(synchronized),
                          "captured": bool(capture)}
        return float(t["median_ms"])

    def time_step(model: nn.Module) -> float:
        was_training = model.training
        model.train(not inference)
        try:
            return timed(model)
        finally:
            model.train(was_training)
            gc.collect()  # compiled callables sit in reference cycles: free this trial's graph

    @contextlib.contextmanager
    def pair(baseline: nn.Module, planned: nn.Module) -> Iterator["PairedSteps"]:
        models = {"baseline": baseline, "plan": planned}
        modes = {k: m.training for k, m in models.items()}
        dev = dev_of(baseline)
        try:
            for m in models.values():
                m.train(not inference)
            torch._dynamo.reset()
            run = {k: make_step(m, torch.compile(m, mode=compile_mode) if compile else m)
                   for k, m in models.items()}
            if trees:  # two graphed callables in turn: each call starts a new step
                run = {k: _marked(s) for k, s in run.items()}
            yield PairedSteps(run, dev, steps, warmup, synchronized, options)
        finally:
            for k, m in models.items():
                m.train(modes[k])
            gc.collect()

    time_step.last = None
    time_step.pair = pair
    return time_step


def _marked(step: Callable[[], object]) -> Callable[[], object]:
    def marked():
        torch.compiler.cudagraph_mark_step_begin()
        return step()
    marked.model = step.model
    return marked


class PairedSteps:
    """The steps of two models, ``baseline`` and ``plan``, compiled once and alive together
    (``step_timer(...).pair(baseline, planned)``, a context), timed in rounds: each round
    times both, one block of steps right after the other, in the order asked. Timings of
    one model each after a compile of its own, seconds apart, move with the host (shared
    machines: a host-bound step's wall time moved by a quarter between rows of one run);
    two blocks timed back to back, each first in half the rounds, see nearly the same host.

    Both compile while the warm-up runs (:meth:`round` does it first if it was not), under
    the timer's Inductor options, with Dynamo's automatic dynamic shapes off: the second
    model compiles the same code again, and there it would otherwise mark dimensions
    dynamic that a model compiled alone keeps static."""

    def __init__(self, steps: Mapping[str, Callable[[], object]], device: torch.device,
                 timed_steps: int, warmup: int, synchronized: bool,
                 options: Mapping[str, object]):
        self.steps = dict(steps)
        self.device = device
        self.timed_steps = timed_steps
        self.warmup = warmup
        self.synchronized = synchronized
        self.options = dict(options)
        self.warm = False

    def _context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(_inductor_patch(self.options))
        stack.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
        return stack

    def warm_up(self) -> None:
        """The warm-up steps of both models (their compiles), baseline first."""
        with self._context():
            for name in ("baseline", "plan"):
                time_steps(self.steps[name], self.device, 1, max(1, self.warmup))
        self.warm = True

    def round(self, plan_first: bool = False) -> dict:
        """One round: ``{"baseline": ms, "plan": ms, "first": which was timed first,
        "baseline_host": ms, "plan_host": ms}`` (each the median of the timer's ``steps``
        after one untimed step; ``*_host`` the host's time to issue one, as
        ``step_timer(...).last["host_ms"]``); on a GPU timed back to back, also
        ``baseline_synchronized`` and ``plan_synchronized``, the steps from an idle GPU."""
        if not self.warm:
            self.warm_up()
        order = ("plan", "baseline") if plan_first else ("baseline", "plan")
        row: dict = {}
        with self._context():
            for name in order:
                t = time_steps(self.steps[name], self.device, self.timed_steps, 1, host=True,
                               synchronized=self.synchronized)
                row[name] = float(t["median_ms"])
                row[f"{name}_host"] = float(t["host_ms"])
                if self.device.type == "cuda" and not self.synchronized:
                    row[f"{name}_synchronized"] = float(t["synchronized_ms"])
        row["first"] = order[0]
        return row


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
    if getattr(time_step, "pair", None) is not None:  # the default timer's A/B pairs
        timed.pair = time_step.pair
    return timed


def _awaited_ms(time_step) -> Optional[float]:
    """The last timing's step from an idle GPU where the timer measured it beside steps
    issued back to back (``synchronized_ms`` of a CUDA timing that was not synchronized)."""
    last = getattr(time_step, "last", None)
    if (isinstance(last, dict) and last.get("device") == "cuda"
            and not last.get("synchronized") and last.get("synchronized_ms") is not None):
        return float(last["synchronized_ms"])
    return None


def _last_host_ms(time_step) -> Optional[float]:
    """The host's time to issue the last timing's step on a GPU, where the timer reported
    it (``time_step.last["host_ms"]``: the default timer's, a caller's that says so)."""
    last = getattr(time_step, "last", None)
    if isinstance(last, dict) and last.get("device") == "cuda" and _positive(
            last.get("host_ms")):
        return float(last["host_ms"])
    return None


def _ab_timer(model: nn.Module, plan: Plan, time_step: Callable[[nn.Module], float],
              inference: bool, stack: contextlib.ExitStack,
              seen: List[Tuple[float, float]]) -> Tuple[Callable[[int], dict], dict]:
    """``(round(i) -> {"baseline": ms, "plan": ms, ...}, how)``: the i-th A/B round, the plan
    timed first in odd rounds (a host that drifts one way during a round favours neither),
    and how the rounds are timed (``{"timing": "paired"}``, or ``"recompiled"`` and why).

    With a timer that pairs (the default timer's ``pair``) the model and a copy of it with
    the plan applied are compiled and warmed up once and kept alive in ``stack``: each round
    times the two steps one right after the other, not each after a compile of its own
    (:class:`PairedSteps`); on a GPU each round's baseline also goes to ``seen`` (host ms,
    step ms), as ``_recording`` keeps the timer's. Otherwise (a timer without ``pair``; a
    model that cannot be copied, is wrapped, or whose copy would take more than half the
    free GPU memory; a copy that failed to apply or compile) each round applies and
    removes the plan and times the model twice, each timing compiling afresh, and keeps
    each timing's host time where the timer reported it on a GPU (``time_step.last``).
    The model is left as it was."""
    root, _ = root_module(model)
    stack.enter_context(restore_on_exit(root))
    unapply(root)
    pair = getattr(time_step, "pair", None)
    why = "the timer does not pair (a time_step of the caller's)" if pair is None else None
    twin = None
    if why is None:
        twin, why = _twin(model, root)
    if twin is not None:
        inner = contextlib.ExitStack()
        try:
            apply(twin, plan, inference=inference)
            paired = inner.enter_context(pair(model, twin))
            inner.callback(paired.steps.clear)  # drops the copy before the pair's gc
            paired.warm_up()  # both compile here: a failure falls back
            stack.push(inner.pop_all())

            def paired_round(i: int) -> dict:
                row = paired.round(plan_first=i % 2 == 1)
                if paired.device.type == "cuda":
                    seen.append((row["baseline_host"], row["baseline"]))
                return row
            return paired_round, {"timing": "paired"}
        except Exception as e:  # noqa: BLE001 - time the rounds the other way
            why = f"pairing failed ({type(e).__name__}: {e})"[:300]
            inner.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def one(i: int) -> dict:
        order = ("plan", "baseline") if i % 2 == 1 else ("baseline", "plan")
        row: dict = {}
        for name in order:
            if name == "plan":
                apply(root, plan, inference=inference)
            row[name] = float(time_step(model))
            row[f"{name}_synchronized"] = _awaited_ms(time_step)
            row[f"{name}_host"] = _last_host_ms(time_step)
            unapply(root)
        for key in ("synchronized", "host"):  # both timings reported it, or neither kept
            if row[f"baseline_{key}"] is None or row[f"plan_{key}"] is None:
                del row[f"baseline_{key}"], row[f"plan_{key}"]
        row["first"] = order[0]
        return row
    return one, {"timing": "recompiled", "why": why}


def _twin(model: nn.Module, root: nn.Module) -> Tuple[Optional[nn.Module], Optional[str]]:
    """A copy of ``model`` (no plan applied) to time beside it, or None and why not."""
    if root is not model:
        return None, "the model is wrapped (compiled or distributed)"
    tensors = list(model.parameters()) + list(model.buffers())
    if tensors and tensors[0].device.type == "cuda":
        need = sum(t.numel() * t.element_size() for t in tensors)
        free, _ = torch.cuda.mem_get_info(tensors[0].device)
        if need > free // 2:
            return None, (f"a copy of the model ({need / 2**30:.1f} GiB) would take more "
                          f"than half the free GPU memory ({free / 2**30:.1f} GiB)")
    try:
        return copy.deepcopy(model), None
    except Exception as e:  # noqa: BLE001 - a model that cannot be copied
        return None, f"the model cannot be copied ({type(e).__name__}: {e})"[:300]


def _host_ms(rounds: List[dict]) -> Optional[Tuple[float, float]]:
    """The median host time to issue one step, (baseline, plan), over the A/B rounds that
    timed it (the default timer's paired rounds); None where none did."""
    pairs = [(r["baseline_host"], r["plan_host"]) for r in rounds
             if _positive(r.get("baseline_host")) and _positive(r.get("plan_host"))]
    if not pairs:
        return None
    return (float(statistics.median(b for b, _ in pairs)),
            float(statistics.median(p for _, p in pairs)))


HOST_ADDED_SHARE = 1.02
"""host time within this share of the baseline's is the rounds' noise: a plan must add more
before :func:`host_check` counts it, and before ``optimize`` notes it on a host-bound step"""


def check_host_slowdown(value, name: str = "host_slowdown") -> float:
    """``value`` as a host slowdown, a finite number >= 1 (not a bool); ValueError naming
    ``name`` otherwise. The one check of every entry point that takes one."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 1.0):
        raise ValueError(f"{name} must be a finite number >= 1.0, got {value!r}")
    return float(value)


def host_check(rounds: List[dict], slowdown: float,
               noise: float = HOST_ADDED_SHARE - 1.0) -> Optional[dict]:
    """Whether a plan that won its A/B rounds would still not be slower on a host
    ``slowdown`` times slower, under two models of how a step's time follows its host's
    (medians of the rounds: steps ``W``, host times ``H``, baseline ``b`` and plan ``p``;
    ``f`` the slowdown):

    - exposed: the host's time is all in the step (a host-bound step timed from an idle
      GPU), so a slower host adds ``(f - 1) H`` to each step: what the plan saves,
      ``gain_ms = W_b - W_p``, must be at least ``margin_ms = (f - 1) (H_p - H_b)``;
    - pipelined: steps issued back to back take the longer of the host's time and the
      step's, ``slow_host_ms = max(W, f H)`` for each: the plan's must be no longer.

    The plan passes only under both (a plan that adds no host time and won its rounds
    passes both). Host time added within ``noise`` of the baseline's (a share; default 2%,
    :data:`HOST_ADDED_SHARE`) counts as none: the rounds' host times vary that much from
    round to round, and two steps that a slow host sets the pace of would otherwise be told
    apart by it. None where the rounds did not time the host.

    Returns ``{"slowdown", "gain_ms", "host_added_ms", "margin_ms", "slow_host_ms":
    {"baseline", "plan"}, "passed"}``."""
    host = _host_ms(rounds)
    if host is None:
        return None
    f = float(slowdown)
    wb = statistics.median(r["baseline"] for r in rounds)
    wp = statistics.median(r["plan"] for r in rounds)
    base_host, plan_host = host
    added = plan_host - base_host
    if plan_host <= (1.0 + noise) * base_host:  # within the noise: none added
        plan_host = min(plan_host, base_host)
    margin = (f - 1.0) * max(plan_host - base_host, 0.0)
    slow = (max(wb, f * base_host), max(wp, f * plan_host))
    return {"slowdown": f, "gain_ms": float(wb - wp), "host_added_ms": float(added),
            "margin_ms": float(margin),
            "slow_host_ms": {"baseline": float(slow[0]), "plan": float(slow[1])},
            "passed": bool(wb - wp >= margin and slow[1] <= slow[0])}


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0
