"""The report's figures, drawn with matplotlib (Agg) and returned as base64 PNG.

matplotlib is optional (the ``plot`` extra) and imported only here; without it
:func:`available` is False, every figure function returns None and the HTML page shows
its tables alone.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..kernels import capabilities as caps
from .tables import ROLES, Row, decisions, flat_stats

MARKERS = {"fwd": "o", "dgrad": "s", "wgrad": "^"}
INSTALL_HINT = "pip install 'loka[plot]'  (or: pip install matplotlib)"


def available() -> bool:
    """Whether figures can be drawn (matplotlib importable)."""
    return caps.module_available("matplotlib")


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _kernel_colors(names: Sequence[str], palette: Optional[Sequence[str]] = None
                   ) -> Dict[str, tuple]:
    """One color per kernel; with ``palette`` (every kernel name of the page) a kernel has
    the same color in every figure."""
    plt = _plt()
    order = list(palette or ()) + [n for n in names if n not in (palette or ())]
    cmap = plt.get_cmap("tab20" if len(order) > 10 else "tab10")
    return {n: cmap(order.index(n) % cmap.N) for n in names}


_PLOTTABLE = 1e100
"""larger magnitudes are left out of the figures (tables keep them): a log axis up to
1e308 overflows while matplotlib places its ticks"""


def _finite(x: Optional[float]) -> bool:
    """Drawable: finite and of a magnitude below :data:`_PLOTTABLE`."""
    return x is not None and math.isfinite(x) and abs(x) < _PLOTTABLE


def _label(text: Any) -> str:
    """A name from a report as literal text (``$`` would start matplotlib's math mode, and a
    malformed formula fails the whole figure)."""
    return str(text).replace("$", r"\$")


def error_vs_speedup(data: List[Row], max_error: float, min_speedup: float,
                     metric: str = "mere", palette: Optional[Sequence[str]] = None
                     ) -> Optional[str]:
    """Per-site error (y, log) against speedup over bf16 (x), one marker per role, one color
    per kernel; the safe-and-fast quadrant (error < budget, speedup > minimum) is shaded.
    Without timings, x is the kernel (a strip plot) and only the error budget is drawn."""
    pts = [r for r in data if _finite(r.error) and r.error > 0]
    if not available() or not pts:
        return None
    plt = _plt()
    kernels = sorted({r.kernel for r in pts})
    colors = _kernel_colors(kernels, palette)
    timed = any(_finite(r.speedup) for r in pts)
    fig, ax = plt.subplots(figsize=(8.5, 5))
    if timed:
        xs = [r.speedup for r in pts if _finite(r.speedup)]
        lo, hi = min(xs + [min_speedup]) * 0.9, max(xs + [min_speedup]) * 1.1
        ax.axvspan(min_speedup, hi, ymin=0, ymax=1, color="#e8f5e9", zorder=0)
        ax.axvline(min_speedup, color="#2e7d32", ls="--", lw=1,
                   label=f"min speedup {min_speedup:g}")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("speedup over bf16 (quantization included)")
    else:
        ax.set_xticks(range(len(kernels)), [_label(k) for k in kernels], rotation=30, ha="right",
                      fontsize=8)
        ax.set_xlabel("kernel (no timings in this report)")
    ax.axhline(max_error, color="#c62828", ls="--", lw=1,
               label=_label(f"max {metric} {max_error:g}"))
    for r in pts:
        if timed and not _finite(r.speedup):
            continue
        x = r.speedup if timed else kernels.index(r.kernel) + (ROLES.index(_role(r.role)) - 1) * 0.15
        ax.scatter(x, r.error, color=colors[r.kernel], marker=MARKERS.get(r.role, "o"), s=36,
                   edgecolors="black" if r.chosen else "none", linewidths=1.2, zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel(_label(f"{metric} (mean over samples)"))
    handles = [plt.Line2D([], [], color=colors[k], marker="o", ls="", label=_label(k))
               for k in kernels]
    handles += [plt.Line2D([], [], color="gray", marker=m, ls="", label=r)
                for r, m in MARKERS.items()]
    handles += [plt.Line2D([], [], color="white", marker="o", markeredgecolor="black",
                           ls="", label="chosen by plan")]
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7,
              loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Error vs speedup per site and role (shaded: fast; below the red line: safe)")
    ax.grid(alpha=0.3, which="both")
    return _png(fig)


def _role(role: str):
    return next(r for r in ROLES if r.value == role)


def decision_map(sites: Sequence[str], plan, palette: Optional[Sequence[str]] = None
                 ) -> Optional[str]:
    """Site x role grid colored by the plan's kernel, each cell labelled with its name."""
    picked = decisions(plan)
    if not available() or not picked:
        return None
    plt = _plt()
    sites = [s for s in sites if s in picked] + [s for s in picked if s not in sites]
    kernels = sorted({k for v in picked.values() for k in v.values()})
    idx = {k: i for i, k in enumerate(kernels)}
    grid = np.full((len(sites), len(ROLES)), np.nan)
    for i, s in enumerate(sites):
        for j, r in enumerate(ROLES):
            if r.value in picked[s]:
                grid[i, j] = idx[picked[s][r.value]]
    # pastel versions of the scatter's kernel colors, so that the labels stay readable
    colors = {k: tuple(0.45 * c + 0.55 for c in rgba[:3]) + (1.0,)
              for k, rgba in _kernel_colors(kernels, palette).items()}
    if "bf16" in colors:
        colors["bf16"] = (0.9, 0.9, 0.9, 1.0)
    cmap = plt.matplotlib.colors.ListedColormap([colors[k] for k in kernels])
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.32 * len(sites)))
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(kernels) - 0.5, aspect="auto")
    for i, s in enumerate(sites):
        for j, r in enumerate(ROLES):
            name = picked[s].get(r.value, "")
            ax.text(j, i, _label(name), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(ROLES)), [r.value for r in ROLES])
    ax.set_yticks(range(len(sites)), [_label(s) for s in sites], fontsize=7)
    ax.xaxis.tick_top()
    ax.set_title("Kernel per site and role (gray: bf16 baseline)", fontsize=10, pad=18)
    return _png(fig)


