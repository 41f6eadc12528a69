"""What the Probe's timings predict for a whole step under a plan.

Each FP8 site-role of the plan saves ``baseline_us - kernel_us`` against the baseline
GEMM; a step runs each site-role once, so the plan's step is predicted as the measured
baseline step less those savings. In training, ``kernel_us`` is the step-aware time where
the report has one (:mod:`loka.probe.pricing`: the GEMM alone, plus each operand's quantization priced
by where the operand comes from, so a quantization Inductor fuses into the activation or
norm that produced the operand costs the share it keeps), else the isolated time of the
whole kernel call (quantization as passes of its own); serving takes the forward timed
with its weight quantized once, as the serving plan runs it, step-aware where the report
has it (``serve_us``: x's quantization priced by its producer), and at a site of the
plan's ``static_scales`` the GEMM and what is left of a static cast
(:func:`~loka.probe.pricing.serve_static_time_us`), and the bytes a static plan saves
on the copies of strided inputs, written in FP8 and once per group of Linears reading one
tensor (:func:`copy_savings_us`, at the device's memory bandwidth).
Both predictions are returned:
the evaluation harness (``loka bench --eval-set``) records them beside every measured LoKA
row, so the gap of each is measured, not assumed.

:func:`fp8_ceiling` bounds what any plan could give on a step before one is made: the
step's share of GEMM time, and the step if every GEMM role ran at its FP8 roofline (the
device's FP8 peak, operands arriving in FP8 for free) or on the fastest kernel the report
timed there whatever its error. A target above the roofline ceiling is out of FP8's reach
on that model; one between the measured ceiling and the plan's prediction is the error
budget's, the head rule's or the pricing's doing, and the ceiling says which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import math
from typing import Dict, List, Optional

import torch

from ..config import Role
from ..kernels import registry
from ..kernels.roofline import Peaks, fp8_time_lower_bound_us, peaks_for
from ..probe.pricing import serve_static_time_us
from ..probe.report import ProbeReport
from .schema import Plan
from .select import _UNTRUSTED_TIMINGS, head_of, judged_speedup, static_serve_speedup

__all__ = ["StepPrediction", "predict_step", "copy_savings_us", "Ceiling", "fp8_ceiling"]


@dataclass(frozen=True)
class StepPrediction:
    """The predicted step of a plan against its measured baseline step."""

    baseline_step_ms: float
    predicted_step_ms: float
    saved_ms: float
    """the sum of the FP8 site-roles' savings (negative: the plan is predicted slower)"""
    per_role_us: Dict[str, float] = field(default_factory=dict)
    """``'site:role'`` -> microseconds saved per step"""
    untimed: List[str] = field(default_factory=list)
    """FP8 site-roles the report holds no time for (counted as saving nothing)"""
    isolated_step_ms: float = 0.0
    """the same prediction from the isolated kernel times alone"""
    step_aware: List[str] = field(default_factory=list)
    """FP8 site-roles priced step-aware (the others at their isolated time)"""
    copies_us: float = 0.0
    """serving with static scales: microseconds saved on the copies of strided inputs
    (:func:`copy_savings_us`), part of ``saved_ms``"""

    @property
    def speedup(self) -> float:
        return self.baseline_step_ms / self.predicted_step_ms

    def to_dict(self) -> dict:
        return {"baseline_step_ms": self.baseline_step_ms,
                "predicted_step_ms": self.predicted_step_ms, "saved_ms": self.saved_ms,
                "predicted_speedup": self.speedup, "per_role_us": dict(self.per_role_us),
                "untimed": list(self.untimed), "isolated_step_ms": self.isolated_step_ms,
                "isolated_speedup": self.baseline_step_ms / self.isolated_step_ms,
                "step_aware": list(self.step_aware), "copies_us": self.copies_us}


