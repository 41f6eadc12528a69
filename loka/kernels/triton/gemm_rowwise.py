"""FP8 GEMM with rowwise (or tensorwise) scales applied in the epilogue.

``c = (a @ b) * scale_a * scale_b`` with ``a`` (M, K) FP8, ``b`` (K, N) FP8 (K-major,
i.e. column-major, is the fast layout for FP8 tensor cores), ``scale_a`` (M, 1) or (1, 1),
``scale_b`` (1, N) or (1, 1) float32. A tensorwise scale is the rowwise kernel with a zero
scale stride. Optional fused epilogue, in float32 before the single rounding: ``+ bias``,
Hard Swish, and the output either in bf16/fp16/fp32 or in FP8 with rowwise scales for the
next layer (the high-precision value is rounded to bf16 first, so that the FP8 output equals
:func:`loka.numerics.quantize` of the bf16 output bit for bit). Optionally also the
statistics of a following BlockNorm (``norm_stats=block``): the mean square of every row's
blocks of ``block`` output features, computed from the output as stored (after its
rounding), so that the norm needs no reduction pass of its own: ``y_blk * rsqrt(ms + eps)``
is :class:`loka.mods.BlockNorm` (the last, shorter block included). Each tile adds its rows'
sums of squares into its block with one float32 atomic add per row and block.

Accumulation: on Hopper, Triton's FP8 ``tl.dot`` accumulates in the tensor cores'
reduced-precision accumulator unless told otherwise; ``FAST_ACC=False`` promotes to
float32 every ``BLOCK_K`` (as DeepGEMM does every 128), ``FAST_ACC=True`` never does (the
analogue of ``_scaled_mm(use_fast_accum=True)``).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from ...numerics import get_format
from .common import (abs_amax, amax_to_scale, autotune, launch, check_float_input,
                     check_gemm_operands, fp8_meta, grouped_tile, next_pow2, round_to,
                     placeholder, scale_and_clamp, unsigned_zero_quotient)
from .quantize import amax_partials, quantize_rowwise, reduce_partials

ACTIVATIONS = {None: 0, "identity": 0, "hardswish": 1}
MAX_FP8_OUT_N = 256
"""widest N whose FP8 output is quantized in the epilogue (one program holds a whole row)"""


def _cfg(bm, bn, bk, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)


# Large tiles for the big GEMMs, thin ones (N or K of 32-64) for the LRM shapes.
GEMM_CONFIGS = [
    _cfg(128, 256, 128, 3, 8), _cfg(256, 128, 128, 3, 8), _cfg(128, 128, 128, 4, 8),
    _cfg(64, 128, 128, 4, 4), _cfg(128, 64, 128, 4, 4), _cfg(64, 64, 128, 4, 4),
    _cfg(128, 32, 64, 4, 4), _cfg(256, 32, 64, 3, 4), _cfg(256, 64, 64, 3, 8),
]
INLINE_CONFIGS = [
    _cfg(64, 64, 128, 4, 4), _cfg(64, 64, 128, 3, 4), _cfg(64, 64, 128, 2, 4),
    _cfg(64, 32, 128, 4, 4), _cfg(64, 32, 128, 3, 4), _cfg(64, 32, 256, 3, 4),
    _cfg(32, 64, 128, 3, 8), _cfg(64, 128, 128, 4, 4), _cfg(128, 64, 128, 4, 4),
    _cfg(256, 64, 64, 3, 8),
]
"""the inline-quantizing GEMM's tiles: it is bound by the cast of every loaded value, not by
the MMA, so thin tiles with few pipeline stages, two or three of which share an SM (more
warps to hide the cast's latency; 64 rows, the Hopper MMA's height: the wrapper transposes
a GEMM whose M is smaller, and 32-row tiles, on the older MMA, spill registers), beside
the larger shapes of GEMM_CONFIGS that fit :data:`INLINE_TILE_ELEMENTS`"""
SPLIT_K_UNIT = 1024
"""K range of one split is a multiple of this (and so of every BLOCK_K)"""
INLINE_SPLIT_UNIT = 256
"""the same for the inline-quantizing GEMM, whose splits are finer (see :func:`split_k`)"""
INLINE_TILE_ELEMENTS = 24576
"""most float values of a and b one K step of the inline-quantizing GEMM loads per four
warps (48 KB of bf16, 192 values a thread): the tiles are cast in registers, so the
largest FP8 tiles would spill"""
INLINE_SHARED_BYTES = 196608
"""shared memory the inline GEMM's pipeline may plan for (192 KB, under the 227 KB an
H100/H200 block may use, with room for the epilogue's scratch)"""
_AS_IS = {"FMT_MAX": 0.0, "MANT_BITS": 0, "MIN_EXP": 0}
"""the inline-quantization constants of an operand that arrives in FP8"""
_NO_INLINE = {"QA_MAX": 0.0, "QA_MANT": 0, "QA_MIN_EXP": 0,
              "QB_MAX": 0.0, "QB_MANT": 0, "QB_MIN_EXP": 0}


