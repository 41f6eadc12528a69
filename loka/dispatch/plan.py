"""Planning: from a Probe report and an accuracy budget to one kernel per site and role.

Shaped like a sharding planner: *enumerate* the kernels the report measured at each site
and role, *estimate* with the report's numbers, *propose* per role the fastest kernel
whose error bound meets its budget, else the baseline.

Selection rule for one (site, role):

1. A candidate is a registered kernel other than the baseline that the report measured
   there without failing, that runs on the target device, serves the role, fits the
   role's GEMM shape (alignment), and is in ``allowed_kernels`` if given.
2. It is *safe* when the upper end of the confidence interval of the error metric is at
   most the budget (``hi <= budget``). The budget is the site's (``site_budgets``, the
   strictest matching pattern), else the role's (``role_budgets``), else ``max_error``.
3. Its speed counts (is *decisive*) only when it was timed on the same device type as
   the target, on a GPU (``timing`` not 'none' or 'cpu-wallclock'), and the kernel is not
   emulated. CPU wall-clock and emulated timings say nothing about FP8 on a GPU.
4. Among safe candidates with a decisive speedup ``>= min_speedup`` the fastest wins
   (ties: lower error bound, then name).
5. No such candidate: with ``assume_fast=True`` a safe candidate without a decisive
   timing wins: a real kernel before any emulated one (emulated kernels are numerical
   references, never fast), then the lowest error bound, then the name; otherwise the
   baseline. This makes CPU reports without
   timings (``ProbeConfig(timing=False)``) plan bf16 everywhere unless the caller opts in.

The JSON layout (schema ``loka.plan``, version :data:`SCHEMA_VERSION`)::

    {"schema": "loka.plan", "version": 1, "created": ISO-8601, "device": "cuda:0",
     "budget": {DispatchConfig fields, "assume_fast", "inference", "allowed_kernels",
                "max_output_change"},
     "source": {"report_created", "report_device", "device_name", "torch"},
     "notes": [str, ...],
     "sites": {fqn: {"name", "in_features", "out_features", "tokens",
                     "roles": {"fwd"|"dgrad"|"wgrad": {"kernel", "error", "error_mean",
                               "speedup", "budget", "reason"}}}},
     "fallbacks": [{"site", "step", "reason", "previous": {"fwd", "dgrad", "wgrad"}}]}
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import fnmatch
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ..config import ROLES, DispatchConfig, LinearConfig, Role, config_to_dict, role_shape
from ..kernels import registry
from ..jsonio import (ReportError, atomic_write_text, decode_number, encode_number, json_safe,
                      read_json, require_fields)
from ..probe.report import ProbeReport

SCHEMA = "loka.plan"
SCHEMA_VERSION = 1
_UNTRUSTED_TIMINGS = ("none", "cpu-wallclock")


class PlanMismatchError(ValueError):
    """A plan applied to a model whose Linears it was not made for."""


# -- the plan as data --------------------------------------------------------------------
@dataclass
class RoleChoice:
    """The kernel chosen for one role of one site, and the evidence behind it."""

    kernel: str
    error: Optional[float] = None
    """upper confidence bound of the budget's metric for ``kernel`` (None: not measured)"""
    error_mean: Optional[float] = None
    speedup: Optional[float] = None
    """decisive speedup over the baseline (None: not timed, or timing not decisive)"""
    budget: Optional[float] = None
    """the error budget that applied to this role at this site"""
    reason: str = ""

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "error": encode_number(self.error),
                "error_mean": encode_number(self.error_mean), "speedup": encode_number(self.speedup),
                "budget": encode_number(self.budget), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping) -> "RoleChoice":
        require_fields(d, ("kernel",), "role choice")
        if not isinstance(d["kernel"], str) or not d["kernel"]:
            raise ReportError(f"role choice: kernel must be a name, got {d['kernel']!r}")
        return cls(d["kernel"], decode_number(d.get("error")), decode_number(d.get("error_mean")),
                   decode_number(d.get("speedup")), decode_number(d.get("budget")), str(d.get("reason", "")))


