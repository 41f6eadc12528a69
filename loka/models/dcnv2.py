"""DCNv2 (Wang et al., 2021, "DCN V2: Improved Deep & Cross Network"): a cross network
``x_{l+1} = x0 ⊙ (W x_l + b) + x_l`` (W full, or low-rank U Vᵀ) and a deep tower, stacked
(cross then deep) or in parallel (concatenated), then a logit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn

from loka.config import ModsConfig
from loka.data.batch import Batch, FeatureSpec

from .arch import MLP, DenseArch, EmbeddingArch, OverArch, RecModel, make_linear


@dataclass(frozen=True)
class DCNv2Config:
    """A DCNv2 model over x0 = concat(DenseArch(dense), flattened table embeddings)."""

    features: FeatureSpec
    """data the model reads"""
    embedding_dim: int = 16
    """d: table embedding width, and the DenseArch output width"""
    dense_hidden: Tuple[int, ...] = (32,)
    """hidden widths of the DenseArch"""
    num_cross: int = 2
    """cross layers"""
    cross_rank: Optional[int] = None
    """None: full-rank W (D x D); r: low-rank cross U (D x r) Vᵀ (r x D)"""
    deep_hidden: Tuple[int, ...] = (64, 64)
    """deep tower widths (each Linear -> norm -> activation)"""
    structure: str = "stacked"
    """'stacked' (deep tower on the cross output) or 'parallel' (both on x0, concatenated)"""
    top_hidden: Tuple[int, ...] = ()
    """hidden widths between the towers and the logit"""
    batch_size: int = 256
    """default batch size B"""
    sparse_embeddings: bool = False
    """sparse embedding gradients (large tables)"""

    def __post_init__(self) -> None:
        for name in ("dense_hidden", "deep_hidden", "top_hidden"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.structure not in ("stacked", "parallel"):
            raise ValueError(f"DCNv2Config.structure must be 'stacked' or 'parallel', "
                             f"got {self.structure!r}")
        if self.cross_rank is not None and self.cross_rank < 1:
            raise ValueError("DCNv2Config.cross_rank must be positive or None")
        if min(self.embedding_dim, self.batch_size) < 1 or self.num_cross < 0:
            raise ValueError(f"invalid DCNv2Config {self}")

    @property
    def input_dim(self) -> int:
        """D, the width of x0."""
        return self.embedding_dim * (len(self.features.tables) + (self.features.num_dense > 0))


class CrossLayer(nn.Module):
    """``x0 ⊙ (W x + b) + x``; W = U Vᵀ when ``rank`` is given (V without bias).

    Shapes:
        x0, x: (B, D) -> (B, D)
    """

    def __init__(self, dim: int, rank: Optional[int] = None,
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        if rank is None:
            self.weight = make_linear(dim, dim, mods)
        else:
            self.weight = nn.Sequential(nn.Linear(dim, rank, bias=False), make_linear(rank, dim, mods))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Args: x0 (B, D), x (B, D). Returns: (B, D)."""
        return x0 * self.weight(x) + x


class DCNv2(RecModel):
    """DCNv2: x0 (B, D) -> cross network and deep tower -> OverArch logit.

    Args:
        config: the architecture.
        mods: Mods honoured at construction.
    """

    def __init__(self, config: DCNv2Config, mods: Optional[ModsConfig] = None) -> None:
        super().__init__(config, mods)
        c, mods = config, self.mods
        d, dim = c.embedding_dim, c.input_dim
        self.dense_arch = DenseArch(c.features.num_dense, c.dense_hidden, d, mods) \
            if c.features.num_dense else None
        self.embedding_arch = EmbeddingArch(c.features.tables, d, sparse=c.sparse_embeddings)
        self.cross = nn.ModuleList(CrossLayer(dim, c.cross_rank, mods) for _ in range(c.num_cross))
        self.deep = MLP(dim, c.deep_hidden, mods, norm=True)
        top_in = self.deep.out_features + (dim if c.structure == "parallel" else 0)
        self.over_arch = OverArch(top_in, c.top_hidden, mods)
        self._finish()

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch with dense (B, n_dense) and the tables of ``feature_spec``.
        Returns: logits (B,)."""
        parts = [self.dense_arch(batch.dense)] if self.dense_arch is not None else []
        if self.embedding_arch.names:
            parts.append(self.embedding_arch(batch.sparse).flatten(1))
        x0 = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # (B, D)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        if self.config.structure == "stacked":
            h = self.deep(x)
        else:
            h = torch.cat([x, self.deep(x0)], dim=1)
        return self.over_arch(h)
