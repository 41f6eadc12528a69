"""``summary.md``: the few numbers a pull request needs, in GitHub Markdown (the figures
stay in ``report.html``).

Every string that comes from a file (device and kernel names, site names, notes, the
title) is escaped: it renders as the text it is, never as Markdown or HTML. Plain text goes
through :func:`md_text` (``<``, ``>`` and ``&`` as entities, the characters that open
Markdown constructs backslash-escaped, line breaks as spaces); names shown as code go
through :func:`md_code` (a fence longer than any run of backticks inside; code spans never
render HTML).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

from ..config import ROLES
from ..jsonio import atomic_write_text
from ..probe.report import ProbeReport
from .tables import (curve_arms, decision_rows, fmt, fp8_fraction, geomean, mismatch_note,
                     plan_budget, rows, timing_note)

_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
_MARKUP = re.compile(r"([\\`*_\[\]|~$#!])")
"""characters that open Markdown constructs inside a line (``$``: GitHub's math)"""


class Markdown(str):
    """A string that is Markdown already (built here from escaped parts): used as is."""


def md_text(x: Any) -> Markdown:
    """``x`` as literal text in Markdown (module doc); safe in a table cell too."""
    text = " ".join(str(x).splitlines())
    text = "".join(_ENTITIES.get(ch, ch) for ch in text)
    return Markdown(_MARKUP.sub(r"\\\1", text))


def md_code(x: Any) -> Markdown:
    """``x`` as an inline code span, for a table cell (``|`` escaped as GFM tables need)."""
    text = " ".join(str(x).splitlines())
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return Markdown(f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|"))


def _md_table(headers: Sequence[Any], body: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return x if isinstance(x, Markdown) else md_text(x)

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


def render_markdown(report: Optional[ProbeReport] = None, plan=None,
                    curves: Optional[Mapping[str, Mapping]] = None,
                    summary: Optional[Mapping[str, Any]] = None,
                    title: str = "LoKA report") -> str:
    """The summary as Markdown: run summary, budget, per-site decisions with the chosen
    kernels' error and speedup, and the learned-vs-N(0, 1) error ratio.

    Args: as :func:`loka.reporting.html.render_html`.
    """
    max_error, min_speedup, metric = plan_budget(plan, report)
    out = [f"## {md_text(title)}", ""]
    if report is not None:
        out.append(f"{len(report.sites)} GEMM site(s) probed on {md_text(report.device)}"
                   f"{' (' + md_text(report.device_name) + ')' if report.device_name else ''}, "
                   f"torch {md_text(report.torch_version or '?')}; budget {md_text(metric)} < "
                   f"{max_error:g}, speedup > {min_speedup:g}.")
        note = timing_note(report)
        if note:
            out += ["", f"> **Note:** {md_text(note)}"]
        mismatch = mismatch_note(report, plan)
        if mismatch:
            out += ["", f"> **Warning:** {md_text(mismatch)}"]
        out.append("")
    if summary:
        out += [_md_table(summary.get("headers", []), summary.get("rows", [])), ""]
        out += [f"> {md_text(n)}" for n in summary.get("notes", [])]
        out.append("")
    if plan is not None:
        fp8, total = fp8_fraction(plan)
        out += [f"**Plan:** {fp8} of {total} GEMM roles off the bf16 baseline.", ""]
        chosen = {(r.site, r.role): r for r in rows(report, plan, metric) if r.chosen} \
            if report is not None else {}
        body = []
        for site, *kernels in decision_rows(report, plan):
            cells = [md_code(site)]
            for role, k in zip(ROLES, kernels):
                r = chosen.get((site, role.value))
                extra = f" ({fmt(r.error)}, {fmt(r.speedup)}x)" if r is not None else ""
                cells.append(md_text(f"{k}{extra}"))
            body.append(cells)
        out += [_md_table(["site"] + [r.value for r in ROLES], body), ""]
        if chosen:
            out += [f"Cells: kernel ({md_text(metric)}, speedup over bf16).", ""]
    elif report is not None:
        out += ["No plan yet: `loka plan report.json -o plan.json`.", ""]
    if report is not None:
        data = [r for r in rows(report, None, "mere") if r.naive]
        learned, naive = geomean(r.error for r in data), geomean(r.naive for r in data)
        if learned and naive:
            out += [f"Learned-distribution MERE is {learned / naive:.2f}x the N(0, 1) MERE "
                    f"(geometric mean over {len(data)} kernel results).", ""]
    arms, _ = curve_arms(curves)
    if arms:
        body = []
        for arm, c in arms.items():
            ev = c.get("eval", {})
            if ev.get("step"):
                body.append([arm, ev["step"][-1], fmt(ev["ne"][-1], ".5f")])
        if body:
            out += [_md_table(["arm", "last eval step", "NE"], body), ""]
    out.append("Figures: `report.html`.")
    return "\n".join(out).rstrip() + "\n"


def write_markdown(path, report=None, plan=None, curves=None, summary=None,
                   title: str = "LoKA report") -> str:
    """Render and write the Markdown atomically; returns ``path``."""
    atomic_write_text(path, render_markdown(report, plan, curves, summary, title))
    return str(path)