@dataclass
class SitePlan:
    """The plan of one Linear (keyed by its fully qualified name)."""

    name: str
    in_features: int
    out_features: int
    tokens: int
    """rows M per step the report observed"""
    roles: Dict[Role, RoleChoice] = field(default_factory=dict)

    def kernel(self, role: Role | str, baseline: str = "bf16") -> str:
        choice = self.roles.get(Role.parse(role))
        return baseline if choice is None else choice.kernel

    def config(self, baseline: str = "bf16") -> LinearConfig:
        return LinearConfig(*(self.kernel(r, baseline) for r in ROLES))

    def uses_baseline_only(self, baseline: str = "bf16") -> bool:
        return all(self.kernel(r, baseline) == baseline for r in ROLES)

    def to_dict(self) -> dict:
        return {"name": self.name, "in_features": self.in_features,
                "out_features": self.out_features, "tokens": self.tokens,
                "roles": {r.value: c.to_dict() for r, c in self.roles.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SitePlan":
        require_fields(d, ("name", "in_features", "out_features", "tokens", "roles"), "site plan")
        if not isinstance(d["roles"], Mapping):
            raise ReportError(f"site plan {d['name']!r}: roles must be an object")
        dims = [d["in_features"], d["out_features"], d["tokens"]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in dims):
            raise ReportError(f"site plan {d['name']!r}: features and tokens must be "
                              f"non-negative integers, got {dims}")
        try:
            roles = {Role.parse(r): RoleChoice.from_dict(c) for r, c in d["roles"].items()}
        except ValueError as e:
            raise ReportError(f"site plan {d['name']!r}: {e}") from None
        return cls(str(d["name"]), *dims, roles)


@dataclass
class Fallback:
    """A site switched to the baseline during a run (by the guard)."""

    site: str
    step: int
    reason: str
    previous: Dict[str, str] = field(default_factory=dict)
    """the site's kernels per role before the switch"""

    def to_dict(self) -> dict:
        return {"site": self.site, "step": int(self.step), "reason": self.reason,
                "previous": dict(self.previous)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Fallback":
        require_fields(d, ("site", "step", "reason"), "fallback")
        return cls(str(d["site"]), int(d["step"]), str(d["reason"]),
                   {str(k): str(v) for k, v in dict(d.get("previous", {})).items()})


@dataclass
class Plan:
    """Per site and role, the name of the kernel to run; JSON in and out.

    Build one with :func:`plan`; apply it with :func:`loka.apply`.
    """

    sites: Dict[str, SitePlan] = field(default_factory=dict)
    device: str = "cpu"
    """the device the plan was made for (kernels unavailable there were excluded)"""
    budget: Dict[str, Any] = field(default_factory=dict)
    """the budget and options the plan was made with"""
    source: Dict[str, Any] = field(default_factory=dict)
    """where the evidence came from (the report's creation time, device, torch)"""
    notes: List[str] = field(default_factory=list)
    fallbacks: List[Fallback] = field(default_factory=list)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())

    @property
    def baseline(self) -> str:
        return str(self.budget.get("baseline", "bf16"))

    def config(self, site: str) -> LinearConfig:
        """The LinearConfig of ``site`` (KeyError for a site the plan does not know)."""
        if site not in self.sites:
            raise KeyError(f"site {site!r} is not in the plan")
        return self.sites[site].config(self.baseline)

    def fp8_sites(self) -> List[str]:
        """Sites where at least one role runs an FP8 kernel, in plan order."""
        out = []
        for name, sp in self.sites.items():
            kernels = {sp.kernel(r, self.baseline) for r in ROLES}
            if any(_is_fp8(k) for k in kernels):
                out.append(name)
        return out

    def record_fallback(self, site: str, step: int, reason: str) -> Fallback:
        """Switch ``site`` to the baseline in this plan and log why (used by the guard)."""
        sp = self.sites[site]
        previous = sp.config(self.baseline).to_dict()
        for role in ROLES:
            old = sp.roles.get(role)
            sp.roles[role] = RoleChoice(self.baseline, budget=None if old is None else old.budget,
                                        reason=f"fallback at step {step}: {reason}")
        fb = Fallback(site, int(step), reason, previous)
        self.fallbacks.append(fb)
        return fb

    @classmethod
    def uniform(cls, model: nn.Module, config: "LinearConfig | str",
                module_filter: Optional[str] = None,
                device: "torch.device | str | None" = None) -> "Plan":
        """A plan without a report: every Linear (whose name matches ``module_filter``)
        on the same kernels, each role falling back to the baseline where its kernel
        cannot serve the Linear's shape or the device (naive FP8, for comparisons).

        Args:
            model: the model (or its torch.compile wrapper).
            config: a LinearConfig, or one kernel name for all three roles.
            module_filter: regular expression searched in each Linear's name.
            device: the target device; default: the model's first parameter's.
        """
        if isinstance(config, str):
            config = LinearConfig.uniform(config)
        root = getattr(model, "_orig_mod", model)
        if device is None:
            first = next(root.parameters(), None)
            device = first.device if first is not None else "cpu"
        target = torch.device(device)
        sites, notes = {}, []
        for name, mod in root.named_modules():
            if not isinstance(mod, nn.Linear) or (module_filter and not re.search(module_filter, name)):
                continue
            sp = SitePlan(name, mod.in_features, mod.out_features, 0)
            for role in ROLES:
                kern = registry.get(config.kernel(role))
                _, k, n = role_shape(role, kern.align, mod.in_features, mod.out_features)
                ok = kern.supports(target, kern.align, k, n, role=role)
                if ok:
                    sp.roles[role] = RoleChoice(kern.name, reason="uniform plan")
                else:
                    sp.roles[role] = RoleChoice("bf16", reason=f"uniform plan: {kern.name} "
                                                               f"cannot run here ({ok.reason})")
                    notes.append(f"{name} {role}: {kern.name} cannot run here ({ok.reason})")
            sites[name] = sp
        return cls(sites=sites, device=str(target), notes=notes,
                   budget={"baseline": "bf16", "uniform": config.to_dict()})

    def copy(self) -> "Plan":
        return Plan.from_dict(self.to_dict())

    def summary(self) -> str:
        """A text table: one row per site, kernel and evidence per role."""
        rows = []
        for name, sp in self.sites.items():
            cells = []
            for r in ROLES:
                c = sp.roles.get(r)
                ev = []
                if c is not None and c.error is not None:
                    ev.append(f"e<={c.error:.3g}")
                if c is not None and c.speedup is not None:
                    ev.append(f"{c.speedup:.2f}x")
                kernel = self.baseline if c is None else c.kernel
                cells.append(kernel + (f" ({', '.join(ev)})" if ev else ""))
            rows.append([name, f"{sp.in_features}->{sp.out_features}", str(sp.tokens)] + cells)
        header = ["site", "K->N", "M"] + [r.value for r in ROLES]
        widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]

        def fmt(row):
            return "  ".join(v.rjust(w) if i in (1, 2) else v.ljust(w)
                             for i, (v, w) in enumerate(zip(row, widths))).rstrip()

        if "uniform" in self.budget:
            how = "uniform: " + ", ".join(f"{r}={k}" for r, k in self.budget["uniform"].items())
        else:
            how = (f"{self.budget.get('metric', 'mere')} <= {self.budget.get('max_error')}, "
                   f"speedup >= {self.budget.get('min_speedup')}")
        lines = [f"plan for {self.device}: {len(self.fp8_sites())}/{len(self.sites)} sites "
                 f"with FP8 ({how})", fmt(header), "-" * len(fmt(header))]
        lines += [fmt(row) for row in rows]
        for fb in self.fallbacks:
            lines.append(f"fallback: {fb.site} at step {fb.step}: {fb.reason}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "created": self.created,
                "device": self.device, "budget": json_safe(self.budget),
                "source": json_safe(self.source), "notes": list(self.notes),
                "sites": {k: v.to_dict() for k, v in self.sites.items()},
                "fallbacks": [f.to_dict() for f in self.fallbacks]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        require_fields(d, ("sites",), "plan")
        try:
            if not isinstance(d["sites"], Mapping):
                raise ReportError("plan: sites must be an object")
            sites = {k: SitePlan.from_dict(v) for k, v in d["sites"].items()}
            for k, sp in sites.items():
                if sp.name != k:
                    raise ReportError(f"plan: site key {k!r} holds site {sp.name!r}")
            fallbacks = [Fallback.from_dict(f) for f in d.get("fallbacks", [])]
            budget = dict(d.get("budget", {}))
        except ReportError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ReportError(f"plan: invalid content ({e})") from None
        return cls(sites=sites, device=str(d.get("device", "cpu")), budget=budget,
                   source=dict(d.get("source", {})), notes=[str(n) for n in d.get("notes", [])],
                   fallbacks=fallbacks, created=str(d.get("created", "")))

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "Plan":
        """Load and validate a plan file (ReportError for corrupt/foreign/unknown version)."""
        data = read_json(path, SCHEMA, SCHEMA_VERSION)
        try:
            return cls.from_dict(data)
        except ReportError as e:
            raise ReportError(f"{path}: {e}") from None


def _is_fp8(name: str) -> bool:
    try:
        return registry.get(name).is_fp8
    except KeyError:
        return name not in ("bf16", "fp32", "tf32")


# -- planning ----------------------------------------------------------------------------
def resolve_budget(config: DispatchConfig, site: str, role: Role | str) -> float:
    """The error budget of ``role`` at ``site``: the strictest matching site pattern, else
    the role's budget, else the global one."""
    matches = [float(b) for pat, b in config.site_budgets.items() if re.search(pat, site)]
    if matches:
        return min(matches)
    role = Role.parse(role)
    for r, b in config.role_budgets.items():
        if Role.parse(r) is role:
            return float(b)
    return float(config.max_error)


def _check_budgets(config: DispatchConfig) -> None:
    values = [("max_error", config.max_error)]
    values += [(f"role_budgets[{r!r}]", b) for r, b in config.role_budgets.items()]
    values += [(f"site_budgets[{p!r}]", b) for p, b in config.site_budgets.items()]
    for what, b in values:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"{what} must be a finite number, got {b!r}")
    for pat in config.site_budgets:
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"site_budgets pattern {pat!r} is not a regular expression ({e})") from None
    if not math.isfinite(config.min_speedup):
        raise ValueError(f"min_speedup must be finite, got {config.min_speedup!r}")


