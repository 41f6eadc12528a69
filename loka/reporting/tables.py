"""What every rendering of a report shares: loading a report or plan file, the rows it is
drawn from, and plain-text tables.

The HTML page, the Markdown summary, the TensorBoard scalars and ``loka report`` all read
their numbers through these functions, so the four never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..config import BASELINE, ROLES
from ..dispatch.schema import SCHEMA as PLAN_SCHEMA
from ..dispatch.schema import Plan
from ..dispatch.select import plan_report_mismatches
from ..jsonio import ReportError, load_json
from ..probe.report import SCHEMA as REPORT_SCHEMA
from ..probe.report import ProbeReport

STAT_KEYS = ("amax", "channel_amax_ratio", "underflow_frac", "overflow_frac", "outlier",
             "kurtosis", "channel_kurtosis_max")
"""statistics shown per site, in this order (see ``loka.probe.stats``): range (amax, the
largest over the median channel amax), the fraction of values a tensorwise FP8 cast flushes
because an outlier sets the scale (underflow) or that saturate unscaled (overflow), and
excess kurtosis (pooled, and the worst channel)"""


# -- files -------------------------------------------------------------------------------
def file_schema(path) -> Optional[str]:
    """The ``schema`` field of a LoKA JSON file (ReportError if it is not a JSON object, or
    above the size limit: :func:`loka.jsonio.load_json`)."""
    data = load_json(path)
    return data.get("schema") if isinstance(data, dict) else None


def load(path):
    """A :class:`~loka.probe.report.ProbeReport` or a ``loka.Plan``, by the file's schema.

    Raises:
        FileNotFoundError: no such file.
        ReportError: not JSON, or neither a report nor a plan.
    """
    schema = file_schema(path)
    if schema == REPORT_SCHEMA:
        return ProbeReport.load(path)
    if schema == PLAN_SCHEMA:
        return Plan.load(path)
    raise ReportError(f"{path}: not a {REPORT_SCHEMA} or {PLAN_SCHEMA} file "
                      f"(schema: {schema!r})")


# -- plans -------------------------------------------------------------------------------
def decisions(plan) -> Dict[str, Dict[str, str]]:
    """``{site: {role: kernel}}`` of a ``loka.Plan`` (or its ``to_dict()``), roles as strings;
    a role the plan leaves out runs the plan's baseline."""
    if plan is None:
        return {}
    if isinstance(plan, Mapping):
        plan = Plan.from_dict(plan)
    return {name: {r.value: sp.kernel(r, plan.baseline) for r in ROLES}
            for name, sp in plan.sites.items()}


def plan_budget(plan, report: Optional[ProbeReport] = None) -> Tuple[float, float, str]:
    """``(max_error, min_speedup, metric)`` the plan was made under (else the report's)."""
    budget: Mapping[str, Any] = getattr(plan, "budget", None) or {}
    if isinstance(plan, Mapping):
        budget = plan.get("budget", {})
    rcfg = report.config if report is not None else {}
    max_error = budget.get("max_error", rcfg.get("max_error", 0.2))
    min_speedup = budget.get("min_speedup", rcfg.get("min_speedup", 1.05))
    return float(max_error), float(min_speedup), str(budget.get("metric", "mere"))


def error_only(plan) -> bool:
    """Whether the plan chose on error alone (``assume_fast``: no decisive timings)."""
    budget = getattr(plan, "budget", None) or (plan.get("budget", {}) if isinstance(plan, Mapping) else {})
    return bool(budget.get("assume_fast", False))


# -- rows of a report --------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One kernel at one site and role, flattened for tables and plots."""

    site: str
    role: str
    kernel: str
    shape: Tuple[int, int, int]
    error: Optional[float]
    error_hi: Optional[float]
    naive: Optional[float]
    speedup: Optional[float]
    time_us: Optional[float]
    safe: bool
    fast: bool
    failed: Optional[str]
    chosen: bool


