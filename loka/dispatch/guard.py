"""The safety valve: FP8 sites that misbehave in training go back to bf16 for good.

On *check steps* (the first, every ``check_every``-th, and the one after a non-finite loss)
each FP8 site records, on the device, whether it turned a finite input into a non-finite
output, whether a gradient GEMM did the same, and (with a static input scale) how much
of its input saturated. :meth:`Guard.step` reads those flags once, switches every
failing site to the baseline (``LinearConfig`` all 'bf16'), logs it with the step and the
reason, and records it in the plan's ``fallbacks``, so ``plan.save(...)`` makes the next
run start from it. A switched site is never checked or switched back within the run.

Only the site that *introduced* a non-finite value is blamed: downstream sites that merely
received one are not, and neither is a site whose weight or bias is non-finite (the
baseline would fail the same way: switching it fixes nothing). Non-finite values that no
FP8 site introduced are logged and left. Sites that ``apply(plan, strict=False)`` skipped
are not guarded (:attr:`Guard.unguarded` lists them).

Data parallel training: pass ``agreement`` (e.g. ``loka.distributed.RankAgreement()``)
so that every rank makes the same decisions: a non-finite loss on one rank makes every
rank skip the update, and a site failing on one rank is switched on all of them (the
ranks then keep running the same plan).

Costs: off check steps one attribute test per site; on check steps a few reductions per
site and one host synchronization in ``step``. Arming changes a Python flag that compiled
graphs guard on, so ``torch.compile`` keeps two graphs (armed and not) and switches
between them without recompiling; switching a site to bf16 recompiles once.

Usage (``step`` after ``backward``, before the optimizer)::

    guard = loka.dispatch.Guard(model, plan, check_every=100)
    for batch in batches:
        loss = loss_fn(model, batch)
        loss.backward()
        if guard.step(loss):       # False: skip this update (non-finite loss or a switch)
            opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol

import torch
from torch import nn

from ..config import LinearConfig
from .linear import Linear, SiteMonitor
from ..probe.hooks import canonical_name
from .schema import Plan
from .swap import applied_plan, root_module, skipped_sites

log = logging.getLogger("loka.dispatch")


@dataclass(frozen=True)
class GuardEvent:
    """One site switched to the baseline."""

    site: str
    step: int
    reason: str
    previous: LinearConfig


class Agreement(Protocol):
    """How the ranks of a data-parallel job agree on the Guard's decisions (collectives
    that every rank calls at the same point of the same step)."""

    def any(self, flag: bool) -> bool:
        """True when ``flag`` is True on any rank."""

    def union(self, failing: Dict[str, str]) -> Dict[str, str]:
        """Every rank's failing sites (site -> reason), the same on every rank."""


def _log_switch(event: GuardEvent) -> None:
    log.warning("loka guard: step %d: %s -> bf16 (%s)", event.step, event.site, event.reason)


