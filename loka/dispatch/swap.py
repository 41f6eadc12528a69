"""Applying a plan: ``nn.Linear`` -> ``loka.Linear`` in place, and back.

``apply`` swaps each Linear whose plan uses a non-baseline kernel for a ``loka.Linear``
made by :meth:`~loka.dispatch.linear.Linear.from_linear`: the same Parameter objects
(optimizers built earlier keep working), the same hooks, the same ``state_dict`` keys and
values. Other Linears are left alone. ``unapply`` restores plain ``nn.Linear`` modules.
Kernels are chosen here, once; nothing is looked up per call.

For a compiled model (``torch.compile(model)``) both operate on ``model._orig_mod``; the
compiled wrapper notices the changed modules and recompiles on its next call. A
``DistributedDataParallel`` wrapper is looked through the same way, and plans name sites
without what wrappers add to qualified names (:func:`~loka.probe.hooks.canonical_name`:
``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``),
so a plan made on one form of a model applies to the others.

Inference (``inference=True``): only the forward role matters, so only sites with an
FP8 forward are swapped; their weights are quantized once (``Linear.quantize_weight``)
and reused by every call. ``drop_weights=True`` then frees the high-precision weights
(the ``state_dict`` changes: ``<site>.weight`` is replaced by ``<site>.weight_fp8`` and
``<site>.weight_scale``, and ``unapply`` refuses). Activations are quantized dynamically
(per row for rowwise kernels) unless ``static_scales`` gives a per-site input amax
(see :func:`~loka.dispatch.static.amax_from_report`). Weights must not change afterwards: apply again to
requantize.

Training with delayed scaling (the plan's ``delayed_scaling``, or ``apply``'s, which
overrides it): every loka.Linear of the plan quantizes the operands that its FP8 roles all
scale tensorwise with a scale estimated at earlier calls
(:meth:`~loka.dispatch.linear.Linear.set_delayed_scaling`); the report's notes say how
many sites and operands that is.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..config import LinearConfig, Role
from ..kernels import registry
from ..numerics.delayed import (DEFAULT_DECAY, FUSING_TORCH, check_decay,
                               inductor_fuses_the_estimate)
from ..probe.hooks import canonical_name
from .linear import Linear
from .schema import Plan, PlanMismatchError
from .static import plan_takes_static

_STATE_ATTR = "_loka_dispatch"
_MAX_LISTED = 6


@dataclass(frozen=True)
class Change:
    """What ``apply`` does (or did) to one site."""

    site: str
    action: str
    """'swap' (nn.Linear -> loka.Linear), 'reconfigure' (a loka.Linear's kernels change),
    'keep' (left as it is)"""
    before: Optional[LinearConfig]
    """kernels before; None for a plain nn.Linear"""
    after: Optional[LinearConfig]
    """kernels after; None for a plain nn.Linear"""

    def __str__(self) -> str:
        def fmt(c):
            return "nn.Linear" if c is None else f"fwd={c.fwd} dgrad={c.dgrad} wgrad={c.wgrad}"
        return f"{self.action:<11} {self.site}: {fmt(self.before)} -> {fmt(self.after)}"


@dataclass
class ApplyReport:
    """Which sites ``apply`` changed, to what, and what it skipped."""

    changes: List[Change] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    """site -> why it was not applied (``strict=False`` only)"""
    inference: bool = False
    compiled: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def changed(self) -> List[str]:
        return [c.site for c in self.changes if c.action != "keep"]

    def summary(self) -> str:
        lines = [f"{len(self.changed)} site(s) changed" + (" (inference)" if self.inference else "")]
        lines += [str(c) for c in self.changes if c.action != "keep"]
        lines += [f"skipped {s}: {why}" for s, why in self.skipped.items()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def root_module(model: nn.Module) -> Tuple[nn.Module, bool]:
    """The module to edit, and whether ``model`` is a torch.compile wrapper (looking
    through ``DistributedDataParallel``, torchrec's ``DistributedModelParallel`` and compile
    wrappers, in any order)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    compiled = False
    while True:
        orig = getattr(model, "_orig_mod", None)
        if isinstance(orig, nn.Module):
            model, compiled = orig, True
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_dmp_wrapped_module", None), nn.Module):
            model = model._dmp_wrapped_module  # torchrec's DistributedModelParallel
        else:
            return model, compiled


def site_paths(root: nn.Module) -> Dict[str, str]:
    """canonical site name (:func:`~loka.probe.hooks.canonical_name`) -> the module's
    qualified name in ``root`` (its first, for shared modules)."""
    paths: Dict[str, str] = {}
    for name, _ in root.named_modules(remove_duplicate=False):
        paths.setdefault(canonical_name(name), name)
    return paths


def _state(root: nn.Module, create: bool = False) -> dict:
    """The bookkeeping ``apply`` keeps on the root module (not in its state_dict)."""
    if create:
        return root.__dict__.setdefault(_STATE_ATTR, {})
    return root.__dict__.get(_STATE_ATTR, {})


def _aliases(root: nn.Module) -> Dict[str, List[str]]:
    """fqn -> every fqn of the same module object (shared modules have several)."""
    by_id: Dict[int, List[str]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        by_id.setdefault(id(mod), []).append(name)
    return {name: by_id[id(mod)] for name, mod in root.named_modules(remove_duplicate=False)}


def _is_plain_linear(mod: nn.Module) -> bool:
    # subclasses with their own forward compute something else: never swap them
    return isinstance(mod, Linear) or type(mod).forward is nn.Linear.forward


def _is_torchao_float8(mod: nn.Module) -> bool:
    """torchao's float8 training Linear (judged by class, without importing torchao)."""
    return type(mod).__name__ == "Float8Linear" and type(mod).__module__.startswith("torchao.")


def _listed(items: List[str]) -> str:
    more = len(items) - _MAX_LISTED
    return ", ".join(items[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def _target_config(plan: Plan, site: str, inference: bool) -> LinearConfig:
    cfg = plan.config(site)
    if inference:  # forward only: the gradient kernels never run
        return LinearConfig(fwd=cfg.fwd, dgrad=plan.baseline, wgrad=plan.baseline)
    return cfg


def _plan_changes(root: nn.Module, plan: Plan, inference: bool,
                  strict: bool) -> Tuple[List[Change], Dict[str, str]]:
    """Validate ``plan`` against ``root`` and list the changes, touching nothing."""
    if not isinstance(plan, Plan):
        raise TypeError(f"expected a loka.Plan, got {type(plan).__name__}")
    modules = {canonical_name(n): m for n, m in root.named_modules(remove_duplicate=False)}
    missing, wrong_type, wrong_shape, bad_kernel = [], {}, {}, []
    for site, sp in plan.sites.items():
        mod = modules.get(canonical_name(site))
        if mod is None:
            missing.append(site)
        elif not isinstance(mod, nn.Linear) or not _is_plain_linear(mod):
            wrong_type[site] = f"a {type(mod).__name__}, not an nn.Linear"
        elif (mod.in_features, mod.out_features) != (sp.in_features, sp.out_features):
            wrong_shape[site] = (f"plan {sp.in_features}->{sp.out_features}, "
                                 f"model {mod.in_features}->{mod.out_features}")
    torchao = [s for s in wrong_type if _is_torchao_float8(modules[canonical_name(s)])]
    if torchao:  # never skipped silently, strict or not: the fix is one call
        raise PlanMismatchError(f"{len(torchao)} site(s) are torchao Float8Linear modules "
                                f"({_listed(torchao)}): call loka.integrations.from_torchao(model) "
                                "first (nn.Linear again, same Parameters), then apply")
    problems = []
    if missing:
        problems.append(f"{len(missing)} site(s) not in the model: {_listed(missing)}")
    if wrong_type:
        problems.append(f"not an nn.Linear: {_listed([f'{s} ({t})' for s, t in wrong_type.items()])}")
    if wrong_shape:
        problems.append(f"shape mismatch: {_listed([f'{s} ({t})' for s, t in wrong_shape.items()])}")
    if problems and strict:
        raise PlanMismatchError("plan does not match this model: " + "; ".join(problems))
    skipped: Dict[str, str] = {s: "not in the model" for s in missing}
    skipped.update(wrong_type)
    skipped.update(wrong_shape)
    records = _state(root).get("sites") or {}
    changes: List[Change] = []
    for site in plan.sites:
        if site in skipped:
            continue
        mod = modules[canonical_name(site)]
        if site == "" and not isinstance(mod, Linear):
            raise PlanMismatchError("the plan's site '' is the model itself: a root Linear "
                                    "cannot be replaced in place; wrap it in a module")
        after = _target_config(plan, site, inference)
        if site in records:  # apply undoes an earlier apply first: compare with that state
            before = records[site]["previous"]
        else:
            before = mod.config if isinstance(mod, Linear) else None
        baseline_only = all(k == plan.baseline for k in after.to_dict().values())
        why = None if baseline_only else _device_problem(mod, after)
        if why is not None:
            bad_kernel.append(f"{site} ({why})")
            skipped[site] = why
        elif before is None:
            changes.append(Change(site, "keep" if baseline_only else "swap", None,
                                  None if baseline_only else after))
        else:
            changes.append(Change(site, "keep" if before == after else "reconfigure", before, after))
    if bad_kernel and strict:
        raise PlanMismatchError(f"kernels that cannot run on the model's device: {_listed(bad_kernel)}")
    return changes, skipped


def _device_problem(mod: nn.Linear, config: LinearConfig) -> Optional[str]:
    """Why a kernel of ``config`` cannot run where ``mod``'s weight lives, or None."""
    weight = mod.weight if mod.weight is not None else getattr(mod, "weight_q", None)
    if weight is None or weight.device.type == "meta":
        return None
    for kname in dict.fromkeys(config.to_dict().values()):
        try:
            ok = registry.get(kname).device_ok(weight.device)
        except KeyError as e:
            return str(e.args[0])
        if not ok:
            return f"{kname}: {ok.reason}"
    return None


def check(model: nn.Module, plan: Plan, inference: bool = False,
          strict: bool = True) -> List[Change]:
    """Dry run of :func:`apply`: the changes it would make, without modifying ``model``.

    Raises :class:`~loka.dispatch.schema.PlanMismatchError` (with ``strict``) when the plan
    names sites the model lacks, or whose shapes or kernels do not fit.
    """
    root, _ = root_module(model)
    return _plan_changes(root, plan, inference, strict)[0]


def apply(model: nn.Module, plan: Plan, inference: bool = False, strict: bool = True,
          drop_weights: bool = False,
          static_scales: Optional[Mapping[str, "float | torch.Tensor"]] = None,
          delayed_scaling: "bool | float | None" = None) -> ApplyReport:
    """Apply ``plan`` to ``model`` in place (see the module docstring).

    Args:
        model: the model, or its ``torch.compile`` wrapper.
        plan: a :class:`~loka.dispatch.schema.Plan` made for this model.
        inference: forward only; weights quantized once.
        strict: raise on sites the model lacks or whose shapes differ; False skips them.
        drop_weights: with ``inference``, free the high-precision weights.
        static_scales: with ``inference``, site -> input amax for static activation scales
            (sites not listed stay dynamic); None: the plan's own (``Plan.static_scales``,
            from ``loka.plan(..., static_scales=True)``), {}: dynamic everywhere.
        delayed_scaling: training only: True (default decay) or a decay in (0, 1] turns on
            delayed tensorwise scaling (module docstring), False turns it off; None: as the
            plan says (ignored with ``inference``).

    Returns:
        An :class:`ApplyReport`. Applying again first undoes the previous apply.
    """
    root, compiled = root_module(model)
    if static_scales is None and inference:
        # the plan's own, where its forward still takes one (a plan edited since, or tuned
        # to other kernels, may have moved a site)
        static_scales = {site: amax for site, amax in
                         (getattr(plan, "static_scales", None) or {}).items()
                         if plan_takes_static(plan, site)}
    if (drop_weights or static_scales) and not inference:
        raise ValueError("drop_weights and static_scales need inference=True")
    decay = _delayed_decay(delayed_scaling)
    if decay is not None and inference:
        raise ValueError("delayed_scaling is for training; serving takes static_scales")
    planned_decay = getattr(plan, "delayed_scaling", None)
    if planned_decay is not None:
        planned_decay = check_decay(planned_decay, "plan.delayed_scaling")
    for site, amax in (static_scales or {}).items():
        if site not in plan.sites:
            raise KeyError(f"static_scales names sites not in the plan: {site}")
        value = torch.as_tensor(amax, dtype=torch.float64)
        if value.numel() != 1 or not bool(torch.isfinite(value)) or float(value) <= 0:
            raise ValueError(f"static_scales[{site!r}] must be one finite positive amax, "
                             f"got {value.tolist()}")
        fwd = plan.sites[site].roles.get(Role.FWD)
        kernel = plan.baseline if fwd is None else fwd.kernel
        if kernel != plan.baseline and not plan_takes_static(plan, site):
            raise ValueError(f"static_scales[{site!r}]: the planned forward kernel {kernel!r} "
                             "takes no static input scale")
    # validate everything before touching the model, so that a bad plan changes nothing
    changes, _ = _plan_changes(root, plan, inference, strict)
    if delayed_scaling is None and not inference:
        decay = planned_decay
    paths = site_paths(root)
    for c in changes:
        if c.action != "keep":
            # raises for bad kernels
            Linear.validate(root.get_submodule(paths[canonical_name(c.site)]), c.after)
    if _state(root).get("plan") is not None:
        unapply(root)
    changes, skipped = _plan_changes(root, plan, inference, strict)
    aliases = _aliases(root)
    records: Dict[str, dict] = {}
    swapped: Dict[int, Linear] = {}
    for c in changes:
        if c.action == "keep":
            continue
        path = paths[canonical_name(c.site)]
        mod = root.get_submodule(path)
        if c.action == "swap":
            new = swapped.get(id(mod))
            if new is None:
                new = swapped[id(mod)] = Linear.from_linear(mod, c.after)
            for name in aliases[path]:
                root.set_submodule(name, new)
            records[c.site] = {"created": True, "previous": None, "aliases": aliases[path],
                               "path": path}
        else:
            records[c.site] = {"created": False, "previous": c.before, "aliases": aliases[path],
                               "path": path}
            mod.set_config(c.after)
    report = ApplyReport(changes, skipped, inference, compiled)
    if inference:
        for site, rec in records.items():
            mod = root.get_submodule(rec["path"])
            if mod.config.fwd == plan.baseline:
                continue
            mod.quantize_weight()
            if static_scales and site in static_scales:
                # the scale table covers the rows the plan was made for
                mod.set_input_amax(static_scales[site], rows=plan.sites[site].tokens)
            if drop_weights:
                mod.drop_weight()
        if drop_weights:
            report.notes.append("high-precision weights dropped: state_dict keys changed "
                                "(weight -> weight_fp8, weight_scale); unapply is not possible")
    previous_delayed: Dict[str, Optional[float]] = {}
    if not inference:  # every planned loka.Linear trains as the plan (or the caller) says
        delayed, planned, done = {}, 0, set()
        for c in changes:
            if c.after is None:
                continue
            path = paths[canonical_name(c.site)]
            mod = root.get_submodule(path)
            if id(mod) in done:  # one module under two sites: set once
                continue
            done.add(id(mod))
            planned += 1
            if not (c.site in records and records[c.site]["created"]):
                previous_delayed[path] = mod.delayed_decay  # restored by unapply
            if mod.delayed_decay != decay:  # (set_config restarted the others' estimates)
                mod.set_delayed_scaling(decay)
            ops = mod.delayed_operands
            if ops:
                delayed[c.site] = ops
        if decay is not None:
            report.notes.append(f"delayed scaling (decay {decay:g}) on {len(delayed)} of "
                                f"{planned} site(s), {sum(map(len, delayed.values()))} "
                                "operand(s); the others scale dynamically")
            if delayed and not inductor_fuses_the_estimate():
                report.notes.append(
                    f"delayed scaling under torch {torch.__version__}: its Inductor takes each "
                    "new estimate in a reduction of its own, so a compiled step keeps an amax "
                    "pass per operand and was measured no faster than dynamic scaling (torch "
                    f"{'.'.join(map(str, FUSING_TORCH))} fuses it; docs/dispatch.md)")
    if compiled:
        report.notes.append("compiled model: changes were made on model._orig_mod; it "
                            "recompiles on its next call")
    state = _state(root, create=True)
    state.update(sites=records, plan=plan, skipped=dict(skipped),
                 previous_delayed=previous_delayed,
                 options={"inference": inference, "strict": strict, "drop_weights": drop_weights,
                          "static_scales": dict(static_scales or {}),
                          "delayed_scaling": delayed_scaling})
    return report


def _delayed_decay(option) -> Optional[float]:
    """``apply``'s ``delayed_scaling``: False or None -> None, True -> the default
    decay, a number in (0, 1] -> itself."""
    if option is False or option is None:
        return None
    if option is True:
        return DEFAULT_DECAY
    return check_decay(option, "delayed_scaling (True, False or a decay)")


def unapply(model: nn.Module) -> List[str]:
    """Undo :func:`apply`: plain ``nn.Linear`` modules again (same Parameters and hooks),
    and loka.Linear modules that existed before back on their previous kernels.

    Returns:
        The sites restored.
    """
    root, _ = root_module(model)
    records = _state(root).get("sites") or {}
    dropped = [s for s, rec in records.items() if rec["created"]
               and root.get_submodule(rec.get("path", s)).weight is None]
    if dropped:
        raise ValueError(f"cannot unapply: the high-precision weights of {_listed(dropped)} "
                         "were dropped (drop_weights=True); reload the original state_dict")
    restored = []
    for site, rec in records.items():
        mod = root.get_submodule(rec.get("path", site))
        if rec["created"]:
            plain = mod.to_linear()
            for name in rec["aliases"]:
                root.set_submodule(name, plain)
        else:
            mod.set_config(rec["previous"])
        restored.append(site)
    for path, decay in (_state(root).get("previous_delayed") or {}).items():
        mod = root.get_submodule(path)
        if mod.delayed_decay != decay:  # unchanged: its estimates stay as they are
            mod.set_delayed_scaling(decay)
    root.__dict__.pop(_STATE_ATTR, None)
    return restored


@contextlib.contextmanager
def restore_on_exit(model: nn.Module) -> Iterator[None]:
    """Leave ``model`` with the plan (and apply options) it had on entry, or none, whatever
    is applied and unapplied in between (the whole-model searches try plan after plan)."""
    root, _ = root_module(model)
    state = _state(root)
    previous, options = state.get("plan"), dict(state.get("options", {}))
    try:
        yield
    finally:
        unapply(root)
        if previous is not None:
            apply(root, previous, **options)


def applied_plan(model: nn.Module) -> Optional[Plan]:
    """The plan last applied to ``model`` (None if none is applied)."""
    return _state(root_module(model)[0]).get("plan")


def skipped_sites(model: nn.Module) -> Dict[str, str]:
    """Sites of the plan last applied to ``model`` that ``apply(strict=False)`` skipped,
    and why (empty if none was skipped, or no plan is applied)."""
    return dict(_state(root_module(model)[0]).get("skipped") or {})
