"""``ProbeReport``: what the Probe measured, per site, role and kernel; JSON in and out.

The JSON layout (schema ``loka.probe-report``, version :data:`SCHEMA_VERSION`)::

    {"schema": "loka.probe-report", "version": 1, "created": ISO-8601, "device": "cuda:0",
     "device_name": "NVIDIA H200", "torch": "2.11.0", "config": {ProbeConfig fields},
     "sites": {fqn: {"name", "in_features", "out_features", "tokens", "dtype",
                     "stats": {...summary...},
                     "roles": {"fwd"|"dgrad"|"wgrad": {"role", "shape": [M, K, N],
                               "baseline_us", "kernels": {name: KernelResult}}}}}}

Loading validates every field (types, shapes, keys that must agree) and raises a
one-line :class:`ReportError` naming the offending path, e.g.
``sites['top.0'].roles['fwd'].shape: expected 3 positive integers, got [4096, -1, 8]``.

Length: each dataclass keeps its fields, their JSON and their checks together (a field
and the rule that validates it change together); split by level, every field would be
described in one file and checked in another.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import BASELINE, Role
from ..jsonio import (MAX_INT, ReportError, atomic_write_text, encode_number,
                      field_bool, field_device, field_int, field_mapping, field_number, field_path,
                      field_str, json_safe, read_json, require_fields)
from .producers import KINDS, X_LAYOUTS, X_USERS

SCHEMA = "loka.probe-report"
SCHEMA_VERSION = 1

ROOFLINE_NOT_TIMED = "roofline: at most {bound:.2f}x at the device's peak rates"
"""``KernelResult.not_timed`` of a kernel whose roofline bound is below ``min_speedup``"""
_ROOFLINE_RE = re.compile(r"roofline: at most ([0-9]*\.?[0-9]+)x")


_POSITIVE = ("mere", "relfro", "naive_mere")
"""error metrics that are never negative (SQNR is in dB: any sign)"""


def _non_negative(d: Mapping, key: str, where: str) -> Optional[float]:
    """``d[key]``: a number that is not negative (a time or a speedup), or None."""
    x = field_number(d, key, where)
    if x is not None and x < 0:
        raise ReportError(f"{field_path(where, key)}: expected a number >= 0, got {x!r}")
    return x


def nearest_the_loss(orders: Mapping[str, Optional[int]], n: int) -> List[str]:
    """The ``n`` sites nearest the loss, given each site's place in the observed training
    forward (``SiteReport.order``; None where it never ran): the last ``n`` to run, never
    more than a quarter of the sites, so that a model of three or fewer Linears keeps none
    back. What ``loka.plan``'s ``head_sites`` keeps on the baseline and what the Probe
    measures forwards only of (``ProbeConfig.head_sites``)."""
    n = min(n, len(orders) // 4)
    ordered = sorted((o, name) for name, o in orders.items() if o is not None)
    return [name for _, name in ordered[-n:]] if n > 0 else []


@dataclass
class ErrorStat:
    """A sample statistic with its bootstrap 95% confidence interval."""

    mean: float
    lo: float
    hi: float
    n: int
    std: float = 0.0

    def to_dict(self) -> dict:
        return {"mean": encode_number(self.mean), "lo": encode_number(self.lo), "hi": encode_number(self.hi),
                "n": int(self.n), "std": encode_number(self.std)}

    @property
    def width(self) -> float:
        """``hi - lo``, the width of the 95% interval."""
        return self.hi - self.lo

    def format(self, digits: int = 3) -> str:
        """``'0.091 [0.085, 0.097]'``."""
        return f"{self.mean:.{digits}g} [{self.lo:.{digits}g}, {self.hi:.{digits}g}]"

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "error statistic",
                  positive: bool = False) -> "ErrorStat":
        """Read and check one statistic: ``lo <= hi``, ``std >= 0`` and, for a ``positive``
        metric (MERE, relative Frobenius), ``mean >= 0`` and ``hi >= 0``. NaN (a kernel
        whose output was not finite) is kept; the planner never takes it as safe. ``lo``
        may be negative: a normal interval ``mean -/+ 1.96 s/sqrt(n)`` reaches below zero."""
        require_fields(d, ("mean", "lo", "hi", "n"), where)
        stat = cls(field_number(d, "mean", where, False), field_number(d, "lo", where, False),
                   field_number(d, "hi", where, False), field_int(d, "n", where),
                   field_number(d, "std", where, default=0.0))
        if positive:  # (comparisons with NaN are False)
            for key in ("hi", "mean"):
                if getattr(stat, key) < 0:
                    raise ReportError(f"{field_path(where, key)}: this error metric is never "
                                      f"negative, got {getattr(stat, key)!r}")
        if stat.lo > stat.hi:
            raise ReportError(f"{field_path(where, 'lo')}: the interval's lower end {stat.lo!r} "
                              f"is above its upper end {stat.hi!r}")
        if stat.std < 0:
            raise ReportError(f"{field_path(where, 'std')}: a standard deviation cannot be "
                              f"negative, got {stat.std!r}")
        return stat


@dataclass
class KernelResult:
    """One kernel at one site and role."""

    kernel: str
    mere: Optional[ErrorStat] = None
    sqnr: Optional[ErrorStat] = None
    relfro: Optional[ErrorStat] = None
    naive_mere: Optional[ErrorStat] = None
    """MERE on N(0, 1) operands of the same shape, for the learned-vs-naive comparison"""
    time_us: Optional[float] = None
    """median time of the full kernel call, quantization included"""
    speedup: Optional[float] = None
    """baseline time / this kernel's time"""
    timing: str = "none"
    """'cuda-graph', 'cuda-events', 'cpu-wallclock' or 'none'; '+compiled' is appended when
    the call was timed under ``torch.compile`` (``ProbeConfig.timing_compile``), and
    '+derived+compiled' when it was derived from the compiled call of the kernel it
    quantizes as (``Kernel.quantizes_as``)"""
    time_us_weight_q: Optional[float] = None
    """forward role only: median time with the weight (operand b) quantized beforehand,
    as in inference, where weights are quantized once"""
    speedup_weight_q: Optional[float] = None
    """baseline time / ``time_us_weight_q``"""
    safe: bool = False
    fast: bool = False
    error: Optional[str] = None
    """set when the kernel failed at this site (then it is never safe)"""
    not_timed: Optional[str] = None
    """why the Probe did not time this kernel here (over the error budget; a roofline
    bound below ``min_speedup``); None: timed, or timing off"""
    time_us_gemm: Optional[float] = None
    """FP8 kernels timed compiled where an operand's quantization could fuse into its
    producer: median time with both operands quantized beforehand (the GEMM alone;
    ``time_us`` less this is what quantizing the operands cost)"""
    step_us: Optional[float] = None
    """what the compiled training step is predicted to pay for this kernel here: the timed
    call less what fusing operand quantizations into their producers saves
    (:mod:`loka.probe.pricing`); None where nothing could fuse (the step pays
    ``time_us``) or the split is missing"""
    step_speedup: Optional[float] = None
    """baseline time / ``step_us``"""
    serve_us: Optional[float] = None
    """forward role only: what a compiled serving forward is predicted to pay for this
    kernel here: ``time_us_weight_q`` less what fusing x's quantization into its producer
    saves (:func:`loka.probe.pricing.serve_time_us`); None where x's quantization does not
    fuse or the split is missing"""
    serve_speedup: Optional[float] = None
    """baseline time / ``serve_us``"""
    errors_from: Optional[str] = None
    """the kernel whose error samples these are (its output equals this kernel's bit for
    bit, ``Kernel.same_bits_as``; ``ProbeConfig.twin_errors``); None: sampled here"""
    roofline_bound: Optional[float] = None
    """where the roofline bound is why the kernel was not timed (``not_timed``): the
    speedup over the measured baseline that the timed call could reach at most at the
    device's peak rates, each operand it quantizes read and cast in a pass of its own at
    full bandwidth. (A quantization fused into its producer would cost less in a whole
    step; the Probe does not time a kernel it prunes, so that is not measured.) A plan for
    the probing device type takes the bound as a timing that is slow when it is below the
    plan's ``min_speedup``, also under ``assume_fast``. Reports written before this field
    read it back from ``not_timed``'s text (two decimals)."""

    def metric(self, name: str) -> Optional[ErrorStat]:
        if name == "neg_sqnr":
            s = self.sqnr
            return None if s is None else ErrorStat(-s.mean, -s.hi, -s.lo, s.n, s.std)
        return getattr(self, name)

    def to_dict(self) -> dict:
        d = {"kernel": self.kernel, "time_us": encode_number(self.time_us), "speedup": encode_number(self.speedup),
             "timing": self.timing, "safe": bool(self.safe), "fast": bool(self.fast),
             "error": self.error}
        if self.time_us_weight_q is not None:
            d["time_us_weight_q"] = encode_number(self.time_us_weight_q)
            d["speedup_weight_q"] = encode_number(self.speedup_weight_q)
        if self.not_timed is not None:
            d["not_timed"] = self.not_timed
        if self.errors_from is not None:
            d["errors_from"] = self.errors_from
        for k in ("time_us_gemm", "step_us", "step_speedup", "serve_us", "serve_speedup",
                  "roofline_bound"):
            if getattr(self, k) is not None:
                d[k] = encode_number(getattr(self, k))
        for k in ("mere", "sqnr", "relfro", "naive_mere"):
            v = getattr(self, k)
            d[k] = None if v is None else v.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "kernel result") -> "KernelResult":
        require_fields(d, ("kernel",), where)
        stats = {k: (None if d.get(k) is None else
                     ErrorStat.from_dict(d[k], field_path(where, k), positive=k in _POSITIVE))
                 for k in ("mere", "sqnr", "relfro", "naive_mere")}
        name = field_str(d, "kernel", where)
        if not name:
            raise ReportError(f"{field_path(where, 'kernel')}: empty kernel name")
        times = {k: _non_negative(d, k, where) for k in
                 ("time_us", "speedup", "time_us_weight_q", "speedup_weight_q",
                  "time_us_gemm", "step_us", "step_speedup", "serve_us", "serve_speedup",
                  "roofline_bound")}
        not_timed = field_str(d, "not_timed", where, optional=True)
        errors_from = field_str(d, "errors_from", where, optional=True)
        if errors_from is not None and errors_from in ("", name):
            raise ReportError(f"{field_path(where, 'errors_from')}: expected another "
                              f"kernel's name, got {errors_from!r} (it names itself)")
        if times["roofline_bound"] is None:  # a report from before the field: its text
            m = _ROOFLINE_RE.match(not_timed or "")
            times["roofline_bound"] = float(m.group(1)) if m else None
        for k in ("time_us_gemm", "step_us", "step_speedup", "serve_us", "serve_speedup"):
            if times[k] is not None and not (math.isfinite(times[k]) and times[k] > 0):
                raise ReportError(f"{field_path(where, k)}: expected a finite number > 0, "
                                  f"got {times[k]!r}")
        for price, timed, what in (("step_us", "time_us", "the timed call's"),
                                   ("serve_us", "time_us_weight_q",
                                    "the weight-quantized forward's")):
            if times[price] is not None and (times[timed] is None
                                             or times[price] > times[timed] * (1 + 1e-9)):
                raise ReportError(f"{field_path(where, price)}: {times[price]!r} is not at "
                                  f"most {what} {timed} ({times[timed]!r})")
        return cls(kernel=name, time_us=times["time_us"], speedup=times["speedup"],
                   timing=field_str(d, "timing", where, "none"),
                   time_us_weight_q=times["time_us_weight_q"],
                   speedup_weight_q=times["speedup_weight_q"],
                   safe=field_bool(d, "safe", where),
                   fast=field_bool(d, "fast", where), error=field_str(d, "error", where, optional=True),
                   not_timed=not_timed,
                   time_us_gemm=times["time_us_gemm"], step_us=times["step_us"],
                   step_speedup=times["step_speedup"], serve_us=times["serve_us"],
                   serve_speedup=times["serve_speedup"], roofline_bound=times["roofline_bound"],
                   errors_from=errors_from, **stats)


