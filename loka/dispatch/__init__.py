"""Dispatch: plans, ``loka.Linear`` and applying plans to models.

>>> plan = loka.plan(report, max_error=0.2, min_speedup=1.05)
>>> loka.apply(model, plan)            # nn.Linear -> loka.Linear where the plan says
>>> guard = loka.dispatch.Guard(model, plan, check_every=100)

One job per module, each importing only those before it: ``linear`` (``loka.Linear``),
``schema`` (the plan as data and JSON), ``select`` (``plan``, ``audit``, ``override``),
``swap`` (``apply``, ``unapply``, ``check``), ``guard`` (the safety valve in training),
``tighten`` (the end-to-end accuracy budget), ``tune`` (whole-step speed:
``tune_speed``, ``search_speed``), ``verdict`` (the A/B rule: ``ab_verdict``),
``optimize`` (Probe, plan and whole-step check in one call), ``predict`` (the step a
report's timings predict for a plan) and ``aot`` (a planned model compiled ahead of time
into an AOTInductor package, served with no Python per call). Their public names
are all here.
"""

from .linear import Linear
from .schema import Fallback, Plan, PlanMismatchError, RoleChoice, SitePlan
from .select import audit, budget_problem, override, plan, plan_report_mismatches
from .static import amax_from_report
from .swap import (ApplyReport, Change, applied_plan, apply, check, skipped_sites, unapply)
from .guard import Guard, GuardEvent
from .tighten import tighten_end_to_end
from .tune import FUSIBLE_TWINS, search_speed, tune_speed
from .verdict import ab_verdict, null_keep_probability, sign_test_p
from .optimize import OptimizeResult, PairedSteps, optimize, plan_families, step_timer
from .predict import Ceiling, StepPrediction, copy_savings_us, fp8_ceiling, predict_step
from .aot import AOTModel, aot_compile, load_aot

__all__ = ["Linear", "Plan", "SitePlan", "RoleChoice", "Fallback", "PlanMismatchError", "plan",
           "audit", "budget_problem", "plan_report_mismatches", "override",
           "tighten_end_to_end", "tune_speed", "search_speed", "FUSIBLE_TWINS", "optimize",
           "OptimizeResult", "step_timer", "PairedSteps", "plan_families", "apply", "unapply",
           "check", "applied_plan", "skipped_sites", "ApplyReport", "Change",
           "amax_from_report", "Guard", "GuardEvent", "StepPrediction", "predict_step",
           "copy_savings_us", "Ceiling", "fp8_ceiling", "ab_verdict", "null_keep_probability",
           "sign_test_p", "AOTModel", "aot_compile", "load_aot"]
