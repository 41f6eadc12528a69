"""The statistics of a paired quality check, in float64.

Two arms scored on the same evaluation examples (same labels, hence the same base-CTR
entropy): the relative NE change ``NE_plan / NE_base - 1`` equals ``mean(l_plan) /
mean(l_base) - 1`` of the per-example log losses, a ratio of paired means. Its interval
over evaluation examples is the delta method's (``ratio_interval``) or a paired bootstrap
(``bootstrap_ratio_interval``); the AUC change's is DeLong's for two correlated AUCs
(``paired_auc``). Over seeds, a Student-t interval of the per-seed changes
(``t_interval``). When the two arms' logits are equal the per-example differences are all
zero and every interval is exactly ``[0, 0]``.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["example_log_losses", "z_quantile", "t_quantile", "ratio_interval",
           "bootstrap_ratio_interval", "paired_auc", "t_interval"]


def example_log_losses(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(N,) float64 binary cross-entropy of each example, from logits (stable)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    return y * np.logaddexp(0.0, -z) + (1.0 - y) * np.logaddexp(0.0, z)


def z_quantile(confidence: float) -> float:
    """The two-sided standard normal quantile of ``confidence`` (1.96 for 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2.0)


def _t_cdf(x: float, df: int) -> float:
    """P(T <= x) for x >= 0, Student t with ``df`` degrees of freedom (Simpson's rule on
    the density over [0, x]: the density is smooth, 4096 panels are exact to ~1e-12)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    t = np.linspace(0.0, x, 4097)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
    h = x / 4096
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())


def t_quantile(confidence: float, df: int) -> float:
    """The two-sided Student-t quantile of ``confidence`` with ``df`` >= 1 degrees of
    freedom (12.706 for 0.95 and df 1), by bisection of the CDF."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    z_quantile(confidence)  # checks confidence
    target = 0.5 + confidence / 2.0
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < target:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def _mean(x: np.ndarray) -> float:
    return math.fsum(x) / x.size


def ratio_interval(base: np.ndarray, plan: np.ndarray, confidence: float = 0.95
                   ) -> Tuple[float, float, float]:
    """``mean(plan) / mean(base) - 1`` of paired samples and its delta-method interval.

    The linearised difference ``d_i = plan_i - R base_i`` (``R`` the ratio of means) has
    mean zero; ``se(R) = sd(d) / (sqrt(N) mean(base))``.

    Returns:
        ``(change, low, high)``.
    """
    base, plan = np.asarray(base, np.float64), np.asarray(plan, np.float64)
    if base.size != plan.size or base.size < 2:
        raise ValueError("paired samples must have the same size, at least 2")
    mean_base = _mean(base)
    ratio = _mean(plan) / mean_base
    d = plan - ratio * base
    d_mean = _mean(d)
    sd = math.sqrt(math.fsum((d - d_mean) ** 2) / (d.size - 1))
    half = z_quantile(confidence) * sd / (math.sqrt(d.size) * mean_base)
    change = ratio - 1.0
    return change, change - half, change + half


def bootstrap_ratio_interval(base: np.ndarray, plan: np.ndarray, resamples: int,
                             confidence: float = 0.95, seed: int = 0,
                             chunk: int = 64) -> Tuple[float, float]:
    """Percentile interval of ``mean(plan) / mean(base) - 1`` over ``resamples`` paired
    bootstrap resamples of the examples (the same indices for both arms)."""
    base, plan = np.asarray(base, np.float64), np.asarray(plan, np.float64)
    rng = np.random.default_rng(seed)
    n = base.size
    out = []
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        out.append(plan[idx].sum(axis=1) / base[idx].sum(axis=1) - 1.0)
    values = np.concatenate(out)
    alpha = (1.0 - confidence) / 2.0
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1.0 - alpha))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x``, tied values sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def _placements(scores: np.ndarray, positive: np.ndarray):
    """DeLong's structural components: per positive, the share of negatives it outscores
    (ties half); per negative, the share of positives that outscore it."""
    pos, neg = scores[positive], scores[~positive]
    m, n = pos.size, neg.size
    all_ranks = _midranks(np.concatenate([pos, neg]))
    v10 = (all_ranks[:m] - _midranks(pos)) / n
    v01 = 1.0 - (all_ranks[m:] - _midranks(neg)) / m
    return v10, v01


def paired_auc(base_scores: np.ndarray, plan_scores: np.ndarray, labels: np.ndarray,
               confidence: float = 0.95) -> Tuple[float, float, float, float, float]:
    """Two correlated AUCs on the same examples and DeLong's interval of their difference.

    Returns:
        ``(auc_base, auc_plan, change, low, high)``, ``change = auc_plan - auc_base``.
    """
    positive = np.asarray(labels) == 1
    m, n = int(positive.sum()), int((~positive).sum())
    if m < 2 or n < 2:
        raise ValueError("a paired AUC needs at least 2 positives and 2 negatives")
    b10, b01 = _placements(np.asarray(base_scores, np.float64), positive)
    p10, p01 = _placements(np.asarray(plan_scores, np.float64), positive)
    auc_base, auc_plan = _mean(b10), _mean(p10)
    d10, d01 = p10 - b10, p01 - b01
    var = (float(np.var(d10, ddof=1)) / m + float(np.var(d01, ddof=1)) / n)
    half = z_quantile(confidence) * math.sqrt(max(var, 0.0))
    change = auc_plan - auc_base
    return auc_base, auc_plan, change, change - half, change + half


def t_interval(values: Sequence[float], confidence: float = 0.95
               ) -> Optional[Tuple[float, float, float]]:
    """Mean of ``values`` and its Student-t interval; None for fewer than 2 values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return None
    mean = _mean(x)
    sd = math.sqrt(math.fsum((x - mean) ** 2) / (x.size - 1))
    half = t_quantile(confidence, x.size - 1) * sd / math.sqrt(x.size)
    return mean, mean - half, mean + half