def plan(report: "ProbeReport | str | os.PathLike", max_error: Optional[float] = None,
         min_speedup: Optional[float] = None, metric: Optional[str] = None,
         role_budgets: Optional[Mapping[str, float]] = None,
         site_budgets: Optional[Mapping[str, float]] = None,
         config: Optional[DispatchConfig] = None,
         allowed_kernels: Optional[Iterable[str]] = None,
         device: "torch.device | str | None" = None, assume_fast: bool = False,
         inference: bool = False) -> Plan:
    """Choose per site and role the fastest kernel that meets the error budget.

    Args:
        report: a :class:`~loka.probe.report.ProbeReport` or the path of a saved one.
        max_error, min_speedup, metric, role_budgets, site_budgets: override the fields of
            ``config`` (a :class:`~loka.config.DispatchConfig`, default: its defaults:
            MERE <= 0.2, speedup >= 1.05).
        allowed_kernels: consider only these kernel names (the baseline is always allowed).
        device: the device the plan is for; default: the report's.
        assume_fast: where no decisive timing exists (CPU or emulated timings, or none),
            choose the lowest-error safe real kernel (else emulated); see the module
            docstring.
        inference: plan for serving (``loka.apply(model, plan, inference=True)``): only
            the forward role is planned, and a kernel's speed is the one the Probe
            measured with the weight quantized beforehand (``speedup_weight_q``), since
            serving quantizes weights once; dgrad and wgrad stay on the baseline.

    Returns:
        A :class:`Plan`; ``plan.notes`` says which kernels were excluded and why.
    """
    if not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    overrides = {k: v for k, v in (("max_error", max_error), ("min_speedup", min_speedup),
                                   ("metric", metric), ("role_budgets", role_budgets),
                                   ("site_budgets", site_budgets)) if v is not None}
    cfg = dataclasses.replace(config or DispatchConfig(), **overrides)
    _check_budgets(cfg)
    allowed = None if allowed_kernels is None else set(allowed_kernels)
    if allowed is not None:
        unknown = sorted(n for n in allowed if n not in {k.name for k in registry.all_kernels()})
        if unknown:
            raise KeyError(f"allowed_kernels names unregistered kernels: {unknown}")
    target = torch.device(device if device is not None else report.device)
    same_device_type = torch.device(report.device).type == target.type
    registry.get(cfg.baseline)  # the baseline must exist

    notes: List[str] = []
    excluded: Dict[str, str] = {}  # kernel name -> why it was never considered
    undecided = 0  # safe site-roles left on the baseline for want of a decisive timing

    def usable(name: str) -> bool:
        if name in excluded:
            return False
        try:
            kern = registry.get(name)
        except KeyError:
            excluded[name] = "not registered in this installation"
            return False
        ok = kern.device_ok(target)
        if not ok:
            excluded[name] = f"unavailable on {target}: {ok.reason}"
            return False
        return True

    sites: Dict[str, SitePlan] = {}
    for name, site in report.sites.items():
        sp = SitePlan(name, site.in_features, site.out_features, site.tokens)
        for role in ROLES:
            budget = resolve_budget(cfg, name, role)
            rr = site.roles.get(role)
            base_stat = None
            if rr is not None and cfg.baseline in rr.kernels:
                base_stat = rr.kernels[cfg.baseline].metric(cfg.metric)
            baseline_choice = RoleChoice(
                cfg.baseline, None if base_stat is None else base_stat.hi,
                None if base_stat is None else base_stat.mean, None, budget,
                "not measured" if rr is None else "no kernel meets the budget")
            if rr is None:
                sp.roles[role] = baseline_choice
                continue
            if inference and role is not Role.FWD:
                baseline_choice.reason = "inference plan: forward only"
                sp.roles[role] = baseline_choice
                continue
            timed, untimed, misfit, other = [], [], 0, 0  # other: over budget, failed, slow
            slow: List[float] = []  # decisive speedups below min_speedup
            for kname, kr in rr.kernels.items():
                if kname == cfg.baseline or (allowed is not None and kname not in allowed):
                    continue
                if not usable(kname):
                    continue
                kern = registry.get(kname)
                shape = role_shape(role, kern.padded_tokens(site.tokens), site.in_features,
                                   site.out_features)
                if not kern.supports(target, *shape, role=role):
                    misfit += 1
                    continue
                stat = kr.metric(cfg.metric)
                if kr.error or stat is None or stat.hi is None or not math.isfinite(stat.hi):
                    other += 1
                    continue
                if stat.hi > budget:
                    other += 1
                    continue
                speedup = kr.speedup
                if inference and kr.speedup_weight_q is not None:
                    speedup = kr.speedup_weight_q
                decisive = (same_device_type and not kern.is_emulated
                            and kr.timing not in _UNTRUSTED_TIMINGS
                            and speedup is not None and math.isfinite(speedup))
                if decisive:
                    if speedup >= cfg.min_speedup:
                        timed.append((speedup, stat, kname))
                    else:
                        slow.append(speedup)
                        other += 1
                else:
                    untimed.append((stat, kern, kname))
            if timed:
                speed, stat, kname = min(timed, key=lambda t: (-t[0], t[1].hi, t[2]))
                sp.roles[role] = RoleChoice(kname, stat.hi, stat.mean, speed, budget,
                                            "fastest kernel within the budget")
            elif untimed and assume_fast and not slow:
                stat, kern, kname = min(untimed, key=lambda t: (t[1].is_emulated, t[0].hi, t[2]))
                sp.roles[role] = RoleChoice(kname, stat.hi, stat.mean, None, budget,
                                            "lowest error within the budget (assume_fast)")
            else:
                if slow:  # timed on this device and not fast enough: emulated twins aside
                    baseline_choice.reason = (f"no kernel within the budget is {cfg.min_speedup:g}x "
                                              f"faster (best {max(slow):.2f}x)")
                elif untimed:
                    undecided += 1
                    baseline_choice.reason = "safe kernels have no decisive timing"
                elif misfit and not other:
                    baseline_choice.reason = ("no kernel fits the GEMM shape (alignment) on "
                                              f"{target.type}")
                sp.roles[role] = baseline_choice
        sites[name] = sp

    for kname, why in sorted(excluded.items()):
        notes.append(f"kernel {kname!r} excluded: {why}")
    if undecided:
        notes.append(f"{undecided} site-role(s) kept on {cfg.baseline}: their safe kernels have "
                     "no decisive timing (CPU wall-clock, emulated, untimed, or measured on "
                     "another device type); pass assume_fast=True to choose the lowest-error "
                     "safe kernel")
    budget_dict = config_to_dict(cfg)
    budget_dict.update(assume_fast=bool(assume_fast), inference=bool(inference),
                       allowed_kernels=None if allowed is None else sorted(allowed))
    source = {"report_created": report.created, "report_device": report.device,
              "device_name": report.device_name, "torch": report.torch_version}
    return Plan(sites=sites, device=str(target), budget=budget_dict, source=source, notes=notes)