def predict_step(plan: Plan, report: ProbeReport, baseline_step_ms: float, *,
                 inference: bool = False) -> StepPrediction:
    """The step time the report's timings predict for ``plan`` (module docstring).

    Args:
        plan: the plan (its FP8 site-roles; baseline roles save nothing).
        report: the Probe's report the timings come from (sites by the plan's names).
        baseline_step_ms: the measured step without the plan (same model, same compile).
        inference: serving: only the forward counts, timed with the weight quantized once.

    Raises:
        ValueError: a baseline step that is not a positive number, or savings that would
            leave no step at all.
    """
    if not isinstance(baseline_step_ms, (int, float)) or not baseline_step_ms > 0:
        raise ValueError(f"baseline_step_ms must be a positive number, got {baseline_step_ms!r}")
    saved_us = isolated_us = 0.0
    per_role: Dict[str, float] = {}
    untimed: List[str] = []
    aware: List[str] = []
    for site, sp in plan.sites.items():
        sr = report.sites.get(site)
        for role, choice in sp.roles.items():
            if choice.kernel == plan.baseline or (inference and role is not Role.FWD):
                continue
            key = f"{site}:{role.value}"
            rr = sr.roles.get(role) if sr is not None else None
            kr = rr.kernels.get(choice.kernel) if rr is not None else None
            t = None if kr is None else (
                kr.time_us_weight_q if inference and kr.time_us_weight_q is not None
                else kr.time_us)
            if rr is None or rr.baseline_us is None or t is None:
                untimed.append(key)
                continue
            step = kr.serve_us if inference else kr.step_us
            if inference and site in (getattr(plan, "static_scales", None) or {}):
                # a static input scale: the GEMM and what is left of x's cast
                static = serve_static_time_us(
                    registry.get(choice.kernel), time_us_weight_q=kr.time_us_weight_q,
                    time_us_gemm=kr.time_us_gemm, producers=sr.producers,
                    compiled=(kr.timing or "").endswith("+compiled"))
                step = static if static is not None else step
            if step is not None:
                aware.append(key)
            per_role[key] = rr.baseline_us - (t if step is None else step)
            saved_us += per_role[key]
            isolated_us += rr.baseline_us - t
    copies_us = copy_savings_us(plan, report) if inference else 0.0
    saved_us += copies_us
    predicted = baseline_step_ms - saved_us / 1e3
    isolated = baseline_step_ms - isolated_us / 1e3
    if not (predicted > 0 and isolated > 0):
        raise ValueError(f"the report's savings ({max(saved_us, isolated_us) / 1e3:.3f} ms) "
                         f"exceed the baseline step ({baseline_step_ms:.3f} ms): the report "
                         "is not of this model")
    return StepPrediction(baseline_step_ms, predicted, saved_us / 1e3, per_role, untimed,
                          isolated, aware, copies_us)


def copy_savings_us(plan: Plan, report: ProbeReport) -> float:
    """What a static serving plan saves on the copies to rows of strided inputs
    (``producers['x_layout']`` 'copied'), priced at the device's memory bandwidth.

    The step copies such an x in the step's precision for each Linear that reads it, in
    bf16 as in the plan; with static scales the plan writes the copy in FP8 (one byte per
    element), once for the Linears that read one tensor (``producers['x_group']``, one
    scale: :func:`loka.dispatch.static.group_amax`). The GEMM timings hold none of it.
    The saving is the bytes written less: ``M x K x (sum of the members' element sizes - 1)``
    per group of FP8 forwards with a static scale. 0 where the report's device has no
    known peaks (:func:`loka.kernels.roofline.peaks_for`)."""
    peaks = peaks_for(report.device_name or "")
    static = getattr(plan, "static_scales", None) or {}
    if peaks is None or not static:
        return 0.0
    served = []
    for site, sp in plan.sites.items():
        fwd = sp.roles.get(Role.FWD)
        if site in static and fwd is not None and fwd.kernel != plan.baseline:
            served.append(site)
    return _copies_us(report, served, peaks)


def _copies_us(report: ProbeReport, sites, peaks: Peaks) -> float:
    """What :func:`copy_savings_us` prices, for the FP8 forwards with a static scale at
    ``sites``: per group of them reading one strided tensor, the bf16 copies each writes
    less the one FP8 copy, at ``peaks``' memory bandwidth (microseconds)."""
    groups: Dict[str, List[tuple]] = {}
    for site in sites:
        sr = report.sites.get(site)
        if sr is None or sr.producers.get("x_layout") != "copied":
            continue
        dtype = getattr(torch, sr.dtype, None)
        size = dtype.itemsize if isinstance(dtype, torch.dtype) else 2
        groups.setdefault(sr.producers.get("x_group", site), []).append(
            (sr.tokens * sr.in_features, size))
    saved_bytes = 0.0
    for members in groups.values():
        elements = max(n for n, _ in members)
        saved_bytes += sum(n * size for n, size in members) - elements
    return max(saved_bytes, 0.0) / (peaks.hbm_tbps * 1e6)


@dataclass(frozen=True)
class Ceiling:
    """What FP8 GEMMs could give a step at most (:func:`fp8_ceiling`). Speedups are the
    baseline step over the step with the savings taken; ``eligible`` ones leave the sites a
    training plan keeps on the baseline (``head``) alone."""

    baseline_step_ms: float
    gemm_ms: float
    """the baseline GEMM time of the counted roles, as the report timed each alone"""
    roofline_speedup: Optional[float]
    """every counted role at its FP8 roofline; None where the device's peaks are unknown"""
    roofline_speedup_eligible: Optional[float]
    measured_speedup: float
    """every counted role on the fastest FP8 kernel the report timed there on a GPU (any
    error; step-aware price where the report has one), the baseline where none is faster"""
    measured_speedup_eligible: float
    head: List[str] = field(default_factory=list)
    untimed: List[str] = field(default_factory=list)
    """counted site-roles without a decisive FP8 timing (saving nothing in the measured
    ceiling)"""

    @property
    def gemm_share(self) -> float:
        return self.gemm_ms / self.baseline_step_ms

    def to_dict(self) -> dict:
        return {"baseline_step_ms": self.baseline_step_ms, "gemm_ms": self.gemm_ms,
                "gemm_share": self.gemm_share, "roofline_speedup": self.roofline_speedup,
                "roofline_speedup_eligible": self.roofline_speedup_eligible,
                "measured_speedup": self.measured_speedup,
                "measured_speedup_eligible": self.measured_speedup_eligible,
                "head": list(self.head), "untimed": list(self.untimed)}


