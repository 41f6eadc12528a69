"""The plan as data: per site and role the chosen kernel and its evidence; JSON in and out.

:class:`Plan` holds one :class:`SitePlan` per Linear (keyed by its fully qualified name),
each with one :class:`RoleChoice` per role, and the :class:`Fallback` records the guard
made. :func:`~loka.dispatch.select.plan` makes one from a Probe report; :func:`loka.apply`
runs it.

The JSON layout (schema ``loka.plan``, version :data:`SCHEMA_VERSION`)::

    {"schema": "loka.plan", "version": 1, "created": ISO-8601, "device": "cuda:0",
     "budget": {DispatchConfig fields, "assume_fast", "inference", "allowed_kernels",
                "max_output_change", "max_ne_change", "ne_budget"},
     "source": {"report_created", "report_device", "device_name", "torch"},
     "notes": [str, ...],
     "sites": {fqn: {"name", "in_features", "out_features", "tokens",
                     "roles": {"fwd"|"dgrad"|"wgrad": {"kernel", "error", "error_mean",
                               "speedup", "budget", "reason", ["ne_cost"]}}}},
     "fallbacks": [{"site", "step", "reason", "previous": {"fwd", "dgrad", "wgrad"}}],
     ["delayed_scaling": decay], ["static_scales": {fqn: amax}]}

``delayed_scaling`` (absent: dynamic scaling) asks ``loka.apply`` to train with delayed
tensorwise scales (:meth:`~loka.dispatch.linear.Linear.set_delayed_scaling`) with that
decay in (0, 1]. ``static_scales`` (absent: dynamic scales; ``loka.plan(...,
inference=True, static_scales=True)`` writes it) gives serving sites a static input amax
each, finite and positive, which ``loka.apply(..., inference=True)`` sets.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from ..config import BASELINE, REFERENCE_KERNEL, ROLES, LinearConfig, Role, role_shape
from ..jsonio import (ReportError, atomic_write_text, encode_number, field_bool, field_device,
                      field_int, field_list, field_mapping, field_number, field_path, field_str,
                      json_safe, read_json, require_fields)
from ..kernels import registry
from ..numerics.delayed import check_decay

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
    ne_cost: Optional[float] = None
    """the measured cost of this role's FP8 kernel in relative NE (``loka.quality.ne_budget``;
    None: not measured). Written to JSON only when set, so plans without it are unchanged."""

    def to_dict(self) -> dict:
        out = {"kernel": self.kernel, "error": encode_number(self.error),
               "error_mean": encode_number(self.error_mean), "speedup": encode_number(self.speedup),
               "budget": encode_number(self.budget), "reason": self.reason}
        if self.ne_cost is not None:
            out["ne_cost"] = encode_number(self.ne_cost)
        return out

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "role choice") -> "RoleChoice":
        require_fields(d, ("kernel",), where)
        if not isinstance(d["kernel"], str) or not d["kernel"]:
            raise ReportError(f"{field_path(where, 'kernel')}: kernel must be a name, got "
                              f"{str(d['kernel'])[:60]!r}")
        return cls(d["kernel"], *(field_number(d, k, where) for k in
                                  ("error", "error_mean", "speedup", "budget")),
                   field_str(d, "reason", where, ""), field_number(d, "ne_cost", where))


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
    def from_dict(cls, d: Mapping, where: str = "site plan") -> "SitePlan":
        require_fields(d, ("name", "in_features", "out_features", "tokens", "roles"), where)
        name = field_str(d, "name", where)
        dims = [field_int(d, k, where) for k in ("in_features", "out_features", "tokens")]
        roles = {}
        for r, c in field_mapping(d, "roles", where).items():
            try:
                role = Role.parse(r)
            except ValueError as e:
                raise ReportError(f"{field_path(where, 'roles')}[{r!r}]: {e}") from None
            roles[role] = RoleChoice.from_dict(c, f"{field_path(where, 'roles')}[{r!r}]")
        return cls(name, *dims, roles)


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
    def from_dict(cls, d: Mapping, where: str = "fallback") -> "Fallback":
        require_fields(d, ("site", "step", "reason"), where)
        previous = field_mapping(d, "previous", where, {})
        for role, kernel in previous.items():
            if not isinstance(kernel, str):
                raise ReportError(f"{field_path(where, 'previous')}.{role}: expected a string, "
                                  f"got {str(kernel)[:60]!r}")
        return cls(field_str(d, "site", where), field_int(d, "step", where),
                   field_str(d, "reason", where), dict(previous))


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
    delayed_scaling: Optional[float] = None
    """training with delayed tensorwise scales at this decay (None: dynamic scaling)"""
    static_scales: Dict[str, float] = field(default_factory=dict)
    """serving: site -> static input amax (empty: dynamic scales)"""

    def __post_init__(self) -> None:
        self._check_delayed()

    def _check_delayed(self) -> None:
        if self.delayed_scaling is not None:
            check_decay(self.delayed_scaling, "delayed_scaling")
        for site, amax in self.static_scales.items():
            if site not in self.sites:
                raise ValueError(f"static_scales names a site not in the plan: {site!r}")
            if (isinstance(amax, bool) or not isinstance(amax, (int, float))
                    or not 0 < amax < math.inf):
                raise ValueError(f"static_scales[{site!r}] must be a finite positive amax, "
                                 f"got {amax!r}")

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
            how = f"{self.budget.get('metric', 'mere')} <= {self.budget.get('max_error')}, "
            timed = any(c.speedup is not None for sp in self.sites.values() for c in sp.roles.values())
            if self.budget.get("assume_fast"):  # untimed roles were chosen on error alone
                how += (f"speedup >= {self.budget.get('min_speedup')} where timed, else "
                        if timed else "") + "chosen on error alone"
            else:
                how += f"speedup >= {self.budget.get('min_speedup')}"
        if self.source.get("dtype") not in (None, "bfloat16"):  # what the baseline ran
            how += f"; baseline {self.baseline} ran {str(self.source['dtype']).replace('float', 'fp')}"
        if self.delayed_scaling is not None:
            how += f"; delayed tensorwise scaling, decay {self.delayed_scaling:g}"
        if self.static_scales:
            how += f"; static input scales at {len(self.static_scales)} site(s)"
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
        self._check_delayed()  # a field set after construction is checked before it is written
        out = {"schema": SCHEMA, "version": SCHEMA_VERSION, "created": self.created,
               "device": self.device, "budget": json_safe(self.budget),
               "source": json_safe(self.source), "notes": list(self.notes),
               "sites": {k: v.to_dict() for k, v in self.sites.items()},
               "fallbacks": [f.to_dict() for f in self.fallbacks]}
        if self.delayed_scaling is not None:
            out["delayed_scaling"] = self.delayed_scaling
        if self.static_scales:
            out["static_scales"] = {k: float(v) for k, v in self.static_scales.items()}
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> "Plan":
        """Read and check a plan's JSON (ReportError naming the field)."""
        require_fields(d, ("sites",), "plan")
        try:
            sites = {}
            for k, v in field_mapping(d, "sites", "").items():
                sp = SitePlan.from_dict(v, f"sites[{k!r}]")
                if sp.name != k:
                    raise ReportError(f"sites[{k!r}]: holds site {sp.name!r}")
                sites[k] = sp
            fallbacks = [Fallback.from_dict(f, f"fallbacks[{i}]") if isinstance(f, Mapping) else
                         _not_object(f"fallbacks[{i}]", f)
                         for i, f in enumerate(field_list(d, "fallbacks", "", []))]
            delayed = field_number(d, "delayed_scaling", "")
            if delayed is not None:
                try:
                    delayed = check_decay(delayed, "delayed_scaling")
                except ValueError as e:
                    raise ReportError(str(e)) from None
            scales = {}
            for site, amax in field_mapping(d, "static_scales", "", {}).items():
                scales[site] = field_number({"v": amax}, "v", f"static_scales[{site!r}]")
            try:
                return cls(sites=sites, device=field_device(d, "device", ""), budget=_budget(d),
                           source=dict(field_mapping(d, "source", "", {})),
                           notes=list(field_list(d, "notes", "", [], item=str)),
                           fallbacks=fallbacks, created=field_str(d, "created", "", ""),
                           delayed_scaling=delayed, static_scales=scales)
            except ValueError as e:  # the fields' own checks (__post_init__)
                raise ReportError(f"plan: {e}") from None
        except ReportError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError,
                RecursionError) as e:
            raise ReportError(f"plan: invalid content ({type(e).__name__}: {str(e)[:200]})") from None

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: "str | os.PathLike", max_bytes: Optional[int] = None) -> "Plan":
        """Load and validate a plan file: any fault (corrupt, foreign, unknown version, a
        field of the wrong type or range) is a one-line :class:`ReportError` naming the
        file and the field (``max_bytes``: see :func:`loka.jsonio.load_json`)."""
        data = read_json(path, SCHEMA, SCHEMA_VERSION, max_bytes)
        try:
            return cls.from_dict(data)
        except ReportError as e:
            raise ReportError(f"{path}: {e}") from None


