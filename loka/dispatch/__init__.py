"""Dispatch: plans, ``loka.Linear`` and applying plans to models.

>>> plan = loka.plan(report, max_error=0.2, min_speedup=1.05)
>>> loka.apply(model, plan)            # nn.Linear -> loka.Linear where the plan says
>>> guard = loka.dispatch.Guard(model, plan, check_every=100)

``plan`` and ``apply`` are both submodules and functions; the package exports the
functions, which also carry their module's helpers (``loka.dispatch.plan.
tighten_end_to_end``, ``loka.dispatch.apply.check``).
"""

from .linear import Linear
from .plan import (FUSIBLE_TWINS, Fallback, Plan, PlanMismatchError, RoleChoice, SitePlan,
                   audit, override, plan, search_speed, tighten_end_to_end, tune_speed)
from .apply import ApplyReport, Change, amax_from_report, applied_plan, apply, check, unapply
from .guard import Guard, GuardEvent

plan.tighten_end_to_end = tighten_end_to_end
plan.tune_speed = tune_speed
plan.search_speed = search_speed
plan.override = override
plan.audit = audit
plan.FUSIBLE_TWINS = FUSIBLE_TWINS
apply.check = check
apply.amax_from_report = amax_from_report

__all__ = ["Linear", "Plan", "SitePlan", "RoleChoice", "Fallback", "PlanMismatchError", "plan", "audit", "override",
           "tighten_end_to_end", "tune_speed", "search_speed", "FUSIBLE_TWINS", "apply", "unapply", "check", "applied_plan", "ApplyReport",
           "Change", "amax_from_report", "Guard", "GuardEvent"]
