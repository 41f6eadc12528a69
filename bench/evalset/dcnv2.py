"""DCN-V2 (Wang et al., 2021, "DCN V2: Improved Deep & Cross Network and Practical Lessons
for Web-scale Learning to Rank Systems"), written from the paper for the evaluation set,
with the LoKA paper's Mods.

``x0`` is the projected concatenation of the dense features (normalised, then embedded)
and the pooled sparse embeddings. Full-rank cross layers ``x_{l+1} = x0 ⊙ (W x_l) + x_l``
(No Bias: W without its bias), then the deep tower on the cross output (the paper's
stacked structure), then one logit.

Plain PyTorch only: nothing here may import ``loka``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn

from .common import (DenseFeatureNorm, EvalBatch, RowBlockNorm, channel_scales, gaussian,
                     generator, loss_fn, stack_dense, teacher_labels)

__all__ = ["DCNv2Spec", "DCNv2Rec", "FullRankCross", "loss_fn"]


@dataclass(frozen=True)
class DCNv2Spec:
    """Sizes of one DCN-V2."""

    num_dense: int
    """raw dense features"""
    num_sparse: int
    """pooled sparse embeddings"""
    embedding_dim: int
    """width of each embedding (the dense features are embedded to it too)"""
    cross_dim: int
    """D: width of x0 and of every cross layer"""
    num_cross: int
    """full-rank cross layers"""
    deep_hidden: Tuple[int, ...]
    """widths of the deep tower"""
    block: int
    """block size of the block norms"""

    @classmethod
    def of(cls, scale: str) -> "DCNv2Spec":
        if scale == "paper":
            return cls(8, 26, 64, 2048, 3, (1024, 1024, 512), 256)
        if scale == "tiny":
            return cls(4, 6, 16, 128, 2, (64, 64, 32), 16)
        raise ValueError(f"unknown scale {scale!r}; expected 'paper' or 'tiny'")


class FullRankCross(nn.Module):
    """One cross layer, ``x0 ⊙ (W x) + x`` with a full (D x D) W.

    Shapes:
        x0, x: (B, D) -> (B, D)
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Linear(dim, dim, bias=False)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.weight(x) + x


class DCNv2Rec(nn.Module):
    """DCN-V2, stacked: cross network, then deep tower, then a logit.

    Args:
        scale: 'paper' (D = 2048, three cross layers, tower 1024-1024-512) or 'tiny'.

    Shapes:
        dense (B, num_dense), sparse (B, num_sparse, embedding_dim) -> logits (B,)
    """

    def __init__(self, scale: str = "paper") -> None:
        super().__init__()
        spec = self.spec = DCNv2Spec.of(scale)
        self.scale = scale
        e = spec.embedding_dim
        self.dense_norm = DenseFeatureNorm(spec.num_dense)
        self.dense_embed = nn.Linear(spec.num_dense, e, bias=False)
        self.input_proj = nn.Linear((spec.num_sparse + 1) * e, spec.cross_dim, bias=False)
        self.input_norm = RowBlockNorm(spec.cross_dim, spec.block)
        self.cross = nn.ModuleList(FullRankCross(spec.cross_dim) for _ in range(spec.num_cross))
        self.cross_norm = RowBlockNorm(spec.cross_dim, spec.block)
        self.deep = stack_dense((spec.cross_dim,) + spec.deep_hidden, spec.block)
        self.logit = nn.Linear(spec.deep_hidden[-1], 1)      # the only bias: the logit's

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        dense_e = self.dense_embed(self.dense_norm(dense))                  # (B, e)
        x0 = self.input_norm(self.input_proj(torch.cat([dense_e, sparse.flatten(1)], dim=1)))
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.logit(self.deep(self.cross_norm(x))).squeeze(-1)

    def make_batch(self, batch_size: int, device: "torch.device | str" = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> EvalBatch:
        """``((dense, sparse), labels)``: dense (B, num_dense) raw features of mixed units,
        sparse (B, num_sparse, embedding_dim) pooled embeddings, labels (B,) float32."""
        spec, gen = self.spec, generator(device, seed)
        dense_units = channel_scales((spec.num_dense,), device, seed=99, spread=2.0)
        dense = gaussian((batch_size, spec.num_dense), dense_units, gen, device, dtype)
        shape = (spec.num_sparse, spec.embedding_dim)
        sparse = gaussian((batch_size,) + shape, channel_scales(shape, device), gen, device, dtype)
        return (dense, sparse), teacher_labels(sparse, gen)
