"""The plan as data: per site and role the chosen kernel and its evidence; JSON in and out.

:class:`Plan` holds one :class:`SitePlan` per Linear (keyed by its fully qualified name),
each with one :class:`RoleChoice` per role, and the :class:`Fallback` records the guard
made. :func:`~loka.dispatch.select.plan` makes one from a Probe report; :func:`loka.apply`
runs it.

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

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from ..config import BASELINE, REFERENCE_KERNEL, ROLES, LinearConfig, Role, role_shape
from ..jsonio import (ReportError, atomic_write_text, decode_number, encode_number, json_safe,
                      read_json, require_fields)
from ..kernels import registry

SCHEMA = "loka.plan"
SCHEMA_VERSION = 1
_HIGH_PRECISION = (BASELINE, REFERENCE_KERNEL, "tf32")
"""kernel names that are not FP8 even where this installation does not register them"""


class PlanMismatchError(ValueError):
    """A plan applied to a model whose Linears it was not made for."""


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

    def kernel(self, role: Role | str, baseline: str = BASELINE) -> str:
        choice = self.roles.get(Role.parse(role))
        return baseline if choice is None else choice.kernel

    def config(self, baseline: str = BASELINE) -> LinearConfig:
        return LinearConfig(*(self.kernel(r, baseline) for r in ROLES))

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

    Build one with :func:`loka.plan`; apply it with :func:`loka.apply`.
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
        return str(self.budget.get("baseline", BASELINE))

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
                    sp.roles[role] = RoleChoice(BASELINE, reason=f"uniform plan: {kern.name} "
                                                             f"cannot run here ({ok.reason})")
                    notes.append(f"{name} {role}: {kern.name} cannot run here ({ok.reason})")
            sites[name] = sp
        return cls(sites=sites, device=str(target), notes=notes,
                   budget={"baseline": BASELINE, "uniform": config.to_dict()})

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
        return name not in _HIGH_PRECISION

