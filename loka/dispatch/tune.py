"""Whole-step speed: let timings of the compiled model, not of each GEMM alone, decide.

The Probe times each GEMM alone. Inside a compiled model an FP8 site also adds
quantization kernels and changes what Inductor fuses around it, so sites that are each
faster alone can make the whole step slower. :func:`tune_speed` starts from a plan and
moves groups of sites back to the baseline while that makes the step faster;
:func:`search_speed` times every candidate at every group of same-shape sites, the
yardstick a plan is measured against. Both apply trial plans to the caller's model and
time its step with the caller's ``time_step``; the model is left with the plan it had.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from torch import nn

from ..config import ROLES, LinearConfig, Role
from ..probe.report import ProbeReport
from .schema import Plan, RoleChoice
from .select import override
from .steptimer import _positive, _twin
from .swap import apply, restore_on_exit, root_module, unapply

def _site_groups(plan: Plan) -> List[List[str]]:
    """FP8 sites grouped by shape and kernels (e.g. the four identical layers of a model):
    a group moves to the baseline as one."""
    groups: Dict[tuple, List[str]] = {}
    for s in plan.fp8_sites():
        sp = plan.sites[s]
        key = (sp.in_features, sp.out_features, sp.tokens,
               tuple(sp.kernel(r, plan.baseline) for r in ROLES))
        groups.setdefault(key, []).append(s)
    return list(groups.values())


FUSIBLE_TWINS: Dict[str, str] = {
    "triton-rowwise-cublas": "cublas-rowwise",
    "triton-rowwise-cublas-fastacc": "cublas-rowwise-fastacc",
    "triton-tensorwise-cublas": "cublas-tensorwise",
    "triton-tensorwise-cublas-fastacc": "cublas-tensorwise-fastacc",
}
"""Kernels with the same numerics (bit-exact quantizers, the same cuBLAS GEMM) whose
quantization is plain PyTorch: alone the Triton quantizer is faster, but inside a
compiled model Inductor fuses the PyTorch one into the op that produces the operand (an
activation, a norm), which the Probe's standalone timing cannot see.
:func:`tune_speed` tries them."""


def _same_kernels(p: Plan, q: Plan) -> bool:
    """Whether two plans put every site-role on the same kernel (a trial of one is a
    trial of the other)."""
    return p.sites.keys() == q.sites.keys() and all(
        p.sites[s].kernel(r, p.baseline) == q.sites[s].kernel(r, q.baseline)
        for s in p.sites for r in ROLES)


def on_baseline(p: Plan, sites: Iterable[str], why: str, roles: Iterable[Role] = ROLES) -> Plan:
    """A copy of ``p`` with ``roles`` (default all) of ``sites`` on the baseline, for
    reason ``why``."""
    out = p.copy()
    for s in sites:
        for role in roles:
            old = out.sites[s].roles.get(role)
            out.sites[s].roles[role] = RoleChoice(
                out.baseline, budget=None if old is None else old.budget, reason=why)
    return out


class _Inapplicable(ValueError):
    """A plan that ``apply`` refuses for this model (a kernel that cannot align a site)."""


class _StepTimer:
    """Apply a plan to the model and time a step with the caller's ``time_step``, logging
    each trial as ``{"sites": FP8 sites, **info, "time": t}``.

    ``paired``: a plan with FP8 sites is timed right after the step without them, and its
    time is scaled by the first baseline time over that adjacent one (``time``; the
    measured one in ``raw_time``, the adjacent baseline in ``baseline_time``): a host whose
    speed drifts between trials moves both timings of a pair, not the comparison. With a
    timer that pairs (``step_timer(...).pair``) the step without FP8 is a copy of the
    model made once, and each trial compiles it beside the planned model and times the two
    one block right after the other, each first in every second trial (``paired_with``:
    ``"copy"``); otherwise (no ``pair``, or a model that cannot be copied) each timing
    compiles the model afresh, the baseline first."""

    def __init__(self, model: nn.Module, time_step: Callable[[nn.Module], float],
                 inference: bool, log: List[dict], paired: bool = False) -> None:
        self.model, self.time_step, self.inference, self.log = model, time_step, inference, log
        self.root, _ = root_module(model)
        self.paired, self.reference = paired, None
        self.copy: Optional[nn.Module] = None
        self.copy_tried = False

    def _time(self) -> float:
        return _positive_time(self.time_step(self.model))

    def _baseline_copy(self) -> Optional[nn.Module]:
        """The model without FP8, copied once (the model unapplied now), or None."""
        if not self.copy_tried:
            self.copy_tried = True
            if getattr(self.time_step, "pair", None) is not None:
                self.copy, _ = _twin(self.model, self.root)
        return self.copy

    def __call__(self, p: Plan, **info) -> float:
        unapply(self.root)
        sites, adjacent, paired_with = p.fp8_sites(), None, None
        pairing = sites and self.paired and self.reference is not None
        copy = self._baseline_copy() if pairing else None
        if pairing and copy is None:
            adjacent = self._time()  # the step without FP8, just before the plan's
        if sites:
            try:
                apply(self.root, p, inference=self.inference)
            except ValueError as e:  # PlanMismatchError too
                unapply(self.root)
                raise _Inapplicable(str(e)) from e
        if copy is not None:
            with self.time_step.pair(copy, self.model) as steps:
                row = steps.round(plan_first=len(self.log) % 2 == 1)
            t, adjacent = _positive_time(row["plan"]), _positive_time(row["baseline"])
            paired_with = "copy"
        else:
            t = self._time()
        if not sites and self.reference is None:
            self.reference = t
        entry = {"sites": sites, **info, "time": t}
        if adjacent is not None:
            entry.update(time=t * self.reference / adjacent, raw_time=t, baseline_time=adjacent)
        if paired_with is not None:
            entry["paired_with"] = paired_with
        self.log.append(entry)
        return entry["time"]


def _positive_time(t) -> float:
    t = float(t)
    if not _positive(t):
        raise ValueError(f"time_step returned {t!r}; it must return a positive time")
    return t


def tune_speed(plan: Plan, model: nn.Module, time_step: Callable[[nn.Module], float], *,
               min_gain: float = 1.0, max_trials: int = 16, inference: bool = False,
               twins: Optional[Mapping[str, str]] = None,
               report: "ProbeReport | None" = None,
               per_role: bool = False,
               families: Sequence[str] = (), paired: bool = False) -> Tuple[Plan, List[dict]]:
    """Keep only the FP8 sites that pay inside the whole model.

    The Probe times each GEMM alone. Inside a compiled model a site also adds its
    quantization kernels and changes what Inductor can fuse around it, so a plan whose
    sites are each faster alone can make the whole step slower. Here whole steps decide.
    ``time_step(model)``, the caller's, runs the model as it will run (compiled, captured
    in a CUDA graph, warmed up) and returns a time, e.g. the median step in ms; it is
    taken for the model without FP8 and with the plan. Then groups of FP8 sites (one shape, one choice of kernels) are
    moved back to the baseline one group at a time, greedily keeping the move that makes
    the step fastest, until no move helps. The result is kept only if it beats the
    all-baseline step by the factor ``min_gain``; otherwise every site goes back.

    Args:
        plan: the plan to tune (not modified).
        model: the model the plan is for; it is left with its previous plan (or none).
        time_step: ``time_step(model) -> time`` with the model as configured.
        min_gain: the tuned plan must be at least this much faster than the baseline.
        max_trials: at most this many ``time_step`` calls (each may recompile).
        inference: apply the plans for inference (weights quantized once).
        twins: ``{kernel: twin}`` of equal numerics (e.g. :data:`FUSIBLE_TWINS`): the plan
            with its kernels replaced by their twins is timed too, and the faster of the
            two is where the greedy search starts.
        report: the Probe report behind ``plan``: the twins then take its measured errors
            and must meet the budget (:func:`override`), so twins of other numerics
            (another library's quantizer) are allowed; without a report, twins must have
            the same numerics and carry the plan's errors over.
        families: kernels each tried as a whole-plan alternative start: the plan with every
            FP8 role of every site on that one kernel (timed once each, unless it repeats
            the plan or its twins; it takes the report's errors, and a kernel outside the
            budget anywhere is not tried; without a report none is). A plan whose roles
            mix kernel libraries makes every operand's layouts in passes of their own (a
            Triton-quantized forward beside a cuBLAS weight gradient shares nothing); one
            kernel for all lets operands be shared or made in one call
            (``bench/step_code.py`` counts the bytes). The per-GEMM timings behind the plan
            cannot see that; the step can.
        per_role: a group with several FP8 roles moves one role at a time to the baseline
            (each a trial of its own), so a paying forward is not lost with a losing
            gradient GEMM; off, the whole group moves at once. With ``inference`` the
            plan's gradient roles go to the baseline first (serving runs forwards only)
            and groups move whole.
        paired: time the step without FP8 right before each trial with FP8 sites and
            compare the trial by its ratio to that step (scaled to the first baseline
            time), so that a host whose speed drifts between trials does not decide; each
            such trial takes two timings (``max_trials`` counts trials). With a timer that
            pairs (the default timer) the two are a copy of the model without FP8 and the
            planned model, compiled together and timed one right after the other
            (:class:`~loka.dispatch.steptimer.PairedSteps`; the trial's ``paired_with``).

    Returns:
        (tuned plan, log): one dict per trial with ``sites`` (FP8 sites of the trial),
        ``removed`` (the group tried, if any), ``role`` (the role moved, None for the
        whole group) and ``time``; the twins' trial has ``twins: True``, a family's
        ``family`` (its kernel); a paired trial's ``raw_time`` and ``baseline_time`` are
        its two timings, ``time`` the first over the second times the first baseline,
        and ``paired_with: "copy"`` where a copy of the model was its baseline.
    """
    if not (min_gain > 0 and math.isfinite(min_gain)):
        raise ValueError(f"min_gain must be a finite positive number, got {min_gain!r}")
    if max_trials < 2:
        raise ValueError(f"max_trials must be >= 2 (the baseline and the plan), got {max_trials}")
    log: List[dict] = []
    timer = _StepTimer(model, time_step, inference, log, paired=paired)
    if inference:  # serving runs forwards only: gradient roles on FP8 are not timed, not kept
        grads = [s for s, sp in plan.sites.items()
                 if any(sp.kernel(r, plan.baseline) != plan.baseline for r in (Role.DGRAD, Role.WGRAD))]
        if grads:
            plan = on_baseline(plan, grads, "inference plan: forward only",
                                roles=(Role.DGRAD, Role.WGRAD))

    with restore_on_exit(timer.root):
        base_time = timer(on_baseline(plan, plan.fp8_sites(), "baseline"), removed=None)
        best, best_time = plan.copy(), timer(plan, removed=None)
        twin = None
        used = {c.kernel for sp in plan.sites.values() for c in sp.roles.values()}
        sub = {k: v for k, v in (twins or {}).items() if k in used}
        if sub:
            with contextlib.suppress(ValueError):  # a twin outside the budget: none
                twin = override(plan, replace=sub, report=report, same_numerics=report is None)
        if twin is not None and len(log) < max_trials:
            t = timer(twin, removed=None, twins=True)
            if t < best_time:
                best, best_time = twin, t
        # without a report no budget can be checked for another kernel's numerics
        for kernel in dict.fromkeys(families if report is not None else ()):
            if len(log) >= max_trials:
                break
            swap = {k: kernel for k in used if k not in (kernel, plan.baseline)}
            if not swap:
                continue  # the plan is on this kernel alone already
            try:
                start = override(plan, replace=swap, report=report)
            except (ValueError, KeyError):  # outside the budget, or not for some role
                continue
            if any(_same_kernels(start, q) for q in (plan, twin) if q is not None):
                continue  # timed already (e.g. the family of a plan's twins)
            try:
                t = timer(start, removed=None, family=kernel)
            except _Inapplicable:
                continue
            if t < best_time:
                best, best_time = start, t
        while len(log) < max_trials:
            candidates = []
            for group in _site_groups(best):
                fp8_roles = [r for r in ROLES
                             if any(best.sites[s].kernel(r, best.baseline) != best.baseline
                                    for s in group)]
                # per role: a group's forward may pay while its gradient GEMMs do not;
                # serving runs the forward only, so there a group moves whole
                moves = fp8_roles if per_role and not inference and len(fp8_roles) > 1 else [None]
                for role in moves:
                    if len(log) >= max_trials:
                        break
                    why = ("end-to-end speed: the step is faster without it" if role is None
                           else f"end-to-end speed: the step is faster with {role} on the baseline")
                    cand = on_baseline(best, group, why, ROLES if role is None else (role,))
                    t = timer(cand, removed=group, role=None if role is None else role.value)
                    candidates.append((t, cand))
            if not candidates:
                break
            t, cand = min(candidates, key=lambda c: c[0])
            if t >= best_time:
                break
            best, best_time = cand, t
        if base_time / best_time < min_gain:
            best = on_baseline(best, best.fp8_sites(),
                           f"end-to-end speed: no FP8 plan beat the baseline by {min_gain:g}x")
            best_time = base_time
        best.budget["speed_tuned"] = {"baseline_time": base_time, "time": best_time,
                                      "trials": len(log), "min_gain": float(min_gain)}
        best.notes.append(f"end-to-end speed: {len(best.fp8_sites())} FP8 site(s) kept, step "
                          f"{best_time:.4g} vs {base_time:.4g} without FP8 ({len(log)} trials)")
    return best, log


def _exact_glob(name: str) -> str:
    """A glob matching exactly ``name`` (site names may hold ``[``, ``*`` or ``?``)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _shape_groups(plan: Plan) -> List[List[str]]:
    """Every site of the plan grouped by its GEMM shape (in, out, tokens)."""
    groups: Dict[tuple, List[str]] = {}
    for s, sp in plan.sites.items():
        groups.setdefault((sp.in_features, sp.out_features, sp.tokens), []).append(s)
    return list(groups.values())


def search_speed(plan: Plan, model: nn.Module, time_step: Callable[[nn.Module], float],
                 candidates: Iterable["LinearConfig | str"], *,
                 report: "ProbeReport | None" = None, inference: bool = False,
                 min_gain: float = 1.0, max_trials: int = 64) -> Tuple[Plan, List[dict]]:
    """The best fixed choice per group of sites, by exhaustive whole-step timing: the
    yardstick a Probe-made plan is measured against.

    Sites are grouped by GEMM shape (the four identical layers of a model form one group).
    For each group and each candidate configuration, the step is timed with that group on
    the candidate and every other site on the baseline; each group keeps its fastest
    candidate if it beats the all-baseline step. The chosen groups are then timed together,
    and the result is the faster of that and the best single group. Groups are searched one
    at a time, not in every combination: interactions between groups (fusion across them)
    are seen only in the final trial. A candidate whose trial raises is logged
    (``failed``) and not chosen.

    Args:
        plan: supplies the sites, their budgets and the baseline (its choices are ignored).
        model, time_step, inference: as :func:`tune_speed`.
        candidates: :class:`~loka.config.LinearConfig` per-role choices, or kernel names
            (that kernel on every role; on the forward only when ``inference``).
        report: the Probe report: a candidate whose error at a site exceeds the budget, or
            that the report did not measure there, is skipped for that group.
        min_gain: the result must beat the all-baseline step by this factor, else every
            site goes back to the baseline.
        max_trials: at most this many ``time_step`` calls (the last one is kept for the
            chosen groups together).

    Returns:
        (plan, log): the log has one dict per trial (``group``, ``candidate``, ``time``),
        ``skipped`` entries for candidates that do not fit a group and ``failed`` entries.
    """
    if not (min_gain > 0 and math.isfinite(min_gain)):
        raise ValueError(f"min_gain must be a finite positive number, got {min_gain!r}")
    configs = []
    for c in candidates:
        if isinstance(c, str):
            c = LinearConfig(fwd=c) if inference else LinearConfig.uniform(c)
        if not isinstance(c, LinearConfig):
            raise TypeError(f"candidates are LinearConfigs or kernel names, got {c!r}")
        configs.append(c)
    if not configs:
        raise ValueError("search_speed needs at least one candidate")
    log: List[dict] = []
    timer = _StepTimer(model, time_step, inference, log)
    base = on_baseline(plan, plan.sites, "baseline")

    def timed() -> int:
        return sum("time" in e for e in log)

    with restore_on_exit(timer.root):
        base_time = timer(base, group=None, candidate=None)
        chosen: Dict[int, Tuple[float, Plan]] = {}
        for gi, group in enumerate(_shape_groups(plan)):
            for cfg in configs:
                if timed() >= max_trials - 1:  # one trial is kept for the chosen groups together
                    break
                assign = {f"{_exact_glob(s)}:{r.value}": cfg.kernel(r) for s in group for r in ROLES}
                try:
                    cand = override(base, assign=assign, report=report)
                except (ValueError, KeyError) as e:
                    log.append({"group": group, "candidate": cfg.to_dict(), "skipped": str(e)})
                    continue
                if not cand.fp8_sites():
                    continue
                try:
                    t = timer(cand, group=group, candidate=cfg.to_dict())
                except _Inapplicable as e:
                    log.append({"group": group, "candidate": cfg.to_dict(), "skipped": str(e)})
                    continue
                except Exception as e:  # noqa: BLE001 - a candidate that breaks is not chosen
                    log.append({"group": group, "candidate": cfg.to_dict(),
                                "failed": f"{type(e).__name__}: {e}"[:300]})
                    continue
                if t < chosen.get(gi, (base_time, None))[0]:
                    chosen[gi] = (t, cand)
        best, best_time = base, base_time
        if chosen:  # the best single group, then all chosen groups together if that is faster
            best_time, single = min(chosen.values(), key=lambda tc: tc[0])
            best = single
            if len(chosen) > 1:
                together = base.copy()
                for _, cand in chosen.values():
                    for s in cand.fp8_sites():
                        together.sites[s] = cand.sites[s]
                t = timer(together, group="all chosen", candidate=None)
                if t < best_time:
                    best, best_time = together, t
        if best_time >= base_time or base_time / best_time < min_gain:
            best, best_time = base, base_time
        best = best.copy()
        best.budget["speed_searched"] = {"baseline_time": base_time, "time": best_time,
                                         "trials": timed(),
                                         "candidates": [c.to_dict() for c in configs]}
        best.notes.append(f"exhaustive search per group: {len(best.fp8_sites())} FP8 site(s), "
                          f"step {best_time:.4g} vs {base_time:.4g} without FP8")
    return best, log

