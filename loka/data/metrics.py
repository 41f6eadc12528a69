"""CTR quality metrics in float64: log loss, normalized entropy (NE), AUC; with sample
weights, several tasks, a window of the latest examples, and reduction across ranks.

NE = log loss / entropy of the base CTR (the label mean), so the predictor that always
outputs the base CTR scores exactly 1.0 and lower is better: the entropy is computed as the
log loss of that constant predictor by the same code, so the ratio is 1.0 bit for bit. Sums
use ``math.fsum`` (correctly rounded), keeping NE differences of 0.02% far above rounding
noise at any sample count.

Weights (``weights=``, one per example, finite and >= 0) weight every sum as torchrec's
``NEMetric`` and ``AUCMetric`` do: NE = sum(w * ce) / (-W+ log p - W- log(1 - p)) with
p = W+ / (W+ + W-), and AUC is the weighted Mann-Whitney statistic, the probability that a
positive drawn by weight outscores a negative drawn by weight (ties count one half; it is
the area under torchrec's weighted ROC curve when no scores tie). On labels of a single
class AUC is 0.5, torchrec's no-signal value; NE stays undefined there (its entropy is
zero) and raises.

Several tasks: pass ``(N, T)`` predictions and labels (tasks as columns; weights ``(N,)``
for all tasks or ``(N, T)``) and each function returns a list of ``T`` values, one per
task. :class:`Metrics` streams any of these, optionally over a window of the latest
``window`` examples, and ``compute(reduce=True)`` combines every rank of the default
``torch.distributed`` group: the NE sums are all-reduced, the AUC's scores gathered.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Deque, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

_PROB_EPS = 1e-15  # probabilities are clamped to [eps, 1 - eps] so that log loss is finite
NO_SIGNAL_AUC = 0.5
"""AUC when the labels hold a single class (torchrec returns the same)"""

Value = Union[float, List[float]]


def _as_f64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim > 2:
        raise ValueError(f"{name} must be (N,) or (N, tasks), got shape {arr.shape}")
    return arr.reshape(-1) if arr.ndim < 2 else arr


def _check(preds: np.ndarray, labels: np.ndarray, *, probs: bool) -> None:
    if preds.size == 0:
        raise ValueError("metrics need at least one example, got empty input")
    if preds.shape != labels.shape:
        what = "size" if preds.ndim == labels.ndim == 1 else "shape"
        sizes = ((preds.size, labels.size) if what == "size"
                 else (tuple(preds.shape), tuple(labels.shape)))
        raise ValueError(f"predictions and labels differ in {what}: {sizes[0]} vs {sizes[1]}")
    if np.isnan(preds).any():
        raise ValueError(f"predictions contain {int(np.isnan(preds).sum())} NaN value(s)")
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        raise ValueError(f"labels must be 0 or 1; found {np.unique(labels[bad])[:5].tolist()}")
    if probs and ((preds < 0) | (preds > 1)).any():
        raise ValueError("probabilities must lie in [0, 1]; pass logits with from_logits=True")


def _weights(weights, labels: np.ndarray) -> Optional[np.ndarray]:
    """Validated weights broadcast to ``labels``' shape, or None (all ones)."""
    if weights is None:
        return None
    w = _as_f64(weights, "weights")
    if labels.ndim == 2 and w.ndim == 1 and w.size == labels.shape[0]:
        w = np.repeat(w[:, None], labels.shape[1], axis=1)
    if w.shape != labels.shape:
        raise ValueError(f"weights must be one per example: shape {tuple(w.shape)} vs labels "
                         f"{tuple(labels.shape)}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and >= 0")
    return w


def _log_terms(preds: np.ndarray, from_logits: bool):
    """(log p, log(1 - p)) per example, computed stably from logits when given."""
    if from_logits:
        return -np.logaddexp(0.0, -preds), -np.logaddexp(0.0, preds)
    p = np.clip(preds, _PROB_EPS, 1.0 - _PROB_EPS)
    return np.log(p), np.log1p(-p)