def audit(plan: Plan, report: "ProbeReport | str | os.PathLike") -> dict:
    """Check a plan against the report it claims to follow, independently of :func:`plan`.

    For every site and role the report measured: the chosen kernel's error bound must be
    within the plan's budget, and no other kernel that the report shows within the budget
    may be faster by the plan's ``min_speedup`` rule (a role left on the baseline is at
    speed 1.0; a candidate must reach ``min_speedup`` to count). Speeds are the report's
    (``speedup_weight_q`` for an inference plan). Only timings taken on a GPU count; a
    plan made with ``assume_fast`` is checked for the budget only. A kernel the report
    timed ran where the report was measured, so the check needs no GPU: it runs anywhere.

    Returns:
        ``{"site_roles": n checked, "violations": [{"site", "role", "chosen",
        "chosen_speedup", "best", "best_speedup", "why"}], "ok": bool}``.
    """
    if not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    cfg = plan.budget
    min_speedup = float(cfg.get("min_speedup", DispatchConfig().min_speedup))
    metric = str(cfg.get("metric", DispatchConfig().metric))
    inference = bool(cfg.get("inference", False))
    speeds_count = not cfg.get("assume_fast", False)
    allowed = None if cfg.get("allowed_kernels") is None else set(cfg["allowed_kernels"])

    def within(rr, kname: str, budget: float) -> bool:
        kr = rr.kernels.get(kname)
        stat = None if kr is None or kr.error else kr.metric(metric)
        return stat is not None and stat.hi is not None and stat.hi <= budget

    def speed(rr, kname: str) -> float:
        if kname == plan.baseline:
            return 1.0
        kr = rr.kernels.get(kname)
        if kr is None or kr.timing in _UNTRUSTED_TIMINGS:
            return math.nan
        s = kr.speedup_weight_q if inference and kr.speedup_weight_q is not None else kr.speedup
        return math.nan if s is None else float(s)

    def runs(site, role: Role, kname: str) -> bool:
        # it ran where the report was measured (it has a timing there); what is left is
        # whether the plan could use it: allowed, serving the role, fitting the padded shape
        try:
            kern = registry.get(kname)
        except KeyError:
            return False
        if allowed is not None and kname not in allowed:
            return False
        return bool(kern.fits(*role_shape(role, kern.padded_tokens(site.tokens), site.in_features,
                                          site.out_features), role=role))

    checked, violations = 0, []
    for name, sp in plan.sites.items():
        site = report.sites.get(name)
        if site is None:
            continue
        for role, choice in sp.roles.items():
            rr = site.roles.get(role)
            if rr is None or (inference and role is not Role.FWD):
                continue
            checked += 1
            budget = choice.budget if choice.budget is not None else math.inf
            chosen = choice.kernel
            row = {"site": name, "role": role.value, "chosen": chosen}
            if chosen != plan.baseline and not within(rr, chosen, budget):
                violations.append({**row, "why": "chosen kernel's error bound is outside the "
                                   f"budget {budget} (or was not measured)"})
                continue
            if not speeds_count:
                continue
            cands = [(speed(rr, k), k) for k in rr.kernels
                     if k != plan.baseline and within(rr, k, budget)
                     and speed(rr, k) >= min_speedup and runs(site, role, k)]
            if not cands:
                continue
            best_speed, best = max(cands)
            mine = speed(rr, chosen)
            if not mine >= best_speed:  # NaN (an untimed choice) counts as slower
                violations.append({**row, "chosen_speedup": encode_number(mine), "best": best,
                                   "best_speedup": best_speed,
                                   "why": "a faster kernel within the budget was measured"})
    return {"site_roles": checked, "violations": violations, "ok": not violations}


