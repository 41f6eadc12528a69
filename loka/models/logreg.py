"""Logistic regression over the same features: the baseline a model must beat.

One learned scalar per id (sum pooled per table), plus a linear function of the dense
features; no interactions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from loka.config import ModsConfig
from loka.data.batch import Batch, FeatureSpec

from .arch import EmbeddingArch, RecModel, make_linear, param_dtype


@dataclass(frozen=True)
class LogRegConfig:
    """A logistic regression."""

    features: FeatureSpec
    """data the model reads"""
    batch_size: int = 256
    """default batch size B"""
    sparse_embeddings: bool = False
    """sparse embedding gradients (large tables)"""


class LogisticRegression(RecModel):
    """``logit = w · dense + b + Σ_tables Σ_bag w_id``.

    Args:
        config: the features.
        mods: accepted for uniformity; the only Linear is the (bias-keeping) logit layer.
    """

    def __init__(self, config: LogRegConfig, mods: Optional[ModsConfig] = None) -> None:
        super().__init__(config, mods)
        self.dense = make_linear(config.features.num_dense, 1, self.mods, last=True)
        self.embedding_arch = EmbeddingArch(config.features.tables, 1,
                                            sparse=config.sparse_embeddings)
        # zeros: the convex problem's natural start, and raw heavy-tailed dense features
        # times a random init would start far from the base rate
        torch.nn.init.zeros_(self.dense.weight)
        for table in self.embedding_arch.tables.values():
            torch.nn.init.zeros_(table.weight)
        self._finish()

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch. Returns: logits (B,)."""
        logits = self.dense(batch.dense.to(param_dtype(self.dense))).squeeze(-1)
        if self.embedding_arch.names:
            logits = logits + self.embedding_arch(batch.sparse).sum(dim=(1, 2))
        return logits
