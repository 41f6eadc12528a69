"""``report.html``: one self-contained page (inline CSS, figures as base64 PNG, no scripts,
no external URLs) that can be mailed, attached to a CI run or opened offline.

Sections, each an ``<section id=...>`` that is always present (saying why when empty):
``summary``, ``error-speedup``, ``decisions``, ``learned-vs-naive``, ``activation-stats``,
``curves``.
"""

from __future__ import annotations

import html as _html
import math
from typing import Any, Mapping, Optional, Sequence

from ..config import ROLES
from ..jsonio import atomic_write_text
from ..probe.report import ProbeReport
from . import plots
from .tables import (curve_arms, decision_rows, decisions, flat_stats, fmt, fp8_fraction, geomean,
                     mismatch_note, plan_budget, rows, stat_columns, timing_note)

SECTIONS = ("summary", "error-speedup", "decisions", "learned-vs-naive", "activation-stats",
            "curves")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;
 color:#1f2328;background:#fff}
main{max-width:1100px;margin:0 auto;padding:24px}
h1{font-size:24px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;
 border-bottom:1px solid #d0d7de;padding-bottom:4px}
.meta{color:#57606a;font-size:13px}
.note{background:#fff8c5;border:1px solid #d4a72c;border-radius:6px;padding:8px 12px;margin:8px 0}
.muted{color:#57606a;font-style:italic}
table{border-collapse:collapse;font-size:12px;margin:8px 0;font-variant-numeric:tabular-nums}
th,td{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa} td.num{text-align:right}
tr.chosen td{background:#dafbe1} td.fp8{background:#ddf4ff} td.base{color:#57606a}
img{max-width:100%;height:auto;display:block;margin:8px 0}
details{margin:8px 0} summary{cursor:pointer;color:#0969da}
"""


def _e(x: Any) -> str:
    return _html.escape(str(x), quote=True)


def _table(headers: Sequence[str], body: Sequence[Sequence[Any]], num_from: int = 99,
           row_class: Optional[Sequence[str]] = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    out = [f"<table><thead><tr>{head}</tr></thead><tbody>"]
    for i, r in enumerate(body):
        cls = f' class="{row_class[i]}"' if row_class and row_class[i] else ""
        cells = "".join(f'<td class="num">{_e(c)}</td>' if j >= num_from else f"<td>{_e(c)}</td>"
                        for j, c in enumerate(r))
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(png: Optional[str], alt: str, why_none: str) -> str:
    if png:
        return f'<img alt="{_e(alt)}" src="data:image/png;base64,{png}">'
    if not plots.available():
        return f'<p class="muted">Plots need matplotlib: {_e(plots.INSTALL_HINT)}.</p>'
    return f'<p class="muted">{_e(why_none)}</p>'


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{_e(title)}</h2>{body}</section>'


def render_html(report: Optional[ProbeReport] = None, plan=None,
                curves: Optional[Mapping[str, Mapping]] = None,
                summary: Optional[Mapping[str, Any]] = None, title: str = "LoKA report") -> str:
    """The page as a string.

    Args:
        report: a ProbeReport (errors, speedups, statistics).
        plan: a ``loka.Plan`` (the decisions); optional.
        curves: ``{arm: {"train": {"step", "loss"}, "eval": {"step", "ne", "auc"}}}``, or a
            curves.json document (``{"arms": ..., "labels": ..., "branch_step": ...}``).
        summary: ``{"headers": [...], "rows": [[...]], "notes": [...]}``, e.g. the demo's
            bf16-vs-LoKA comparison.
        title: the page title.

    Returns:
        A complete HTML5 document.
    """
    max_error, min_speedup, metric = plan_budget(plan, report)
    data = rows(report, plan, metric) if report is not None else []
    # every figure colors a kernel the same way
    palette = sorted({r.kernel for r in data} | {k for v in decisions(plan).values()
                                                 for k in v.values()})
    parts = [f"<h1>{_e(title)}</h1>"]
    meta = []  # plain text, escaped once below (every field may come from a hostile file)
    if report is not None:
        meta.append(f"{len(report.sites)} GEMM site(s) probed on {report.device}"
                    f"{' (' + report.device_name + ')' if report.device_name else ''}, "
                    f"torch {report.torch_version or '?'}, {report.created}")
    if plan is not None:
        fp8, total = fp8_fraction(plan)
        meta.append(f"plan: {fp8} of {total} GEMM roles off the bf16 baseline")
    meta.append(f"budget: {metric} < {max_error:g}, speedup > {min_speedup:g}")
    parts.append(f'<p class="meta">{" &middot; ".join(_e(m) for m in meta)}</p>')
    note = timing_note(report) if report is not None else None
    if note:
        parts.append(f'<p class="note">{_e(note)}</p>')
    mismatch = mismatch_note(report, plan)
    if mismatch:
        parts.append(f'<p class="note"><b>Warning:</b> {_e(mismatch)}</p>')

    # summary
    if summary:
        body = _table(summary.get("headers", []), summary.get("rows", []), num_from=1)
        body += "".join(f'<p class="note">{_e(n)}</p>' for n in summary.get("notes", []))
    else:
        body = '<p class="muted">No run summary was given (the demo writes one).</p>'
    parts.append(_section("summary", "Summary", body))

    # error vs speedup
    png = plots.error_vs_speedup(data, max_error, min_speedup, metric, palette)
    body = _figure(png, "error versus speedup", "No kernel results with an error in this report.")
    if data:
        body += "<details><summary>All kernel results</summary>" + _table(
            ["site", "role", "M x K x N", "kernel", metric, "hi95", "speedup", "safe", "fast"],
            [[r.site, r.role, "x".join(map(str, r.shape)), r.kernel, fmt(r.error), fmt(r.error_hi),
              fmt(r.speedup), "yes" if r.safe else "no", "yes" if r.fast else "no"] for r in data],
            num_from=4, row_class=["chosen" if r.chosen else "" for r in data]) + "</details>"
    parts.append(_section("error-speedup", "Error versus speedup", body))

    # decisions
    sites = list(report.sites) if report is not None else []
    if plan is not None:
        png = plots.decision_map(sites, plan, palette)
        body = _figure(png, "kernel per site and role", "The plan has no sites.")
        body += _decision_table(decision_rows(report, plan))
    else:
        body = '<p class="muted">No plan was given: make one with <code>loka plan</code>.</p>'
    parts.append(_section("decisions", "Decisions per site and role", body))

    # learned vs naive
    png = plots.learned_vs_naive(data, palette)
    body = _figure(png, "learned versus N(0,1) error",
                   "No N(0, 1) comparison in this report (ProbeConfig.compare_naive=False).")
    ratios = _naive_ratios(data)
    if ratios:
        body += _table(["kernel", "geomean learned MERE", "geomean N(0,1) MERE", "ratio"],
                       ratios, num_from=1)
    parts.append(_section("learned-vs-naive", "Learned distributions versus N(0, 1)", body))

    # activation statistics
    cols = stat_columns(report) if report is not None else []
    stats = {s: sr.stats for s, sr in report.sites.items()} if report is not None else {}
    # the figure shows the input activations; the table adds the output gradients
    png = plots.activation_stats(stats, [c for c in cols if not c.startswith("grad.")])
    body = _figure(png, "activation statistics", "The report holds no activation statistics.")
    if cols:
        body += ('<p class="meta">underflow_frac: values a tensorwise FP8 cast flushes because '
                 'an outlier sets the scale; overflow_frac: values an unscaled cast saturates; '
                 'channel_amax_ratio: largest / median channel amax; kurtosis: excess kurtosis '
                 '(0 for a Gaussian).</p>')
        for op, caption in (("act", "input x"), ("grad", "output gradient dy"), ("", "other")):
            op_cols = [c for c in cols if c.rpartition(".")[0] == op]
            if op_cols:
                body += f'<p class="meta"><b>{_e(caption)}</b></p>' + _table(
                    ["site"] + [c.rpartition(".")[2] for c in op_cols],
                    [[s] + [fmt(flat_stats(v).get(c)) for c in op_cols] for s, v in stats.items()],
                    num_from=1)
    parts.append(_section("activation-stats", "Activation statistics per site", body))

    # curves
    arms, branch_step = curve_arms(curves)
    if arms:
        png = plots.training_curves(arms, branch_step)
        body = _figure(png, "training curves", "The curves are empty.") + _curve_table(arms)
        if branch_step is not None:
            body += (f'<p class="meta">The arms share steps 1-{branch_step} and continue from '
                     'the same checkpoint.</p>')
    else:
        body = '<p class="muted">No training curves were given (the demo writes curves.json).</p>'
    parts.append(_section("curves", "Training curves", body))

    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width\"><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(parts)}</main></body></html>\n")


def _decision_table(body) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in ["site"] + [r.value for r in ROLES])
    out = [f"<table><thead><tr>{head}</tr></thead><tbody>"]
    for r in body:
        cells = [f"<td>{_e(r[0])}</td>"] + [
            f'<td class="{"base" if k in ("bf16", "-") else "fp8"}">{_e(k)}</td>' for k in r[1:]]
        out.append(f"<tr>{''.join(cells)}</tr>")
    return "".join(out) + "</tbody></table>"


def _naive_ratios(data):
    by_kernel = {}
    for r in data:
        if r.error and r.naive and math.isfinite(r.error) and math.isfinite(r.naive):
            by_kernel.setdefault(r.kernel, []).append(r)
    out = []
    for k, rs in sorted(by_kernel.items()):
        learned, naive = geomean(r.error for r in rs), geomean(r.naive for r in rs)
        if learned and naive:
            out.append([k, fmt(learned), fmt(naive), fmt(learned / naive, ".2f")])
    return out


def _curve_table(curves) -> str:
    body = []
    for arm, c in curves.items():
        ev = c.get("eval", {})
        if ev.get("step"):
            body.append([arm, ev["step"][-1], fmt(ev["ne"][-1], ".5f"),
                         fmt(ev.get("auc", [None])[-1] if ev.get("auc") else None, ".4f")])
    return _table(["arm", "last eval step", "NE", "AUC"], body, num_from=1) if body else ""


def write_html(path, report: Optional[ProbeReport] = None, plan=None, curves=None,
               summary=None, title: str = "LoKA report") -> str:
    """Render and write the page atomically; returns ``path``."""
    atomic_write_text(path, render_html(report, plan, curves, summary, title))
    return str(path)