# -- editing a plan ---------------------------------------------------------------------
def override(plan: Plan, *, replace: Optional[Mapping[str, str]] = None,
             assign: Optional[Mapping[str, str]] = None,
             report: "ProbeReport | str | os.PathLike | None" = None,
             check_budget: bool = True, same_numerics: bool = False) -> Plan:
    """A copy of ``plan`` with some kernels changed by hand (an experiment, or a choice the
    Probe cannot see, such as a kernel whose quantization fuses into its producer inside a
    compiled model).

    Args:
        plan: the plan to edit (not modified).
        replace: ``{old: new}``: every role on kernel ``old`` moves to ``new``.
        assign: ``{"<site glob>:<role>": kernel}`` (role 'fwd', 'dgrad', 'wgrad' or '*'):
            those roles move to ``kernel``, the baseline included. Applied after ``replace``.
        report: the Probe report the plan came from: the new choices take its error bound
            and speedup for that site and role.
        check_budget: with a report, refuse a kernel whose error bound at a site exceeds
            the role's budget, or that the report did not measure there.
        same_numerics: without a report, the new kernels compute what the old ones did (a
            fusible twin, :data:`FUSIBLE_TWINS`): each changed role keeps its error bound
            (its isolated speedup no longer applies).

    Returns:
        The edited plan; each changed role's ``reason`` says what it was before.

    Raises:
        KeyError: an unregistered kernel; ValueError: a kernel that does not serve a role,
        a glob that matches no site, or (``check_budget``) a choice outside the budget.
    """
    if report is not None and not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    edits: List[Tuple[str, Role, str]] = []  # (site, role, kernel)
    for old, new in (replace or {}).items():
        registry.get(new)
        edits += [(s, r, new) for s, sp in plan.sites.items() for r in ROLES
                  if sp.kernel(r, plan.baseline) == old]
    for key, kernel in (assign or {}).items():
        pattern, sep, role_text = key.rpartition(":")
        if not sep or not pattern:
            raise ValueError(f"assign keys are '<site glob>:<role>', got {key!r}")
        roles = list(ROLES) if role_text == "*" else [Role.parse(role_text)]
        sites = [s for s in plan.sites if fnmatch.fnmatchcase(s, pattern)]
        if not sites:
            raise ValueError(f"{pattern!r} matches no site of the plan")
        registry.get(kernel)
        edits += [(s, r, kernel) for s in sites for r in roles]
    out = plan.copy()
    for site, role, kernel in edits:
        kern = registry.get(kernel)
        if role not in kern.roles:
            raise ValueError(f"kernel {kernel!r} does not serve role {role} ({site})")
        old = out.sites[site].roles.get(role)
        budget = None if old is None else old.budget
        error = error_mean = speedup = None
        if report is not None and kernel != out.baseline:
            kr = report.sites.get(site)
            kr = None if kr is None else kr.roles.get(role)
            kr = None if kr is None else kr.kernels.get(kernel)
            stat = None if kr is None else kr.metric(str(out.budget.get("metric", "mere")))
            if stat is not None and stat.hi is not None and math.isfinite(stat.hi):
                error, error_mean = stat.hi, stat.mean
                speedup = kr.speedup_weight_q if (out.budget.get("inference") and
                                                  kr.speedup_weight_q is not None) else kr.speedup
            if check_budget and (error is None or (budget is not None and error > budget)):
                raise ValueError(f"{site} {role}: {kernel!r} " + (
                    "was not measured there by the report" if error is None else
                    f"has error bound {error:.4g} above the budget {budget:g}"))
        elif same_numerics and old is not None:
            error, error_mean = old.error, old.error_mean
        was = "nothing" if old is None else old.kernel
        why = (f"{old.reason}; twin of {was} (same numerics)" if same_numerics and old is not None
               else f"override (was {was})")
        out.sites[site].roles[role] = RoleChoice(kernel, error, error_mean, speedup, budget, why)
    if edits:
        out.notes.append(f"overridden by hand: {len(edits)} site-role(s)")
    return out


