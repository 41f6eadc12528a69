"""One call from a model to a plan that never slows its step: Probe, plan, whole-step check.

:func:`optimize` runs the Probe over the caller's batches, plans under the error budget,
then lets whole steps decide, as the model will run (compiled, optionally in CUDA graphs):
:func:`~loka.dispatch.tune.tune_speed` moves FP8 sites back to the baseline while that
makes the step faster, and a last A/B comparison, baseline and plan timed in turn (each
first in half the rounds; with the default timer both compiled once and alive together),
keeps the plan only if its step is faster than the step without it in every round, or, where
one round of a noisy host went the other way, in enough extra rounds to pass a sign test at
the level of winning them all (:func:`ab_verdict`). So the plan it returns is never slower
than not applying one, as far as the timer can tell: a plan that does not win its rounds
goes back to the baseline whole. The rounds are timed, so "never slower" is as sure as the
timer is steady: :func:`null_keep_probability` is how often a plan no faster than the
baseline passes them.

Without a GPU (and without a ``time_step`` of the caller's) no timing says anything about
FP8 speed: the plan is then made on error alone and says so in its notes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import ProbeConfig, Role
from ..kernels import registry
from ..kernels.registry import Scaling
from ..numerics.delayed import check_decay
from ..probe import probe
from ..probe.report import ProbeReport
from .predict import fp8_ceiling, predict_step
from .schema import Plan
from .select import kernel_speedup, override
from .select import plan as make_plan
# (step_timer and check_compile_options are this module's public names too)
from .steptimer import (HOST_ADDED_SHARE, PairedSteps, _ab_timer, _host_ms, _recorded,
                        _recording, check_capture, check_compile_options, check_host_slowdown,
                        host_check, step_timer)
from .swap import root_module
from .tune import FUSIBLE_TWINS, on_baseline, tune_speed
from .verdict import _ratio, _wins, ab_note, ab_verdict, null_keep_probability

__all__ = ["OptimizeResult", "optimize", "step_timer", "plan_families", "PairedSteps"]

MAX_FAMILIES = 4
"""whole-plan alternatives :func:`optimize` times at most (:func:`plan_families`)"""


def plan_families(plan: Plan, report: Optional[ProbeReport] = None,
                  limit: int = MAX_FAMILIES, *,
                  allowed_kernels: Optional[Sequence[str]] = None,
                  inference: bool = False) -> List[str]:
    """Kernels to try as the one kernel of every FP8 role of ``plan``
    (``tune_speed``'s ``families``), at most ``limit``:

    1. when the plan mixes kernels, its own, most used site-roles first (ties by name): a
       role-by-role mix makes each operand's layouts separately;
    2. with a ``report``, its tensorwise kernels with quantizers that it measured at every
       FP8 site-role of the plan within the plan's budgets, fastest median speedup first
       (:func:`~loka.dispatch.select.kernel_speedup`): one scale per tensor lets the
       forward's FP8 x and W serve the gradient GEMMs, the fewest quantization bytes of
       any scaling in the evaluation-set Wukong's compiled step (bench/BENCHMARKS.md,
       "Where a plan's bytes go"). Up to half the slots (at least one) are kept for the
       fastest of them: a mix's own kernels mostly repeat its layouts, and the one
       tensorwise family timed in a whole step beat the mixed rowwise plan it came from
       (bench/BENCHMARKS.md, "The evaluation-set plan's 9 sites on one tensorwise
       family"), while their isolated speedups, which rank them, did not say so.

    Kernels that quantize alike (a kernel and its fast-accumulation twin,
    ``Kernel.quantizes_as``) count once: the first of them. ``allowed_kernels`` (as
    :func:`loka.plan`'s) limits both."""
    allowed = None if allowed_kernels is None else set(allowed_kernels)
    count: dict = {}
    roles = []
    for name, sp in plan.sites.items():
        for role, choice in sp.roles.items():
            if choice.kernel != plan.baseline:
                count[choice.kernel] = count.get(choice.kernel, 0) + 1
                roles.append((name, role))

    def kind(k: str) -> str:  # kernels that quantize alike (a fast-accumulation twin)
        try:
            return registry.get(k).quantizes_as or k
        except KeyError:
            return k

    def dedupe(names: List[str]) -> List[str]:
        seen, out = set(), []
        for k in names:
            if kind(k) not in seen:
                seen.add(kind(k))
                out.append(k)
        return out

    own = sorted(count, key=lambda k: (-count[k], k)) if len(count) > 1 else []
    own = dedupe([k for k in own if allowed is None or k in allowed])
    sharing = []
    if report is not None and roles:
        first = report.sites.get(roles[0][0])
        names = first.roles[roles[0][1]].kernels if first and roles[0][1] in first.roles else {}
        for k in names:
            if k in own or set(count) == {k} or (allowed is not None and k not in allowed):
                continue
            try:
                kern = registry.get(k)
            except KeyError:
                continue
            if not (kern.is_fp8 and kern.scaling is Scaling.TENSORWISE
                    and kern.quantize_a is not None):
                continue
            speeds = []
            for site, role in roles:
                sr = report.sites.get(site)
                res = sr.roles[role].kernels.get(k) if sr and role in sr.roles else None
                if res is None or res.error is not None or res.mere is None:
                    break
                speeds.append(kernel_speedup(res, inference) or 0.0)
            else:
                try:  # within every site-role's budget
                    override(plan, replace={old: k for old in count if old != k}, report=report)
                except (ValueError, KeyError):
                    continue
                sharing.append((-statistics.median(speeds), k))
        sharing = dedupe([k for _, k in sorted(sharing)])
    if limit < 1:
        return []
    keep = limit - min(len(sharing), max(1, limit // 2))  # slots for sharing kernels
    return (own[:keep] + sharing)[:limit]


@dataclass
class OptimizeResult:
    """What :func:`optimize` found."""

    plan: Plan
    """the plan to apply: faster than none in the final A/B rounds (in every one, or enough
    of them to pass :func:`ab_verdict`'s sign test), or on the baseline"""
    report: ProbeReport
    """the Probe's report the plan was made from"""
    untuned: Plan
    """the plan as made from the report alone, before any whole-step timing"""
    trials: List[dict] = field(default_factory=list)
    """one entry per whole-step timing of the tuning (``tune_speed``'s log)"""
    rounds: List[dict] = field(default_factory=list)
    """the final A/B rounds: ``{"baseline": ms, "plan": ms}`` each (with those timed after a
    lost round, :func:`ab_verdict`)"""
    timed: bool = False
    """whether whole steps were timed (False: the plan was made on error alone)"""
    host_bound: Optional[bool] = None
    """whether the step without FP8 is host-bound on the GPU: the host took at least
    :data:`HOST_BOUND_SHARE` of its time to issue it. There
    GPU time saved saves no wall time: CUDA graphs or a larger batch let FP8 pay. None
    where the timer did not say (a caller's ``time_step`` without ``last``, or the CPU)."""

    @property
    def speedup(self) -> Optional[float]:
        """Median step without FP8 over median step with the plan, in the final rounds."""
        return _ratio(self.rounds, "baseline", "plan")

    @property
    def synchronized_speedup(self) -> Optional[float]:
        """The same for steps each started on an idle GPU, where the timer measured them
        beside steps issued back to back (``step_timer``'s ``synchronized_ms``); None where
        it did not (a timer of the caller's, the CPU, or ``synchronized_steps``, whose
        rounds are timed so already)."""
        return _ratio(self.rounds, "baseline_synchronized", "plan_synchronized")


HOST_BOUND_SHARE = 0.8
"""a step whose host issues it in at least this share of its time is host-bound: what FP8
saves of its GPU time mostly comes back as the GPU waiting for the host"""


HOST_SLOWDOWN = 1.5
"""the default ``host_slowdown`` of :func:`optimize`: a plan is kept only if it would not be
slower than none on a host this many times slower
(:func:`~loka.dispatch.steptimer.host_check`)"""


def _keeps_model_state(fn):
    """``fn(model, ...)`` that leaves the model's gradients and buffers as they were: the
    Probe's steps and the timed training steps replace gradients and move a norm's
    running statistics (each buffer is copied back in place)."""
    @functools.wraps(fn)
    def keeping(model, *args, **kwargs):
        root, _ = root_module(model)
        grads = [(p, p.grad) for p in root.parameters()]
        buffers = [(b, b.detach().clone()) for b in root.buffers()]
        try:
            return fn(model, *args, **kwargs)
        finally:
            for p, g in grads:
                p.grad = g
            with torch.no_grad():
                for b, saved in buffers:
                    if b.shape == saved.shape and b.dtype == saved.dtype:
                        b.copy_(saved)
    return keeping


@_keeps_model_state
def optimize(model: nn.Module, batches: Iterable, loss_fn: Callable[[nn.Module, object], torch.Tensor],
             *, inference: bool = False, config: Optional[ProbeConfig] = None,
             report: Optional[ProbeReport] = None,
             max_error: Optional[float] = None, min_speedup: Optional[float] = None,
             allowed_kernels: Optional[Sequence[str]] = None,
             head_sites: Optional[int] = None,
             time_step: Optional[Callable[[nn.Module], float]] = None,
             forward: Optional[Callable[[nn.Module, object], object]] = None,
             compile: bool = True, compile_mode: Optional[str] = None,
             compile_options: Optional[Mapping[str, object]] = None,
             synchronized_steps: bool = False, capture_steps: bool = False,
             paired_trials: bool = False, max_trials: int = 16, rounds: int = 3,
             steps: int = 10, warmup: int = 3,
             progress: Optional[Callable[[str], None]] = None,
             refine: Optional[Callable[[Plan], Plan]] = None,
             delayed_scaling: Optional[float] = None, static_scales: bool = False,
             static_margin: float = 1.0,
             host_slowdown: float = HOST_SLOWDOWN) -> OptimizeResult:
    """Probe ``model`` on ``batches``, plan, and keep only what makes its step faster.

    Args:
        model: the user's model, on the device it will run on; it is left as it was (no
            plan applied; its gradients and buffers, such as a norm's running statistics,
            as they came): apply ``result.plan`` with :func:`loka.apply`.
        batches: batches for the Probe (a few suffice); the first is also the batch whose
            steps are timed.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        inference: plan and time serving (forward only, weights quantized once).
        config: the Probe's settings (default :class:`~loka.ProbeConfig` with this
            ``head_sites``, whose gradient roles it does not measure; for serving, with
            ``roles=(Role.FWD,)``: a serving plan runs forwards only).
        report: a Probe report of this model made before: the Probe is not run again.
        max_error, min_speedup, allowed_kernels, head_sites: passed to :func:`loka.plan`.
        time_step: ``time_step(model) -> ms`` of the caller's own (milliseconds, as the
            report's savings are subtracted from it for ``predicted_speedup``); default
            :func:`step_timer` on the first batch (on CUDA only: without a GPU and without
            a ``time_step`` the plan is made on error alone and is not timed).
        forward: ``forward(model, batch)`` for serving steps (default ``model(batch)``),
            run under ``torch.no_grad``; a server that runs under ``torch.inference_mode``
            should enter it here too: the compiled graph, its guards and its host time
            differ between the two.
        compile, compile_mode, compile_options, steps, warmup: the default timer's
            settings (:func:`step_timer`; ``compile_options`` are refused with a
            ``time_step`` or ``compile=False``): time the steps compiled as they will run.
        synchronized_steps: the default timer starts each step on an idle GPU, as a caller
            that waits for each result runs them, not back to back (where a host slower than
            the GPU sets the pace); refused with a ``time_step`` of your own.
        capture_steps: the default timer captures each whole step in one CUDA graph and
            replays it (``step_timer``'s ``capture``), as a training loop or a server that
            captures its whole step runs it: the host's cost per step is one replay for
            every plan. Decide with it when your steps run that way; refused with a
            ``time_step`` of your own or with Inductor's CUDA graphs
            (``compile_mode="reduce-overhead"``).
        paired_trials: time the step without FP8 beside each tuning trial (with the
            default timer a copy of the model, timed in the same round) and compare the
            trial by its ratio to it (``tune_speed``'s ``paired``): a host whose speed
            drifts during the tuning does not decide, for twice the timings.
        max_trials: at most this many trials while tuning.
        rounds: final A/B rounds (baseline and plan, the plan timed first in every second
            round; with the default timer the model and a copy of it that holds the plan
            compiled once and timed one right after the other, :class:`PairedSteps`); the
            plan is kept if it is faster in every round. Where it lost one (from 3 rounds;
            with 1 or 2 no extra rounds could pass the test), up to ``rounds`` more are
            timed, and it is kept if its wins then pass a one-sided sign test at the level
            of winning all ``rounds`` (:func:`ab_verdict`): one noisy round no longer
            throws a faster plan away. The price: a plan no faster than the baseline is
            kept a little more often (:func:`null_keep_probability`: 0.172 for 3 rounds,
            against 0.125 when every round must be won).
        progress: called with one line per stage.
        refine: ``refine(plan) -> plan``, applied to the report's plan before any
            whole-step timing (which then only moves more sites back): e.g. an NE budget,
            ``lambda p: loka.quality.ne_budget(p, ...).plan``.
        delayed_scaling: train the plans timed, and the one returned, with delayed
            tensorwise scales at this decay (``Plan.delayed_scaling``; training only).
        static_scales, static_margin: serve the plans timed, and the one returned, with
            static activation scales (``loka.plan(..., static_scales=True)``; serving only).
        host_slowdown: where the rounds timed the host's time to issue each step (the
            default timer's paired rounds), a plan that won its rounds is kept only if it
            would not be slower than none on a host this many times slower: its gain per
            step must be at least ``host_slowdown - 1`` times the host time it adds, and
            back to back its step, the longer of its time and its host's scaled, no longer
            than the baseline's (:func:`~loka.dispatch.steptimer.host_check`: hosts of one
            kind differ, and a shared one slows down from call to call). 1.0 turns the
            check off.

    Returns:
        An :class:`OptimizeResult`; ``result.plan.budget["optimize"]`` records the rounds,
        the measured speedup and ``predicted_speedup``, what the report's step-aware timings
        predicted for the plan that was timed (:func:`~loka.dispatch.predict_step`; the
        isolated GEMM timings' in ``isolated_predicted_speedup``),
        so every run measures how far the step is from the sum of its GEMMs, and
        ``ceiling``, the most FP8 GEMMs could give that step
        (:func:`~loka.dispatch.fp8_ceiling`, ``Ceiling.to_dict()``), and ``ab_timing``,
        how the rounds were timed (``{"timing": "paired"}``, or ``"recompiled"`` and why
        not paired), and ``host_ms``, the host's median time to issue one step of each,
        ``{"baseline": ms, "plan": ms}``, where the rounds timed it (paired rounds; else
        None; on a GPU the host's time to issue it, elsewhere the step). On a host-bound
        step, a kept plan whose host time is more than 2% over the baseline's
        (:data:`HOST_ADDED_SHARE`) says so in its notes: it won on the host that timed it,
        and a slower host can make it slower than none. ``host_check`` records the check of
        ``host_slowdown`` (``host_check``'s dict, None where it did not run).
    """
    if rounds < 1:
        raise ValueError(f"optimize needs rounds >= 1, got {rounds}")
    if delayed_scaling is not None:
        if inference:
            raise ValueError("delayed_scaling is for training; serving takes static scales")
        delayed_scaling = check_decay(delayed_scaling, "delayed_scaling")
    if static_scales and not inference:
        raise ValueError("static_scales is for serving (inference=True); training takes "
                         "delayed_scaling")
    host_slowdown = check_host_slowdown(host_slowdown)
    options = check_compile_options(compile_options, compile)
    if options and time_step is not None:
        raise ValueError("compile_options are the default timer's: a time_step of your own "
                         "compiles the steps its own way")
    own = [name for name, on in (("synchronized_steps", synchronized_steps),
                                 ("capture_steps", capture_steps)) if on]
    if own and time_step is not None:
        raise ValueError(f"{own[0]} is the default timer's: a time_step of your own "
                         "times the steps its own way")
    check_capture(capture_steps, compile, compile_mode, options)  # with or without a GPU
    say = progress or (lambda _line: None)
    batches = list(batches)
    if not batches:
        raise ValueError("optimize needs at least one batch")
    root, _ = root_module(model)
    first = next(root.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    timed = time_step is not None or device.type == "cuda"
    if time_step is None and timed:  # made before the Probe runs
        time_step = step_timer(batches[0], loss_fn, inference=inference, forward=forward,
                               compile=compile, compile_mode=compile_mode, steps=steps,
                               warmup=warmup, compile_options=options,
                               synchronized=synchronized_steps, capture=capture_steps)

    if report is None:
        if config is None:
            # a serving plan runs forwards only: the Probe measures nothing else (a third of
            # the errors and timings of all three roles)
            # (in training, the head's gradient roles too: the plan keeps them on the
            # baseline; ProbeConfig.head_sites)
            config = ProbeConfig(roles=(Role.FWD,)) if inference else ProbeConfig(
                **({} if head_sites is None else {"head_sites": head_sites}))
        elif not inference and head_sites is not None and config.head_sites > head_sites:
            say(f"note: the Probe measures forwards only at its {config.head_sites} head "
                f"site(s) (ProbeConfig.head_sites) but the plan keeps only {head_sites} back: "
                f"the others' gradient roles stay on the baseline, untimed")
        say(f"probing {sum(1 for m in root.modules() if isinstance(m, nn.Linear))} Linear(s) "
            f"over {len(batches)} batch(es)"
            + (", forwards only" if tuple(config.roles) == (Role.FWD,) else ""))
        report = probe(model, batches, loss_fn, config=config)
    # where the report has no decisive timing, a safe kernel is a candidate all the same:
    # the whole step decides (or, untimed, the plan is made on error alone, and says so)
    untuned = make_plan(report, max_error=max_error, min_speedup=min_speedup,
                        allowed_kernels=allowed_kernels, inference=inference, assume_fast=True,
                        head_sites=head_sites, static_scales=static_scales,
                        static_margin=static_margin)
    say(f"plan from the report: {len(untuned.fp8_sites())} FP8 site(s)")
    start = untuned if refine is None else refine(untuned.copy())
    if refine is not None:
        if not isinstance(start, Plan):
            raise TypeError(f"refine must return a Plan, got {type(start).__name__}")
        say(f"refined: {len(start.fp8_sites())} FP8 site(s)")
    if delayed_scaling is not None:
        start = start.copy()
        start.delayed_scaling = float(delayed_scaling)
    result = OptimizeResult(plan=start.copy(), report=report, untuned=untuned, timed=timed)
    if not timed:
        result.plan.notes.append("optimize: not timed (no GPU and no time_step): the plan is "
                                 "made on error alone and may be slower than none")
        return result
    if not start.fp8_sites():
        result.plan.notes.append("optimize: the report's plan has no FP8 site; nothing to time")
        return result
    baseline_host: List[Tuple[float, float]] = []
    time_step = _recording(time_step, baseline_host)
    say(f"timing whole steps (at most {max_trials})")
    tuned, log = tune_speed(start, model, time_step, inference=inference, twins=FUSIBLE_TWINS,
                            report=report, max_trials=max_trials, paired=paired_trials,
                            families=plan_families(start, report,
                                                   allowed_kernels=allowed_kernels,
                                                   inference=inference))
    result.trials = log
    predicted = isolated = ceiling = ab_timing = None
    if tuned.fp8_sites():
        say(f"confirming {len(tuned.fp8_sites())} FP8 site(s) against the baseline "
            f"in {rounds} A/B round(s)")
        with contextlib.ExitStack() as stack:
            ab_round, ab_timing = _ab_timer(model, tuned, time_step, inference, stack,
                                            baseline_host)
            result.rounds = [ab_round(i) for i in range(rounds)]
            while ab_verdict(result.rounds, rounds) is None:  # a lost round: time more
                if len(result.rounds) == rounds:
                    say(f"the plan lost {rounds - _wins(result.rounds)} of {rounds} A/B "
                        f"round(s): timing up to {rounds} more")
                result.rounds.append(ab_round(len(result.rounds)))
        del ab_round  # (the paired steps, and the model's copy, are gone with the stack)
        # what the report's GEMM timings predicted for the plan that was timed
        base_ms = statistics.median(r["baseline"] for r in result.rounds)
        try:
            prediction = predict_step(tuned, report, base_ms, inference=inference)
            predicted = prediction.speedup
            isolated = base_ms / prediction.isolated_step_ms
        except ValueError:  # no positive step, or savings the step cannot hold
            predicted = isolated = None
        try:  # the most FP8 GEMMs could give this step (timed kernels, device roofline)
            ceiling = fp8_ceiling(report, base_ms, inference=inference,
                                  static_scales=bool(static_scales),
                                  head_sites=int(tuned.budget.get("head_sites", 3))).to_dict()
        except ValueError:
            ceiling = None
        why = ab_note(result.rounds, rounds)
        if not ab_verdict(result.rounds, rounds):
            tuned = on_baseline(tuned, tuned.fp8_sites(), why)
            tuned.notes.append(why + "; every site is on the baseline")
        elif why is not None:
            tuned.notes.append(why)
    if baseline_host:
        host = statistics.median(h for h, _ in baseline_host)
        step_ms = statistics.median(ms for _, ms in baseline_host)
        result.host_bound = bool(host >= HOST_BOUND_SHARE * step_ms)
        if result.host_bound:
            say(f"the step without FP8 is host-bound: its host issues it in {host:.3f} of "
                f"{step_ms:.3f} ms, so GPU time saved saves no wall time; " + (
                    "" if capture_steps else "CUDA graphs (capture_steps=True, compile_mode="
                    "'reduce-overhead'), ") + "Inductor's C++ wrapper "
                f"(compile_options={{'cpp_wrapper': True}}) or a larger batch let FP8 pay"
                + ("" if synchronized_steps else
                   "; a caller that waits for each step's result runs them as "
                   "synchronized_steps=True times them"))
            if result.synchronized_speedup is not None:
                say(f"each step started on an idle GPU (as a caller that waits for each "
                    f"result runs them), the plan's step was "
                    f"{result.synchronized_speedup:.3f}x of the baseline's (up to 3 calls "
                    f"per round" + (f"; back to back {result.speedup:.3f}x)"
                                    if result.speedup is not None else ")"))
    host_ms = _host_ms(result.rounds)
    checked = None
    if tuned.fp8_sites() and host_slowdown > 1.0:
        checked = host_check(result.rounds, host_slowdown)
        if checked is not None and not checked["passed"]:
            slow, lost = checked["slow_host_ms"], []
            if checked["gain_ms"] < checked["margin_ms"]:
                lost.append(f"with its host time all in the step, by "
                            f"{1e3 * (checked['margin_ms'] - checked['gain_ms']):.0f} us")
            if slow["plan"] > slow["baseline"]:
                lost.append(f"issued back to back, {slow['plan']:.3f} against "
                            f"{slow['baseline']:.3f} ms")
            line = (f"the plan won its rounds by {1e3 * checked['gain_ms']:.0f} us per step "
                    f"but adds {1e3 * checked['host_added_ms']:.0f} us of host time: on a "
                    f"host {host_slowdown:g}x slower it would be slower than none ("
                    + "; ".join(lost) + ") (host_slowdown)")
            say(line)
            tuned = on_baseline(tuned, tuned.fp8_sites(), line)
            tuned.notes.append("optimize: " + line + "; every site is on the baseline")
    if (result.host_bound and host_ms and tuned.fp8_sites()
            and host_ms[1] > HOST_ADDED_SHARE * host_ms[0]):
        line = (f"the plan adds {1e3 * (host_ms[1] - host_ms[0]):.0f} us of host time per "
                f"step ({host_ms[0]:.3f} -> {host_ms[1]:.3f} ms): on this host-bound step it "
                f"won on this host"
                + (f" and would not lose on one {host_slowdown:g}x slower; on a slower host "
                   f"still" if checked else "; on a slower host")
                + " it can be slower than none")
        say(line)
        tuned.notes.append("optimize: " + line)
    tuned.budget["optimize"] = {"rounds": result.rounds, "trials": len(log),
                                "first_rounds": rounds,
                                "null_keep_probability": null_keep_probability(rounds),
                                "speedup": _finite(result.speedup),
                                "synchronized_speedup": _finite(result.synchronized_speedup),
                                "predicted_speedup": _finite(predicted),
                                "isolated_predicted_speedup": _finite(isolated),
                                "ceiling": ceiling, "host_bound": result.host_bound,
                                "compile_options": _recorded(options),
                                "synchronized_steps": bool(synchronized_steps),
                                "capture_steps": bool(capture_steps),
                                "paired_trials": bool(paired_trials),
                                "ab_timing": ab_timing, "host_check": checked,
                                "host_ms": (None if host_ms is None else
                                            {"baseline": host_ms[0], "plan": host_ms[1]})}
    result.plan = tuned
    kept = len(tuned.fp8_sites())
    say(f"kept {kept} FP8 site(s)" + ("" if not result.speedup else
                                      f", step {result.speedup:.3f}x of the baseline" if kept
                                      else f"; the plan timed ran at {result.speedup:.3f}x of "
                                      f"the baseline in its rounds"))
    return result


def _finite(x: Optional[float]) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None