def _prune(configs, named_args, **kwargs):
    m, n, k = named_args["M"], named_args["N"], named_args["K"]
    if kwargs.get("FP8_OUT"):
        # The whole row in one tile: BLOCK_N is fixed by N, the rest is tuned.
        bn = max(32, next_pow2(n))
        return [_cfg(bm, bn, bk, s, w) for bm, bk, s, w in
                ((64, 128, 4, 4), (128, 64, 4, 4 if bn <= 64 else 8), (128, 128, 3, 8),
                 (64, 64, 4, 4)) if bm * bn <= 128 * 256]
    inline = bool(kwargs.get("QA_MAX") or kwargs.get("QB_MAX"))
    if inline:  # its own tiles (never the autotuner's fallback to the first, largest one)
        configs = INLINE_CONFIGS
    keep = [c for c in configs
            if c.kwargs["BLOCK_N"] <= max(32, next_pow2(n))
            and c.kwargs["BLOCK_K"] <= max(64, next_pow2(k))
            and c.kwargs["BLOCK_M"] <= max(64, next_pow2(m))]
    if inline:
        keep = keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"]
                            * c.kwargs["BLOCK_K"])]
        return [_inline_stages(c) for c in keep]
    return keep


def _inline_stages(c: triton.Config) -> triton.Config:
    """``c`` with at most as many pipeline stages as the inline GEMM's shared memory holds:
    each stage keeps a float tile of a and b, and the fp16 casts take one stage more
    (a 4-stage (64, 128, 128) config needs 256 KB; an H100/H200 block gets 227 KB)."""
    stage = (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * 2
    stages = max(1, min(c.num_stages, INLINE_SHARED_BYTES // stage - 1))
    return triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=stages)


@autotune(configs=GEMM_CONFIGS,
          key=["M", "N", "K", "K_SPLIT", "FP8_OUT", "FAST_ACC", "NORM_BLOCK", "QA_MAX",
               "QB_MAX"], prune=_prune,
          # the BlockNorm statistics are added by atomics; without them ss_ptr is a
          # one-element placeholder, so zeroing it around autotuning costs nothing
          reset_to_zero=["ss_ptr"])
@triton.jit
def rowwise_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, cs_ptr, ss_ptr, M, N,
                        K, K_SPLIT, stride_am, stride_ak, stride_bk, stride_bn, stride_cs,
                        stride_cm, stride_cn, stride_sa, stride_sb, NPART_A, NPART_B,
                        HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NORM_BLOCK: tl.constexpr,
                        FP8_OUT: tl.constexpr, FAST_ACC: tl.constexpr, FMT_MAX: tl.constexpr,
                        MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                        QA_MAX: tl.constexpr, QA_MANT: tl.constexpr, QA_MIN_EXP: tl.constexpr,
                        QB_MAX: tl.constexpr, QB_MANT: tl.constexpr, QB_MIN_EXP: tl.constexpr,
                        SOFT_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of c over the K range ``[pid_k * K_SPLIT, +K_SPLIT)``;
    grouped launch order for L2 reuse of b. With several K splits each writes its scaled
    partial sum to slice ``pid_k`` of c (stride_cs) and the caller adds them. With
    ``NORM_BLOCK`` (a power of two; one K split), the sums of squares of the stored output
    over each row's blocks of NORM_BLOCK columns are added into ss (M, cdiv(N, NORM_BLOCK)).

    Inline quantization (``QA_MAX > 0``, likewise for b): a is a float tensor, sa_ptr holds
    the (NPART_A, M) partial row amaxes of :func:`~loka.kernels.triton.quantize.amax_partials`;
    the prologue reduces them to the rows' scales and every loaded tile is cast to the FP8
    format (QA_MAX, QA_MANT, QA_MIN_EXP) before the dot, with the quantizers' exact
    numerics, so the FP8 operand is never written to memory. The dot then multiplies the
    FP8 values on the fp16 tensor cores (exact), always accumulating in float32."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Wrapped indices keep the loads in bounds without masks on M and N (Triton tutorial).
    k0 = pid_k * K_SPLIT
    a_ptrs = (a_ptr + (rows % M)[:, None].to(tl.int64) * stride_am
              + (k0 + ks[None, :]).to(tl.int64) * stride_ak)
    b_ptrs = (b_ptr + (k0 + ks[:, None]).to(tl.int64) * stride_bk
              + (cols % N)[None, :].to(tl.int64) * stride_bn)
    k_end = tl.minimum(K - k0, K_SPLIT)
    row_ok, col_ok = rows < M, cols < N
    sa = _operand_scale(sa_ptr, rows, M, stride_sa, NPART_A, QA_MAX, SOFT_ROUND)
    sb = _operand_scale(sb_ptr, cols, N, stride_sb, NPART_B, QB_MAX, SOFT_ROUND)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k_end, BLOCK_K)):
        k_left = k_end - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        if QA_MAX > 0:
            a = _cast_tile(a, sa[:, None], QA_MAX, QA_MANT, QA_MIN_EXP, SOFT_ROUND,
                           a_ptr.dtype.element_ty != tl.float32)
        if QB_MAX > 0:
            b = _cast_tile(b, sb[None, :], QB_MAX, QB_MANT, QB_MIN_EXP, SOFT_ROUND,
                           b_ptr.dtype.element_ty != tl.float32)
        if QA_MAX > 0 or QB_MAX > 0:
            # e4m3 and e5m2 values are exact in fp16 and their products in float32: the fp16
            # MMA gives the FP8 GEMM's products, accumulated in float32, and takes either
            # operand layout from shared memory (the FP8 MMA wants both K-major, and these
            # tiles were cast in registers: an N-major b would be transposed byte by byte)
            acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        elif FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # Hard Swish, x * relu6(x + 3) / 6, as torch computes it
        acc = tl.math.div_rn(acc * tl.clamp(acc + 3.0, 0.0, 6.0), tl.zeros_like(acc) + 6.0)
    mask = row_ok[:, None] & col_ok[None, :]
    c_off = pid_k * stride_cs + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    if FP8_OUT:
        # Quantize what the next layer would see: the bf16 output, scaled per row.
        y = tl.where(mask, round_to(acc, tl.bfloat16, SOFT_ROUND), 0.0)
        scale = amax_to_scale(abs_amax(y, 1), FMT_MAX, SOFT_ROUND)
        q = scale_and_clamp(y, scale[:, None], FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, True)
        tl.store(c_ptr + c_off, q.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(cs_ptr + rows, scale, mask=row_ok & (pid_n == 0))
    else:
        y = round_to(acc, c_ptr.dtype.element_ty, SOFT_ROUND)
        tl.store(c_ptr + c_off, y.to(c_ptr.dtype.element_ty), mask=mask)
    if NORM_BLOCK > 0:
        _add_block_sums(ss_ptr, tl.where(mask, y * y, 0.0), rows, row_ok, pid_n, N, BLOCK_M,
                        BLOCK_N, NORM_BLOCK)


@triton.jit
def _operand_scale(ptr, idx, n, stride, NPART, Q_MAX: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """The dequantization scales of rows ``idx`` of a (or columns of b): loaded (an FP8
    operand, ``Q_MAX == 0``; stride 0 for a tensorwise scale), or reduced from the operand's
    (NPART, n) partial amaxes (inline quantization); 0 past ``n``."""
    if Q_MAX > 0:
        s = amax_to_scale(reduce_partials(ptr, idx, n, NPART), Q_MAX, SOFT_ROUND)
    else:
        s = tl.load(ptr + idx * stride, mask=idx < n, other=0.0)
    return s


@triton.jit
def _cast_tile(x, scale, Q_MAX: tl.constexpr, Q_MANT: tl.constexpr, Q_MIN_EXP: tl.constexpr,
               SOFT_ROUND: tl.constexpr, X16: tl.constexpr):
    """A loaded float tile as the quantizers would store it: e4m3 (3 mantissa bits) or
    e5m2, with the exact scale-and-cast of :func:`~loka.kernels.triton.common.scale_and_clamp`
    up to the sign of a zero. On the GPU the clamp to ``±Q_MAX`` is left to the cast, which
    saturates (``cvt.rn.satfinite``: a quotient past the format's max, which only rounding
    makes, becomes the max, NaN stays NaN), and a zero keeps no sign: neither changes a
    product sum, and the two cost three of the dozen instructions per element this GEMM
    spends on casting."""
    if SOFT_ROUND:
        y = scale_and_clamp(x.to(tl.float32), scale, Q_MAX, Q_MANT, Q_MIN_EXP, SOFT_ROUND)
    else:
        y = unsigned_zero_quotient(x.to(tl.float32), scale, X16)
    if Q_MANT == 3:
        q = y.to(tl.float8e4nv)
    else:
        q = y.to(tl.float8e5)
    return q


@triton.jit
def _add_block_sums(ss_ptr, sq, rows, row_ok, pid_n, N, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """Add a tile's row sums of ``sq`` (BLOCK_M, BLOCK_N) into the NORM_BLOCK-column blocks
    they belong to: one block per tile when BLOCK_N <= NORM_BLOCK (both powers of two, so a
    tile never straddles two), else BLOCK_N // NORM_BLOCK blocks per tile."""
    nblk = tl.cdiv(N, NORM_BLOCK)
    r64 = rows.to(tl.int64)
    if BLOCK_N <= NORM_BLOCK:
        blk = (pid_n * BLOCK_N) // NORM_BLOCK
        tl.atomic_add(ss_ptr + r64 * nblk + blk, tl.sum(sq, 1), mask=row_ok & (blk < nblk))
    else:
        per: tl.constexpr = BLOCK_N // NORM_BLOCK
        part = tl.sum(tl.reshape(sq, (BLOCK_M, per, NORM_BLOCK)), 2)
        blk = pid_n * per + tl.arange(0, per)
        tl.atomic_add(ss_ptr + r64[:, None] * nblk + blk[None, :], part,
                      mask=row_ok[:, None] & (blk < nblk)[None, :])


def _scale_stride(scale: torch.Tensor, length: int, name: str, axis: int) -> int:
    """Stride of a (length,)-indexed scale vector; 0 for a tensorwise (single) scale."""
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    if scale.numel() == 1:
        return 0
    want = (length, 1) if axis == 0 else (1, length)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name} must have shape {want} or (1, 1), got {tuple(scale.shape)}")
    return scale.stride(axis)


def gemm_rowwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                 activation: Optional[str] = None, out_dtype: torch.dtype = torch.bfloat16,
                 fp8_out: Optional[str] = None, fast_accum: bool = False,
                 norm_stats: Optional[int] = None,
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """``act((a @ b) * scale_a * scale_b + bias)``.

    Args:
        a: (M, K) float8_e4m3fn/e5m2, K contiguous preferred.
        b: (K, N) FP8, column-major (K contiguous) preferred.
        scale_a: (M, 1) or (1, 1) float32 dequantization scales of ``a``.
        scale_b: (1, N) or (1, 1) float32 dequantization scales of ``b``.
        bias: optional (N,) added in float32.
        activation: None / 'identity' or 'hardswish'.
        out_dtype: bf16, fp16 or fp32 output (ignored with ``fp8_out``).
        fp8_out: 'e4m3'/'e5m2': return the output quantized rowwise instead. For N up to
            :data:`MAX_FP8_OUT_N` the epilogue quantizes; wider outputs go through bf16 and
            :func:`~loka.kernels.triton.quantize.quantize_rowwise` (two kernels).
        fast_accum: never promote the FP8 accumulator to float32 (faster, less accurate).
        norm_stats: a BlockNorm block size (a power of two): also return the float32 mean
            square (M, ceil(N / norm_stats)) of each row's blocks of the output, as stored
            (with ``fp8_out``: of the bf16 output that is quantized); the last block may be
            shorter and is averaged over its own length.

    Returns:
        (M, N) in ``out_dtype``; with ``fp8_out``: (q (M, N) FP8, scale (M, 1) float32);
        with ``norm_stats`` the mean squares are appended to either.
    """
    m, k, n = check_gemm_operands(a, b)
    if norm_stats is not None and (not isinstance(norm_stats, int) or norm_stats < 1
                                   or norm_stats & (norm_stats - 1)):
        raise ValueError(f"norm_stats must be a BlockNorm block size that is a power of two, "
                         f"got {norm_stats!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(map(str, ACTIVATIONS))}, got {activation!r}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    if fp8_out is not None and n > MAX_FP8_OUT_N:
        y = gemm_rowwise(a, b, scale_a, scale_b, bias=bias, activation=activation,
                         out_dtype=torch.bfloat16, fast_accum=fast_accum, norm_stats=norm_stats)
        if norm_stats is None:
            return quantize_rowwise(y, fp8_out)
        y, ms = y
        return (*quantize_rowwise(y, fp8_out), ms)
    sa_stride = _scale_stride(scale_a, m, "scale_a", 0)
    sb_stride = _scale_stride(scale_b, n, "scale_b", 1)
    meta = fp8_meta(fp8_out or "e4m3")
    if m == 0 or n == 0 or k == 0:
        if k == 0 and m and n:
            raise ValueError("FP8 GEMM with K = 0 is undefined")
        c = torch.empty((m, n), dtype=get_format(fp8_out).dtype if fp8_out else out_dtype,
                        device=a.device)
        out = (c, torch.empty((m, 1), device=a.device)) if fp8_out is not None else (c,)
        if norm_stats is not None:
            out += (torch.empty((m, triton.cdiv(n, norm_stats)), device=a.device),)
        return out if len(out) > 1 else c
    fused = (bias is not None or activation not in (None, "identity") or fp8_out
             or norm_stats is not None)  # an epilogue needs the whole sum: no K split
    split, k_split = (1, k) if fused else k_ranges(m, n, k, unit=SPLIT_K_UNIT)
    if fp8_out is not None:
        c = torch.empty((m, n), dtype=get_format(fp8_out).dtype, device=a.device)
        cs = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    elif split > 1:  # float32 partial sums, added below
        c = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        cs = c
    else:
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        cs = placeholder(c)
    nblk = triton.cdiv(n, norm_stats) if norm_stats is not None else 0
    ss = torch.zeros((m, nblk), dtype=torch.float32, device=a.device) if nblk else placeholder(c)
    grid = lambda meta_: (triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]), split)  # noqa: E731
    launch(rowwise_gemm_kernel)[grid](
        a, b, c, scale_a, scale_b, bias if bias is not None else placeholder(scale_a), cs, ss,
        m, n, k, k_split, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        c.stride(0) if split > 1 else 0, c.stride(-2), c.stride(-1), sa_stride, sb_stride, 0, 0,
        HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation], NORM_BLOCK=norm_stats or 0,
        FP8_OUT=fp8_out is not None, FAST_ACC=fast_accum, **meta, **_NO_INLINE)
    out = (c, cs) if fp8_out is not None else (c.sum(0).to(out_dtype) if split > 1 else c,)
    if norm_stats is not None:  # sums of squares -> mean squares (the last block shorter)
        lengths = (n - torch.arange(nblk, device=a.device) * norm_stats).clamp(max=norm_stats)
        out += (ss / lengths.to(torch.float32),)
    return out if len(out) > 1 else out[0]