def fp8_ceiling(report: ProbeReport, baseline_step_ms: float, *, inference: bool = False,
                static_scales: bool = False, head_sites: int = 3,
                peaks: Optional[Peaks] = None) -> Ceiling:
    """The most FP8 GEMMs could give a step whose baseline was measured at
    ``baseline_step_ms`` (module docstring).

    Every role the report timed counts (serving: the forwards). The roofline ceiling takes
    each role's baseline time down to :func:`loka.kernels.roofline.fp8_time_lower_bound_us`
    with its operands already in FP8 (no quantization at all); the measured ceiling takes it
    to the fastest FP8 kernel the report timed there on a GPU, judged as a plan judges it
    (step-aware in training, weight quantized once in serving, static input scales with
    ``static_scales``) but with no error budget. In training the ``head_sites`` sites nearest
    the loss (:func:`loka.dispatch.select.head_of`) are left out of the eligible ceilings.
    Serving with ``static_scales`` adds to both what the timed forwards' copies of strided
    inputs save (:func:`copy_savings_us`), where the device's peaks are known.

    Args:
        peaks: the device's peak rates; default: the report's device name's
            (:data:`loka.kernels.roofline.PEAKS`), None for a device not listed there.

    Raises:
        ValueError: a baseline step that is not a positive finite number, or GEMM savings
            that would leave no step (the report is not of this model).
    """
    if (isinstance(baseline_step_ms, bool) or not isinstance(baseline_step_ms, (int, float))
            or not math.isfinite(baseline_step_ms) or baseline_step_ms <= 0):
        raise ValueError(f"baseline_step_ms must be a positive number, got {baseline_step_ms!r}")
    if peaks is None and report.device.startswith("cuda") and report.device_name:
        peaks = peaks_for(report.device_name)
    head = [] if inference else head_of(report, head_sites)[0]
    gemm = roof = roof_elig = meas = meas_elig = 0.0
    untimed: List[str] = []
    fp8_static: List[str] = []
    known = {k.name: k for k in registry.all_kernels()}
    for name, site in report.sites.items():
        for role, rr in site.roles.items():
            if (inference and role is not Role.FWD) or rr.baseline_us is None:
                continue
            base = rr.baseline_us
            gemm += base
            eligible = name not in head
            if peaks is not None:
                lb = fp8_time_lower_bound_us(tuple(rr.shape), peaks, quantizes_a=False,
                                             quantizes_b=False)
                saved = max(base - lb, 0.0)
                roof += saved
                roof_elig += saved if eligible else 0.0
            best, decisive, static_ok = 1.0, False, False
            for kname, kr in rr.kernels.items():
                kern = known.get(kname)  # a report's kernel no longer registered: skipped
                if (kern is None or not kern.is_fp8 or kern.is_emulated or kr.error
                        or kr.timing is None or kr.timing.split("+")[0] in _UNTRUSTED_TIMINGS):
                    continue
                sp = judged_speedup(kr, kern, site, role, base, inference, static_scales)
                if sp is not None and math.isfinite(sp) and sp > 0:
                    decisive, best = True, max(best, sp)
                    static_ok = static_ok or (
                        inference and static_scales
                        and static_serve_speedup(kr, kern, site, base) is not None)
            if not decisive:
                untimed.append(f"{name}:{role.value}")
            saved = base - base / best
            meas += saved
            meas_elig += saved if eligible else 0.0
            if static_ok:  # a forward that can serve with a static scale
                fp8_static.append(name)
    if peaks is not None and fp8_static:
        # the copies of strided inputs those forwards write in FP8, once per group
        # (copy_savings_us): not GEMM time, but what serving them in FP8 saves with them
        copies = _copies_us(report, fp8_static, peaks)
        roof, roof_elig, meas, meas_elig = (v + copies for v in (roof, roof_elig, meas,
                                                                 meas_elig))

    def ratio(saved_us: float) -> float:
        left = baseline_step_ms - saved_us / 1e3
        if left <= 0:
            raise ValueError(f"the report's GEMM savings ({saved_us / 1e3:.3f} ms) exceed the "
                             f"baseline step ({baseline_step_ms:.3f} ms): the report is not "
                             "of this model")
        return baseline_step_ms / left
    return Ceiling(float(baseline_step_ms), gemm / 1e3,
                   ratio(roof) if peaks is not None else None,
                   ratio(roof_elig) if peaks is not None else None,
                   ratio(meas), ratio(meas_elig), head, untimed)