@dataclass
class RoleReport:
    role: Role
    shape: Tuple[int, int, int]
    """(M, K, N) of the GEMM this role runs"""
    baseline_us: Optional[float] = None
    kernels: Dict[str, KernelResult] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"role": self.role.value, "shape": list(self.shape),
                "baseline_us": encode_number(self.baseline_us),
                "kernels": {k: v.to_dict() for k, v in self.kernels.items()}}

    def best(self, max_error: Optional[float] = None, metric: str = "mere"
             ) -> Optional[KernelResult]:
        """The fastest safe kernel (ties and untimed kernels: the lowest error bound).

        Safe means no failure and, with ``max_error``, ``metric``'s upper bound below it;
        without ``max_error`` the recorded ``safe`` flag (the Probe's budget).
        """
        candidates = []
        for kr in self.kernels.values():
            stat = kr.metric(metric)
            if kr.error is not None or stat is None:
                continue
            ok = kr.safe if max_error is None else (math.isfinite(stat.hi) and stat.hi < max_error)
            if ok:
                speed = kr.speedup if kr.speedup is not None and math.isfinite(kr.speedup) else -math.inf
                candidates.append((-speed, stat.hi, kr.kernel, kr))
        return min(candidates, key=lambda c: c[:3])[3] if candidates else None

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "role report") -> "RoleReport":
        require_fields(d, ("role", "shape", "kernels"), where)
        try:
            role = Role.parse(d["role"])
        except ValueError as e:
            raise ReportError(f"{field_path(where, 'role')}: {e}") from None
        shape = d["shape"]
        if (not isinstance(shape, list) or len(shape) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_INT
                       for x in shape)):
            raise ReportError(f"{field_path(where, 'shape')}: expected [M, K, N] of 3 positive "
                              f"integers, got {str(shape)[:60]}")
        kernels = {}
        for k, v in field_mapping(d, "kernels", where).items():
            kr = KernelResult.from_dict(v, f"{field_path(where, 'kernels')}[{k!r}]")
            if kr.kernel != k:
                raise ReportError(f"{field_path(where, 'kernels')}[{k!r}]: holds kernel {kr.kernel!r}")
            kernels[k] = kr
        for k, kr in kernels.items():
            twin = kr.errors_from
            if twin is not None and (twin not in kernels or kernels[twin].errors_from):
                why = (f"no kernel {twin!r} in this role" if twin not in kernels else
                       f"{twin!r} is itself copied from {kernels[twin].errors_from!r}")
                raise ReportError(f"{field_path(where, 'kernels')}[{k!r}].errors_from: {why}")
        return cls(role, tuple(shape), _non_negative(d, "baseline_us", where), kernels)


@dataclass
class SiteReport:
    """One GEMM site (a Linear, keyed by its fully qualified name)."""

    name: str
    in_features: int
    out_features: int
    tokens: int
    """rows M of the site's input per step (product of its leading dims)"""
    dtype: str = "bfloat16"
    stats: Dict[str, Any] = field(default_factory=dict)
    """summary of the learned statistics (amax, outlier fraction, kurtosis, ...)"""
    roles: Dict[Role, RoleReport] = field(default_factory=dict)
    producers: Dict[str, str] = field(default_factory=dict)
    """'x' and 'dy' -> the kind of op that makes that operand in the training step
    (:mod:`loka.probe.producers`); 'x_users' -> 'single' or 'shared' (whether ops other
    than this GEMM read x); 'x_layout' -> 'rows' or 'copied'; 'x_group' -> the first site
    (in the forward's order) of the sites whose input is one tensor, present only where
    several are; absent where the Probe did not see it"""
    order: Optional[int] = None
    """when it first ran in the observed training forwards (0 first; None: not recorded):
    the last to run are nearest the loss (``DispatchConfig.head_sites``)"""

    @property
    def shape(self) -> Tuple[int, int, int]:
        return (self.tokens, self.in_features, self.out_features)

    def to_dict(self) -> dict:
        d = {"name": self.name, "in_features": self.in_features,
             "out_features": self.out_features, "tokens": self.tokens, "dtype": self.dtype,
             "stats": json_safe(self.stats),
             "roles": {r.value: rr.to_dict() for r, rr in self.roles.items()}}
        if self.producers:
            d["producers"] = dict(self.producers)
        return d if self.order is None else {**d, "order": self.order}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "site report") -> "SiteReport":
        require_fields(d, ("name", "in_features", "out_features", "tokens", "roles"), where)
        roles = {}
        for r, v in field_mapping(d, "roles", where).items():
            rr = RoleReport.from_dict(v, f"{field_path(where, 'roles')}[{r!r}]")
            if rr.role.value != r:
                raise ReportError(f"{field_path(where, 'roles')}[{r!r}]: holds role {rr.role.value!r}")
            roles[rr.role] = rr
        producers = dict(field_mapping(d, "producers", where, {}))
        for operand, kind in producers.items():
            if operand == "x_group":
                if not isinstance(kind, str) or not kind:
                    raise ReportError(f"{field_path(where, 'producers')}['x_group']: expected "
                                      f"the name of a site, got {kind!r}")
            elif operand in ("x_users", "x_layout"):
                allowed = X_USERS if operand == "x_users" else X_LAYOUTS
                if kind not in allowed:
                    raise ReportError(f"{field_path(where, 'producers')}[{operand!r}]: expected "
                                      f"one of {allowed}, got {kind!r}")
            elif operand not in ("x", "dy") or kind not in KINDS:
                raise ReportError(f"{field_path(where, 'producers')}[{operand!r}]: expected "
                                  f"'x' or 'dy' -> one of {KINDS}, got {kind!r}")
        return cls(field_str(d, "name", where), field_int(d, "in_features", where, 1),
                   field_int(d, "out_features", where, 1), field_int(d, "tokens", where),
                   field_str(d, "dtype", where, "bfloat16"), dict(field_mapping(d, "stats", where, {})),
                   roles, producers,
                   field_int(d, "order", where) if d.get("order") is not None else None)