def split_k(m: int, n: int, k: int, tile: int = 128, unit: Optional[int] = None) -> int:
    """K splits for GEMMs with few output tiles and a long K (the wgrad of a Linear over a
    large batch: M, N of 32-64, K of a million): enough programs for two waves of SMs,
    counting (tile, tile) output tiles, each split at least ``unit`` long; none below
    ``8 * unit`` (``unit`` defaults to :data:`SPLIT_K_UNIT`, read at the call)."""
    unit = SPLIT_K_UNIT if unit is None else unit
    tiles = triton.cdiv(m, tile) * triton.cdiv(n, tile)
    if tiles >= 66 or k < 8 * unit:
        return 1
    return max(1, min(triton.cdiv(k, unit), triton.cdiv(264, tiles)))


def k_ranges(m: int, n: int, k: int, tile: int = 128, unit: Optional[int] = None
             ) -> Tuple[int, int]:
    """``(splits, k_split)``: :func:`split_k`'s count rounded to K ranges that are whole
    multiples of ``unit`` (so of every BLOCK_K), and the number of such ranges K needs."""
    unit = SPLIT_K_UNIT if unit is None else unit
    split = split_k(m, n, k, tile, unit)
    if split == 1:
        return 1, k
    k_split = triton.cdiv(triton.cdiv(k, split), unit) * unit
    return triton.cdiv(k, k_split), k_split