def _ce_sum(preds, labels, from_logits, weights=None) -> float:
    """sum of (weighted) cross-entropies, correctly rounded."""
    log_p, log_q = _log_terms(preds, from_logits)
    pos = labels == 1
    if weights is None:
        return -(math.fsum(log_p[pos]) + math.fsum(log_q[~pos]))
    return -(math.fsum(weights[pos] * log_p[pos]) + math.fsum(weights[~pos] * log_q[~pos]))


def _log_loss(preds, labels, from_logits, weights=None) -> float:
    total = labels.size if weights is None else math.fsum(weights)
    if total <= 0:
        raise ValueError("all weights are zero: the metrics are undefined")
    return _ce_sum(preds, labels, from_logits, weights) / total


def _norm(w_pos: float, w_neg: float) -> float:
    """the (weighted) log loss sum of the constant predictor at the base CTR"""
    if w_pos <= 0 or w_neg <= 0:
        which = "1" if w_neg <= 0 else "0"
        raise ValueError(f"NE is undefined when every (weighted) label is {which} "
                         "(the base CTR has zero entropy)")
    ctr = w_pos / (w_pos + w_neg)
    # the very arithmetic of _log_terms on the constant ctr, so that predicting the base
    # CTR gives NE == 1.0 bit for bit
    log_p, log_q = _log_terms(np.array([ctr]), False)
    return -(w_pos * float(log_p[0]) + w_neg * float(log_q[0]))


def _entropy(labels: np.ndarray, weights=None) -> float:
    if weights is None:
        n, n_pos = labels.size, int((labels == 1).sum())
        if n_pos in (0, n):
            raise ValueError(f"NE is undefined when all {n} labels are {labels[0]:.0f} "
                             "(the base CTR has zero entropy)")
        # the log loss of the constant predictor `ctr`, by the very same arithmetic as the
        # model's log loss, so that predicting the base CTR gives NE == 1.0 bit for bit
        return _log_loss(np.full(n, n_pos / n), labels, from_logits=False)
    pos = labels == 1
    w_pos, w_neg = math.fsum(weights[pos]), math.fsum(weights[~pos])
    return _norm(w_pos, w_neg) / (w_pos + w_neg)


def _per_task(fn, *arrays):
    """fn applied to 1-D arrays: a float for (N,) input, a list per column for (N, T)."""
    first = arrays[0]
    if first.ndim == 1:
        return fn(*arrays)
    return [fn(*(None if a is None else a[:, t] for a in arrays)) for t in range(first.shape[1])]


def log_loss(preds, labels, *, from_logits: bool = False, weights=None) -> Value:
    """Mean binary cross-entropy (natural log) of ``preds`` against ``labels``: (N,) or
    (N, tasks); ``weights`` (N,) or like ``labels`` give the weighted mean."""
    p, y = _as_f64(preds, "preds"), _as_f64(labels, "labels")
    _check(p, y, probs=not from_logits)
    w = _weights(weights, y)
    return _per_task(lambda p, y, w: _log_loss(p, y, from_logits, w), p, y, w)


def normalized_entropy(preds, labels, *, from_logits: bool = False, weights=None) -> Value:
    """Log loss divided by the entropy of the empirical CTR of ``labels`` (both weighted
    when ``weights`` are given); per task for (N, tasks) input."""
    p, y = _as_f64(preds, "preds"), _as_f64(labels, "labels")
    _check(p, y, probs=not from_logits)
    w = _weights(weights, y)
    return _per_task(lambda p, y, w: _log_loss(p, y, from_logits, w) / _entropy(y, w), p, y, w)