@dataclass
class ProbeReport:
    sites: Dict[str, SiteReport] = field(default_factory=dict)
    device: str = "cpu"
    device_name: str = ""
    torch_version: str = ""
    config: Dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    meta: Dict[str, Any] = field(default_factory=dict)
    """free-form: model name, steps observed, timing notes"""

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "created": self.created,
                "device": self.device, "device_name": self.device_name,
                "torch": self.torch_version, "config": json_safe(self.config),
                "meta": json_safe(self.meta),
                "sites": {k: v.to_dict() for k, v in self.sites.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ProbeReport":
        require_fields(d, ("sites",), "probe report")
        try:
            sites = {}
            for k, v in field_mapping(d, "sites", "").items():
                site = SiteReport.from_dict(v, f"sites[{k!r}]")
                if site.name != k:
                    raise ReportError(f"sites[{k!r}]: holds site {site.name!r}")
                sites[k] = site
            return cls(sites=sites, device=field_device(d, "device", ""),
                       device_name=field_str(d, "device_name", "", ""),
                       torch_version=field_str(d, "torch", "", ""),
                       config=dict(field_mapping(d, "config", "", {})),
                       created=field_str(d, "created", "", ""), meta=dict(field_mapping(d, "meta", "", {})))
        except ReportError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError,
                RecursionError) as e:
            raise ReportError(f"probe report: invalid content ({type(e).__name__}: "
                              f"{str(e)[:200]})") from None

    def save(self, path: "str | os.PathLike") -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=False))

    @classmethod
    def load(cls, path: "str | os.PathLike", max_bytes: Optional[int] = None) -> "ProbeReport":
        """Load and validate a report file: any fault is a one-line :class:`ReportError`
        naming the file and the field (``max_bytes``: see :func:`loka.jsonio.load_json`)."""
        data = read_json(path, SCHEMA, SCHEMA_VERSION, max_bytes)
        try:
            return cls.from_dict(data)
        except ReportError as e:
            raise ReportError(f"{path}: {e}") from None

    # -- summaries ---------------------------------------------------------------------
    def summary_table(self, max_error: Optional[float] = None, metric: str = "mere") -> str:
        """One line per site and role: shape, the best safe kernel (fastest; see
        :meth:`RoleReport.best`), its error ``mean [lo, hi]`` and speedup.

        Args:
            max_error: budget on ``metric``'s upper bound; None: the recorded ``safe`` flags.
        """
        head = ("site", "M x K x N", "role", "best safe kernel", f"{metric} [95% CI]", "speedup")
        lines = [head]
        cpu_timed = False
        for name, site in self.sites.items():
            for role, rr in site.roles.items():
                best = rr.best(max_error, metric)
                stat = None if best is None else best.metric(metric)
                speed = None if best is None else best.speedup
                if best is not None and best.timing.startswith("cpu-wallclock"):
                    speed, cpu_timed = None, True  # CPU noise, not a speed of FP8 on a GPU
                # the baseline is the GEMM in the site's dtype: say which it ran
                label = "-" if best is None else best.kernel + (
                    f" (ran {site.dtype.replace('float', 'fp')})"
                    if best.kernel == BASELINE and site.dtype not in ("bfloat16", "") else "")
                lines.append((name, "x".join(map(str, rr.shape)), role.value, label,
                              "-" if stat is None else stat.format(),
                              "-" if speed is None else f"{speed:.2f}x"))
        widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        if cpu_timed:
            text.append("speedup '-': CPU timing, not a GPU speed (wall clock of emulated and "
                        "CPU kernels)")
        return "\n".join(text)

    def geomean_error(self, kernel: str, role: "Role | str | None" = None,
                      metric: str = "mere") -> float:
        """Geometric mean across sites (and roles, unless ``role`` is given) of ``kernel``'s
        mean error, where it ran without failure: the paper's cross-layer summary.

        Args:
            metric: 'mere', 'relfro' or 'naive_mere' (positive metrics only).
        """
        if metric not in ("mere", "relfro", "naive_mere"):
            raise ValueError(f"geomean_error needs a positive metric (mere, relfro, naive_mere), "
                             f"not {metric!r}")
        roles = None if role is None else {Role.parse(role)}
        values = []
        for site in self.sites.values():
            for r, rr in site.roles.items():
                kr = rr.kernels.get(kernel)
                if (roles is None or r in roles) and kr is not None and kr.error is None:
                    stat = getattr(kr, metric)
                    if stat is not None:
                        values.append(stat.mean)
        if not values:
            raise ValueError(f"kernel {kernel!r} has no {metric} in this report"
                             + ("" if role is None else f" for role {Role.parse(role)}"))
        if any(math.isnan(v) for v in values):
            return math.nan
        if any(v <= 0 for v in values):
            return 0.0
        return math.exp(sum(math.log(v) for v in values) / len(values))

    def kernel_names(self) -> List[str]:
        names = []
        for s in self.sites.values():
            for rr in s.roles.values():
                for k in rr.kernels:
                    if k not in names:
                        names.append(k)
        return names


