"""Charts of a run: each variant's speedup per mode (:func:`plot`) and across batch sizes
(:func:`plot_sweep`). matplotlib is optional: it is imported when a chart is drawn."""

from __future__ import annotations

from typing import List, Tuple

from .variants import RATIO_REFS, Variant

__all__ = ["plot", "plot_panels", "plot_sweep"]

COLORS = {"loka": "tab:green", "torchao": "tab:orange", "bf16": "tab:blue"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_panels(result: dict) -> List[Tuple[str, str, List[dict]]]:
    """``(mode, reference, rows)`` for each mode with measured rows: the rows' speedups
    against the first baseline of :data:`RATIO_REFS` that the run measured in that mode."""
    panels = []
    for mode in ("train", "infer"):
        for ref in RATIO_REFS:
            rows = [r for r in result.get(mode, []) if f"speedup_vs_{ref}" in r]
            if rows:
                panels.append((mode, ref, rows))
                break
    return panels


def plot(result: dict, path: str) -> str:
    """A bar chart of each variant's speedup, one panel per mode that has rows (against
    bf16, or the first baseline the run has: :func:`plot_panels`)."""
    plt = _pyplot()
    panels = plot_panels(result)
    if not panels:
        raise ValueError("nothing to plot: no row has a speedup against a measured baseline")
    heights = max(len(rows) for _, _, rows in panels)
    # room for the longest variant name left of the bars, so titles never run off the page
    label_in = 0.075 * max(len(r["variant"]) for _, _, rows in panels for r in rows)
    fig, axes = plt.subplots(1, len(panels), figsize=((4.5 + label_in) * len(panels),
                                                      1.5 + 0.45 * heights), squeeze=False)
    for ax, (mode, ref, rows) in zip(axes[0], panels):
        names = [r["variant"] for r in rows]
        vals = [r[f"speedup_vs_{ref}"] for r in rows]
        colors = [COLORS[Variant.parse(n).family] for n in names]
        ax.barh(names, vals, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlim(0, 1.15 * max(max(vals), 1.0))  # room for the value printed after each bar
        ax.set_title("training step" if mode == "train" else "inference forward")
        ax.set_xlabel(f"speedup vs {ref} (median step time)")
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    fig.suptitle(f"{result['config']['model']} {result['config']['preset']} on "
                 f"{result['env'].get('gpu', result['env']['device'])} ({result['env']['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(sweep: dict, path: str, ref: str = "bf16+mods") -> str:
    """Speedup against ``ref`` (else bf16) per variant across batch sizes, one panel per
    mode that has such points."""
    plt = _pyplot()
    panels = []
    for mode in ("train", "infer"):
        for r in dict.fromkeys((ref, "bf16")):
            key = f"speedup_vs_{r}"
            lines = {v: sorted((int(b), row[key]) for b, row in by_b.items() if key in row)
                     for v, by_b in sweep[mode].items()}
            lines = {v: pts for v, pts in lines.items() if pts}
            if lines:
                panels.append((mode, r, lines))
                break
    if not panels:
        raise ValueError(f"nothing to plot: no speedup against {ref} or bf16")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (mode, r, lines) in zip(axes[0], panels):
        for variant, pts in lines.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=variant)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"speedup vs {r}")
        ax.set_title("training step" if mode == "train" else "inference forward")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
