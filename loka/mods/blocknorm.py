"""BlockNorm: parameter-free RMS normalization over contiguous blocks of features.

It replaces LayerNorm in the paper's Mods: no mean subtraction, no affine parameters, and
statistics over blocks of 256 features rather than the whole row, so that a GEMM epilogue
(or a fused norm -> quantize kernel) can normalize one output tile without a second pass
over the row.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn as nn

from ._swap import ModuleChange, swap_modules

DEFAULT_BLOCK_SIZE = 256
DEFAULT_EPS = 1e-6


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class BlockNorm(nn.Module):
    """``y = x / sqrt(mean(x_blk ** 2) + eps)`` per contiguous block ``x_blk`` of the last dim.

    Blocks are ``[0, B), [B, 2B), ...``. When the feature dim ``D`` is not a multiple of
    ``B``, the last, shorter block (the final ``D % B`` features) is normalized on its own;
    ``D < B`` is therefore plain RMSNorm over the row. ``eps`` is added to the mean square,
    inside the square root.

    Computes in float32 (float64 inputs in float64) and returns the input dtype.

    Args:
        block_size: B, features per block.
        eps: added to each block's mean square.

    Shapes:
        x: (..., D) -> (..., D)
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, eps: float = DEFAULT_EPS) -> None:
        super().__init__()
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"BlockNorm block_size must be a positive int, got {block_size!r}")
        if eps <= 0:
            raise ValueError(f"BlockNorm eps must be positive, got {eps}")
        self.block_size, self.eps = block_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (..., D) floating. Returns: (..., D), dtype of ``x``."""
        if not x.is_floating_point():
            raise TypeError(f"BlockNorm needs a floating-point input, got {x.dtype}")
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.to(compute)
        d, b = x.shape[-1], self.block_size
        full = d - d % b
        lead = x.shape[:-1]
        parts = []
        if full:
            parts.append(_rms_normalize(xc[..., :full].reshape(*lead, full // b, b), self.eps)
                         .reshape(*lead, full))
        if full < d:
            parts.append(_rms_normalize(xc[..., full:], self.eps))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, eps={self.eps}"


def swap_norms(model: nn.Module, block_size: int = DEFAULT_BLOCK_SIZE
               ) -> Tuple[List[ModuleChange], List[Tuple[str, str]]]:
    """Replace every LayerNorm / RMSNorm over one (last) dim by ``BlockNorm(block_size)``,
    in place; norms over several trailing dims are left and reported as skipped."""

    def match(m: nn.Module) -> bool:
        return isinstance(m, (nn.LayerNorm, nn.RMSNorm))

    one_dim = lambda m: len(m.normalized_shape) == 1  # noqa: E731
    changes, skipped = swap_modules(model, lambda m: match(m) and one_dim(m),
                                    lambda m: BlockNorm(block_size))
    skipped += [(fqn, f"normalizes over {tuple(m.normalized_shape)}, not one dim")
                for fqn, m in model.named_modules() if match(m) and not one_dim(m)]
    return changes, skipped