def rows(report: ProbeReport, plan=None, metric: str = "mere",
         include_baseline: bool = False) -> List[Row]:
    """Every (site, role, kernel) result of ``report``; ``chosen`` marks the plan's pick."""
    picked = decisions(plan)
    out = []
    for site, sr in report.sites.items():
        for role, rr in sr.roles.items():
            for name, kr in rr.kernels.items():
                if name == BASELINE and not include_baseline:
                    continue
                stat = kr.metric(metric)
                naive = kr.naive_mere if metric == "mere" else None
                out.append(Row(
                    site, role.value, name, tuple(rr.shape),
                    None if stat is None else stat.mean, None if stat is None else stat.hi,
                    None if naive is None else naive.mean, kr.speedup, kr.time_us,
                    kr.safe, kr.fast, kr.error,
                    picked.get(site, {}).get(role.value) == name))
    return out


def flat_stats(stats: Mapping[str, Any], prefix: str = "") -> Dict[str, float]:
    """Nested stats ``{'x': {'amax': 3.1}}`` -> ``{'x.amax': 3.1}`` (numbers only)."""
    out: Dict[str, float] = {}
    for k, v in stats.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flat_stats(v, key + "."))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, (int, float)) or (isinstance(v, str) and v in ("nan", "inf", "-inf")):
            out[key] = float(v)
    return out


def _stat_rank(leaf: str) -> Optional[int]:
    for i, pattern in enumerate(STAT_KEYS):
        if leaf == pattern or leaf.startswith(pattern + "_") or (
                pattern == "outlier" and "outlier" in leaf):
            return i
    return None


def stat_columns(report: ProbeReport, operands: Sequence[str] = ("act", "grad", "")) -> List[str]:
    """The flattened stat keys on range, outliers and kurtosis present in ``report``, for the
    given operands (``act``: the input x, ``grad``: the output gradient dy, ``""``: keys
    without an operand prefix), in ``STAT_KEYS`` order per operand."""
    found = set()
    for sr in report.sites.values():
        found.update(flat_stats(sr.stats))
    cols = []
    for op in operands:
        keyed = []
        for k in found:
            prefix, _, leaf = k.rpartition(".")
            rank = _stat_rank(leaf)
            if prefix == op and rank is not None:
                keyed.append((rank, k))
        cols += [k for _, k in sorted(keyed)]
    return cols


