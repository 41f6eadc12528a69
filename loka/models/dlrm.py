"""DLRM (Naumov et al., 2019): a bottom MLP over the dense features, pairwise dot products
of all embeddings (the bottom output included), and a top MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from loka.config import ModsConfig
from loka.data.batch import Batch, FeatureSpec

from .arch import DenseArch, EmbeddingArch, OverArch, RecModel


@dataclass(frozen=True)
class DLRMConfig:
    """A DLRM with F = len(tables) (+1 with dense features) interacting embeddings."""

    features: FeatureSpec
    """data the model reads"""
    embedding_dim: int = 16
    """d: table width and bottom MLP output width"""
    bottom_hidden: Tuple[int, ...] = (32,)
    """hidden widths of the bottom MLP (its output is d wide)"""
    top_hidden: Tuple[int, ...] = (64, 32)
    """hidden widths of the top MLP"""
    batch_size: int = 256
    """default batch size B"""
    sparse_embeddings: bool = False
    """sparse embedding gradients (large tables)"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bottom_hidden", tuple(self.bottom_hidden))
        object.__setattr__(self, "top_hidden", tuple(self.top_hidden))
        if min(self.embedding_dim, self.batch_size) < 1:
            raise ValueError(f"invalid DLRMConfig {self}")
        if self.num_fields < 2:
            raise ValueError("DLRM needs at least two interacting embeddings")

    @property
    def num_fields(self) -> int:
        return len(self.features.tables) + (self.features.num_dense > 0)


class DotInteraction(torch.nn.Module):
    """Upper triangle (no diagonal) of Z Zᵀ.

    Shapes:
        z: (B, F, d) -> (B, F (F - 1) / 2)
    """

    def __init__(self, num_fields: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_fields, num_fields, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Args: z (B, F, d). Returns: (B, F (F - 1) / 2)."""
        return torch.bmm(z, z.transpose(1, 2))[:, self.rows, self.cols]


class DLRM(RecModel):
    """DLRM: bottom MLP (B, d), table embeddings (B, T, d) -> dots -> top MLP logit.

    Args:
        config: the architecture.
        mods: Mods honoured at construction.
    """

    def __init__(self, config: DLRMConfig, mods: Optional[ModsConfig] = None) -> None:
        super().__init__(config, mods)
        c, mods = config, self.mods
        d = c.embedding_dim
        self.dense_arch = DenseArch(c.features.num_dense, c.bottom_hidden, d, mods) \
            if c.features.num_dense else None
        self.embedding_arch = EmbeddingArch(c.features.tables, d, sparse=c.sparse_embeddings)
        self.interaction = DotInteraction(c.num_fields)
        f = c.num_fields
        top_in = f * (f - 1) // 2 + (d if self.dense_arch is not None else 0)
        self.over_arch = OverArch(top_in, c.top_hidden, mods)
        self._finish()

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch with dense (B, n_dense) and the tables of ``feature_spec``.
        Returns: logits (B,)."""
        emb = self.embedding_arch(batch.sparse)  # (B, T, d); T >= 1 by the config check
        if self.dense_arch is None:
            return self.over_arch(self.interaction(emb))
        bottom = self.dense_arch(batch.dense)  # (B, d)
        dots = self.interaction(torch.cat([bottom.unsqueeze(1), emb], dim=1))
        return self.over_arch(torch.cat([bottom, dots], dim=1))
