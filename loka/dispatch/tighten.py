"""The end-to-end accuracy budget: move FP8 sites back to the baseline until the model's
output on held-out batches changes by at most a given relative amount.

A per-GEMM error budget does not bound the change of the whole model; this measures it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..config import ROLES, LinearConfig, Role
from .schema import Plan, RoleChoice
from .swap import apply, restore_on_exit, root_module, unapply

Batch = Any

def _default_forward(model: nn.Module, batch: Batch):
    return model(batch)


def _tensors(out) -> List[torch.Tensor]:
    """The floating-point tensors of a model output (a tensor, tuple/list or dict)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


class _Measure:
    """Baseline outputs on held-out batches, and the change of a configured model."""

    def __init__(self, model, batches, loss_fn, forward):
        self.model, self.batches, self.loss_fn = model, list(batches), loss_fn
        self.forward = forward or _default_forward
        if not self.batches:
            raise ValueError("tighten_end_to_end needs at least one held-out batch")
        self.reference = [self._run(b) for b in self.batches]

    @torch.no_grad()
    def _run(self, batch):
        if self.loss_fn is not None:
            loss = self.loss_fn(self.model, batch)
            return [torch.as_tensor(loss).detach().double().reshape(())]
        outs = _tensors(self.forward(self.model, batch))
        if not outs:
            raise ValueError("the model's output has no floating-point tensor to compare; "
                             "pass loss_fn or forward")
        return [o.detach().double() for o in outs]

    def change(self) -> float:
        """Relative output change ||y - y_ref|| / ||y_ref|| over all batches, or with a
        loss_fn the mean relative change of the loss per batch; inf if non-finite."""
        if self.loss_fn is not None:
            rel = []
            for b, (ref,) in zip(self.batches, self.reference):
                (got,) = self._run(b)
                rel.append(float((got - ref).abs() / ref.abs().clamp_min(1e-30)))
            val = sum(rel) / len(rel)
        else:
            num = den = 0.0
            for b, ref in zip(self.batches, self.reference):
                for g, r in zip(self._run(b), ref):
                    num += float((g - r).square().sum())
                    den += float(r.square().sum())
            val = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
        return val if math.isfinite(val) else math.inf


def tighten_end_to_end(plan: Plan, model: nn.Module, batches: Iterable[Batch],
                       max_output_change: float, loss_fn: Optional[Callable] = None,
                       forward: Optional[Callable] = None) -> Tuple[Plan, List[dict]]:
    """Move sites back to the baseline until the model's output changes by at most
    ``max_output_change`` (relative) on held-out batches.

    Each FP8 site's *contribution* is measured one at a time (only that site's forward
    on FP8); sites are then reverted, largest contribution first, re-measuring the whole
    plan after each, until the bound holds. Only the forward pass is observable this way:
    a site with FP8 only in dgrad/wgrad contributes zero and is kept.

    Args:
        plan: the plan to tighten (not modified).
        model: the model the plan is for, unplanned or planned; it is left as found.
        batches: held-out inputs; ``forward(model, batch)`` (default ``model(batch)``)
            gives the output, or ``loss_fn(model, batch)`` a scalar loss.
        max_output_change: bound on the relative output (or loss) change, >= 0.
        loss_fn: compare the loss instead of the outputs.
        forward: how to run a batch (default ``model(batch)``).

    Returns:
        (new plan, log): the log has one dict per measurement with ``site``, ``action``
        ('measure', 'contribution', 'revert'), ``change``.
    """
    if not (isinstance(max_output_change, (int, float)) and max_output_change >= 0
            and math.isfinite(max_output_change)):
        raise ValueError(f"max_output_change must be a finite number >= 0, got {max_output_change!r}")
    root, _ = root_module(model)
    was_training = root.training
    new = plan.copy()
    log: List[dict] = []
    with restore_on_exit(root):
        try:
            unapply(root)
            root.eval()
            measure = _Measure(root, batches, loss_fn, forward)
            apply(root, new)
            modules = dict(root.named_modules())
            fwd_sites = [s for s in new.fp8_sites() if new.sites[s].kernel(Role.FWD, new.baseline)
                         != new.baseline]
            total = measure.change()
            log.append({"site": None, "action": "measure", "change": total})
            if total > max_output_change and fwd_sites:
                full = {s: modules[s].config for s in fwd_sites}
                off = {s: dataclasses.replace(c, fwd=new.baseline) for s, c in full.items()}
                for s in fwd_sites:
                    modules[s].set_config(off[s])
                contribution = {}
                for s in fwd_sites:
                    modules[s].set_config(full[s])
                    contribution[s] = measure.change()
                    modules[s].set_config(off[s])
                    log.append({"site": s, "action": "contribution", "change": contribution[s]})
                for s in fwd_sites:
                    modules[s].set_config(full[s])
                for s in sorted(fwd_sites, key=lambda s: -contribution[s]):
                    if total <= max_output_change:
                        break
                    modules[s].set_config(LinearConfig.uniform(new.baseline))
                    total = measure.change()
                    for role in ROLES:
                        old = new.sites[s].roles.get(role)
                        new.sites[s].roles[role] = RoleChoice(
                            new.baseline, budget=None if old is None else old.budget,
                            reason=f"end-to-end budget: contributed {contribution[s]:.3g} of "
                                   f"output change")
                    log.append({"site": s, "action": "revert", "change": total})
            reverted = [e["site"] for e in log if e["action"] == "revert"]
            new.budget["max_output_change"] = float(max_output_change)
            new.notes.append(f"end-to-end: output change {total:.4g} (bound {max_output_change:g}) "
                             f"after reverting {len(reverted)} site(s) to {new.baseline}")
        finally:
            root.train(was_training)
    return new, log

