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
finite scale and quantizes to zeros, never NaN; an empty block (an operand with no rows or
no columns) has amax 0 too, so an empty operand quantizes to empty data with such scales.

Finite input never yields NaN: scales and FP8 values are computed in float32, and a finite
value beyond float32's range (a float64 input) *saturates* to ``±torch.finfo(float32).max``
first, so its block's scale stays finite (``quantize`` of 1e300 dequantizes to 3.4e38).
Non-finite inputs are not an error: NaN or Inf make the scale of their block non-finite,
and the dequantized block (and any GEMM output reading it) is non-finite too; the Dispatch
guard catches that downstream. Quantization itself never raises on values, with one
exception: a static ``scale`` passed to :func:`quantize` must be finite and positive
(a zero scale would turn every zero into NaN), which is checked unless the caller has.
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


_GRANULARITIES = {g.value: g for g in Granularity}


def as_granularity(granularity: "Granularity | str") -> Granularity:
    """``Granularity(granularity)`` without calling the enum's constructor on a member:
    code that torch.compile traces calls this (Dynamo in torch 2.11 cannot trace
    ``Granularity(Granularity.TENSORWISE)``)."""
    if isinstance(granularity, Granularity):
        return granularity
    try:
        return _GRANULARITIES[granularity]
    except (KeyError, TypeError):
        raise ValueError(f"{granularity!r} is not a valid Granularity") from None


BLOCK = 128
"""block length of blockwise scaling (1x128 activations, 128x128 weights)"""
MX_BLOCK = 32
"""block length of MX scaling (OCP Microscaling spec)"""
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""where wider inputs saturate before scaling: scales and FP8 values are float32"""


def operand_block(granularity: "Granularity | str", operand: str) -> Tuple[int, int]:
    """The block shape of ``operand`` ('a' of shape (M, K) or 'b' of shape (K, N))."""
    g = as_granularity(granularity)
    if operand not in ("a", "b"):
        raise ValueError(f"operand must be 'a' or 'b', got {operand!r}")
    # compared by value (a str enum): traced code then reads no member of the class, which
    # compiled code would check per call is the member ``granularity`` came from
    if g == "tensorwise":
        return (-1, -1)
    if g == "rowwise":
        return (1, -1) if operand == "a" else (-1, 1)
    if g == "blockwise":
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


def is_qtensor(x) -> bool:
    """``isinstance(x, QTensor)``, for code torch.compile traces: the class read through this
    module, where ``quantize`` reads it, so that compiled code has no per-call check that
    two modules' ``QTensor`` are one class."""
    return isinstance(x, QTensor)


def _resolve_block(shape: Tuple[int, int], block: Tuple[int, int]) -> Tuple[int, int]:
    r, c = shape
    br = r if block[0] == -1 else block[0]
    bc = c if block[1] == -1 else block[1]
    return max(br, 1), max(bc, 1)


