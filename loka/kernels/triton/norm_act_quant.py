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

Rowwise scales: a persistent program owns ``BLOCK_M`` rows at a time; pass 1 computes the
activation chunk by chunk and its row amax, pass 2 recomputes each chunk (its input is
still in L1/L2) and casts. Tensorwise scales: the kernel writes the activation and one
partial amax per program, then :func:`~loka.kernels.triton.quantize.tensor_cast_kernel`
reduces the partials and casts (the two-stage amax).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...numerics import get_format
from .common import (abs_amax, amax_to_scale, autotune, fp8_meta, nan_max, next_pow2,
                     round_to, scale_and_clamp)
from .quantize import tensor_cast_kernel

NORMS = {"none": 0, "blocknorm": 1, "layernorm": 2}
ACTIVATIONS = {"identity": 0, "hardswish": 1}
_MAX_PROGRAMS = 528
"""persistent programs: four per SM of an H100/H200"""


def _prune(configs, named_args, **kwargs):
    d = kwargs["BLOCK_D"]
    m = named_args["M"]
    keep = [c for c in configs if 1024 <= c.kwargs["BLOCK_M"] * d <= 8192
            and c.kwargs["BLOCK_M"] <= max(1, next_pow2(m))]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"])]


@triton.jit
def _norm_act_chunk(x_ptr, w_ptr, b_ptr, rows, c0, M, D, stride_xm, eps, mean, rstd,
                    NORM: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                    SOFT_ROUND: tl.constexpr):
    """act(norm(x[rows, c0 : c0 + GROUP])) in float32, rounded as the unfused ops round,
    zero outside the tensor; returns (y, mask, cols)."""
    hp = x_ptr.dtype.element_ty
    local = tl.arange(0, BLOCK_D)
    cols = c0 + local
    col_ok = (cols < D) & (local < GROUP)
    mask = (rows < M)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if NORM == 1:
        n = tl.minimum(D - c0, GROUP).to(tl.float32)
        ms = tl.math.div_rn(tl.sum(x * x, 1), tl.zeros_like(rows.to(tl.float32)) + n)
        y = round_to(x * tl.rsqrt(ms + eps)[:, None], hp, SOFT_ROUND)
    elif NORM == 2:
        y = (x - mean[:, None]) * rstd[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = round_to(y, hp, SOFT_ROUND)
    else:
        y = x
    if ACT == 1:
        y = round_to(tl.math.div_rn(y * tl.clamp(y + 3.0, 0.0, 6.0), tl.zeros_like(y) + 6.0),
                     hp, SOFT_ROUND)
    return tl.where(mask, y, 0.0), mask, cols


@autotune(configs=[triton.Config({"BLOCK_M": m}, num_warps=w)
                   for m in (1, 2, 4, 8, 16, 32) for w in (4, 8)],
          key=["M", "D", "NORM", "GROUP", "ROWWISE", "WRITE_HP"], prune=_prune)
@triton.jit
def norm_act_quant_kernel(x_ptr, w_ptr, b_ptr, y_ptr, q_ptr, scale_ptr, partial_ptr, M, D,
                          stride_xm, eps, NORM: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_D: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                          ACT: tl.constexpr, WRITE_HP: tl.constexpr, ROWWISE: tl.constexpr,
                          FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                          MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                          BLOCK_M: tl.constexpr):
    """x (M, D) -> y (M, D) in x's dtype (if WRITE_HP), q (M, D) FP8 with rowwise scales
    (M,) (ROWWISE) or one partial amax per program in ``partial`` (tensorwise)."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    total_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    for rb in range(pid, tl.cdiv(M, BLOCK_M), nprog):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        r64 = rows[:, None].to(tl.int64)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if NORM == 2:  # row statistics first: mean, then the centred second moment
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                m2 = (rows < M)[:, None] & (cols < D)[None, :]
                acc += tl.sum(tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=m2,
                                      other=0.0).to(tl.float32), 1)
            mean = acc / D
            acc = tl.zeros([BLOCK_M], dtype=tl.float32)
            for c0 in range(0, D, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                m2 = (rows < M)[:, None] & (cols < D)[None, :]
                xc = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=m2,
                             other=0.0).to(tl.float32)
                xc = tl.where(m2, xc - mean[:, None], 0.0)
                acc += tl.sum(xc * xc, 1)
            rstd = tl.rsqrt(acc / D + eps)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, D, GROUP):
            y, mask, cols = _norm_act_chunk(x_ptr, w_ptr, b_ptr, rows, c0, M, D, stride_xm,
                                            eps, mean, rstd, NORM, GROUP, BLOCK_D, HAS_W,
                                            HAS_B, ACT, SOFT_ROUND)
            if WRITE_HP:
                tl.store(y_ptr + r64 * D + cols[None, :], y.to(y_ptr.dtype.element_ty),
                         mask=mask)
            amax = nan_max(amax, abs_amax(y, 1))
        if ROWWISE:
            scale = amax_to_scale(amax, FMT_MAX, SOFT_ROUND)
            tl.store(scale_ptr + rows, scale, mask=rows < M)
            for c0 in range(0, D, GROUP):
                y, mask, cols = _norm_act_chunk(x_ptr, w_ptr, b_ptr, rows, c0, M, D,
                                                stride_xm, eps, mean, rstd, NORM, GROUP,
                                                BLOCK_D, HAS_W, HAS_B, ACT, SOFT_ROUND)
                q = scale_and_clamp(y, scale[:, None], FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)
                tl.store(q_ptr + r64 * D + cols[None, :], q.to(q_ptr.dtype.element_ty),
                         mask=mask)
        else:
            total_amax = nan_max(total_amax, amax)
    if not ROWWISE:
        tl.store(partial_ptr + pid, abs_amax(total_amax, 0))


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
    write_hp = return_hp or not rowwise  # tensorwise casts from the stored activation
    y = torch.empty_like(x) if write_hp else None
    q = torch.empty((m, d), dtype=get_format(fmt).dtype, device=x.device)
    scale = torch.empty((m, 1) if rowwise else (1, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return y, q, scale
    group = block if norm == "blocknorm" else min(next_pow2(d), 2048)
    nprog = max(1, min(triton.cdiv(m, 8), _MAX_PROGRAMS))  # persistent: programs loop over rows
    partial = torch.empty((nprog,), dtype=torch.float32, device=x.device)
    norm_act_quant_kernel[(nprog,)](
        x, weight if weight is not None else x, bias if bias is not None else x,
        y if y is not None else x, q, scale, partial, m, d, x.stride(0), float(eps),
        NORM=NORMS[norm], GROUP=group, BLOCK_D=next_pow2(group), HAS_W=weight is not None,
        HAS_B=bias is not None, ACT=ACTIVATIONS[act], WRITE_HP=write_hp, ROWWISE=rowwise,
        **meta)
    if not rowwise:
        tensor_cast_kernel[(nprog,)](y, q, scale, partial, nprog, m, d, y.stride(0), 1, d, 1,
                                     NPART_P2=next_pow2(nprog), **meta)
    return (y if return_hp else None), q, scale
