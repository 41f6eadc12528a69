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
(:func:`~loka.probe.pricing.serve_static_time_us`). Both predictions are returned:
the evaluation harness (``loka bench --eval-set``) records them beside every measured LoKA
row, so the gap of each is measured, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from ..config import Role
from ..kernels import registry
from ..probe.pricing import serve_static_time_us
from ..probe.report import ProbeReport
from .schema import Plan

__all__ = ["StepPrediction", "predict_step"]


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

    @property
    def speedup(self) -> float:
        return self.baseline_step_ms / self.predicted_step_ms

    def to_dict(self) -> dict:
        return {"baseline_step_ms": self.baseline_step_ms,
                "predicted_step_ms": self.predicted_step_ms, "saved_ms": self.saved_ms,
                "predicted_speedup": self.speedup, "per_role_us": dict(self.per_role_us),
                "untimed": list(self.untimed), "isolated_step_ms": self.isolated_step_ms,
                "isolated_speedup": self.baseline_step_ms / self.isolated_step_ms,
                "step_aware": list(self.step_aware)}


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
    predicted = baseline_step_ms - saved_us / 1e3
    isolated = baseline_step_ms - isolated_us / 1e3
    if not (predicted > 0 and isolated > 0):
        raise ValueError(f"the report's savings ({max(saved_us, isolated_us) / 1e3:.3f} ms) "
                         f"exceed the baseline step ({baseline_step_ms:.3f} ms): the report "
                         "is not of this model")
    return StepPrediction(baseline_step_ms, predicted, saved_us / 1e3, per_role, untimed,
                          isolated, aware)