# -- end-to-end budget -------------------------------------------------------------------
Batch = Any


@contextlib.contextmanager
def _restoring(root: nn.Module):
    """Leave ``root`` with the plan (and apply options) it had on entry, or none: the
    end-to-end searches below apply and unapply trial plans in between."""
    from .apply import _state, apply, unapply  # apply imports this module

    state = _state(root)
    previous, options = state.get("plan"), dict(state.get("options", {}))
    try:
        yield
    finally:
        unapply(root)
        if previous is not None:
            apply(root, previous, **options)


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
    from .apply import apply, unapply  # apply imports this module

    if not (isinstance(max_output_change, (int, float)) and max_output_change >= 0
            and math.isfinite(max_output_change)):
        raise ValueError(f"max_output_change must be a finite number >= 0, got {max_output_change!r}")
    root = getattr(model, "_orig_mod", model)
    was_training = root.training
    new = plan.copy()
    log: List[dict] = []
    with _restoring(root):
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


# -- end-to-end speed -----------------------------------------------------------------------
def _site_groups(plan: Plan) -> List[List[str]]:
    """FP8 sites grouped by shape and kernels (e.g. the four identical layers of a model):
    a group moves to the baseline as one."""
    groups: Dict[tuple, List[str]] = {}
    for s in plan.fp8_sites():
        sp = plan.sites[s]
        key = (sp.in_features, sp.out_features, sp.tokens,
               tuple(sp.kernel(r, plan.baseline) for r in ROLES))
        groups.setdefault(key, []).append(s)
    return list(groups.values())


FUSIBLE_TWINS: Dict[str, str] = {
    "triton-rowwise-cublas": "cublas-rowwise",
    "triton-rowwise-cublas-fastacc": "cublas-rowwise-fastacc",
    "triton-tensorwise-cublas": "cublas-tensorwise",
    "triton-tensorwise-cublas-fastacc": "cublas-tensorwise-fastacc",
}
"""Kernels with the same numerics (bit-exact quantizers, the same cuBLAS GEMM) whose
quantization is plain PyTorch: alone the Triton quantizer is faster, but inside a
compiled model Inductor fuses the PyTorch one into the op that produces the operand (an
activation, a norm), which the Probe's standalone timing cannot see.
:func:`tune_speed` tries them."""


def _on_baseline(p: Plan, sites: Iterable[str], why: str, roles: Iterable[Role] = ROLES) -> Plan:
    """A copy of ``p`` with ``roles`` (default all) of ``sites`` on the baseline, for
    reason ``why``."""
    out = p.copy()
    for s in sites:
        for role in roles:
            old = out.sites[s].roles.get(role)
            out.sites[s].roles[role] = RoleChoice(
                out.baseline, budget=None if old is None else old.budget, reason=why)
    return out


class _Inapplicable(ValueError):
    """A plan that ``apply`` refuses for this model (a kernel that cannot align a site)."""


class _StepTimer:
    """Apply a plan to the model and time a step with the caller's ``time_step``, logging
    each trial as ``{"sites": FP8 sites, **info, "time": t}``."""

    def __init__(self, model: nn.Module, time_step: Callable[[nn.Module], float],
                 inference: bool, log: List[dict]) -> None:
        self.model, self.time_step, self.inference, self.log = model, time_step, inference, log
        self.root = getattr(model, "_orig_mod", model)

    def __call__(self, p: Plan, **info) -> float:
        from .apply import apply, unapply  # apply imports this module

        unapply(self.root)
        if p.fp8_sites():
            try:
                apply(self.root, p, inference=self.inference)
            except ValueError as e:  # PlanMismatchError too
                unapply(self.root)
                raise _Inapplicable(str(e)) from e
        t = float(self.time_step(self.model))
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"time_step returned {t!r}; it must return a positive time")
        self.log.append({"sites": p.fp8_sites(), **info, "time": t})
        return t


