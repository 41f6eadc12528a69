"""Parts the evaluation models share, written the way a user of the LoKA paper would write
them into their own model: a parameter-free block RMS norm, hard swish, a LayerNorm for raw
dense features, a Linear -> norm -> activation block, the synthetic batch and the loss.

Plain PyTorch only: nothing here may import ``loka`` (the evaluation set is a stand-in for
a user's model that LoKA has never seen).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RowBlockNorm", "HSwish", "DenseFeatureNorm", "NormedDense", "stack_dense",
           "EvalBatch", "loss_fn", "channel_scales", "gaussian", "teacher_labels", "generator"]

EvalBatch = Tuple[Tuple[torch.Tensor, ...], torch.Tensor]
"""``(inputs, labels)``: the model is called as ``model(*inputs)``; labels (B,) float32"""


class RowBlockNorm(nn.Module):
    """RMS normalisation without parameters over consecutive blocks of ``block`` features
    of the last dimension (the paper's BlockNorm), in float32, cast back.

    Shapes:
        x: (..., features) -> (..., features)
    """

    def __init__(self, features: int, block: int = 256, eps: float = 1e-6) -> None:
        super().__init__()
        if features % block:
            raise ValueError(f"RowBlockNorm: {features} features are not whole blocks of {block}")
        self.features, self.block, self.eps = features, block, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = x.float().unflatten(-1, (self.features // self.block, self.block))
        inv_rms = (blocks.square().mean(dim=-1, keepdim=True) + self.eps).rsqrt()
        return (blocks * inv_rms).flatten(-2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"features={self.features}, block={self.block}"


class HSwish(nn.Module):
    """Hard swish, ``x * relu6(x + 3) / 6``: the paper's cheap stand-in for Swish."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (x + 3.0).clamp(min=0.0, max=6.0) * (1.0 / 6.0)


class DenseFeatureNorm(nn.Module):
    """LayerNorm (with gain and shift) of raw dense features, whose columns come in very
    different units; float32 statistics.

    Shapes:
        x: (B, features) -> (B, features)
    """

    def __init__(self, features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(features))
        self.shift = nn.Parameter(torch.zeros(features))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        centered = xf - xf.mean(dim=-1, keepdim=True)
        var = centered.square().mean(dim=-1, keepdim=True)
        y = centered * (var + self.eps).rsqrt() * self.gain.float() + self.shift.float()
        return y.to(x.dtype)


class NormedDense(nn.Sequential):
    """``HSwish(RowBlockNorm(x Wᵀ))``: a hidden layer with the paper's Mods (no bias, block
    norm, hard swish).

    Shapes:
        x: (B, in_features) -> (B, out_features)
    """

    def __init__(self, in_features: int, out_features: int, block: int) -> None:
        super().__init__(nn.Linear(in_features, out_features, bias=False),
                         RowBlockNorm(out_features, block), HSwish())


def stack_dense(widths: Sequence[int], block: int) -> nn.Sequential:
    """``NormedDense`` layers ``widths[0] -> widths[1] -> ...``."""
    return nn.Sequential(*(NormedDense(a, b, block) for a, b in zip(widths[:-1], widths[1:])))


def loss_fn(model: nn.Module, batch: EvalBatch) -> torch.Tensor:
    """Binary cross-entropy with logits, in float32: ``model(*inputs)`` against labels."""
    inputs, labels = batch
    logits = model(*inputs)
    return F.binary_cross_entropy_with_logits(logits.float().reshape(-1),
                                              labels.float().reshape(-1))


def channel_scales(shape: Sequence[int], device: "torch.device | str", seed: int = 1234,
                   spread: float = 0.75) -> torch.Tensor:
    """Fixed log-normal per-channel scales (the same for every batch of a model): pooled
    embeddings and dense features are not N(0, 1), some channels are much larger."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.exp(spread * torch.randn(tuple(shape), generator=g)).to(device)


def gaussian(shape: Sequence[int], scales: torch.Tensor, gen: torch.Generator,
             device: "torch.device | str", dtype: torch.dtype) -> torch.Tensor:
    """N(0, 1) draws times per-channel ``scales`` (broadcast over the leading batch dim)."""
    x = torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32)
    return (x * scales).to(dtype)


def teacher_labels(features: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Labels (B,) float32 drawn from a fixed logistic teacher on the first features, so the
    task is learnable but not trivial."""
    flat = features.float().flatten(1)[:, :64]
    logit = flat.sum(dim=-1) / (flat.shape[1] ** 0.5 * flat.std().clamp(min=1e-6))
    u = torch.rand(logit.shape, generator=gen, device=logit.device)
    return (u < torch.sigmoid(logit)).float()


def generator(device: "torch.device | str", seed: int) -> torch.Generator:
    """A generator on ``device`` (batches are drawn where they are used)."""
    return torch.Generator(device=torch.device(device)).manual_seed(seed)