def geomean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Geometric mean of the positive finite values (the paper's cross-layer error summary)."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def timing_modes(report: ProbeReport) -> List[str]:
    modes = []
    for sr in report.sites.values():
        for rr in sr.roles.values():
            for kr in rr.kernels.values():
                if kr.timing not in modes:
                    modes.append(kr.timing)
    return modes


def mismatch_note(report: Optional[ProbeReport], plan) -> Optional[str]:
    """A warning when ``plan`` and ``report`` describe different models (sites in one and
    not the other, or of other shapes: :func:`loka.dispatch.plan_report_mismatches`);
    None when they match or either is missing. Every rendering shows it above its tables:
    a report and a plan of two models are rendered side by side only with this warning."""
    if report is None or plan is None:
        return None
    if isinstance(plan, Mapping):
        plan = Plan.from_dict(plan)
    found = plan_report_mismatches(plan, report)
    if not found:
        return None
    listed = "; ".join(f"{m['site']}: {m['why']}" for m in found[:_MAX_MISMATCHES])
    more = len(found) - _MAX_MISMATCHES
    return (f"the plan does not match this report ({len(found)} difference(s): {listed}"
            + (f"; and {more} more" if more > 0 else "") + "): they describe different "
            "models or runs, so the plan's choices are not this report's")


_MAX_MISMATCHES = 5


def timing_note(report: ProbeReport) -> Optional[str]:
    """A warning when the report's speedups cannot support FP8 decisions."""
    modes = timing_modes(report)
    if modes and all(m in ("none",) for m in modes):
        return "This report has no timings: decisions rest on error only."
    if "cpu-wallclock" in modes:
        return ("Timings were taken on the CPU (wall clock): they say nothing about FP8 speed "
                "on a GPU. Plan on error only (loka.plan(..., assume_fast=True)) or probe "
                "again on the GPU.")
    return None


def curve_arms(curves: Optional[Mapping[str, Any]]) -> Tuple[Dict[str, Mapping], Optional[int]]:
    """``({label: {"train", "eval"}}, branch_step)`` of curves given as ``{arm: ...}`` or as a
    curves.json document (``{"arms", "labels", "branch_step"}``, written by the demo)."""
    if not curves:
        return {}, None
    if "arms" in curves and isinstance(curves["arms"], Mapping):
        labels = curves.get("labels") or {}
        arms = {str(labels.get(k, k)): v for k, v in curves["arms"].items()}
        step = curves.get("branch_step")
        return arms, int(step) if isinstance(step, int) and not isinstance(step, bool) else None
    return dict(curves), None


# -- text --------------------------------------------------------------------------------
def fmt(x: Optional[float], spec: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def format_table(headers: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    """A left-aligned plain-text table with a rule under the header."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def decision_rows(report: Optional[ProbeReport], plan) -> List[List[str]]:
    """``[site, fwd, dgrad, wgrad]`` per site: the plan's kernels (or '-' where none)."""
    picked = decisions(plan)
    names = list(picked) if report is None else list(report.sites) + [
        s for s in picked if s not in report.sites]
    return [[s] + [picked.get(s, {}).get(r.value, "-") for r in ROLES] for s in names]


def fp8_fraction(plan) -> Tuple[int, int]:
    """(roles on a non-baseline kernel, roles in the plan)."""
    picked = decisions(plan)
    total = sum(len(v) for v in picked.values())
    fp8 = sum(1 for v in picked.values() for k in v.values() if k not in (BASELINE, "fp32"))
    return fp8, total


def text_report(report: ProbeReport, plan=None, metric: str = "mere") -> str:
    """The ``loka report report.json`` table: per site and role, the best kernels."""
    max_error, min_speedup, metric = plan_budget(plan, report) if plan is not None else (
        *plan_budget(None, report)[:2], metric)
    head = [f"probe report: {len(report.sites)} site(s) on {report.device}"
            f"{' (' + report.device_name + ')' if report.device_name else ''}, "
            f"torch {report.torch_version or '?'}, budget {metric} < {max_error:g}, "
            f"speedup > {min_speedup:g}"]
    note = timing_note(report)
    if note:
        head.append("note: " + note)
    mismatch = mismatch_note(report, plan)
    if mismatch:
        head.append("warning: " + mismatch)
    body = []
    for r in rows(report, plan, metric):
        flags = ("safe " if r.safe else "") + ("fast" if r.fast else "")
        if r.failed:
            flags = "failed: " + r.failed[:40]
        body.append([r.site, r.role, "x".join(map(str, r.shape)), r.kernel, fmt(r.error),
                     fmt(r.error_hi), fmt(r.naive), fmt(r.speedup), flags.strip(),
                     "*" if r.chosen else ""])
    table = format_table(["site", "role", "MxKxN", "kernel", metric, "hi95", "N(0,1)",
                          "speedup", "flags", "plan"], body)
    return "\n".join(head + ["", table])


def text_plan(plan, report: Optional[ProbeReport] = None) -> str:
    """The ``loka report plan.json`` table: the kernel of every site and role."""
    max_error, min_speedup, metric = plan_budget(plan, report)
    fp8, total = fp8_fraction(plan)
    head = f"plan: {fp8} of {total} GEMM roles off the baseline; budget {metric} < " \
           f"{max_error:g}, speedup > {min_speedup:g}"
    return head + "\n\n" + format_table(["site"] + [r.value for r in ROLES],
                                        decision_rows(report, plan))