def learned_vs_naive(data: List[Row], palette: Optional[Sequence[str]] = None) -> Optional[str]:
    """MERE on learned distributions (y) against MERE on N(0, 1) operands (x), log-log, with
    the y = x diagonal: points above it are sites where naive inputs understate the error."""
    pts = [r for r in data if _finite(r.error) and _finite(r.naive) and r.error > 0 and r.naive > 0]
    if not available() or not pts:
        return None
    plt = _plt()
    kernels = sorted({r.kernel for r in pts})
    colors = _kernel_colors(kernels, palette)
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for r in pts:
        ax.scatter(r.naive, r.error, color=colors[r.kernel], marker=MARKERS.get(r.role, "o"), s=30)
    vals = [r.naive for r in pts] + [r.error for r in pts]
    lo, hi = min(vals) * 0.8, max(vals) * 1.25
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("MERE on N(0, 1) operands")
    ax.set_ylabel("MERE on learned distributions")
    ratio = math.exp(sum(math.log(r.error / r.naive) for r in pts) / len(pts))
    ax.set_title(f"Learned vs N(0, 1) error (geometric-mean ratio {ratio:.2f})", fontsize=10)
    ax.legend(handles=[plt.Line2D([], [], color=colors[k], marker="o", ls="", label=_label(k))
                       for k in kernels], fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    return _png(fig)


def activation_stats(site_stats: Mapping[str, Mapping], columns: Sequence[str]) -> Optional[str]:
    """One horizontal bar chart per statistic (amax, outlier fraction, kurtosis), sites on y."""
    if not available() or not columns or not site_stats:
        return None
    plt = _plt()
    sites = list(site_stats)
    flat = {s: flat_stats(v) for s, v in site_stats.items()}
    # an all-zero statistic (e.g. no overflow anywhere) is left to the table
    columns = [c for c in columns if any(flat[s].get(c, 0.0) not in (0.0,) and
                                         _finite(flat[s].get(c, 0.0)) for s in sites)][:6]
    if not columns:
        return None
    fig, axes = plt.subplots(1, len(columns), figsize=(3.2 * len(columns), 0.9 + 0.3 * len(sites)),
                             sharey=True, squeeze=False)
    for ax, col in zip(axes[0], columns):
        vals = [flat[s].get(col, float("nan")) for s in sites]
        ax.barh(range(len(sites)), [v if _finite(v) else 0.0 for v in vals], color="#5c6bc0")
        ax.set_title(_label(col), fontsize=9)
        finite = [v for v in vals if _finite(v)]
        positive = [v for v in finite if v > 0]
        if finite and min(finite) < 0:  # excess kurtosis can be negative
            if max(abs(v) for v in finite) > 100:
                ax.set_xscale("symlog", linthresh=1.0)
            ax.axvline(0, color="black", lw=0.6)
        elif positive and max(positive) / max(min(positive), 1e-30) > 100:
            ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(labelsize=7)
    axes[0][0].set_yticks(range(len(sites)), [_label(s) for s in sites], fontsize=7)
    axes[0][0].invert_yaxis()
    fig.suptitle("Activation statistics per site", fontsize=10)
    return _png(fig)


def training_curves(curves: Mapping[str, Mapping], branch_step: Optional[int] = None
                    ) -> Optional[str]:
    """Training loss and held-out NE against the step, one line per arm (bf16, LoKA, ...).

    Args:
        curves: ``{arm: {"train": {"step": [...], "loss": [...]},
                         "eval": {"step": [...], "ne": [...]}}}``.
    """
    if not available() or not curves:
        return None
    plt = _plt()
    fig, (ax_loss, ax_ne) = plt.subplots(1, 2, figsize=(10, 3.8))
    styles = ("-", "--", ":", "-.")
    for i, (arm, c) in enumerate(curves.items()):
        tr, ev = c.get("train", {}), c.get("eval", {})
        ls = styles[i % len(styles)]  # arms share their history up to the branch: dashes show both
        if tr.get("step"):
            window = max(10, len(tr["loss"]) // 20)
            ax_loss.plot(tr["step"], _smooth(tr["loss"], window), label=_label(arm), lw=1.3, ls=ls)
        if ev.get("step"):
            ax_ne.plot(ev["step"], ev["ne"], label=_label(arm), marker="o", ms=3, lw=1.3, ls=ls)
    for ax, name in ((ax_loss, "training loss (smoothed)"), (ax_ne, "held-out NE")):
        if branch_step is not None:
            ax.axvline(branch_step, color="gray", lw=0.8, ls=":", label="branch")
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _png(fig)


def _smooth(values: Sequence[float], window: int = 10) -> List[float]:
    """Trailing moving average, so that per-batch noise does not hide the trend."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out
