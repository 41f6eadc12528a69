"""Scaling granularities, quantize and dequantize.

Every granularity is one rule: the operand is cut into blocks of ``(rows, cols)`` elements
and each block gets one float32 *dequantization* scale ``s = amax(block) / fmt.max``, so
that ``x ≈ q * s``. A block dimension of ``-1`` spans the whole axis. For a GEMM
``a (M, K) @ b (K, N)`` the blocks of the two operands run along K:

============  ===================  ==================  ==========================
granularity    block of ``a``       block of ``b``      used by
============  ===================  ==================  ==========================
tensorwise     whole tensor         whole tensor        torchao/cuBLAS tensorwise
rowwise        (1, K)  per row      (K, 1) per column   torchao rowwise, FBGEMM
blockwise      (1, 128)             (128, 128)          DeepGEMM, cuBLAS 12.9
mx             (1, 32), e8m0        (32, 1), e8m0       OCP MXFP8 (Blackwell)
============  ===================  ==================  ==========================

``amax`` is clamped below by :data:`AMAX_EPS` so that an all-zero block gets a tiny
finite scale and quantizes to zeros, never NaN. Non-finite inputs are not an error:
NaN or Inf make the scale of their block non-finite, and the dequantized block (and any
GEMM output reading it) is non-finite too; the Dispatch guard catches that downstream.
Quantization itself never raises on values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..config import ValueEnum
from .formats import FP8Format, get_format

AMAX_EPS = 1e-12
"""lower clamp of a block's amax: all-zero blocks quantize to zero with a finite scale"""


class Granularity(ValueEnum):
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MX = "mx"


BLOCK = 128
"""block length of blockwise scaling (1x128 activations, 128x128 weights)"""
MX_BLOCK = 32
"""block length of MX scaling (OCP Microscaling spec)"""


def operand_block(granularity: "Granularity | str", operand: str) -> Tuple[int, int]:
    """The block shape of ``operand`` ('a' of shape (M, K) or 'b' of shape (K, N))."""
    g = Granularity(granularity)
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
    if g is Granularity.TENSORWISE:
        return (-1, -1)
    if g is Granularity.ROWWISE:
        return (1, -1) if operand == "a" else (-1, 1)
    if g is Granularity.BLOCKWISE:
        return (1, BLOCK) if operand == "a" else (BLOCK, BLOCK)
    return (1, MX_BLOCK) if operand == "a" else (MX_BLOCK, 1)


@dataclass
class QTensor:
    """An FP8 tensor with its float32 dequantization scales.

    ``data`` has the logical shape ``(R, C)``; ``scale`` has shape
    ``(ceil(R / block[0]), ceil(C / block[1]))`` and ``x ≈ data * scale`` blockwise.
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FP8Format
    block: Tuple[int, int]
    """resolved block shape (no -1)"""
    granularity: Granularity

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def t(self) -> "QTensor":
        """The transpose, with its scales transposed (no requantization)."""
        return QTensor(self.data.t(), self.scale.t(), self.fmt,
                       (self.block[1], self.block[0]), self.granularity)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


def _resolve_block(shape: Tuple[int, int], block: Tuple[int, int]) -> Tuple[int, int]:
    r, c = shape
    br = r if block[0] == -1 else block[0]
    bc = c if block[1] == -1 else block[1]
    return max(br, 1), max(bc, 1)


def _blocked(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """View (R, C) as (R/br, br, C/bc, bc), zero-padding ragged edges."""
    r, c = x.shape
    pr, pc = (-r) % br, (-c) % bc
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x.reshape((r + pr) // br, br, (c + pc) // bc, bc)


def round_scale_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Round dequantization scales *up* to a power of two (no overflow after rounding);
    power-of-two scales make the scaling itself exact and are what MX's e8m0 stores."""
    return torch.exp2(torch.ceil(torch.log2(scale)))


def compute_scales(x: torch.Tensor, fmt: "FP8Format | str", block: Tuple[int, int],
                   power_of_two: bool = False) -> torch.Tensor:
    """Float32 dequantization scales of ``x`` (R, C) for blocks ``block``.

    Returns:
        (ceil(R / br), ceil(C / bc)) float32
    """
    fmt = get_format(fmt)
    br, bc = _resolve_block(tuple(x.shape), block)
    amax = _blocked(x.detach(), br, bc).abs().amax(dim=(1, 3)).float()
    scale = amax.clamp(min=AMAX_EPS) / fmt.max
    if power_of_two:
        scale = round_scale_to_power_of_two(scale)
    return scale


def _expand(scale: torch.Tensor, shape: Tuple[int, int], br: int, bc: int) -> torch.Tensor:
    r, c = shape
    full = scale.repeat_interleave(br, dim=0) if br > 1 else scale
    full = full.repeat_interleave(bc, dim=1) if bc > 1 else full
    return full[:r, :c]


def quantize(x: torch.Tensor, fmt: "FP8Format | str" = "e4m3",
             granularity: "Granularity | str" = Granularity.TENSORWISE, operand: str = "a",
             *, block: Tuple[int, int] | None = None, power_of_two: bool | None = None,
             scale: torch.Tensor | None = None) -> QTensor:
    """Quantize a 2-D tensor to FP8 with saturation (values beyond ``fmt.max`` clamp).

    Args:
        x: (R, C) float tensor; a GEMM operand ``a`` (M, K) or ``b`` (K, N).
        fmt: FP8 format.
        granularity: scaling granularity; its block shape depends on ``operand``.
        operand: 'a' or 'b', deciding the direction of rowwise/blockwise blocks.
        block: explicit block shape, overriding the granularity's.
        power_of_two: round scales up to powers of two (default: only for MX).
        scale: precomputed dequantization scales (static scaling); amax is not taken.

    Returns:
        QTensor with ``data`` (R, C) in ``fmt.dtype`` and float32 ``scale``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise TypeError(f"quantize expects a float32/bf16/fp16 tensor, got {x.dtype}")
    fmt = get_format(fmt)
    g = Granularity(granularity)
    blk = operand_block(g, operand) if block is None else block
    if power_of_two is None:
        power_of_two = g is Granularity.MX
    br, bc = _resolve_block(tuple(x.shape), blk)
    if scale is None:
        scale = compute_scales(x, fmt, (br, bc), power_of_two)
    else:
        scale = scale.float().reshape(-(-x.shape[0] // br), -(-x.shape[1] // bc))
    if br == x.shape[0] and bc == x.shape[1]:
        scaled = x.float() / scale.reshape(())
    else:
        scaled = x.float() / _expand(scale, tuple(x.shape), br, bc)
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return QTensor(data, scale, fmt, (br, bc), g)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data * q.scale`` blockwise, in ``dtype``."""
    br, bc = q.block
    if br >= q.data.shape[0] and bc >= q.data.shape[1]:
        out = q.data.float() * q.scale.reshape(())
    else:
        out = q.data.float() * _expand(q.scale, tuple(q.data.shape), br, bc)
    return out.to(dtype)


def fake_quantize(x: torch.Tensor, fmt: "FP8Format | str" = "e4m3",
                  granularity: "Granularity | str" = Granularity.TENSORWISE,
                  operand: str = "a", **kwargs) -> torch.Tensor:
    """quantize then dequantize, in float32: the value an FP8 kernel actually multiplies."""
    return dequantize(quantize(x, fmt, granularity, operand, **kwargs))


_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                         torch.float8_e5m2fnuz})


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES
