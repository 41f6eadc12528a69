"""The NE budget: which FP8 site-roles a plan keeps so that its paired NE change stays
within ``max_ne_change``.

A per-GEMM error budget (``max_error`` on the Probe's metric) does not bound what a plan
does to the model's NE: small errors at many sites add up, and one site's error can cost
more than another's. :func:`ne_budget` closes that gap with the paired quality check
(:mod:`loka.quality.check`):

1. **Cost of each FP8 site-role** (:func:`site_role_costs`). For every site-role the plan
   runs in FP8, an arm with only that site-role in FP8 (every other one on the baseline)
   trains ``cost_steps`` steps from the same weights on the same batches as one baseline
   arm, and both are scored on the same examples. Its cost is the *second-order NE cost*
   of the logit change ``d = z_arm - z_base`` (:func:`second_order_cost`)::

       cost = 1/2 sum_i p_i (1 - p_i) d_i^2 / sum_i l_base,i      (relative NE, >= 0)

   the term of the log loss's expansion in ``d`` that does not average out: the first
   term, ``sum (p - y) d``, has no sign of its own for a rounding perturbation, and is
   what makes a single paired change noisy. The cost is paired (same weights, batches,
   RNG, examples), needs no long training, and is exactly 0 for a site-role whose kernel
   changes nothing. It ranks: ``bench/results/ne_budget_cpu.json`` holds its rank
   correlation with the paired check over groups of site-roles.
2. **The budget** (:func:`ne_budget`). The site-roles are ranked by cost; the paired check
   (``steps`` steps, ``seeds``) of the whole plan runs first; while the upper end of its
   interval of the relative NE change exceeds ``max_ne_change``, the costliest site-roles
   go back to the baseline: a bisection over how many of the ranked list move back, so a
   plan of ``n`` FP8 site-roles takes about ``1 + log2(n)`` paired checks (the baseline
   arm of each seed is trained once and shared by all of them, :class:`PairedArms`).
   Moving every one back is the baseline itself, a change of exactly 0, and needs no check.

The plan returned records each FP8 site-role's cost (``RoleChoice.ne_cost``), what moved
back and why (``reason``), ``budget["max_ne_change"]`` and ``budget["ne_budget"]`` (the
ranking, every check, the final change and its bound), and a note.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from ..config import ROLES, Role
from ..data.batch import Batch
from ..data.metrics import normalized_entropy
from ..dispatch import Plan, RoleChoice
from ..kernels import registry
from ..train import predict, train
from .check import QualityResult, _compare, deterministic
from .stats import example_log_losses

__all__ = ["DEFAULT_MAX_NE_CHANGE", "BaselineNotLearnedError", "PairedArms", "SiteRoleCost",
           "NEBudgetResult", "second_order_cost", "fp8_site_roles", "only", "without", "site_role_costs",
           "ne_budget"]

DEFAULT_MAX_NE_CHANGE = 2e-4
"""0.02% relative NE: a change that already matters in production"""

_INTERVALS = ("auto", "seeds", "examples")


def second_order_cost(z_base: np.ndarray, z_plan: np.ndarray, labels: np.ndarray) -> float:
    """``1/2 sum p (1 - p) d^2 / sum l_base`` in float64: the second-order NE cost of the
    logit change ``d = z_plan - z_base`` (``p`` the baseline's probabilities, ``l_base`` its
    per-example log losses), in relative NE; 0 exactly when the logits are equal."""
    z_base = np.asarray(z_base, np.float64)
    z_plan = np.asarray(z_plan, np.float64)
    if z_base.shape != z_plan.shape or z_base.size == 0:
        raise ValueError(f"second_order_cost needs two non-empty logit arrays of one shape, "
                         f"got {z_base.shape} and {z_plan.shape}")
    if not (np.isfinite(z_base).all() and np.isfinite(z_plan).all()):
        raise ValueError("second_order_cost: the logits are not all finite")
    p = 0.5 * (1.0 + np.tanh(0.5 * z_base))  # the logistic function, without overflow
    d = z_plan - z_base
    loss = math.fsum(example_log_losses(z_base, labels))
    return 0.5 * math.fsum(p * (1.0 - p) * d * d) / loss


class BaselineNotLearnedError(ValueError):
    """A baseline arm no better than the bound (by default the base rate's NE, 1.0): the
    paired changes measured against it would say nothing about a plan. Train longer, lower
    the learning rate, warm it up (``warmup_steps``), or start from a trained checkpoint
    with its optimizer states (``initial_optimizer_state``)."""


class PairedArms:
    """Arms trained on the paired check's identical terms against one baseline per seed.

    What :func:`~loka.quality.paired_check` does for one plan, for many: each seed's
    model is built once (``build_model(seed)`` after ``torch.manual_seed(seed)``, then
    ``initial_state`` loaded), every arm trains a copy of it with ``loka.train.train`` for
    ``steps`` steps on ``train_data(seed)`` under :class:`~loka.quality.deterministic`,
    and is scored on ``eval_data()``. The baseline arm of each seed is trained once and
    kept, so a ranking of ``n`` plans costs ``n + 1`` arms per seed, not ``2 n``.
    """

    def __init__(self, build_model: Callable[[int], nn.Module],
                 train_data: Callable[[int], Iterable[Batch]],
                 eval_data: Callable[[], Iterable[Batch]], *, steps: int,
                 seeds: Sequence[int] = (0,), lr: float = 1e-3, device="cpu",
                 initial_state: Optional[Dict[str, torch.Tensor]] = None,
                 eval_steps: Optional[int] = None, autocast_bf16: Optional[bool] = None,
                 keep_states: bool = False,
                 initial_optimizer_state: Optional[Sequence[Mapping[str, Any]]] = None,
                 warmup_steps: int = 0) -> None:
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if not seeds:
            raise ValueError("give at least one seed")
        self.build_model, self.train_data, self.eval_data = build_model, train_data, eval_data
        self.steps, self.seeds, self.lr = int(steps), tuple(int(s) for s in seeds), lr
        self.device = torch.device(device)
        self.initial_state, self.eval_steps = initial_state, eval_steps
        self.initial_optimizer_state, self.warmup_steps = initial_optimizer_state, warmup_steps
        self.autocast = (self.device.type == "cuda" if autocast_bf16 is None
                         else bool(autocast_bf16))
        self._origins: Dict[int, nn.Module] = {}
        self._baselines: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        self.keep_states = keep_states
        self.baseline_states: Dict[int, Dict[str, torch.Tensor]] = {}
        """each seed's trained baseline weights (with ``keep_states``): the model a serving
        plan is checked on (``PairedArms(steps=0, initial_state=...)``)"""
        self.arms_trained = 0
        """arms trained so far, baselines included"""

    def _origin(self, seed: int) -> nn.Module:
        if seed not in self._origins:
            with deterministic():
                torch.manual_seed(seed)
                model = self.build_model(seed)
                if self.initial_state is not None:
                    model.load_state_dict(self.initial_state)
            self._origins[seed] = model
        return self._origins[seed]

    def scored(self, plan: Optional[Plan], seed: int) -> Tuple[np.ndarray, np.ndarray, int]:
        """``(logits, labels, fallbacks)`` of the arm that trains with ``plan`` (None: the
        baseline, trained once per seed and kept)."""
        if plan is None and seed in self._baselines:
            return (*self._baselines[seed], 0)
        model = copy.deepcopy(self._origin(seed))
        with deterministic():
            run = train(model, self.train_data(seed), self.steps, lr=self.lr,
                        device=self.device, seed=seed, plan=plan,
                        autocast_bf16=self.autocast, progress=False,
                        warmup_steps=self.warmup_steps,
                        optimizer_state=self.initial_optimizer_state)
            if run.steps != self.steps:  # the arms would not be the check they claim to be
                raise ValueError(f"train_data({seed}) ran out after {run.steps} of "
                                 f"{self.steps} steps")
            logits, labels = predict(model, self.eval_data(), self.eval_steps,
                                     device=self.device, autocast_bf16=self.autocast)
        self.arms_trained += 1
        if plan is None:
            self._baselines[seed] = (logits, labels)
            if self.keep_states:
                self.baseline_states[seed] = {k: v.detach().clone()
                                              for k, v in model.state_dict().items()}
            return logits, labels, 0
        return logits, labels, len(run.plan.fallbacks) if run.plan is not None else 0

    def baseline_ne(self, seed: int) -> float:
        """NE of ``seed``'s trained baseline arm on the evaluation data."""
        z, labels, _ = self.scored(None, seed)
        return normalized_entropy(z, labels, from_logits=True)

    def require_learned(self, max_ne: float = 1.0) -> None:
        """:class:`BaselineNotLearnedError` unless every seed's baseline arm (trained
        ``steps`` steps; trained here if it was not yet) reaches an NE below ``max_ne``
        (1.0: the base rate's): a change measured against a baseline that diverged, or has
        not learned yet, says nothing about a plan."""
        bad = {s: ne for s in self.seeds if not (ne := self.baseline_ne(s)) < max_ne}
        if bad:
            shown = ", ".join(f"seed {s}: NE {ne:.3g}" for s, ne in list(bad.items())[:4])
            raise BaselineNotLearnedError(
                f"the baseline did not learn in {self.steps} steps ({shown}; the bound is "
                f"{max_ne:g}, 1 is the base rate's)")

    def check(self, plan: Optional[Plan], *, confidence: float = 0.95,
              meta: Optional[Dict[str, Any]] = None) -> QualityResult:
        """The paired check of ``plan`` against the shared baselines, every seed."""
        results = []
        for seed in self.seeds:
            base = self.scored(None, seed)
            mine = self.scored(plan, seed)
            results.append(_compare(seed, base[:2], mine[:2], confidence, 0, mine[2]))
        return QualityResult(seeds=results, steps=self.steps, confidence=confidence,
                             control=False, meta=dict(meta or {}))

    def cost(self, plan: Optional[Plan]) -> Tuple[float, float]:
        """``(second-order cost, measured relative NE change)`` of ``plan``, each the mean
        over seeds."""
        costs, changes = [], []
        for seed in self.seeds:
            z_base, labels, _ = self.scored(None, seed)
            z_plan, labels_plan, _ = self.scored(plan, seed)
            if not np.array_equal(labels, labels_plan):
                raise RuntimeError("the arms were scored on different examples: the "
                                   "evaluation data must give the same batches every time")
            costs.append(second_order_cost(z_base, z_plan, labels))
            l_base, l_plan = example_log_losses(z_base, labels), example_log_losses(z_plan, labels)
            changes.append(math.fsum(l_plan) / math.fsum(l_base) - 1.0)
        return math.fsum(costs) / len(costs), math.fsum(changes) / len(changes)


@dataclass
class SiteRoleCost:
    """What one FP8 site-role costs, measured alone."""

    site: str
    role: str
    kernel: str
    cost: float
    """second-order NE cost (relative NE, mean over the cost seeds)"""
    rel_ne_change: float
    """the measured relative NE change of the arm (mean over the cost seeds; noisy)"""

    @property
    def key(self) -> str:
        return f"{self.site}:{self.role}"


@dataclass
class NEBudgetResult:
    """What :func:`ne_budget` found."""

    plan: Plan
    """the plan within the budget, its costs and what moved back recorded"""
    costs: List[SiteRoleCost]
    """every FP8 site-role of the plan given, costliest first"""
    moved_back: List[str] = field(default_factory=list)
    """``site:role`` moved back to the baseline, costliest first"""
    checks: List[Dict[str, Any]] = field(default_factory=list)
    """every paired check made: ``moved_back`` (how many), ``rel_ne_change``, ``upper``"""
    quality: Optional[QualityResult] = None
    """the paired check of the plan returned (None: nothing is left in FP8, the change is 0)"""
    rel_ne_change: float = 0.0
    upper: float = 0.0
    """the upper end of the interval the budget was held to"""


def _is_fp8(kernel: str) -> bool:
    try:
        return registry.get(kernel).is_fp8
    except KeyError:
        return False


def fp8_site_roles(plan: Plan) -> List[Tuple[str, Role]]:
    """``(site, role)`` of every role ``plan`` runs on an FP8 kernel, in plan order."""
    return [(name, role) for name, sp in plan.sites.items() for role in ROLES
            if _is_fp8(sp.kernel(role, plan.baseline))]


def without(plan: Plan, pairs: Iterable[Tuple[str, Role]], why: str,
            costs: Optional[Dict[Tuple[str, Role], float]] = None) -> Plan:
    """A copy of ``plan`` with the site-roles ``pairs`` on the baseline, for reason ``why``
    (their measured costs kept in ``ne_cost``)."""
    out = plan.copy()
    for site, role in pairs:
        old = out.sites[site].roles.get(role)
        out.sites[site].roles[role] = RoleChoice(
            out.baseline, budget=None if old is None else old.budget, reason=why,
            ne_cost=(costs or {}).get((site, role)))
    return out


def only(plan: Plan, site: str, role: Role) -> Plan:
    """A copy of ``plan`` in which only ``role`` of ``site`` keeps its kernel."""
    rest = [p for p in fp8_site_roles(plan) if p != (site, role)]
    return without(plan, rest, f"only {site}:{role} in FP8")


def site_role_costs(plan: Plan, arms: PairedArms,
                    progress: Optional[Callable[[str], None]] = None, *,
                    known: Iterable[SiteRoleCost] = (),
                    on_cost: Optional[Callable[[SiteRoleCost], None]] = None
                    ) -> List[SiteRoleCost]:
    """Every FP8 site-role of ``plan`` measured alone against ``arms``' baselines (see the
    module's docstring), costliest first (ties: plan order). ``known``: costs measured
    before on the same arms (a run resumed), kept where their site, role and kernel are
    the plan's; ``on_cost`` is called with each cost as it is measured."""
    out = []
    pairs = fp8_site_roles(plan)
    before = {(c.site, c.role, c.kernel): c for c in known}
    for i, (site, role) in enumerate(pairs):
        kernel = plan.sites[site].kernel(role)
        if (site, role.value, kernel) in before:
            out.append(before[(site, role.value, kernel)])
            continue
        if progress:
            progress(f"cost {i + 1}/{len(pairs)}: {site}:{role}")
        cost, change = arms.cost(only(plan, site, role))
        out.append(SiteRoleCost(site, role.value, kernel, cost, change))
        if on_cost is not None:
            on_cost(out[-1])
    order = sorted(range(len(out)), key=lambda i: (-out[i].cost, i))
    return [out[i] for i in order]


def _upper(result: QualityResult, interval: str) -> float:
    if interval == "seeds":
        return result.rel_ne_seeds[1]
    return result.rel_ne_examples[1]


def ne_budget(plan: Plan, build_model: Callable[[int], nn.Module],
              train_data: Callable[[int], Iterable[Batch]],
              eval_data: Callable[[], Iterable[Batch]], *,
              max_ne_change: float = DEFAULT_MAX_NE_CHANGE, steps: int,
              seeds: Sequence[int] = (0, 1, 2), lr: float = 1e-3, device="cpu",
              initial_state: Optional[Dict[str, torch.Tensor]] = None,
              eval_steps: Optional[int] = None, confidence: float = 0.95,
              interval: str = "auto", cost_steps: Optional[int] = None,
              cost_seeds: Sequence[int] = (0,), costs: Optional[List[SiteRoleCost]] = None,
              autocast_bf16: Optional[bool] = None,
              progress: Optional[Callable[[str], None]] = None,
              on_check: Optional[Callable[[int, QualityResult], None]] = None,
              prior_checks: Optional[Mapping[int, QualityResult]] = None,
              initial_optimizer_state: Optional[Sequence[Mapping[str, Any]]] = None,
              warmup_steps: int = 0,
              max_baseline_ne: Optional[float] = 1.0) -> NEBudgetResult:
    """Move ``plan``'s costliest FP8 site-roles back to the baseline until the paired
    check's upper bound on the relative NE change is at most ``max_ne_change``.

    Args:
        plan: the plan to hold to the budget (not changed).
        build_model, train_data, eval_data, steps, seeds, lr, device, initial_state,
            initial_optimizer_state, warmup_steps, eval_steps, confidence, autocast_bf16:
            the paired check's terms (:func:`~loka.quality.paired_check`).
        max_baseline_ne: every seed's baseline arm of the checks (``steps`` steps) must
            reach an NE below this on the evaluation data, else
            :class:`BaselineNotLearnedError` before the first check's plan arms train
            (:meth:`PairedArms.require_learned`; the short cost arms are not held to it):
            1.0, the base rate's, by default; None checks nothing (a test of the mechanics
            on an untrained model).
        max_ne_change: the budget, relative (2e-4: 0.02%).
        interval: the interval whose upper end is held to the budget: ``"seeds"`` (the
            Student-t interval over seeds, needs two seeds or more), ``"examples"`` (over
            evaluation examples), ``"auto"`` (seeds when there are two or more).
        cost_steps: training steps of each cost arm (None: ``min(steps, 20)``: short, so
            that a site-role's perturbation is measured before training noise swamps it).
        cost_seeds: the seeds the costs are averaged over.
        costs: costs measured before (:func:`site_role_costs`): not measured again.
        progress: called with one line per stage.
        on_check: called with ``(k, result)`` after each paired check (``k``: how many of
            the costliest site-roles were back on the baseline), so that a caller can keep
            every check as it is made (a long run cut short keeps them).
        prior_checks: ``k -> result`` of checks made before (a run resumed): those are not
            made again. Each must have this call's steps, seeds and confidence and, in its
            ``meta["moved_back"]`` (which every check records), the ``k`` site-roles this
            ranking moves back, else ValueError; the data and the learning rate are the
            caller's to keep the same.

    Returns:
        An :class:`NEBudgetResult`; ``result.plan`` is the plan within the budget.
    """
    if isinstance(max_ne_change, bool) or not isinstance(max_ne_change, (int, float)) or \
            not math.isfinite(max_ne_change) or max_ne_change <= 0:
        raise ValueError(f"max_ne_change must be a finite number > 0, got {max_ne_change!r}")
    if interval not in _INTERVALS:
        raise ValueError(f"interval must be one of {list(_INTERVALS)}, got {interval!r}")
    if not seeds:
        raise ValueError("give at least one seed")
    if interval == "auto":
        interval = "seeds" if len(seeds) >= 2 else "examples"
    if interval == "seeds" and len(seeds) < 2:
        raise ValueError("interval='seeds' needs at least two seeds")
    say = progress or (lambda _line: None)
    terms = dict(build_model=build_model, train_data=train_data, eval_data=eval_data, lr=lr,
                 device=device, initial_state=initial_state, eval_steps=eval_steps,
                 autocast_bf16=autocast_bf16, initial_optimizer_state=initial_optimizer_state,
                 warmup_steps=warmup_steps)
    pairs = fp8_site_roles(plan)
    measured = costs is None
    cost_steps = min(steps, 20) if cost_steps is None else int(cost_steps)
    if max_baseline_ne is not None and (
            isinstance(max_baseline_ne, bool) or not isinstance(max_baseline_ne, (int, float))
            or not math.isfinite(max_baseline_ne) or max_baseline_ne <= 0):
        raise ValueError(f"max_baseline_ne must be None or a finite number > 0, got "
                         f"{max_baseline_ne!r}")
    if measured:
        cost_arms = PairedArms(steps=cost_steps, seeds=cost_seeds, **terms)
        say(f"measuring {len(pairs)} FP8 site-role(s) alone, {cost_arms.steps} steps each")
        costs = site_role_costs(plan, cost_arms, say)
    known = {(c.site, Role.parse(c.role)): c.cost for c in costs}
    missing = [f"{s}:{r}" for s, r in pairs if (s, r) not in known]
    if missing:
        raise ValueError(f"costs are missing for FP8 site-role(s) {missing[:4]}")
    ranked = sorted(pairs, key=lambda p: (-known[p], pairs.index(p)))
    arms = PairedArms(steps=steps, seeds=seeds, **terms)
    checks: List[Dict[str, Any]] = []
    results: Dict[int, QualityResult] = {}

    def back(k: int) -> List[str]:
        return [f"{s}:{r.value}" for s, r in ranked[:k]]

    prior = dict(prior_checks or {})
    bad = [k for k in prior if not isinstance(k, int) or isinstance(k, bool)
           or not 0 <= k <= len(ranked) or not isinstance(prior[k], QualityResult)]
    if bad:
        raise ValueError(f"prior_checks: expected k in 0..{len(ranked)} -> QualityResult, got "
                         f"keys {bad[:4]}")
    for k, r in prior.items():  # made on these terms, with these site-roles moved back
        terms_now = (steps, [int(x) for x in seeds], confidence, back(k))
        terms_then = (r.steps, [x.seed for x in r.seeds], r.confidence,
                      r.meta.get("moved_back"))
        names = ("steps", "seeds", "confidence", "moved_back")
        differ = [n for n, a, b in zip(names, terms_now, terms_then) if a != b]
        if differ:
            raise ValueError(f"prior_checks[{k}]: made on other terms ({', '.join(differ)})")

    def holds(k: int) -> bool:
        if k in prior:
            result = prior[k]
            say(f"paired check with the {k} costliest of {len(ranked)} moved back: made before")
        else:
            if max_baseline_ne is not None:  # its baselines, before this check's plan arms
                arms.require_learned(max_baseline_ne)
            trial = without(plan, ranked[:k], "NE budget trial")
            say(f"paired check with the {k} costliest of {len(ranked)} moved back")
            result = arms.check(trial, confidence=confidence, meta={"moved_back": back(k)})
            if on_check is not None:
                on_check(k, result)
        results[k] = result
        seeds_iv = result.rel_ne_seeds
        upper = _upper(result, interval)
        checks.append({"moved_back": k, "rel_ne_change": result.rel_ne_change,
                       "upper": upper, "rel_ne_examples": list(result.rel_ne_examples),
                       "rel_ne_seeds": None if seeds_iv is None else list(seeds_iv),
                       "auc_change": result.auc_change})
        say(f"  {k} moved back: relative NE change {result.rel_ne_change:+.4%}, upper bound "
            f"{upper:+.4%} ({'within' if upper <= max_ne_change else 'over'} "
            f"{max_ne_change:.4%})")
        return upper <= max_ne_change

    n = len(ranked)
    if n == 0 or holds(0):
        k = 0
    else:  # holds(n) is the baseline itself: exactly 0
        lo, hi = 0, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid, hi)
        k = hi
    moved = ranked[:k]
    why = (f"NE budget: moved back to keep the paired relative NE change <= "
           f"{max_ne_change:.4%} ({interval} interval upper bound)")
    out = without(plan, moved, why, known)
    for site, role in pairs:  # costs given for site-roles this plan lacks are not recorded
        if (site, role) not in moved and role in out.sites[site].roles:
            out.sites[site].roles[role].ne_cost = known[(site, role)]
    final = results.get(k)
    change = 0.0 if final is None else final.rel_ne_change
    upper = 0.0 if final is None else _upper(final, interval)
    result = NEBudgetResult(plan=out, costs=list(costs), quality=final, checks=checks,
                            moved_back=[f"{s}:{r.value}" for s, r in moved],
                            rel_ne_change=change, upper=upper)
    out.budget["max_ne_change"] = float(max_ne_change)
    out.budget["ne_budget"] = {
        "interval": interval, "confidence": confidence, "steps": steps, "seeds": list(seeds),
        "cost": "second-order NE cost of the arm with only this site-role in FP8",
        "cost_steps": cost_steps if measured else None,
        "cost_seeds": list(cost_seeds) if measured else None,
        "ranked": [{"site": c.site, "role": c.role, "kernel": c.kernel, "ne_cost": c.cost,
                    "rel_ne_change": c.rel_ne_change} for c in costs],
        "moved_back": result.moved_back, "checks": checks, "rel_ne_change": change,
        "upper": upper}
    out.notes.append(f"NE budget: kept {n - k} of {n} FP8 site-role(s); paired relative NE "
                     f"change {change:+.4%}, upper bound {upper:+.4%} <= {max_ne_change:.4%}"
                     + ("" if final is not None else " (every site-role on the baseline: "
                        "the baseline itself)"))
    return result