class Guard:
    """Watch the FP8 sites of a planned model and switch failing ones to the baseline.

    Args:
        model: the model with ``plan`` applied (or its torch.compile wrapper).
        plan: the applied plan; switches are recorded in its ``fallbacks``.
        check_every: check every N-th step (the first step is always checked); None:
            only after a non-finite loss.
        saturation_threshold: largest tolerated fraction of input elements beyond a
            static input scale (sites with dynamic scaling cannot saturate).
        on_switch: called with each :class:`GuardEvent` (default: a logging warning).
        check_loss: test the loss passed to :meth:`step` for finiteness every step (one
            scalar host synchronization; pass False to test only on check steps).
        agreement: an :class:`Agreement` across data-parallel ranks (None: this process
            decides alone).

    Attributes:
        sites: the guarded sites (FP8 sites of the plan, applied, not yet switched).
        unguarded: FP8 sites of the plan that ``apply(model, plan, strict=False)`` skipped,
            and why; they run no FP8 kernel and are not guarded.
    """

    def __init__(self, model: nn.Module, plan: Plan, check_every: Optional[int] = 100,
                 saturation_threshold: float = 1e-3,
                 on_switch: Optional[Callable[[GuardEvent], None]] = None,
                 check_loss: bool = True, agreement: Optional[Agreement] = None) -> None:
        if check_every is not None and (isinstance(check_every, bool) or
                                        not isinstance(check_every, int) or check_every < 1):
            raise ValueError(f"check_every must be a positive int or None, got {check_every!r}")
        if not (0 <= saturation_threshold <= 1):
            raise ValueError(f"saturation_threshold must be in [0, 1], got {saturation_threshold!r}")
        root, _ = root_module(model)
        self.plan = plan
        self.check_every = check_every
        self.saturation_threshold = float(saturation_threshold)
        self.on_switch = on_switch or _log_switch
        self.check_loss = check_loss
        self.agreement = agreement
        self.step_index = 0
        self.events: List[GuardEvent] = []
        self.switched: set = set()
        self._unattributed: List[str] = []
        self.sites: Dict[str, Linear] = {}
        seen = set()
        modules = {canonical_name(n): m for n, m in root.named_modules(remove_duplicate=False)}
        # sites a non-strict apply of this plan skipped run on nothing of the plan: not guarded
        skipped = skipped_sites(root) if applied_plan(root) is plan else {}
        self.unguarded: Dict[str, str] = {}  # FP8 sites a non-strict apply skipped, and why
        not_applied = []
        for site in plan.fp8_sites():
            if isinstance(modules.get(canonical_name(site)), Linear):
                continue
            if site in skipped:
                self.unguarded[site] = skipped[site]
            else:
                not_applied.append(site)
        if not_applied:
            raise ValueError(f"the plan's FP8 sites {not_applied[:6]} are not loka.Linear in this "
                             "model: loka.apply(model, plan) first")
        for site in plan.fp8_sites():
            if site in self.unguarded:
                continue
            mod = modules[canonical_name(site)]
            if id(mod) in seen or mod._all_baseline:
                continue
            seen.add(id(mod))
            mod.monitor = SiteMonitor()
            self.sites[site] = mod
        self._pending = True  # the first step is checked
        self._arm(self._pending)

    # -- arming --------------------------------------------------------------------
    def _arm(self, on: bool) -> None:
        for mod in self.sites.values():
            if on:
                mod.monitor.arm(mod.weight.device)
            else:
                mod.monitor.disarm()

    @property
    def armed(self) -> bool:
        return self._pending

    # -- the check -------------------------------------------------------------------
    def _evaluate(self) -> Dict[str, str]:
        """Read the recorded flags (one sync); site -> reason for each failing site."""
        names, values = [], []
        for site, mod in self.sites.items():
            mon = mod.monitor
            zero = torch.zeros((), device=mon.grad_flags.device)
            fwd = zero if mon.fwd_bad is None else mon.fwd_bad.float()
            sat = zero if mon.saturation is None else mon.saturation.float()
            grads = mon.grad_flags.grad if mon.grad_flags.grad is not None else zero.expand(2)
            names.append(site)
            values.append(torch.stack([fwd, sat, grads[0], grads[1]]))
        if not names:
            return {}
        table = torch.stack(values).tolist()
        failing = {}
        for site, (fwd, sat, dgrad, wgrad) in zip(names, table):
            cfg = self.sites[site].config
            reasons = []
            if fwd > 0 and cfg.fwd != self.plan.baseline:
                reasons.append(f"non-finite output from a finite input (fwd {cfg.fwd})")
            if sat > self.saturation_threshold:
                reasons.append(f"FP8 saturation {sat:.3%} > {self.saturation_threshold:.3%} "
                               f"(static input scale, fwd {cfg.fwd})")
            if dgrad > 0 and cfg.dgrad != self.plan.baseline:
                reasons.append(f"non-finite input gradient from a finite one (dgrad {cfg.dgrad})")
            if wgrad > 0 and cfg.wgrad != self.plan.baseline:
                reasons.append(f"non-finite weight gradient from finite operands (wgrad {cfg.wgrad})")
            if reasons:
                failing[site] = "; ".join(reasons)
        return failing

    def _switch(self, failing: Dict[str, str], step: int) -> None:
        for site, reason in failing.items():
            mod = self.sites.pop(site)
            previous = mod.config
            mod.monitor = None
            mod.set_config(LinearConfig.uniform(self.plan.baseline))
            self.switched.add(site)
            if site in self.plan.sites:
                self.plan.record_fallback(site, step, reason)
            event = GuardEvent(site, step, reason, previous)
            self.events.append(event)
            self.on_switch(event)

    def step(self, loss: "torch.Tensor | float | None" = None,
             recheck: Optional[Callable[[], object]] = None) -> bool:
        """End of one training step: check if due, switch failing sites.

        Args:
            loss: this step's loss (tested for finiteness if ``check_loss``).
            recheck: called on a non-finite loss of a step that was not checked; it should
                rerun the step's forward (and backward, for the gradient checks) on the
                same batch, so that the guard can find the site at fault at once (its
                gradients add to the step's, which is to be skipped anyway). Without it,
                the next step is checked instead.

        Returns:
            True when the step is healthy (finite loss, no site switched): apply the
            optimizer update; False: skip it.
        """
        step = self.step_index
        bad_loss = False
        if loss is not None and (self.check_loss or self._pending):
            bad_loss = not bool(torch.isfinite(torch.as_tensor(loss)).all())
            if self.agreement is not None:  # one rank's non-finite loss: every rank skips
                bad_loss = self.agreement.any(bad_loss)
        failing: Dict[str, str] = {}
        evaluated = self._pending or (bad_loss and recheck is not None)
        if not self._pending and evaluated:
            self._arm(True)
            recheck()
        if evaluated:
            failing = self._evaluate()
            if self.agreement is not None:  # a site failing on one rank switches on all
                failing = {s: r for s, r in self.agreement.union(failing).items()
                           if s in self.sites}
        self._arm(False)
        self._switch(failing, step)
        if bad_loss and not failing and evaluated:
            self._unattributed.append(f"step {step}: non-finite loss not introduced by an FP8 site")
            log.warning("loka guard: step %d: non-finite loss, no FP8 site introduced it", step)
        recheck_next = bad_loss and not evaluated
        self.step_index += 1
        due = self.check_every is not None and self.step_index % self.check_every == 0
        self._pending = bool(self.sites) and (due or recheck_next)
        if self._pending:
            self._arm(True)
        return not bad_loss and not failing

    def close(self) -> None:
        """Detach the monitors (the sites keep their current kernels)."""
        for mod in self.sites.values():
            mod.monitor = None
        self.sites.clear()
        self._pending = False

    @property
    def notes(self) -> List[str]:
        return list(self._unattributed)