def _auc(s: np.ndarray, y: np.ndarray, w: Optional[np.ndarray] = None) -> float:
    pos = y == 1
    if w is None:
        n_pos = int(pos.sum())
        n_neg = y.size - n_pos
        if n_pos == 0 or n_neg == 0:
            return NO_SIGNAL_AUC
        order = np.argsort(s, kind="mergesort")
        sorted_s = s[order]
        # average ranks (1-based) over runs of equal scores
        starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
        ends = np.r_[starts[1:], s.size]
        avg_rank = (starts + ends + 1) / 2.0
        ranks = np.empty(s.size, dtype=np.float64)
        ranks[order] = np.repeat(avg_rank, ends - starts)
        rank_sum = math.fsum(ranks[pos])
        return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)
    # weighted: over runs of equal scores in ascending order, each positive weight beats
    # the negative weight of every lower run and ties half of its own run's
    w_pos_total, w_neg_total = math.fsum(w[pos]), math.fsum(w[~pos])
    if w_pos_total <= 0 or w_neg_total <= 0:
        return NO_SIGNAL_AUC
    order = np.argsort(s, kind="mergesort")
    sorted_s, sorted_w, sorted_pos = s[order], w[order], pos[order]
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    run_pos = np.add.reduceat(np.where(sorted_pos, sorted_w, 0.0), starts)
    run_neg = np.add.reduceat(np.where(sorted_pos, 0.0, sorted_w), starts)
    below = np.cumsum(run_neg) - run_neg  # negative weight strictly below each run
    wins = math.fsum(run_pos * below) + 0.5 * math.fsum(run_pos * run_neg)
    return wins / (w_pos_total * w_neg_total)


def auc(scores, labels, *, weights=None) -> Value:
    """ROC AUC by the (weighted) Mann-Whitney rank statistic; tied scores share their mean
    rank, so a constant predictor scores exactly 0.5, and so do labels of a single class.
    Any monotone score (logit or prob) works. Per task for (N, tasks) input."""
    s, y = _as_f64(scores, "scores"), _as_f64(labels, "labels")
    _check(s, y, probs=False)
    w = _weights(weights, y)
    return _per_task(_auc, s, y, w)


