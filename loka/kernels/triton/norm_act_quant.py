"""Fused normalization -> activation -> FP8 quantization.

One kernel reads the pre-activation ``x`` (M, D) once from memory and writes the FP8
activation the next GEMM consumes, its float32 scales, and, when asked, the high-precision
activation (the autograd edge). It computes what the unfused composition computes and
rounds where it rounds: the norm's output and the activation's output are rounded to the
input dtype, and the FP8 value is the quantization of that rounded value, so the FP8
tensor equals :func:`loka.numerics.quantize` of the kernel's own high-precision output bit
for bit.

Norms: ``blocknorm`` (parameter-free RMS norm over blocks of ``GROUP`` features, a last
shorter block normalized on its own, as :class:`loka.mods.BlockNorm`), ``layernorm``
(optionally affine), ``none``. Activations: ``hardswish``, ``identity``.

Layout: a program owns ``BLOCK_M`` rows and sees them as a 3-D tile
``[BLOCK_M, NG, GP]``: ``NG`` BlockNorm blocks of ``GROUP`` features each, padded to
``GP`` (a power of two) lanes, so a block's mean square is a reduction over the last axis
and the rowwise amax one over the last two; the other norms use one "block" of the whole
row (``NG = 1``). Rows of up to ``MAX_TILE`` lanes are held in registers whole: ``x`` is
read once and nothing is recomputed (norm, activation, amax, scale, cast and stores in one
pass; bytes moved = read x + write q (+ write y)). Longer rows go through ``NG``-block
chunks: pass 1 computes and stores the activation and the row amax, pass 2 recomputes each
chunk (its input is then mostly in L2) and casts. The tuner may also split a long row that
fits whole (8-16K lanes of BlockNorm) into ``SPLIT`` chunks the same way: a whole row of
16K lanes takes 77-140 registers a thread and leaves one program per SM, too few loads in
flight; chunks of 2-8K lanes trade a second read of the row, from L2, for more programs per
SM.

Tensorwise scales: a first pass folds every program's amax into one global amax with an
integer ``atomic_max`` (the bits of a non-negative float order as the float does, and a
positive NaN above +inf, so NaN propagates). When the high-precision activation is wanted,
that pass also writes it and
:func:`~loka.kernels.triton.quantize.tensor_cast_kernel` casts from it; when only the FP8
tensor is wanted (``return_hp=False``), a second launch of the same kernel (``CAST``)
recomputes the activation from ``x`` and casts it with the global scale, so the
activation never goes to memory (bytes moved: read x twice + write q, against read x +
write y + read y + write q).

Rounding of the activation follows the device of the reference: on CUDA, PyTorch's Hard
Swish is ``x * clamp(x + 3, 0, 6) * (1/6)`` (a product with the float32 reciprocal), on
the CPU (the reference of Triton's interpreter, ``SOFT_ROUND``) ``... / 6``, IEEE-rounded.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...numerics import get_format
from .common import (abs_amax, amax_to_scale, autotune, launch, fp8_meta, next_pow2, round_to,
                     placeholder, scale_and_clamp)
from .quantize import tensor_cast_kernel

NORMS = {"none": 0, "blocknorm": 1, "layernorm": 2}
ACTIVATIONS = {"identity": 0, "hardswish": 1}
MAX_TILE = 16384
"""lanes of the longest row held in registers whole (one pass, x read once)"""
CHUNK = 4096
"""lanes per chunk of a longer row (two passes)"""
_NAN_BITS = tl.constexpr(0x7FC00000)
"""a positive quiet NaN: above +inf (0x7F800000) as an int32"""


def _tile_shape(d: int, norm: str, block: int) -> Tuple[int, int, int, int]:
    """``(GROUP, NG, GP, NCHUNK)`` for rows of ``d`` features: ``NG`` blocks of ``GROUP``
    features padded to ``GP`` lanes per tile, ``NCHUNK`` tiles per row."""
    if norm == "blocknorm":
        group = min(block, d)  # a block longer than the row is the whole row
        gp = next_pow2(group)
        ngroups = triton.cdiv(d, group)
        if next_pow2(ngroups) * gp <= MAX_TILE:
            return group, next_pow2(ngroups), gp, 1
        ng = max(1, CHUNK // gp)  # a block longer than CHUNK stays one (wide) tile
        return group, ng, gp, triton.cdiv(ngroups, ng)
    dp = next_pow2(d)
    if dp <= MAX_TILE:
        return dp, 1, dp, 1
    return CHUNK, 1, CHUNK, triton.cdiv(d, CHUNK)


def _split(cfg: triton.Config) -> int:
    return cfg.kwargs.get("SPLIT", 1)


def _prune(configs, named_args, **kwargs):
    """Tiles of 8 to 64 lanes per thread (16-byte loads, no spills), at most 16K lanes;
    no taller than the tensor. Register caps and split rows only for whole rows of 8-16K
    lanes that hold at least ``SPLIT`` blocks. Short rows of a short tensor: the tallest
    tile that fits."""
    row = kwargs["NG"] * kwargs["GP"]
    m = named_args["M"]
    long_whole = kwargs["NCHUNK"] == 1 and row >= 8192
    fits = [c for c in configs if c.kwargs["BLOCK_M"] <= max(1, next_pow2(m))
            and (c.maxnreg is None or long_whole)
            and (_split(c) == 1 or (long_whole and kwargs["NG"] >= _split(c)))]
    keep = []
    for c in fits:
        tile, threads = c.kwargs["BLOCK_M"] * row // _split(c), 32 * c.num_warps
        if 8 * threads <= tile <= min(64 * threads, MAX_TILE) or (
                c.kwargs["BLOCK_M"] == 1 and row > MAX_TILE and c.num_warps >= 8):
            keep.append(c)
    if keep:
        return keep
    whole = [c for c in fits if _split(c) == 1]
    small = min(c.num_warps for c in whole)
    return [max((c for c in whole if c.num_warps == small), key=lambda c: c.kwargs["BLOCK_M"])]


@triton.jit
def _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm, GROUP: tl.constexpr, NG: tl.constexpr,
               GP: tl.constexpr):
    """x[rows, c0 : c0 + NG * GROUP] as a float32 [BLOCK_M, NG, GP] tile (zero outside);
    returns (x, cols, col_ok, mask)."""
    g = tl.arange(0, NG)[None, :, None]
    c = tl.arange(0, GP)[None, None, :]
    cols = c0 + g * GROUP + c
    if GP == GROUP:
        col_ok = cols < D
    else:
        col_ok = (c < GROUP) & (cols < D)
    mask = row_ok[:, None, None] & col_ok
    x = tl.load(x_ptr + r64 * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    return x, cols, col_ok, mask


@triton.jit
def _norm_act(x, cols, col_ok, mask, c0, D, x_ptr, w_ptr, b_ptr, eps, mean, rstd,
              NORM: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
              HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
              SOFT_ROUND: tl.constexpr):
    """act(norm(x)) of a tile in float32, rounded as the unfused ops round (zero outside)."""
    hp = x_ptr.dtype.element_ty
    if NORM == 1:  # BlockNorm: the mean square of each block, the last one maybe shorter
        n = tl.maximum(tl.minimum(D - c0 - tl.arange(0, NG) * GROUP, GROUP), 1)
        ss = tl.sum(x * x, 2)
        ms = tl.math.div_rn(ss, tl.zeros_like(ss) + n.to(tl.float32)[None, :])
        y = round_to(x * tl.rsqrt(ms + eps)[:, :, None], hp, SOFT_ROUND)
    elif NORM == 2:
        y = (x - mean[:, None, None]) * rstd[:, None, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = tl.where(mask, round_to(y, hp, SOFT_ROUND), 0.0)
    else:
        y = x
    if ACT == 1:
        h = y * tl.clamp(y + 3.0, 0.0, 6.0)
        if SOFT_ROUND:  # the CPU reference divides (IEEE)
            h = tl.math.div_rn(h, tl.zeros_like(h) + 6.0)
        else:  # PyTorch's CUDA kernel multiplies by the float32 1/6
            h = h * 0.16666666666666666
        y = round_to(h, hp, SOFT_ROUND)
    return y


@triton.jit
def _row_amax(y):
    """amax(|y|) over the last two axes of a [BLOCK_M, NG, GP] tile, NaN-propagating."""
    return abs_amax(abs_amax(y, 2), 1)


@triton.jit
def _global_amax(partial_ptr, amax):
    """Fold the amax of a program's rows into the global one (int32 bits, atomic max)."""
    a = abs_amax(amax, 0)
    bits = tl.where(a != a, _NAN_BITS, a.to(tl.int32, bitcast=True))
    tl.atomic_max(partial_ptr, bits)


CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w)
           for m in (1, 2, 4, 8, 16, 32, 64) for w in (4, 8, 16)] + [
    # Whole rows of 8-16K values: at 77-140 registers a thread, one program per SM, and
    # one 32 KB row in flight is too little to cover the memory latency. Two remedies for
    # the tuner to weigh: registers capped at 64 (16 warps) or 128 (8 warps), so that two
    # programs share an SM (a few values spill); or the row split into SPLIT chunks of
    # 2-8K lanes (two passes, the second reading the row again, mostly from L2).
    triton.Config({"BLOCK_M": 1}, num_warps=16, maxnreg=64),
    triton.Config({"BLOCK_M": 1}, num_warps=8, maxnreg=128)] + [
    triton.Config({"BLOCK_M": 1, "SPLIT": s}, num_warps=w) for s in (2, 4, 8) for w in (4, 8)]
"""the fused kernel's tiles (:func:`_prune` keeps those that fit a shape)"""


@autotune(configs=CONFIGS,
          key=["M", "D", "NORM", "GROUP", "NG", "GP", "ACT", "ROWWISE", "WRITE_HP", "CAST"],
          prune=_prune)
@triton.jit
def norm_act_quant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, scale_ptr, partial_ptr, M, D,
                          stride_xm, eps, NORM: tl.constexpr, GROUP: tl.constexpr,
                          NG: tl.constexpr, GP: tl.constexpr, NCHUNK: tl.constexpr,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                          WRITE_HP: tl.constexpr, ROWWISE: tl.constexpr,
                          CAST: tl.constexpr, FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                          MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                          BLOCK_M: tl.constexpr, SPLIT: tl.constexpr = 1):
    """Rows [pid * BLOCK_M, +BLOCK_M) of x (M, D) -> y (M, D) in x's dtype (if WRITE_HP),
    q (M, D) FP8 with rowwise scales (M,) (ROWWISE), or the global amax's int32 bits in
    ``partial`` (tensorwise), or, with ``CAST`` (tensorwise, second launch), q cast with the
    scale of the global amax already in ``partial`` (the scale stored by program 0).
    ``SPLIT`` > 1 runs a row of ``NG`` blocks as chunks of ``NG // SPLIT`` blocks."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    # the activation is rounded to x's dtype before it is quantized: 16-bit values
    X16: tl.constexpr = x_ptr.dtype.element_ty != tl.float32
    g_scale = 0.0
    if CAST:
        g_amax = tl.load(partial_ptr).to(tl.float32, bitcast=True)
        g_scale = amax_to_scale(g_amax, FMT_MAX, SOFT_ROUND)
        tl.store(scale_ptr, g_scale, mask=tl.program_id(0) == 0)
    row_ok = rows < M
    r64 = rows[:, None, None].to(tl.int64)
    zero_m = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NCHUNK == 1 and SPLIT == 1:  # the whole row in registers: x read once
        x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, 0, D, stride_xm, GROUP, NG, GP)
        mean, rstd = zero_m, zero_m
        if NORM == 2:
            mean = tl.math.div_rn(tl.sum(tl.sum(x, 2), 1), zero_m + D)
            xc = tl.where(mask, x - mean[:, None, None], 0.0)
            var = tl.math.div_rn(tl.sum(tl.sum(xc * xc, 2), 1), zero_m + D)
            rstd = tl.rsqrt(var + eps)
        y = _norm_act(x, cols, col_ok, mask, 0, D, x_ptr, w_ptr, b_ptr, eps, mean, rstd, NORM,
                      GROUP, NG, HAS_W, HAS_B, ACT, SOFT_ROUND)
        if WRITE_HP:
            tl.store(y_ptr + r64 * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        if CAST:
            qv = scale_and_clamp(y, g_scale, FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, X16)
            tl.store(q_ptr + r64 * D + cols, qv.to(q_ptr.dtype.element_ty), mask=mask)
        elif ROWWISE:
            amax = _row_amax(y)
            scale = amax_to_scale(amax, FMT_MAX, SOFT_ROUND)
            qv = scale_and_clamp(y, scale[:, None, None], FMT_MAX, MANT_BITS, MIN_EXP,
                                 SOFT_ROUND, X16)
            qcols = cols
            if WRITE_HP:
                # A 16-byte store holds 8 bf16 values but 16 FP8 ones, and Triton gives
                # each store its own register layout: the tile would go through shared
                # memory between the two, and the activation be computed in both layouts.
                # Offsets seen as runs of HP_VEC make the FP8 store take the first layout.
                HP_VEC: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
                qcols = (cols // HP_VEC) * HP_VEC + cols % HP_VEC
            tl.store(q_ptr + r64 * D + qcols, qv.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(scale_ptr + rows, scale, mask=row_ok)
        else:
            _global_amax(partial_ptr, _row_amax(y))
    else:  # long rows: chunks of TG blocks, the activation computed twice
        tl.static_assert(NG % SPLIT == 0, "a split row must hold SPLIT chunks of whole blocks")
        TG: tl.constexpr = NG // SPLIT
        CW: tl.constexpr = TG * GROUP
        mean, rstd = zero_m, zero_m
        if NORM == 2:  # row statistics first: mean, then the centred second moment
            acc = zero_m
            for c0 in range(0, D, CW):
                x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm,
                                                   GROUP, TG, GP)
                acc += tl.sum(tl.sum(x, 2), 1)
            mean = tl.math.div_rn(acc, zero_m + D)
            acc = zero_m
            for c0 in range(0, D, CW):
                x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm,
                                                   GROUP, TG, GP)
                xc = tl.where(mask, x - mean[:, None, None], 0.0)
                acc += tl.sum(tl.sum(xc * xc, 2), 1)
            rstd = tl.rsqrt(tl.math.div_rn(acc, zero_m + D) + eps)
        if CAST:
            for c0 in range(0, D, CW):
                x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm,
                                                   GROUP, TG, GP)
                y = _norm_act(x, cols, col_ok, mask, c0, D, x_ptr, w_ptr, b_ptr, eps, mean, rstd,
                              NORM, GROUP, TG, HAS_W, HAS_B, ACT, SOFT_ROUND)
                qv = scale_and_clamp(y, g_scale, FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, X16)
                tl.store(q_ptr + r64 * D + cols, qv.to(q_ptr.dtype.element_ty), mask=mask)
        else:
            amax = zero_m
            for c0 in range(0, D, CW):
                x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm, GROUP,
                                                   TG, GP)
                y = _norm_act(x, cols, col_ok, mask, c0, D, x_ptr, w_ptr, b_ptr, eps, mean, rstd,
                              NORM, GROUP, TG, HAS_W, HAS_B, ACT, SOFT_ROUND)
                if WRITE_HP:
                    tl.store(y_ptr + r64 * D + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
                amax = tl.maximum(amax, _row_amax(y), propagate_nan=tl.PropagateNan.ALL)
            if ROWWISE:
                scale = amax_to_scale(amax, FMT_MAX, SOFT_ROUND)
                tl.store(scale_ptr + rows, scale, mask=row_ok)
                for c0 in range(0, D, CW):
                    x, cols, col_ok, mask = _load_tile(x_ptr, r64, row_ok, c0, D, stride_xm,
                                                       GROUP, TG, GP)
                    y = _norm_act(x, cols, col_ok, mask, c0, D, x_ptr, w_ptr, b_ptr, eps, mean,
                                  rstd, NORM, GROUP, TG, HAS_W, HAS_B, ACT, SOFT_ROUND)
                    qv = scale_and_clamp(y, scale[:, None, None], FMT_MAX, MANT_BITS, MIN_EXP,
                                         SOFT_ROUND, X16)
                    tl.store(q_ptr + r64 * D + cols, qv.to(q_ptr.dtype.element_ty), mask=mask)
            else:
                _global_amax(partial_ptr, amax)


def norm_act_quant(x: torch.Tensor, *, norm: str = "blocknorm", block: int = 256,
                   act: str = "hardswish", fmt="e4m3", granularity: str = "rowwise",
                   return_hp: bool = True, eps: float = 1e-6,
                   weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None
                   ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Launch the fused kernel.

    Args:
        x: (M, D) float32/bf16/fp16 with contiguous rows.
        norm: 'blocknorm', 'layernorm' or 'none'.
        block: BlockNorm's block size (ignored by the other norms).
        act: 'hardswish' or 'identity'.
        fmt: 'e4m3' or 'e5m2'.
        granularity: 'rowwise' or 'tensorwise'.
        return_hp: also return the high-precision activation.
        eps: the norm's epsilon (added to the mean square / variance).
        weight, bias: LayerNorm's optional affine parameters, (D,).

    Returns:
        y (M, D) in x's dtype or None, q (M, D) FP8 row-major, scale (M, 1) or (1, 1) float32.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {sorted(NORMS)}, got {norm!r}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if granularity not in ("rowwise", "tensorwise"):
        raise ValueError(f"granularity must be 'rowwise' or 'tensorwise', got {granularity!r}")
    if norm == "blocknorm" and (not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive int, got {block!r}")
    if (weight is not None or bias is not None) and norm != "layernorm":
        raise ValueError("weight and bias are LayerNorm's affine parameters")
    m, d = x.shape
    if d == 0:
        raise ValueError("cannot normalize rows of zero features")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (d,):
            raise ValueError(f"{name} must have shape ({d},), got {tuple(p.shape)}")
    meta = fp8_meta(fmt)
    rowwise = granularity == "rowwise"
    y = torch.empty_like(x) if return_hp else None
    q = torch.empty((m, d), dtype=get_format(fmt).dtype, device=x.device)
    scale = torch.empty((m, 1) if rowwise else (1, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return y, q, scale
    group, ng, gp, nchunk = _tile_shape(d, norm, block)
    # tensorwise: the global amax as int32 bits, folded in with atomic max from 0
    amax_bits = torch.zeros((1,), dtype=torch.int32, device=x.device) if not rowwise else \
        placeholder(scale)
    grid = lambda meta_: (triton.cdiv(m, meta_["BLOCK_M"]),)  # noqa: E731
    args = (x, weight if weight is not None else placeholder(x),
            bias if bias is not None else placeholder(x), y if y is not None else placeholder(x),
            q, scale, amax_bits, m, d, x.stride(0), float(eps))
    kw = dict(NORM=NORMS[norm], GROUP=group, NG=ng, GP=gp, NCHUNK=nchunk,
              HAS_W=weight is not None, HAS_B=bias is not None, ACT=ACTIVATIONS[act],
              ROWWISE=rowwise, **meta)
    launch(norm_act_quant_kernel)[grid](*args, WRITE_HP=return_hp, CAST=False, **kw)
    if not rowwise and return_hp:  # cast from the stored activation
        nprog = max(1, min(triton.cdiv(m * d, 16384), 512))
        launch(tensor_cast_kernel)[(nprog,)](y, q, scale, amax_bits.view(torch.float32), 1, m, d,
                                             y.stride(0), 1, d, 1, NPART_P2=1, **meta)
    elif not rowwise:  # FP8 only: recompute from x and cast, the activation never stored
        launch(norm_act_quant_kernel)[grid](*args, WRITE_HP=False, CAST=True, **kw)
    return y, q, scale
