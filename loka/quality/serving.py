"""The serving NE budget: a serving plan held to a bound on the NE change it causes.

A model served from a trained checkpoint has no training noise: applied to the same model,
a plan changes each held-out example's logit by a fixed amount, and the paired relative NE
change over the examples, with its interval (:func:`~loka.quality.stats.ratio_interval`),
is the whole of its cost. :func:`serve_ne_budget` measures each FP8 forward of the plan
alone (its second-order NE cost, :func:`~loka.quality.budget.second_order_cost`: low noise,
zero exactly where the logits do not move), then checks the plan with its costliest
forwards moved back to the baseline, one more at a time, until the upper end of the
interval is within the budget. Every check serves the same examples; the model is left as
it was.

The examples that choose the sites should not be the ones that report the plan's change:
give it a validation stream and report on another (``bench/evalset_quality.py`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..data.metrics import normalized_entropy
from ..dispatch.schema import Plan, Role
from ..dispatch.static import static_scales_for
from ..dispatch.swap import apply, restore_on_exit, root_module, unapply
from ..jsonio import json_safe
from .budget import (DEFAULT_MAX_NE_CHANGE, BaselineNotLearnedError, SiteRoleCost,
                     fp8_site_roles, only, second_order_cost, without)
from .stats import example_log_losses, ratio_interval

__all__ = ["ServeBudgetResult", "serve_ne_budget", "fp8_forwards"]


def fp8_forwards(plan: Plan) -> List[str]:
    """The sites whose forward ``plan`` runs on an FP8 kernel (what a serving step runs in
    FP8; a serving plan's backward roles are never run), in plan order."""
    return [site for site, role in fp8_site_roles(plan) if role is Role.FWD]


@dataclass
class ServeBudgetResult:
    """What :func:`serve_ne_budget` found."""

    plan: Plan
    """the plan within the budget: a site moved back has every role on the baseline, its
    forward carrying its cost (``ne_cost``), and no static scale"""
    costs: List[SiteRoleCost]
    """every FP8 forward of the plan given, alone, costliest first"""
    checks: List[Dict[str, Any]] = field(default_factory=list)
    """each check made: ``moved_back`` (how many of the costliest), ``sites`` (FP8 sites
    left), ``rel_ne_change`` and its ``interval``"""
    moved_back: List[str] = field(default_factory=list)
    """the sites moved back, costliest first"""
    baseline_ne: float = math.nan
    """the model's NE without the plan on the examples"""
    examples: int = 0

    @property
    def rel_ne_change(self) -> float:
        """The returned plan's relative NE change (0 where nothing is left in FP8)."""
        return self.checks[-1]["rel_ne_change"] if self.checks else 0.0

    @property
    def upper(self) -> float:
        """The upper end of the returned plan's interval."""
        return self.checks[-1]["interval"][1] if self.checks else 0.0

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe (a non-finite cost or change, a plan's non-finite logits, as a string)."""
        return json_safe({"costs": [vars(c) for c in self.costs], "checks": self.checks,
                          "moved_back": self.moved_back, "baseline_ne": self.baseline_ne,
                          "examples": self.examples, "rel_ne_change": self.rel_ne_change,
                          "upper": self.upper, "fp8_forwards": len(fp8_forwards(self.plan))})


def _default_labels(batch) -> torch.Tensor:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[1]
    labels = getattr(batch, "labels", None)
    if labels is None:
        raise TypeError("serve_ne_budget: a batch is neither (inputs, labels) nor has "
                        "`.labels`; pass labels=")
    return labels


def serve_ne_budget(plan: Plan, model: nn.Module, batches: Iterable, *,
                    forward: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
                    labels: Optional[Callable[[Any], torch.Tensor]] = None,
                    max_ne_change: float = DEFAULT_MAX_NE_CHANGE, confidence: float = 0.95,
                    max_baseline_ne: Optional[float] = 1.0,
                    progress: Optional[Callable[[str], None]] = None) -> ServeBudgetResult:
    """Move ``plan``'s costliest FP8 forwards back to the baseline until serving ``model``
    with it changes the NE on ``batches`` by at most ``max_ne_change`` (the upper end of
    the paired interval over examples).

    Args:
        plan: a serving plan (``loka.plan(report, inference=True[, static_scales=True])``);
            not changed. Its static scales stay with the sites that keep FP8.
        model: the trained model as it will be served (device, dtype); left as it was (a
            plan applied to it is taken off while it serves and put back after, and every
            module keeps its own train/eval mode).
        batches: held-out batches (materialised once; every check serves all of them).
        forward: ``forward(model, batch) -> logits``, one logit per example (default: for
            an ``(inputs, labels)`` pair ``model(*inputs)`` when inputs is a tuple, else
            ``model(inputs)``; ``model(batch)`` for any other batch).
        labels: ``labels(batch) -> 0/1 labels`` (default ``batch[1]`` or ``batch.labels``).
        max_ne_change: the budget, relative (2e-4: 0.02%).
        confidence: of the interval over examples.
        max_baseline_ne: the model without the plan must reach an NE below this on the
            batches (1.0: the base rate's), else :class:`BaselineNotLearnedError`; None
            checks nothing.
        progress: called with one line per stage.

    Returns:
        A :class:`ServeBudgetResult`; ``result.plan`` is the plan within the budget, its
        notes say how many forwards moved back and the bound it met.
    """
    if isinstance(max_ne_change, bool) or not isinstance(max_ne_change, (int, float)) or \
            not math.isfinite(max_ne_change) or max_ne_change <= 0:
        raise ValueError(f"max_ne_change must be a finite number > 0, got {max_ne_change!r}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    batches = list(batches)
    if not batches:
        raise ValueError("serve_ne_budget needs at least one batch")
    say = progress or (lambda _line: None)
    if forward is None:
        def forward(m, b):
            if not (isinstance(b, (tuple, list)) and len(b) == 2):
                return m(b)
            return m(*b[0]) if isinstance(b[0], (tuple, list)) else m(b[0])
    labels = labels or _default_labels
    root, _ = root_module(model)
    y = np.concatenate([np.asarray(labels(b).detach().float().reshape(-1).cpu(), np.float64)
                        for b in batches])

    def serve(plan_arm: bool) -> Optional[np.ndarray]:
        """Logits of every example; None where a plan made them non-finite."""
        with torch.no_grad():
            z = np.concatenate([np.asarray(forward(model, b).detach().float().reshape(-1).cpu(),
                                           np.float64) for b in batches])
        if z.shape != y.shape:
            raise ValueError(f"serve_ne_budget: {z.size} logits for {y.size} labels "
                             "(one logit per example)")
        if not np.isfinite(z).all():
            if plan_arm:  # the plan's doing: infinitely costly, not an error
                return None
            raise ValueError("serve_ne_budget: the model served non-finite logits")
        return z

    def served(p: Optional[Plan]) -> Optional[np.ndarray]:
        if p is None:
            return serve(False)
        apply(root, p, inference=True)
        try:
            return serve(True)
        finally:
            unapply(root)

    def change_of(z: Optional[np.ndarray]) -> Tuple[float, float, float]:
        if z is None:
            return math.inf, math.inf, math.inf
        return ratio_interval(base_ll, example_log_losses(z, y), confidence)

    # each module's own mode (a model may hold eval submodules in a training root), by name:
    # apply and unapply swap module objects, the names stay
    modes = {name: m.training for name, m in root.named_modules()}
    root.eval()
    try:
        with restore_on_exit(root):
            unapply(root)
            z0 = served(None)
            ne0 = float(normalized_entropy(z0, y, from_logits=True))
            if max_baseline_ne is not None and not ne0 < max_baseline_ne:
                raise BaselineNotLearnedError(
                    f"the model without the plan has NE {ne0:.4f} on these batches, not below "
                    f"{max_baseline_ne}: a change measured against it says nothing")
            base_ll = example_log_losses(z0, y)
            forwards = fp8_forwards(plan)
            costs = []
            for i, site in enumerate(forwards):
                say(f"cost {i + 1}/{len(forwards)}: {site}")
                z = served(only(plan, site, Role.FWD))
                costs.append(SiteRoleCost(site, Role.FWD.value, plan.sites[site].kernel(Role.FWD),
                                          math.inf if z is None else second_order_cost(z0, z, y),
                                          change_of(z)[0]))
            costs = [costs[i] for i in sorted(range(len(costs)),
                                              key=lambda i: (-costs[i].cost, i))]
            result = ServeBudgetResult(plan.copy(), costs, baseline_ne=ne0, examples=int(y.size))
            cost_of = {(c.site, Role.FWD): c.cost if math.isfinite(c.cost) else None
                       for c in costs}
            roles_of: Dict[str, List[Tuple[str, Role]]] = {}
            for site, role in fp8_site_roles(plan):  # a site moved back serves in bf16 whole
                roles_of.setdefault(site, []).append((site, role))
            for k in range(len(costs) + 1):
                moved = [c.site for c in costs[:k]]
                candidate = (without(plan, [pair for s in moved for pair in roles_of[s]],
                                     "serve NE budget", cost_of) if moved else plan.copy())
                if candidate.static_scales:  # only a forward in FP8 takes a scale
                    candidate.static_scales = static_scales_for(candidate,
                                                                candidate.static_scales)
                if k == len(costs):  # nothing left in FP8: no change at all
                    result.plan, result.moved_back = candidate, moved
                    result.checks.append({"moved_back": k, "sites": 0, "rel_ne_change": 0.0,
                                          "interval": [0.0, 0.0]})
                    break
                say(f"check {k + 1}: {len(costs) - k} FP8 forward(s)")
                change, lo, hi = change_of(served(candidate))
                result.checks.append({"moved_back": k, "sites": len(costs) - k,
                                      "rel_ne_change": change, "interval": [lo, hi]})
                if hi <= max_ne_change:
                    result.plan, result.moved_back = candidate, moved
                    break
    finally:
        for name, m in root.named_modules():
            if name in modes:
                m.training = modes[name]
    note = (f"serve NE budget: {len(result.moved_back)} of {len(costs)} FP8 forward(s) back; "
            f"relative NE change {result.rel_ne_change:+.3e} (upper {result.upper:+.3e} <= "
            f"{max_ne_change:g}) on {result.examples} examples")
    if costs and len(result.moved_back) == len(costs):
        narrowest = min((c["interval"][1] - c["interval"][0]) / 2 for c in result.checks[:-1])
        if narrowest > max_ne_change:  # no plan could have been certified on these examples
            note += (f"; the interval's half-width on them ({narrowest:.1e} at best) is over "
                     "the budget: measure on more examples")
    result.plan.notes.append(note)
    return result
