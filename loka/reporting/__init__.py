"""Reports for people: a self-contained ``report.html``, a Markdown ``summary.md`` for pull
requests, plain-text tables for the terminal, and TensorBoard scalars.

>>> from loka import reporting
>>> reporting.write_html("report.html", report, plan, curves)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..kernels import capabilities as caps
from .html import SECTIONS, render_html, write_html
from .markdown import render_markdown, write_markdown
from .tables import curve_arms, decisions, load, rows, text_plan, text_report

__all__ = ["SECTIONS", "decisions", "load", "render_html", "render_markdown", "rows",
           "text_plan", "text_report", "write_html", "write_markdown", "write_tensorboard",
           "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` imports (the tensorboard package is installed)."""
    return caps.module_available("torch.utils.tensorboard")


def write_tensorboard(logdir, report=None, plan=None,
                      curves: Optional[Mapping[str, Mapping]] = None) -> int:
    """Write the curves (``<arm>/loss``, ``<arm>/ne``, ``<arm>/auc`` per step) and, per site,
    the chosen kernels' error and speedup as TensorBoard scalars.

    Returns:
        The number of scalars written.

    Raises:
        RuntimeError: ``torch.utils.tensorboard`` does not import (tensorboard missing).
    """
    if not tensorboard_available():
        raise RuntimeError("TensorBoard output needs the tensorboard package: "
                           "pip install 'loka[tensorboard]'")
    from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard package

    n = 0
    with SummaryWriter(str(logdir)) as w:
        for arm, c in curve_arms(curves)[0].items():
            for part, keys in (("train", ("loss",)), ("eval", ("ne", "auc", "loss"))):
                series = c.get(part, {})
                for key in keys:
                    for step, v in zip(series.get("step", []), series.get(key, [])):
                        w.add_scalar(f"{arm}/{part}_{key}", v, step)
                        n += 1
        if report is not None:
            for i, r in enumerate(x for x in rows(report, plan) if x.chosen):
                tag = f"plan/{r.site}/{r.role}"
                if r.error is not None:
                    w.add_scalar(tag + "/error", r.error, 0)
                    n += 1
                if r.speedup is not None:
                    w.add_scalar(tag + "/speedup", r.speedup, 0)
                    n += 1
    return n
