"""A DLRM-style tower (Naumov et al., 2019, "Deep Learning Recommendation Model for
Personalization and Recommendation Systems"), written from the paper for the evaluation
set, with the LoKA paper's Mods, sized so that its GEMMs matter at batch 4096.

A bottom MLP embeds the (normalised) dense features into one more embedding; the pairwise
dot products of all embeddings (upper triangle, no diagonal) are concatenated to it and
padded by one zero column to a multiple of 16, as MLPerf's reference DLRM pads its
interaction; a top MLP makes the logit.

Plain PyTorch only: nothing here may import ``loka``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import (DenseFeatureNorm, EvalBatch, channel_scales, gaussian, generator,
                     loss_fn, stack_dense, teacher_labels)

__all__ = ["DLRMSpec", "DLRMRec", "PairwiseDots", "loss_fn"]


@dataclass(frozen=True)
class DLRMSpec:
    """Sizes of one DLRM-style model."""

    num_dense: int
    """raw dense features"""
    bottom: Tuple[int, ...]
    """widths of the bottom MLP (the last one is the embedding width)"""
    num_sparse: int
    """pooled sparse embeddings"""
    top: Tuple[int, ...]
    """hidden widths of the top MLP before the logit"""
    block: int
    """block size of the block norms"""
    pad_to: int = 16
    """the interaction output is padded with zeros to a multiple of this"""

    @classmethod
    def of(cls, scale: str) -> "DLRMSpec":
        if scale == "paper":
            return cls(512, (1024, 512, 256), 26, (2048, 2048, 1024), 256)
        if scale == "tiny":
            return cls(32, (64, 32, 16), 5, (64, 64, 32), 16)
        raise ValueError(f"unknown scale {scale!r}; expected 'paper' or 'tiny'")

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input: bottom output, pairwise dots, zero padding."""
        n = self.num_sparse + 1
        raw = self.bottom[-1] + n * (n - 1) // 2
        return -(-raw // self.pad_to) * self.pad_to


class PairwiseDots(nn.Module):
    """Dot products of every pair of embeddings (upper triangle, no diagonal), after the
    dense embedding, zero-padded to ``out_dim``.

    Shapes:
        dense (B, d), sparse (B, n, d) -> (B, out_dim)
    """

    def __init__(self, num_embeddings: int, out_dim: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_embeddings, num_embeddings, offset=1)
        self.register_buffer("pair_index", rows * num_embeddings + cols, persistent=False)
        self.out_dim = out_dim

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        t = torch.cat([dense.unsqueeze(1), sparse], dim=1)                  # (B, n, d)
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)[:, self.pair_index]
        out = torch.cat([dense, dots], dim=1)
        return F.pad(out, (0, self.out_dim - out.shape[1]))


class DLRMRec(nn.Module):
    """DLRM-style: bottom MLP, pairwise dot interaction, top MLP, logit.

    Args:
        scale: 'paper' (dense 512 -> 1024-512-256, 27 embeddings of 256, top
            2048-2048-1024-1) or 'tiny'.

    Shapes:
        dense (B, num_dense), sparse (B, num_sparse, bottom[-1]) -> logits (B,)
    """

    def __init__(self, scale: str = "paper") -> None:
        super().__init__()
        spec = self.spec = DLRMSpec.of(scale)
        self.scale = scale
        self.dense_norm = DenseFeatureNorm(spec.num_dense)
        self.bottom = stack_dense((spec.num_dense,) + spec.bottom, spec.block)
        self.interaction = PairwiseDots(spec.num_sparse + 1, spec.interaction_dim)
        self.top = stack_dense((spec.interaction_dim,) + spec.top, spec.block)
        self.logit = nn.Linear(spec.top[-1], 1)              # the only bias: the logit's

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        z = self.interaction(self.bottom(self.dense_norm(dense)), sparse)
        return self.logit(self.top(z)).squeeze(-1)

    def make_batch(self, batch_size: int, device: "torch.device | str" = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> EvalBatch:
        """``((dense, sparse), labels)``: dense (B, num_dense) raw features of mixed units,
        sparse (B, num_sparse, d) pooled embeddings, labels (B,) float32."""
        spec, gen = self.spec, generator(device, seed)
        dense_units = channel_scales((spec.num_dense,), device, seed=99, spread=2.0)
        dense = gaussian((batch_size, spec.num_dense), dense_units, gen, device, dtype)
        shape = (spec.num_sparse, spec.bottom[-1])
        # pooled embeddings at the scale the bottom MLP's output has (block-normalised)
        sparse = gaussian((batch_size,) + shape, channel_scales(shape, device), gen, device, dtype)
        return (dense, sparse), teacher_labels(sparse, gen)