def tune_speed(plan: Plan, model: nn.Module, time_step: Callable[[nn.Module], float], *,
               min_gain: float = 1.0, max_trials: int = 16, inference: bool = False,
               twins: Optional[Mapping[str, str]] = None,
               report: "ProbeReport | None" = None,
               per_role: bool = False) -> Tuple[Plan, List[dict]]:
    """Keep only the FP8 sites that pay inside the whole model.

    The Probe times each GEMM alone. Inside a compiled model a site also adds its
    quantization kernels and changes what Inductor can fuse around it, so a plan whose
    sites are each faster alone can make the whole step slower (seen on the Wukong
    reference step: bench/BENCHMARKS.md). Here whole steps decide. ``time_step(model)``,
    the caller's, runs the model as it will run (compiled, captured in a CUDA graph, warmed
    up) and returns a time, e.g. the median step in ms; it is taken for the model without
    FP8 and with the plan. Then groups of FP8 sites (one shape, one choice of kernels) are
    moved back to the baseline one group at a time, greedily keeping the move that makes
    the step fastest, until no move helps. The result is kept only if it beats the
    all-baseline step by the factor ``min_gain``; otherwise every site goes back.

    Args:
        plan: the plan to tune (not modified).
        model: the model the plan is for; it is left with its previous plan (or none).
        time_step: ``time_step(model) -> time`` with the model as configured.
        min_gain: the tuned plan must be at least this much faster than the baseline.
        max_trials: at most this many ``time_step`` calls (each may recompile).
        inference: apply the plans for inference (weights quantized once).
        twins: ``{kernel: twin}`` of equal numerics (e.g. :data:`FUSIBLE_TWINS`): the plan
            with its kernels replaced by their twins is timed too, and the faster of the
            two is where the greedy search starts.
        report: the Probe report behind ``plan``: the twins then take its measured errors
            and must meet the budget (:func:`override`), so twins of other numerics
            (another library's quantizer) are allowed; without a report, twins must have
            the same numerics and carry the plan's errors over.
        per_role: a group with several FP8 roles moves one role at a time to the baseline
            (each a trial of its own), so a paying forward is not lost with a losing
            gradient GEMM; off, the whole group moves at once. With ``inference`` the
            plan's gradient roles go to the baseline first (serving runs forwards only)
            and groups move whole.

    Returns:
        (tuned plan, log): one dict per trial with ``sites`` (FP8 sites of the trial),
        ``removed`` (the group tried, if any), ``role`` (the role moved, None for the
        whole group) and ``time``.
    """
    if not (min_gain > 0 and math.isfinite(min_gain)):
        raise ValueError(f"min_gain must be a finite positive number, got {min_gain!r}")
    if max_trials < 2:
        raise ValueError(f"max_trials must be >= 2 (the baseline and the plan), got {max_trials}")
    log: List[dict] = []
    timer = _StepTimer(model, time_step, inference, log)
    if inference:  # serving runs forwards only: gradient roles on FP8 are not timed, not kept
        grads = [s for s, sp in plan.sites.items()
                 if any(sp.kernel(r, plan.baseline) != plan.baseline for r in (Role.DGRAD, Role.WGRAD))]
        if grads:
            plan = _on_baseline(plan, grads, "inference plan: forward only",
                                roles=(Role.DGRAD, Role.WGRAD))

    with _restoring(timer.root):
        base_time = timer(_on_baseline(plan, plan.fp8_sites(), "baseline"), removed=None)
        best, best_time = plan.copy(), timer(plan, removed=None)
        twin = None
        used = {c.kernel for sp in plan.sites.values() for c in sp.roles.values()}
        sub = {k: v for k, v in (twins or {}).items() if k in used}
        if sub:
            with contextlib.suppress(ValueError):  # a twin outside the budget: none
                twin = override(plan, replace=sub, report=report, same_numerics=report is None)
        if twin is not None and len(log) < max_trials:
            t = timer(twin, removed=None, twins=True)
            if t < best_time:
                best, best_time = twin, t
        while len(log) < max_trials:
            candidates = []
            for group in _site_groups(best):
                fp8_roles = [r for r in ROLES
                             if any(best.sites[s].kernel(r, best.baseline) != best.baseline
                                    for s in group)]
                # per role: a group's forward may pay while its gradient GEMMs do not;
                # serving runs the forward only, so there a group moves whole
                moves = fp8_roles if per_role and not inference and len(fp8_roles) > 1 else [None]
                for role in moves:
                    if len(log) >= max_trials:
                        break
                    why = ("end-to-end speed: the step is faster without it" if role is None
                           else f"end-to-end speed: the step is faster with {role} on the baseline")
                    cand = _on_baseline(best, group, why, ROLES if role is None else (role,))
                    t = timer(cand, removed=group, role=None if role is None else role.value)
                    candidates.append((t, cand))
            if not candidates:
                break
            t, cand = min(candidates, key=lambda c: c[0])
            if t >= best_time:
                break
            best, best_time = cand, t
        if base_time / best_time < min_gain:
            best = _on_baseline(best, best.fp8_sites(),
                           f"end-to-end speed: no FP8 plan beat the baseline by {min_gain:g}x")
            best_time = base_time
        best.budget["speed_tuned"] = {"baseline_time": base_time, "time": best_time,
                                      "trials": len(log), "min_gain": float(min_gain)}
        best.notes.append(f"end-to-end speed: {len(best.fp8_sites())} FP8 site(s) kept, step "
                          f"{best_time:.4g} vs {base_time:.4g} without FP8 ({len(log)} trials)")
    return best, log