def _not_object(where: str, x) -> None:
    raise ReportError(f"{where}: expected a JSON object, got {str(x)[:60]!r}")


_METRICS = ("mere", "relfro", "neg_sqnr")
"""the error metrics a budget applies to (``DispatchConfig.metric``)"""
_BUDGET_FIELDS = {"max_error": "number", "min_speedup": "number", "metric": "string",
                  "baseline": "string", "assume_fast": "bool", "inference": "bool",
                  "role_budgets": "numbers", "site_budgets": "numbers",
                  "allowed_kernels": "names", "uniform": "names-by-role",
                  "max_ne_change": "number", "head_sites": "count"}
"""the fields of a plan's ``budget`` LoKA reads, and their JSON types (others are kept)"""


def _budget(d: Mapping) -> Dict[str, Any]:
    """``d['budget']`` with the types of the fields LoKA reads checked; values are kept as
    written (numbers may be "inf"; null budgets load, and :func:`audit` judges them)."""
    budget = dict(field_mapping(d, "budget", "", {}))
    for key, kind in _BUDGET_FIELDS.items():
        if key not in budget or (budget[key] is None and kind in ("names", "numbers")):
            continue
        where = f"budget.{key}"
        if kind == "number":  # what every rendering of the plan shows: finite numbers
            x = field_number(budget, key, "budget", optional=False)
            if not math.isfinite(x) or (key == "min_speedup" and x <= 0):
                raise ReportError(f"{where}: expected a finite number"
                                  + (" > 0" if key == "min_speedup" else "") + f", got {x!r}")
        elif kind == "string":
            field_str(budget, key, "budget")
            if key == "metric" and budget[key] not in _METRICS:
                raise ReportError(f"{where}: unknown metric {budget[key][:60]!r}; expected one "
                                  f"of {list(_METRICS)}")
        elif kind == "bool":
            field_bool(budget, key, "budget")
        elif kind == "count":
            field_int(budget, key, "budget")
        elif kind == "numbers":
            for k in field_mapping(budget, key, "budget"):
                field_number(budget[key], k, where)
        elif kind == "names":
            field_list(budget, key, "budget", item=str)
        else:
            for k in field_mapping(budget, key, "budget"):
                field_str(budget[key], k, where)
    return budget


def _is_fp8(name: str) -> bool:
    try:
        return registry.get(name).is_fp8
    except KeyError:
        return name not in _HIGH_PRECISION

