"""What the Probe's timings predict for a whole step under a plan.

Each FP8 site-role of the plan saves ``baseline_us - kernel_us`` against the baseline
GEMM, as the Probe timed both alone at the site's shape (quantization included; the
forward with the weight quantized beforehand when serving); a step runs each site-role
once, so the plan's step is predicted as the measured baseline step less those savings.

This is the isolated-GEMM prediction the Dispatch ranks kernels by. A compiled step can
differ from it both ways: quantization fused into a producing norm or activation costs
less than the Probe's standalone pass, while copies, transposes and launches that only
the step has cost more. The evaluation harness (``loka bench --eval-set``) records this
prediction beside every measured LoKA row, so the gap is measured, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from ..config import Role
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

    @property
    def speedup(self) -> float:
        return self.baseline_step_ms / self.predicted_step_ms

    def to_dict(self) -> dict:
        return {"baseline_step_ms": self.baseline_step_ms,
                "predicted_step_ms": self.predicted_step_ms, "saved_ms": self.saved_ms,
                "predicted_speedup": self.speedup, "per_role_us": dict(self.per_role_us),
                "untimed": list(self.untimed)}


def predict_step(plan: Plan, report: ProbeReport, baseline_step_ms: float, *,
                 inference: bool = False) -> StepPrediction:
    """The step time the report's isolated timings predict for ``plan``.

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
    saved_us, per_role, untimed = 0.0, {}, []
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
            per_role[key] = rr.baseline_us - t
            saved_us += per_role[key]
    predicted = baseline_step_ms - saved_us / 1e3
    if not predicted > 0:
        raise ValueError(f"the report's savings ({saved_us / 1e3:.3f} ms) exceed the baseline "
                         f"step ({baseline_step_ms:.3f} ms): the report is not of this model")
    return StepPrediction(baseline_step_ms, predicted, saved_us / 1e3, per_role, untimed)