class Metrics:
    """Streaming accumulator of NE, AUC and log loss, optionally weighted, per task, over a
    window, and across ranks.

    Predictions are kept (as float64) because an exact AUC needs every score; that is
    9 bytes per example and task (17 with weights), 9 MB per million.

    Args:
        from_logits: ``update`` receives logits (True, the model's output) or probabilities.
        window: keep only the latest ``window`` examples (None: all of them).
    """

    def __init__(self, from_logits: bool = True, window: Optional[int] = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"window must be a positive number of examples, got {window!r}")
        self.from_logits = from_logits
        self.window = window
        self._parts: Deque[Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]] = deque()
        self._count = 0
        self._tasks: Optional[int] = None
        self._weighted: Optional[bool] = None

    def update(self, logits_or_probs, labels, weights=None) -> None:
        """Add a batch: ``logits_or_probs`` and ``labels`` (B,) or (B, tasks), labels in
        {0, 1}; ``weights`` (B,) or like ``labels``. Every update must have the same number
        of tasks, and give weights always or never."""
        p, y = _as_f64(logits_or_probs, "preds"), _as_f64(labels, "labels")
        _check(p, y, probs=not self.from_logits)
        w = _weights(weights, y)
        tasks = 0 if y.ndim == 1 else y.shape[1]
        if self._tasks is not None and tasks != self._tasks:
            raise ValueError(f"this Metrics has {self._tasks or 'no'} task columns; the batch "
                             f"has {tasks or 'none'}")
        if self._weighted is not None and (w is not None) != self._weighted:
            raise ValueError("give weights with every update or with none")
        self._tasks, self._weighted = tasks, w is not None
        self._parts.append((p, y, w))
        self._count += y.shape[0]
        if self.window is not None:
            while self._count - self._parts[0][1].shape[0] >= self.window:
                self._count -= self._parts.popleft()[1].shape[0]
            extra = self._count - self.window
            if extra > 0:  # cut the oldest batch to the window
                p0, y0, w0 = self._parts[0]
                self._parts[0] = (p0[extra:], y0[extra:], None if w0 is None else w0[extra:])
                self._count -= extra

    @property
    def count(self) -> int:
        """Examples held (on this rank)."""
        return self._count

    def reset(self) -> None:
        self._parts.clear()
        self._count = 0
        self._tasks = self._weighted = None

    def _arrays(self):
        p = np.concatenate([a for a, _, _ in self._parts])
        y = np.concatenate([b for _, b, _ in self._parts])
        w = np.concatenate([c for _, _, c in self._parts]) if self._weighted else None
        return p, y, w

    def compute(self, reduce: bool = False) -> Dict[str, Value]:
        """Returns dict(ne, auc, logloss, ctr, count) over everything held (or the window):
        floats, or per-task lists for (B, tasks) updates; ``ctr`` is weighted with weights.

        Args:
            reduce: over every rank of the initialized default ``torch.distributed`` group
                (each rank calls it; every rank gets the same result, or the same error). A
                rank without examples takes part with none. Without an initialized group it
                is this rank's result.
        """
        if reduce and _distributed():
            return self._compute_reduced(*self._layout_across_ranks())
        if not self._parts:
            raise ValueError("Metrics.compute() called before any update()")
        p, y, w = self._arrays()
        ll = _per_task(lambda p, y, w: _log_loss(p, y, self.from_logits, w), p, y, w)
        ent = _per_task(_entropy, y, w)
        ne = [a / b for a, b in zip(ll, ent)] if isinstance(ll, list) else ll / ent
        ctr = _per_task(lambda y, w: float(y.mean()) if w is None
                        else math.fsum(w[y == 1]) / math.fsum(w), y, w)
        return {"ne": ne, "auc": _per_task(_auc, p, y, w), "logloss": ll, "ctr": ctr,
                "count": int(y.shape[0])}

    def _layout_across_ranks(self):
        """This rank's arrays in the layout every rank agrees on (tasks, weights): the same
        check on every rank, so that all raise together rather than some waiting forever."""
        mine = torch.tensor([-1 if self._tasks is None else self._tasks,
                             -1 if self._weighted is None else int(self._weighted)])
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        layouts = {tuple(t.tolist()) for t in every if int(t[0]) >= 0}
        if not layouts:
            raise ValueError("Metrics.compute() called before any update() on every rank")
        if len(layouts) > 1:
            raise ValueError(f"ranks updated with different layouts (tasks, weighted): "
                             f"{sorted(layouts)}")
        tasks, weighted = layouts.pop()
        if self._parts:
            return self._arrays()
        shape = (0,) if tasks == 0 else (0, tasks)
        empty = np.zeros(shape)
        return empty, empty.copy(), (empty.copy() if weighted else None)

    def _compute_reduced(self, p, y, w) -> Dict[str, Value]:
        tasks = 1 if y.ndim == 1 else y.shape[1]
        cols = (lambda a: [a]) if y.ndim == 1 else (lambda a: [a[:, t] for t in range(tasks)])
        # NE: the sufficient statistics, summed over ranks (float64 sums of fsum'ed parts)
        stats = []
        for pt, yt, wt in zip(cols(p), cols(y), cols(w) if w is not None else [None] * tasks):
            pos = yt == 1
            w_pos = float(pos.sum()) if wt is None else math.fsum(wt[pos])
            w_neg = float((~pos).sum()) if wt is None else math.fsum(wt[~pos])
            stats.append([_ce_sum(pt, yt, self.from_logits, wt), w_pos, w_neg])
        summed = torch.tensor(stats, dtype=torch.float64)
        dist.all_reduce(summed)
        count = torch.tensor([y.shape[0]], dtype=torch.int64)
        dist.all_reduce(count)
        # AUC: every rank's scores, labels (and weights)
        gp, gy = _gather(p), _gather(y)
        gw = _gather(w) if w is not None else None
        ne, ll, ctr = [], [], []
        for ce, w_pos, w_neg in summed.tolist():
            total = w_pos + w_neg
            if total <= 0:
                raise ValueError("all weights are zero: the metrics are undefined")
            ll.append(ce / total)
            ne.append(ce / _norm(w_pos, w_neg))
            ctr.append(w_pos / total)
        out_auc = _per_task(_auc, gp, gy, gw)
        one = y.ndim == 1
        return {"ne": ne[0] if one else ne, "auc": out_auc, "logloss": ll[0] if one else ll,
                "ctr": ctr[0] if one else ctr, "count": int(count.item())}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gather(a: np.ndarray) -> np.ndarray:
    """``a`` of every rank, concatenated along the first axis in rank order."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.int64))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros((longest,) + tuple(t.shape[1:]), dtype=torch.float64)
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return np.concatenate([q[:int(s)].numpy() for q, s in zip(parts, sizes)])
