"""Scoring a model on evaluation data: every example of a finite stream exactly once (or
the next ``steps`` batches), per-example logits for paired comparisons (:func:`predict`)
and NE, AUC and log loss (:func:`evaluate`)."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import numpy as np
import torch
from torch import nn

from ..data.batch import Batch
from ..data.metrics import Metrics
from ..data.synthetic import SyntheticCTR

__all__ = ["EmptyEvaluationError", "is_infinite", "predict", "evaluate"]


class EmptyEvaluationError(ValueError):
    """An evaluation that saw no example: its data is empty."""


def is_infinite(stream: Iterable[Batch]) -> bool:
    """Whether ``stream`` never ends: the synthetic stream, or a reader told to ``loop``."""
    return isinstance(stream, SyntheticCTR) or bool(getattr(stream, "loop", False))


@torch.no_grad()
def predict(model: nn.Module, batches: Iterable[Batch], steps: Optional[int] = None, *,
            device=None, autocast_bf16: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """Logits and labels of ``model`` on ``batches``: all of them, once (None), or the
    first ``steps``.

    Returns:
        ``(logits, labels)``, each (N,) float64.
    """
    if steps is None and is_infinite(batches):
        raise ValueError("evaluating an infinite stream needs a number of batches (steps)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    logits, labels = [], []
    source = batches if steps is None else (b for _, b in zip(range(steps), batches))
    try:
        for batch in source:
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                out = model(batch)
            logits.append(out.detach().to("cpu", torch.float64).reshape(-1))
            labels.append(batch.labels.detach().to("cpu", torch.float64).reshape(-1))
    finally:
        model.train(was_training)
    if not logits:
        raise EmptyEvaluationError("no examples to evaluate: the evaluation data is empty")
    return torch.cat(logits).numpy(), torch.cat(labels).numpy()


def evaluate(model: nn.Module, data_iter: Iterable[Batch], steps: Optional[int] = None, *,
             device=None, autocast_bf16: bool = False) -> Dict[str, float]:
    """NE, AUC and log loss of ``model`` over ``data_iter``: all of it, once (None), or its
    next ``steps`` batches (fewer if it ends). Returns dict(ne, auc, logloss, ctr, count),
    ``count`` the examples seen. Raises ValueError for ``steps=None`` on a stream that
    never ends (:func:`is_infinite`), :class:`EmptyEvaluationError` for no example."""
    logits, labels = predict(model, data_iter, steps, device=device, autocast_bf16=autocast_bf16)
    metrics = Metrics(from_logits=True)
    metrics.update(logits, labels)
    return metrics.compute()