def _grid(shape: Tuple[int, int], block: Tuple[int, int]) -> Tuple[int, int]:
    """Blocks per axis: one for a whole-axis block (-1), even of an empty axis."""
    return tuple(1 if b == -1 else -(-n // b) for n, b in zip(shape, block))


# read by traced code as names of this module, not as attributes of ``torch`` (compiled code
# would check per call that this module's ``torch`` is the caller's)
_F64 = torch.float64
_as_tensor = torch.as_tensor


def saturate_float64(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or for float64 ``x`` in float32 with finite values beyond float32's
    range saturated (module doc); Inf and NaN stay as they are. For quantizers of other
    libraries (torchao's) that compute in float32, so that they saturate as LoKA's do."""
    if x.dtype != _F64:
        return x
    return torch.where(torch.isfinite(x), x.clamp(-FLOAT32_MAX, FLOAT32_MAX), x).float()


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


def in_memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x``, or its transpose where that is the contiguous one: a whole-tensor reduction
    (an amax) has the same value either way, and one over a transposed view in its
    logical order reads memory a row's stride apart, which compiled code does slowly
    (bench/BENCHMARKS.md, "Delayed scaling", the H100 run)."""
    if x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous():
        return x.t()
    return x


def compute_scales(x: torch.Tensor, fmt: "FP8Format | str", block: Tuple[int, int],
                   power_of_two: bool = False) -> torch.Tensor:
    """Float32 dequantization scales of ``x`` (R, C) for blocks ``block``.

    Returns:
        (ceil(R / br), ceil(C / bc)) float32; a whole-axis block (-1) gives one scale
        along that axis, also when the axis is empty
    """
    fmt = get_format(fmt)
    if x.numel() == 0:  # the amax of an empty block is 0
        amax = torch.zeros(_grid(tuple(x.shape), block), dtype=torch.float32, device=x.device)
    else:
        br, bc = _resolve_block(tuple(x.shape), block)
        if (br, bc) == tuple(x.shape):  # one block: reduce in memory order
            x = in_memory_order(x)
            br, bc = x.shape
        amax = _blocked(saturate_float64(x.detach()), br, bc).abs().amax(dim=(1, 3)).float()
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
             scale: torch.Tensor | None = None, check_scale: bool = True) -> QTensor:
    """Quantize a 2-D tensor to FP8 with saturation (values beyond ``fmt.max`` clamp).

    Args:
        x: (R, C) float tensor; a GEMM operand ``a`` (M, K) or ``b`` (K, N).
        fmt: FP8 format.
        granularity: scaling granularity; its block shape depends on ``operand``.
        operand: 'a' or 'b', deciding the direction of rowwise/blockwise blocks.
        block: explicit block shape, overriding the granularity's.
        power_of_two: round scales up to powers of two (default: only for MX).
        scale: precomputed dequantization scales (static scaling); amax is not taken.
            One finite positive value per block (any shape with that many elements).
        check_scale: check that ``scale`` is finite and positive (ValueError otherwise).
            The check reads the values (a host synchronization): pass False on a hot path
            whose scale was checked where it was made (``loka.Linear.set_input_amax``).

    Returns:
        QTensor with ``data`` (R, C) in ``fmt.dtype`` and float32 ``scale``.

    Finite values beyond float32's range saturate (module doc): finite input never
    yields NaN. An empty ``x`` gives empty ``data`` with finite scales.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise TypeError(f"quantize expects a float32/bf16/fp16 tensor, got {x.dtype}")
    fmt = get_format(fmt)
    g = as_granularity(granularity)
    blk = operand_block(g, operand) if block is None else block
    if power_of_two is None:
        power_of_two = g == "mx"
    shape = tuple(x.shape)
    br, bc = _resolve_block(shape, blk)
    if scale is None:
        scale = compute_scales(x, fmt, blk, power_of_two)
    else:
        scale = _static_scale(scale, _grid(shape, blk), check_scale)
    if x.numel() == 0:
        return QTensor(torch.empty(shape, dtype=fmt.dtype, device=x.device), scale, fmt,
                       (br, bc), g)
    if br == shape[0] and bc == shape[1]:
        scaled = saturate_float64(x).float() / scale.reshape(())
    else:
        scaled = saturate_float64(x).float() / _expand(scale, shape, br, bc)
    data = scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return QTensor(data, scale, fmt, (br, bc), g)


def _static_scale(scale: torch.Tensor, grid: Tuple[int, int], check: bool) -> torch.Tensor:
    """A caller's dequantization scales as the (grid) float32 tensor ``quantize`` stores."""
    scale = _as_tensor(scale)
    if scale.numel() != grid[0] * grid[1]:
        raise ValueError(f"static scale has {scale.numel()} value(s), but this operand has "
                         f"{grid[0]}x{grid[1]} block(s)")
    scale = scale.float().reshape(grid)
    if check and scale.numel() and not bool(torch.isfinite(scale).all() & (scale > 0).all()):
        bad = scale[~(torch.isfinite(scale) & (scale > 0))].flatten()[:4].tolist()
        raise ValueError(f"static scale must be finite and positive, got {bad}: a zero "
                         "scale turns zeros into NaN, and a non-finite one every value")
    return scale


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.data * q.scale`` blockwise, in ``dtype`` (empty data: an empty tensor).

    Computed in float32, or exactly in float64 for ``dtype=torch.float64``. MX scales are
    powers of two rounded up, so a block whose amax lies within half an FP8 step of
    float32's largest value can round to 2**128: inf in float32, finite in float64."""
    if q.data.numel() == 0:
        return torch.empty(tuple(q.data.shape), dtype=dtype, device=q.data.device)
    br, bc = q.block
    # float64: exact (an FP8 value times a float32 scale has at most 28 significant bits)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if br >= q.data.shape[0] and bc >= q.data.shape[1]:
        out = q.data.to(wide) * q.scale.reshape(()).to(wide)
    else:
        out = q.data.to(wide) * _expand(q.scale, tuple(q.data.shape), br, bc).to(wide)
    return out.to(dtype)


def requantize_transposed(q: QTensor, check_scale: bool = True) -> QTensor:
    """The other layout of a rowwise operand made from its FP8 data, not from the
    high-precision tensor: ``qᵀ`` quantized rowwise (one scale per column of ``q``), with
    power-of-two scales taken from the dequantized values, its data a contiguous (C, R)
    tensor (the layout a GEMM reads ``xᵀ`` in).

    ``q`` must be rowwise with power-of-two scales (``quantize(x, fmt, 'rowwise',
    power_of_two=True)``): then ``q.data * q.scale`` is exact, and a value that lies in
    FP8's normal range under its row's scale is ``x`` rounded to FP8's mantissa, whatever
    the power-of-two scale. Let ``r = requantize_transposed(q)`` and ``d = quantize(x.t(),
    fmt, 'rowwise', power_of_two=True)``. Wherever a value is normal under its row's scale
    and under both column scales (``d``'s and ``r``'s), ``r`` dequantizes to exactly ``d``'s
    value. The two column scales can differ: by rounding, a column's largest value can
    cross a power of two, and where that value is below its row's normal range it can
    round up enough to double ``r``'s scale; the column's other values are then rounded
    on that coarser grid. A value below its row's normal range is rounded twice. Every
    value stays within the two roundings' half steps of ``x``.

    Values of ``x`` so close to float32's largest that FP8 rounds them to 2**128 dequantize
    to float32's largest (as ``quantize`` saturates) instead of inf. A NaN in ``x`` makes
    its row's scale NaN (as ``quantize`` does), hence every column's scale, hence every
    value of the result: one NaN reaches all of it.

    What it is for: the weight gradient reads ``xᵀ`` and ``dyᵀ`` with scales along the batch,
    where the forward and the input gradient read ``x`` and ``dy`` with scales along the
    features. Made from the FP8 rows (one byte per value) instead of the bf16 tensor (two,
    through a transposed view), the second layout costs one read of the FP8 data for the
    column amax and one for the cast (``bench/bench_quantizers.py`` times it: rows
    ``c_p2_requant`` and ``c_p2_dual``).

    Args:
        q: rowwise QTensor (R, C) with power-of-two scales.
        check_scale: check that the finite scales are powers of two (ValueError
            otherwise); the check reads them (a host synchronization): pass False on a hot
            path whose scales were made with ``power_of_two=True``.

    Returns:
        QTensor of shape (C, R), rowwise, ``scale`` (C, 1), power-of-two.
    """
    if (q.granularity != Granularity.ROWWISE or q.block[0] != 1
            or q.block[1] < q.data.shape[1]):
        raise ValueError(f"requantize_transposed takes a rowwise QTensor with one scale per "
                         f"row, got {q.granularity.value} with block {q.block}")
    if check_scale and q.scale.numel():
        finite = torch.isfinite(q.scale)
        if not bool((~finite | (torch.frexp(q.scale)[0] == 0.5)).all()):
            raise ValueError("requantize_transposed needs power-of-two scales "
                             "(quantize(..., power_of_two=True)): other scales round twice")
    values = dequantize(q).clamp(-FLOAT32_MAX, FLOAT32_MAX)  # (NaN stays NaN)
    r = quantize(values.t(), q.fmt, Granularity.ROWWISE, "a", power_of_two=True)
    return QTensor(r.data.contiguous(), r.scale, r.fmt, r.block, r.granularity)


def fake_quantize(x: torch.Tensor, fmt: "FP8Format | str" = "e4m3",
                  granularity: "Granularity | str" = Granularity.TENSORWISE,
                  operand: str = "a", **kwargs) -> torch.Tensor:
    """quantize then dequantize, in float32: the value an FP8 kernel actually multiplies."""
    return dequantize(quantize(x, fmt, granularity, operand, **kwargs))


_FP8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
                         torch.float8_e5m2fnuz})


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in _FP8_DTYPES
