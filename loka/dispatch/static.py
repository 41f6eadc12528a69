"""Static serving scales: what a plan can set (``apply(..., static_scales=...)``,
``Plan.static_scales``) from the input amax a Probe report observed."""

from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional

import torch
from torch import nn

from ..config import Role
from ..kernels import registry
from .linear import Linear, takes_static_input_scale
from .schema import Plan

__all__ = ["amax_from_report", "group_amax", "observed_amax", "plan_takes_static",
           "static_scales_for", "static_saturation"]


def plan_takes_static(plan: Plan, site: str) -> bool:
    """Whether ``site``'s planned forward is an FP8 kernel that takes a static input scale
    (False for the baseline, a site the plan lacks, or a kernel not registered here)."""
    sp = plan.sites.get(site)
    fwd = None if sp is None else sp.roles.get(Role.FWD)
    if fwd is None or fwd.kernel == plan.baseline:
        return False
    try:
        return takes_static_input_scale(registry.get(fwd.kernel))
    except KeyError:
        return False


def amax_from_report(report, key: str = "act.amax", margin: float = 1.0) -> Dict[str, float]:
    """Per-site input amax for ``apply(..., static_scales=...)`` from a Probe report.

    Args:
        report: a :class:`~loka.probe.report.ProbeReport`.
        key: dotted path into each site's ``stats`` to the observed input amax (the
            Probe's summary keeps it at ``stats['act']['amax']``).
        margin: multiply the amax by this (> 1 leaves headroom for unseen outliers).

    Returns:
        {site: amax} for every site whose stats have a finite positive value at ``key``.
    """
    if not margin > 0:
        raise ValueError(f"margin must be positive, got {margin!r}")
    out = {name: v * margin for name, v in group_amax(report, key).items() if v is not None}
    if not out and report.sites:
        raise KeyError(f"no site of the report has a finite positive stats value at {key!r}")
    return out


def group_amax(report, key: str = "act.amax") -> Dict[str, Optional[float]]:
    """Every report site's observed input amax (:func:`observed_amax`), where sites read one
    tensor (the Probe's ``producers['x_group']``) the largest any of them observed.

    Those sites saw row samples of one tensor, so the largest is the better estimate of its
    amax; and with one value they hold one static scale (:meth:`loka.Linear.set_input_amax`
    shares a table of equal scales between Linears), so their casts are one expression of
    the same inputs, which compiled code makes once for all of them instead of once per
    site (the lowering of ``loka::scaled_mm``, :mod:`loka.kernels.ops`).
    """
    values = {name: observed_amax(site, key) for name, site in report.sites.items()}
    groups: Dict[str, float] = {}
    for name, site in report.sites.items():
        g, v = site.producers.get("x_group"), values[name]
        if g is not None and v is not None:
            groups[g] = max(groups.get(g, v), v)
    for name, site in report.sites.items():
        g = site.producers.get("x_group")
        if g in groups and values[name] is not None:
            values[name] = groups[g]
    return values


def observed_amax(site, key: str = "act.amax") -> Optional[float]:
    """A report site's value at the dotted ``key`` into its ``stats`` (the Probe keeps the
    observed input amax at ``stats['act']['amax']``), where it is finite and positive."""
    v = site.stats
    for part in key.split("."):
        v = v.get(part) if isinstance(v, Mapping) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"):
        return float(v)
    return None


def static_scales_for(plan: Plan, amax: Mapping[str, float]) -> Dict[str, float]:
    """The entries of ``amax`` (site -> input amax) at the sites whose planned forward is an
    FP8 kernel that takes a static input scale: what ``apply(..., static_scales=...)`` can
    set for ``plan``."""
    return {site: value for site, value in amax.items()
            if site in plan.sites and plan_takes_static(plan, site)}


def static_saturation(model: nn.Module, run: Callable[[], object]) -> Dict[str, float]:
    """Per FP8 site of ``model`` that serves with a static input scale: the largest share,
    over the calls ``run()`` makes, of its input elements beyond its amax (they saturate).
    ``run`` serves the data (e.g. ``lambda: [model(b) for b in batches]``); the hooks that
    count are removed after it, and a site ``run`` never calls is absent."""
    worst: Dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.input_amax is not None:
            def count(m, args, name=name):
                x = args[0].detach()
                share = float((x.abs() > m.input_amax).sum()) / max(x.numel(), 1)
                worst[name] = max(worst.get(name, 0.0), share)
            hooks.append(mod.register_forward_pre_hook(count))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    return worst
