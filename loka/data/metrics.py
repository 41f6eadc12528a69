"""CTR quality metrics in float64: log loss, normalized entropy (NE), AUC.

NE = log loss / entropy of the base CTR (the label mean), so the predictor that always
outputs the base CTR scores exactly 1.0 and lower is better: the entropy is computed as the
log loss of that constant predictor by the same code, so the ratio is 1.0 bit for bit. Sums
use ``math.fsum`` (correctly rounded), keeping NE differences of 0.02% far above rounding
noise at any sample count.
"""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np
import torch

_PROB_EPS = 1e-15  # probabilities are clamped to [eps, 1 - eps] so that log loss is finite


def _as_f64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    return arr


def _check(preds: np.ndarray, labels: np.ndarray, *, probs: bool) -> None:
    if preds.size == 0:
        raise ValueError("metrics need at least one example, got empty input")
    if preds.shape != labels.shape:
        raise ValueError(f"predictions and labels differ in size: {preds.size} vs {labels.size}")
    if np.isnan(preds).any():
        raise ValueError(f"predictions contain {int(np.isnan(preds).sum())} NaN value(s)")
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        raise ValueError(f"labels must be 0 or 1; found {np.unique(labels[bad])[:5].tolist()}")
    if probs and ((preds < 0) | (preds > 1)).any():
        raise ValueError("probabilities must lie in [0, 1]; pass logits with from_logits=True")


def _log_terms(preds: np.ndarray, from_logits: bool):
    """(log p, log(1 - p)) per example, computed stably from logits when given."""
    if from_logits:
        return -np.logaddexp(0.0, -preds), -np.logaddexp(0.0, preds)
    p = np.clip(preds, _PROB_EPS, 1.0 - _PROB_EPS)
    return np.log(p), np.log1p(-p)


def _log_loss(preds, labels, from_logits) -> float:
    log_p, log_q = _log_terms(preds, from_logits)
    pos = labels == 1
    total = math.fsum(log_p[pos]) + math.fsum(log_q[~pos])
    return -total / labels.size


def _entropy(labels: np.ndarray) -> float:
    n_pos = int((labels == 1).sum())
    n = labels.size
    if n_pos in (0, n):
        raise ValueError(f"NE is undefined when all {n} labels are {labels[0]:.0f} "
                         "(the base CTR has zero entropy)")
    # the log loss of the constant predictor `ctr`, by the very same arithmetic as the
    # model's log loss, so that predicting the base CTR gives NE == 1.0 bit for bit
    return _log_loss(np.full(n, n_pos / n), labels, from_logits=False)


def log_loss(preds, labels, *, from_logits: bool = False) -> float:
    """Mean binary cross-entropy (natural log) of ``preds`` (N,) against ``labels`` (N,)."""
    p, y = _as_f64(preds, "preds"), _as_f64(labels, "labels")
    _check(p, y, probs=not from_logits)
    return _log_loss(p, y, from_logits)


def normalized_entropy(preds, labels, *, from_logits: bool = False) -> float:
    """Log loss divided by the entropy of the empirical CTR of ``labels``."""
    p, y = _as_f64(preds, "preds"), _as_f64(labels, "labels")
    _check(p, y, probs=not from_logits)
    return _log_loss(p, y, from_logits) / _entropy(y)


def auc(scores, labels) -> float:
    """ROC AUC by the Mann-Whitney rank statistic; tied scores share their mean rank, so
    a constant predictor scores exactly 0.5. Any monotone score (logit or prob) works."""
    s, y = _as_f64(scores, "scores"), _as_f64(labels, "labels")
    _check(s, y, probs=False)
    n_pos = int((y == 1).sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC is undefined with a single class in the labels")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # average ranks (1-based) over runs of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg_rank = (starts + ends + 1) / 2.0
    ranks = np.empty(s.size, dtype=np.float64)
    ranks[order] = np.repeat(avg_rank, ends - starts)
    rank_sum = math.fsum(ranks[y == 1])
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


class Metrics:
    """Streaming accumulator of NE, AUC and log loss.

    Predictions are kept (as float64) because an exact AUC needs every score; that is
    9 bytes per example, 9 MB per million.

    Args:
        from_logits: ``update`` receives logits (True, the model's output) or probabilities.
    """

    def __init__(self, from_logits: bool = True) -> None:
        self.from_logits = from_logits
        self._preds: List[np.ndarray] = []
        self._labels: List[np.ndarray] = []

    def update(self, logits_or_probs, labels) -> None:
        """Add a batch: ``logits_or_probs`` (B,), ``labels`` (B,) in {0, 1}."""
        p, y = _as_f64(logits_or_probs, "preds"), _as_f64(labels, "labels")
        _check(p, y, probs=not self.from_logits)
        self._preds.append(p)
        self._labels.append(y)

    @property
    def count(self) -> int:
        return sum(a.size for a in self._labels)

    def reset(self) -> None:
        self._preds.clear()
        self._labels.clear()

    def compute(self) -> Dict[str, float]:
        """Returns dict(ne, auc, logloss, ctr, count) over everything seen so far."""
        if not self._labels:
            raise ValueError("Metrics.compute() called before any update()")
        p, y = np.concatenate(self._preds), np.concatenate(self._labels)
        ll = _log_loss(p, y, self.from_logits)
        return {"ne": ll / _entropy(y), "auc": auc(p, y), "logloss": ll,
                "ctr": float(y.mean()), "count": int(y.size)}
