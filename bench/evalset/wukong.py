"""Wukong (Zhang et al., 2024, "Wukong: Towards a Scaling Law for Large-Scale
Recommendation"), written from the paper for the evaluation set, with the LoKA paper's Mods.

A Wukong layer maps n embeddings of width d to nF + nL embeddings:

- Factorization Machine Block: ``FM(X) = X (Xᵀ Y)`` with a learned projection Y (n x k)
  of the embedding axis, so the (n x n) interaction matrix is never formed; then
  ``MLP(norm(flatten(FM(X))))`` reshaped to nF embeddings.
- Linear Compression Block: a Linear over the embedding axis, n -> nL embeddings.
- ``norm(concat(FMB(X), LCB(X)) + X)``, the norm over d.

The top MLP reads the last layer's embeddings flattened. Inputs are already-pooled
embeddings (B, n, d), as a torchrec EmbeddingBagCollection hands them over.

Plain PyTorch only: nothing here may import ``loka``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn

from .common import (EvalBatch, HSwish, RowBlockNorm, channel_scales, gaussian, generator,
                     loss_fn, stack_dense, teacher_labels)

__all__ = ["WukongSpec", "WukongRec", "FMInteraction", "TokenCompress", "WukongStage",
           "loss_fn"]


@dataclass(frozen=True)
class WukongSpec:
    """Sizes of one Wukong."""

    num_embeddings: int
    """n: embeddings that enter every layer (nF + nL must equal n: an identity residual)"""
    dim: int
    """d: embedding width"""
    num_fm: int
    """nF: embeddings the FM block emits"""
    num_lcb: int
    """nL: embeddings the linear compression block emits"""
    fm_rank: int
    """k: rank of the FM projection of the embedding axis"""
    fm_hidden: int
    """hidden width of the FM block's MLP"""
    num_layers: int
    """Wukong layers"""
    top_hidden: Tuple[int, ...]
    """hidden widths of the top MLP before the logit"""
    block: int
    """block size of the block norms"""

    @classmethod
    def of(cls, scale: str) -> "WukongSpec":
        if scale == "paper":  # ANCHORS.md's Wukong reference step: 19 Linears
            return cls(64, 256, 32, 32, 32, 2048, 4, (2048, 1024), 256)
        if scale == "tiny":
            return cls(8, 32, 4, 4, 4, 64, 2, (64, 32), 16)
        raise ValueError(f"unknown scale {scale!r}; expected 'paper' or 'tiny'")


class FMInteraction(nn.Module):
    """The FM block: ``MLP(norm(flatten(X (Xᵀ Y))))`` -> nF embeddings.

    Shapes:
        x: (B, n, d) -> (B, nF, d)
    """

    def __init__(self, spec: WukongSpec) -> None:
        super().__init__()
        n, d, k = spec.num_embeddings, spec.dim, spec.fm_rank
        self.num_out, self.dim = spec.num_fm, d
        self.project = nn.Linear(n, k, bias=False)           # Y, applied to Xᵀ
        self.norm = RowBlockNorm(n * k, spec.block)
        self.mlp = nn.Sequential(
            nn.Linear(n * k, spec.fm_hidden, bias=False),
            RowBlockNorm(spec.fm_hidden, spec.block),
            HSwish(),
            nn.Linear(spec.fm_hidden, spec.num_fm * d, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xt_y = self.project(x.transpose(1, 2))               # (B, d, k) = Xᵀ Y
        fm = torch.bmm(x, xt_y)                              # (B, n, k) = X Xᵀ Y
        out = self.mlp(self.norm(fm.flatten(1)))             # (B, nF * d)
        return out.view(x.shape[0], self.num_out, self.dim)


class TokenCompress(nn.Module):
    """The linear compression block: a Linear over the embedding axis.

    Shapes:
        x: (B, n, d) -> (B, nL, d)
    """

    def __init__(self, spec: WukongSpec) -> None:
        super().__init__()
        self.mix = nn.Linear(spec.num_embeddings, spec.num_lcb, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x.transpose(1, 2)).transpose(1, 2)


class WukongStage(nn.Module):
    """One Wukong layer: ``norm(concat(FM(X), LCB(X)) + X)``, the norm over d.

    Shapes:
        x: (B, n, d) -> (B, n, d)
    """

    def __init__(self, spec: WukongSpec) -> None:
        super().__init__()
        self.fm = FMInteraction(spec)
        self.lcb = TokenCompress(spec)
        self.norm = RowBlockNorm(spec.dim, min(spec.block, spec.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.cat([self.fm(x), self.lcb(x)], dim=1) + x)


class WukongRec(nn.Module):
    """Wukong over pooled embeddings: L Wukong layers, then a top MLP on the flattened
    embeddings, then one logit.

    Args:
        scale: 'paper' (ANCHORS.md's reference configuration) or 'tiny' (CPU tests).

    Shapes:
        x: (B, n, d) -> logits (B,)
    """

    def __init__(self, scale: str = "paper") -> None:
        super().__init__()
        spec = self.spec = WukongSpec.of(scale)
        if spec.num_fm + spec.num_lcb != spec.num_embeddings:
            raise ValueError("WukongRec keeps n embeddings per layer: nF + nL must equal n")
        self.scale = scale
        self.layers = nn.Sequential(*(WukongStage(spec) for _ in range(spec.num_layers)))
        widths = (spec.num_embeddings * spec.dim,) + spec.top_hidden
        self.top = stack_dense(widths, spec.block)
        self.logit = nn.Linear(widths[-1], 1)                # the only bias: the logit's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logit(self.top(self.layers(x).flatten(1))).squeeze(-1)

    def make_batch(self, batch_size: int, device: "torch.device | str" = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> EvalBatch:
        """``((x,), labels)``: x (B, n, d) pooled embeddings with fixed per-channel
        scales, labels (B,) float32."""
        spec, gen = self.spec, generator(device, seed)
        shape = (spec.num_embeddings, spec.dim)
        x = gaussian((batch_size,) + shape, channel_scales(shape, device), gen, device, dtype)
        return (x,), teacher_labels(x, gen)