def inline_transposed(m: int, n: int) -> bool:
    """Whether :func:`gemm_rowwise_inline` runs an (M, N) product as ``cᵀ = bᵀ aᵀ``: when
    M is under 64 and N is larger, since the Hopper MMA's tiles are 64 rows tall and an M
    under 64 would be loaded, and cast, 64 / M times over."""
    return m < min(n, 64)


def gemm_rowwise_inline(a: torch.Tensor, b: torch.Tensor, a_fmt="e4m3", b_fmt="e4m3", *,
                        scale_a: Optional[torch.Tensor] = None,
                        scale_b: Optional[torch.Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16,
                        fast_accum: bool = False) -> torch.Tensor:
    """Rowwise FP8 GEMM that quantizes its float operands in its own loads.

    The same result as quantizing with :func:`~loka.kernels.triton.quantize.quantize_rowwise`
    (``a`` per row, ``b`` per column) and calling :func:`gemm_rowwise` (identical FP8 values
    and scales; only the float32 summation order may differ), but the FP8 copies are never
    written: a float operand costs one amax pass (partials per column span) and the GEMM
    reads it in its float format. The cast tiles are multiplied on the fp16 tensor cores
    (e4m3 and e5m2 values are exact in fp16, their products in float32, and the sum is
    float32: the numerics of the FP8 GEMM with float32 accumulation, whatever
    ``fast_accum`` says), which read operands of either layout; the FP8 MMA would need both
    K-major, and the operands of a weight gradient (``dyᵀ``, ``x``) are not. This pays where quantization, not the GEMM, dominates: a
    Linear's weight gradient over a large batch (M, N of 32-64, K of a million) or any GEMM
    with few output tiles; the K range is split to fill the GPU. Where each tile of an
    operand is loaded by many programs it is also cast many times: the Probe times it.

    Args:
        a: (M, K) float (quantized here) or FP8 with ``scale_a`` (M, 1) or (1, 1).
        b: (K, N) float (quantized per column here) or FP8 with ``scale_b`` (1, N) or (1, 1).
        a_fmt, b_fmt: 'e4m3' or 'e5m2' for a float operand (ignored for an FP8 one).
        out_dtype: bf16, fp16 or fp32.
        fast_accum: never promote the FP8 accumulator to float32 (only when both operands
            arrive in FP8; an inline cast accumulates in float32).

    Returns:
        (M, N) in ``out_dtype``.
    """
    metas = []
    for name, t, scale, fmt in (("a", a, scale_a, a_fmt), ("b", b, scale_b, b_fmt)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if scale is None:
                raise ValueError(f"an FP8 {name} needs its scale_{name}")
            metas.append(_AS_IS)
        else:
            check_float_input(t, name)
            if scale is not None:
                raise ValueError(f"{name} is {t.dtype}, quantized here: pass no scale_{name}")
            metas.append(fp8_meta(fmt))
    qa, qb = metas
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"GEMM shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if k == 0:
        raise ValueError("FP8 GEMM with K = 0 is undefined")
    # a float operand's scales come from its partial amaxes (rows of a, rows of bᵀ)
    ops = []  # per operand: (tensor, scales or partials, scale stride, partials, format)
    for name, t, scale, meta, length, axis, rows in (("a", a, scale_a, qa, m, 0, a),
                                                      ("b", b, scale_b, qb, n, 1, b.t())):
        if meta is _AS_IS:
            ops.append((t, scale, _scale_stride(scale, length, f"scale_{name}", axis), 0, meta))
        else:
            partial = amax_partials(rows)[0]
            ops.append((t, partial, 0, partial.shape[0], meta))
    split, k_split = k_ranges(m, n, k, tile=64, unit=INLINE_SPLIT_UNIT)
    c = torch.empty((split, m, n) if split > 1 else (m, n),
                    dtype=torch.float32 if split > 1 else out_dtype, device=a.device)
    stride_cm, stride_cn = c.stride(-2), c.stride(-1)
    if inline_transposed(m, n):  # cᵀ = bᵀ aᵀ: the wider N fills the MMA's 64-row tiles
        (ta, pa, sa_stride, npart_a, qa), (tb, pb, sb_stride, npart_b, qb) = ops[1], ops[0]
        ta, tb, m_, n_ = ta.t(), tb.t(), n, m
        stride_cm, stride_cn = stride_cn, stride_cm
    else:
        (ta, pa, sa_stride, npart_a, qa), (tb, pb, sb_stride, npart_b, qb) = ops
        m_, n_ = m, n
    grid = lambda meta_: (triton.cdiv(m_, meta_["BLOCK_M"]) * triton.cdiv(n_, meta_["BLOCK_N"]), split)  # noqa: E731
    inline = {"QA_MAX": qa["FMT_MAX"], "QA_MANT": qa["MANT_BITS"], "QA_MIN_EXP": qa["MIN_EXP"],
              "QB_MAX": qb["FMT_MAX"], "QB_MANT": qb["MANT_BITS"], "QB_MIN_EXP": qb["MIN_EXP"]}
    launch(rowwise_gemm_kernel)[grid](
        ta, tb, c, pa, pb, placeholder(pa), placeholder(c), placeholder(c), m_, n_, k, k_split,
        ta.stride(0), ta.stride(1),
        tb.stride(0), tb.stride(1), c.stride(0) if split > 1 else 0, stride_cm, stride_cn,
        sa_stride, sb_stride, npart_a, npart_b,
        HAS_BIAS=False, ACT=0, NORM_BLOCK=0, FP8_OUT=False, FAST_ACC=fast_accum,
        **fp8_meta("e4m3"), **inline)
    return c.sum(0).to(out_dtype) if split > 1 else c


def reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              *, bias=None, activation=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """float32 reference of :func:`gemm_rowwise` (without ``fp8_out``)."""
    y = (a.float() @ b.float()) * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    if activation == "hardswish":
        y = torch.nn.functional.hardswish(y)
    return y.to(out_dtype)