def _exact_glob(name: str) -> str:
    """A glob matching exactly ``name`` (site names may hold ``[``, ``*`` or ``?``)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _shape_groups(plan: Plan) -> List[List[str]]:
    """Every site of the plan grouped by its GEMM shape (in, out, tokens)."""
    groups: Dict[tuple, List[str]] = {}
    for s, sp in plan.sites.items():
        groups.setdefault((sp.in_features, sp.out_features, sp.tokens), []).append(s)
    return list(groups.values())


def search_speed(plan: Plan, model: nn.Module, time_step: Callable[[nn.Module], float],
                 candidates: Iterable["LinearConfig | str"], *,
                 report: "ProbeReport | None" = None, inference: bool = False,
                 min_gain: float = 1.0, max_trials: int = 64) -> Tuple[Plan, List[dict]]:
    """The best fixed choice per group of sites, by exhaustive whole-step timing: the
    yardstick a Probe-made plan is measured against.

    Sites are grouped by GEMM shape (the four identical layers of a model form one group).
    For each group and each candidate configuration, the step is timed with that group on
    the candidate and every other site on the baseline; each group keeps its fastest
    candidate if it beats the all-baseline step. The chosen groups are then timed together,
    and the result is the faster of that and the best single group. Groups are searched one
    at a time, not in every combination: interactions between groups (fusion across them)
    are seen only in the final trial. A candidate whose trial raises is logged
    (``failed``) and not chosen.

    Args:
        plan: supplies the sites, their budgets and the baseline (its choices are ignored).
        model, time_step, inference: as :func:`tune_speed`.
        candidates: :class:`~loka.config.LinearConfig` per-role choices, or kernel names
            (that kernel on every role; on the forward only when ``inference``).
        report: the Probe report: a candidate whose error at a site exceeds the budget, or
            that the report did not measure there, is skipped for that group.
        min_gain: the result must beat the all-baseline step by this factor, else every
            site goes back to the baseline.
        max_trials: at most this many ``time_step`` calls (the last one is kept for the
            chosen groups together).

    Returns:
        (plan, log): the log has one dict per trial (``group``, ``candidate``, ``time``),
        ``skipped`` entries for candidates that do not fit a group and ``failed`` entries.
    """
    if not (min_gain > 0 and math.isfinite(min_gain)):
        raise ValueError(f"min_gain must be a finite positive number, got {min_gain!r}")
    configs = []
    for c in candidates:
        if isinstance(c, str):
            c = LinearConfig(fwd=c) if inference else LinearConfig.uniform(c)
        if not isinstance(c, LinearConfig):
            raise TypeError(f"candidates are LinearConfigs or kernel names, got {c!r}")
        configs.append(c)
    if not configs:
        raise ValueError("search_speed needs at least one candidate")
    log: List[dict] = []
    timer = _StepTimer(model, time_step, inference, log)
    base = _on_baseline(plan, plan.sites, "baseline")

    def timed() -> int:
        return sum("time" in e for e in log)

    with _restoring(timer.root):
        base_time = timer(base, group=None, candidate=None)
        chosen: Dict[int, Tuple[float, Plan]] = {}
        for gi, group in enumerate(_shape_groups(plan)):
            for cfg in configs:
                if timed() >= max_trials - 1:  # one trial is kept for the chosen groups together
                    break
                assign = {f"{_exact_glob(s)}:{r.value}": cfg.kernel(r) for s in group for r in ROLES}
                try:
                    cand = override(base, assign=assign, report=report)
                except (ValueError, KeyError) as e:
                    log.append({"group": group, "candidate": cfg.to_dict(), "skipped": str(e)})
                    continue
                if not cand.fp8_sites():
                    continue
                try:
                    t = timer(cand, group=group, candidate=cfg.to_dict())
                except _Inapplicable as e:
                    log.append({"group": group, "candidate": cfg.to_dict(), "skipped": str(e)})
                    continue
                except Exception as e:  # noqa: BLE001 - a candidate that breaks is not chosen
                    log.append({"group": group, "candidate": cfg.to_dict(),
                                "failed": f"{type(e).__name__}: {e}"[:300]})
                    continue
                if t < chosen.get(gi, (base_time, None))[0]:
                    chosen[gi] = (t, cand)
        best, best_time = base, base_time
        if chosen:  # the best single group, then all chosen groups together if that is faster
            best_time, single = min(chosen.values(), key=lambda tc: tc[0])
            best = single
            if len(chosen) > 1:
                together = base.copy()
                for _, cand in chosen.values():
                    for s in cand.fp8_sites():
                        together.sites[s] = cand.sites[s]
                t = timer(together, group="all chosen", candidate=None)
                if t < best_time:
                    best, best_time = together, t
        if best_time >= base_time or base_time / best_time < min_gain:
            best, best_time = base, base_time
        best = best.copy()
        best.budget["speed_searched"] = {"baseline_time": base_time, "time": best_time,
                                         "trials": timed(),
                                         "candidates": [c.to_dict() for c in configs]}
        best.notes.append(f"exhaustive search per group: {len(best.fp8_sites())} FP8 site(s), "
                          f"step {best_time:.4g} vs {base_time:.4g} without FP8")
    return best, log