def compare_reports(a: ProbeReport, b: ProbeReport, *, max_error: Optional[float] = None,
                    metric: str = "mere", as_text: bool = False):
    """What changed from report ``a`` to report ``b``.

    Per site and role present in both: the best safe kernel in each (see
    :meth:`RoleReport.best`) and, for every kernel measured in both, the error means and
    their difference ``b - a``, and the speedups.

    Returns:
        ``{"only_in_a": [site], "only_in_b": [site], "best_changed": int,
        "roles": [{"site", "role", "best_a", "best_b", "changed", "kernels": {name:
        {"a", "b", "delta", "speedup_a", "speedup_b", "safe_a", "safe_b"}}}]}``, or with
        ``as_text`` a readable summary of the same.
    """
    out = {"metric": metric, "only_in_a": sorted(set(a.sites) - set(b.sites)),
           "only_in_b": sorted(set(b.sites) - set(a.sites)), "roles": []}
    for name in (n for n in a.sites if n in b.sites):
        sa, sb = a.sites[name], b.sites[name]
        for role in (r for r in sa.roles if r in sb.roles):
            ra, rb = sa.roles[role], sb.roles[role]
            ba, bb = ra.best(max_error, metric), rb.best(max_error, metric)
            kernels = {}
            for k in (k for k in ra.kernels if k in rb.kernels):
                ka, kb = ra.kernels[k], rb.kernels[k]
                ea, eb = ka.metric(metric), kb.metric(metric)
                va = None if ea is None else ea.mean
                vb = None if eb is None else eb.mean
                kernels[k] = {"a": va, "b": vb,
                              "delta": None if va is None or vb is None else vb - va,
                              "speedup_a": ka.speedup, "speedup_b": kb.speedup,
                              "safe_a": ka.safe, "safe_b": kb.safe}
            best_a = None if ba is None else ba.kernel
            best_b = None if bb is None else bb.kernel
            out["roles"].append({"site": name, "role": role.value, "best_a": best_a,
                                 "best_b": best_b, "changed": best_a != best_b,
                                 "kernels": kernels})
    out["best_changed"] = sum(r["changed"] for r in out["roles"])
    return _comparison_text(out) if as_text else out


def _comparison_text(cmp: Mapping) -> str:
    lines = [f"{len(cmp['roles'])} site-role(s) in both reports; best safe kernel changed in "
             f"{cmp['best_changed']}"]
    for key, label in (("only_in_a", "only in a"), ("only_in_b", "only in b")):
        if cmp[key]:
            lines.append(f"sites {label}: {', '.join(cmp[key])}")
    for r in cmp["roles"]:
        mark = "*" if r["changed"] else " "
        lines.append(f"{mark} {r['site']} {r['role']}: {r['best_a'] or '-'} -> {r['best_b'] or '-'}")
        for k, v in r["kernels"].items():
            if v["delta"] is not None and v["delta"] != 0:
                flip = "" if v["safe_a"] == v["safe_b"] else (
                    " (now safe)" if v["safe_b"] else " (now unsafe)")
                lines.append(f"    {k}: {cmp['metric']} {v['a']:.4g} -> {v['b']:.4g} "
                             f"({v['delta']:+.3g}){flip}")
    return "\n".join(lines)
