"""FP8 quantization kernels: rowwise, colwise (transposed), tensorwise and blockwise.

Each kernel takes the amax and casts in as few passes over the input as the granularity
allows, and matches :func:`loka.numerics.quantize` bit for bit (same float32 scales, same
FP8 values):

* rowwise, rows of up to ``MAX_ROW`` contiguous elements: **one pass**, one program per
  ``BLOCK_R`` rows holds its rows in registers (amax, scale and cast fused);
* rowwise of long rows or of a transposed view (the wgrad operands ``dyᵀ`` and ``xᵀ``,
  "colwise along M"): **two stages** over ``NSPLIT`` column spans, stage 1 writes a
  per-(span, row) partial amax, stage 2 reduces the partials of its rows and casts, writing
  the row-major (transposed) output;
* tensorwise: **two stages**, a persistent stage 1 writes one partial amax per program,
  stage 2 reduces the partials (a few hundred floats) and casts;
* blockwise (1x128 and 128x128 blocks, as in DeepGEMM): one pass, a block per tile.

Inputs are any 2-D float32/bf16/fp16 view (arbitrary strides); outputs are fresh tensors.
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from ...numerics import BLOCK, get_format, quantize as _reference_quantize
from .common import (abs_amax, amax_to_scale, autotune, launch, check_float_input, fp8_meta, nan_max,
                     next_pow2, scale_and_clamp)

MAX_ROW = 16384
"""longest contiguous row quantized in one pass (BLOCK_R x MAX_ROW values in registers)"""
_PARTS_CHUNK = tl.constexpr(32)
"""partial amaxes per row that stage 2 of the two-stage path loads at once"""
_TARGET_PROGRAMS = 528
"""programs the two-stage rowwise path aims for: four waves of an H100/H200 (132 SMs), so
that enough loads are in flight on every SM (two waves left the transposed dgrad and wgrad
operands of the Wukong MLPs at 32-128 programs, see :func:`split_plan`)"""


# -- rowwise, one pass ------------------------------------------------------------------

def _prune_rows(configs, named_args, **kwargs):
    # Keep the tile between 2K and 16K values: enough bytes in flight, no register spill.
    c = kwargs["BLOCK_C"]
    fits = [cfg for cfg in configs if cfg.kwargs["BLOCK_R"] <= max(1, next_pow2(named_args["R"]))
            and cfg.kwargs["BLOCK_R"] * c <= 16384]
    keep = [cfg for cfg in fits if cfg.kwargs["BLOCK_R"] * c >= 2048]
    # short rows: no config reaches 2K values per tile, take the tallest that fits
    return keep or [max(fits, key=lambda cfg: cfg.kwargs["BLOCK_R"])] if fits else []


@autotune(configs=[triton.Config({"BLOCK_R": r}, num_warps=w)
                   for r in (1, 2, 4, 8, 16, 32, 64) for w in (4, 8)],
          key=["R", "C"], prune=_prune_rows)
@triton.jit
def rowwise_quant_kernel(x_ptr, q_ptr, scale_ptr, R, C, stride_xr, stride_xc,
                         FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                         SOFT_ROUND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """One pass: rows ``[pid*BLOCK_R, +BLOCK_R)`` of x (R, C) -> q (R, C) row-major, scale (R,)."""
    _quantize_rows(x_ptr, q_ptr, scale_ptr, R, C, stride_xr, stride_xc, FMT_MAX, MANT_BITS,
                   MIN_EXP, SOFT_ROUND, BLOCK_C, BLOCK_R)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, scale_ptr, R, C, stride_xr, stride_xc, FMT_MAX: tl.constexpr,
                   MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """The program's rows of x quantized and stored."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = amax_to_scale(abs_amax(x, 1), FMT_MAX, SOFT_ROUND)
    y = scale_and_clamp(x, scale[:, None], FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND,
                        x_ptr.dtype.element_ty != tl.float32)
    tl.store(q_ptr + r64 * C + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < R)


# -- rowwise, two stages (long rows, transposed views) ----------------------------------

# Two families of tiles: wide ones for row-major views (contiguous along C) and tall ones
# for transposed views (contiguous along R, so a tile must be tall to coalesce there). The
# large 8-warp tiles keep 32 KB of loads in flight per program: a long K range split over
# only a few hundred programs (the FM projection's wgrad operands, 32-64 rows of 2**20)
# is otherwise bound by load latency, not bandwidth.
_ROW_TILES = ((32, 128, 4), (16, 256, 4), (8, 512, 4), (4, 1024, 4), (32, 512, 8), (16, 1024, 8))
_TALL_TILES = ((128, 32, 4), (64, 64, 4), (32, 64, 4), (16, 64, 4), (32, 256, 4), (64, 256, 8),
               (128, 128, 8))
_SPLIT_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                  for r, c, w in _ROW_TILES + _TALL_TILES]
_SPAN_UNIT = {False: 1024, True: 64}
"""column spans of the two-stage path are multiples of this, keyed on "transposed" (the
kernels mask each span's own end, so a tile need not divide it)"""


def _family(cfg: triton.Config) -> bool:
    """Whether a split config is of the row-major family (else the tall one)."""
    return (cfg.kwargs["BLOCK_R"], cfg.kwargs["BLOCK_C"], cfg.num_warps) in _ROW_TILES


def _prune_split(configs, named_args, **kwargs):
    # Only the view's own tile family (BLOCK_C >= 128 exactly for row-major views), and
    # never taller or wider than the tensor; if nothing fits, the family's shortest tile.
    row_major = named_args["stride_xc"] == 1
    r, c = named_args["R"], named_args["C"]
    family = [cfg for cfg in configs if _family(cfg) == row_major]
    keep = [cfg for cfg in family if cfg.kwargs["BLOCK_R"] <= max(4, next_pow2(r))
            and cfg.kwargs["BLOCK_C"] <= max(32, next_pow2(c))]
    return keep or [min(family, key=lambda cfg: cfg.kwargs["BLOCK_R"])]


def split_plan(r: int, c: int, transposed: bool) -> Tuple[int, int]:
    """(nsplit, span) of the two-stage rowwise path for an (r, c) view: the column spans
    each program covers, so that ``ceil(r / 64) * nsplit`` reaches about
    ``_TARGET_PROGRAMS`` where the rows allow it (at most 256 spans)."""
    unit = _SPAN_UNIT[transposed]
    row_blocks = triton.cdiv(r, 64)
    nsplit = max(1, min(256, triton.cdiv(c, unit), triton.cdiv(_TARGET_PROGRAMS, row_blocks)))
    span = triton.cdiv(triton.cdiv(c, nsplit), unit) * unit
    return triton.cdiv(c, span), span


@autotune(configs=_SPLIT_CONFIGS, key=["R", "C", "stride_xc"], prune=_prune_split)
@triton.jit
def rowwise_amax_split_kernel(x_ptr, partial_ptr, R, C, stride_xr, stride_xc, SPAN,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stage 1: partial[s, r] = amax of x[r, s*SPAN : (s+1)*SPAN]."""
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows[:, None].to(tl.int64)
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    c0 = pid_s * SPAN
    c_end = tl.minimum(C, c0 + SPAN)  # a tile that overhangs the span reads none of the next
    for off in range(0, c_end - c0, BLOCK_C):
        cols = c0 + off + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < c_end)
        x = tl.load(x_ptr + r64 * stride_xr + cols[None, :].to(tl.int64) * stride_xc,
                    mask=mask, other=0.0)
        amax = nan_max(amax, abs_amax(x.to(tl.float32), 1))
    tl.store(partial_ptr + pid_s * R + rows, amax, mask=rows < R)


@triton.jit
def reduce_partials(partial_ptr, rows, R, NSPLIT):
    """The amax of each of ``rows`` from stage 1's (NSPLIT, R) partials, read
    ``_PARTS_CHUNK`` spans at a time (a register tile that does not grow with NSPLIT);
    0 for rows at or past R."""
    amax = tl.zeros(rows.shape, dtype=tl.float32)
    for s0 in range(0, NSPLIT, _PARTS_CHUNK):
        splits = s0 + tl.arange(0, _PARTS_CHUNK)
        p = tl.load(partial_ptr + splits[:, None] * R + rows[None, :],
                    mask=(splits[:, None] < NSPLIT) & (rows[None, :] < R), other=0.0)
        amax = nan_max(amax, abs_amax(p, 0))
    return amax


@autotune(configs=_SPLIT_CONFIGS, key=["R", "C", "stride_xc"], prune=_prune_split)
@triton.jit
def rowwise_cast_split_kernel(x_ptr, q_ptr, scale_ptr, partial_ptr, R, C, stride_xr, stride_xc,
                              SPAN, NSPLIT, FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                              MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stage 2: reduce the partials of BLOCK_R rows, then cast their span; q row-major."""
    pid_r, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    scale = amax_to_scale(reduce_partials(partial_ptr, rows, R, NSPLIT), FMT_MAX, SOFT_ROUND)
    tl.store(scale_ptr + rows, scale, mask=(rows < R) & (pid_s == 0))
    r64 = rows[:, None].to(tl.int64)
    c0 = pid_s * SPAN
    c_end = tl.minimum(C, c0 + SPAN)
    for off in range(0, c_end - c0, BLOCK_C):
        cols = c0 + off + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < c_end)
        x = tl.load(x_ptr + r64 * stride_xr + cols[None, :].to(tl.int64) * stride_xc,
                    mask=mask, other=0.0).to(tl.float32)
        y = scale_and_clamp(x, scale[:, None], FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND,
                            x_ptr.dtype.element_ty != tl.float32)
        tl.store(q_ptr + r64 * C + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)


# -- tensorwise, two stages -------------------------------------------------------------

_TILE_CONFIGS = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
                 for r, c, w in ((8, 512, 4), (4, 1024, 8), (32, 128, 4), (64, 64, 4),
                                 (128, 32, 4))]


@autotune(configs=_TILE_CONFIGS, key=["R", "C", "stride_xc"], prune=_prune_split)
@triton.jit
def tensor_amax_kernel(x_ptr, partial_ptr, R, C, stride_xr, stride_xc,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stage 1 (persistent): partial[pid] = amax over the tiles pid, pid + P, pid + 2P, ..."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    n_c = tl.cdiv(C, BLOCK_C)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for t in range(pid, tl.cdiv(R, BLOCK_R) * n_c, nprog):
        rows = (t // n_c) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (t % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr
                    + cols[None, :].to(tl.int64) * stride_xc, mask=mask, other=0.0)
        acc = nan_max(acc, tl.abs(x.to(tl.float32)))
    tl.store(partial_ptr + pid, abs_amax(abs_amax(acc, 1), 0))


@autotune(configs=_TILE_CONFIGS, key=["R", "C", "stride_xc"], prune=_prune_split)
@triton.jit
def tensor_cast_kernel(x_ptr, q_ptr, scale_ptr, partial_ptr, NPART, R, C, stride_xr, stride_xc,
                       stride_qr, stride_qc, FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                       MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                       NPART_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Stage 2 (persistent): every program reduces the NPART partials, then casts its tiles."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    parts = tl.arange(0, NPART_P2)
    p = tl.load(partial_ptr + parts, mask=parts < NPART, other=0.0)
    scale = amax_to_scale(abs_amax(p, 0), FMT_MAX, SOFT_ROUND)
    tl.store(scale_ptr, scale, mask=pid == 0)
    n_c = tl.cdiv(C, BLOCK_C)
    for t in range(pid, tl.cdiv(R, BLOCK_R) * n_c, nprog):
        rows = (t // n_c) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (t % n_c) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        r64, c64 = rows[:, None].to(tl.int64), cols[None, :].to(tl.int64)
        x = tl.load(x_ptr + r64 * stride_xr + c64 * stride_xc, mask=mask, other=0.0)
        y = scale_and_clamp(x.to(tl.float32), scale, FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND,
                            x_ptr.dtype.element_ty != tl.float32)
        tl.store(q_ptr + r64 * stride_qr + c64 * stride_qc, y.to(q_ptr.dtype.element_ty),
                 mask=mask)


# -- blockwise (1x128 and 128x128) ------------------------------------------------------

def _prune_block(configs, named_args, **kwargs):
    want = kwargs["SCALE_ROWS"]
    col_contig = named_args["stride_xc"] == 1
    keep = []
    for cfg in configs:
        r = cfg.kwargs["BLOCK_R"]
        if want == 128 and r != 128:
            continue
        if want == 1 and (col_contig and r > 32 or not col_contig and r < 32):
            continue  # transposed views want tall tiles
        keep.append(cfg)
    return keep


@autotune(configs=[triton.Config({"BLOCK_R": r}, num_warps=w)
                   for r, w in ((4, 4), (8, 4), (32, 4), (64, 4), (128, 8))],
          key=["R", "C", "stride_xc", "SCALE_ROWS"], prune=_prune_block)
@triton.jit
def block_quant_kernel(x_ptr, q_ptr, scale_ptr, R, C, stride_xr, stride_xc, stride_qr, stride_qc,
                       stride_sr, stride_sc, FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                       MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                       SCALE_ROWS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """Blocks of (SCALE_ROWS, BLOCK_C): SCALE_ROWS == 1 gives 1x128 (one scale per row and
    128 columns), SCALE_ROWS == BLOCK_R == 128 gives 128x128."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    r64, c64 = rows[:, None].to(tl.int64), cols[None, :].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xr + c64 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    row_amax = abs_amax(x, 1)
    if SCALE_ROWS == 1:
        scale = amax_to_scale(row_amax, FMT_MAX, SOFT_ROUND)
        y = scale_and_clamp(x, scale[:, None], FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND,
                            x_ptr.dtype.element_ty != tl.float32)
        tl.store(scale_ptr + rows * stride_sr + pid_c * stride_sc, scale, mask=rows < R)
    else:
        scale = amax_to_scale(abs_amax(row_amax, 0), FMT_MAX, SOFT_ROUND)
        y = scale_and_clamp(x, scale, FMT_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND,
                            x_ptr.dtype.element_ty != tl.float32)
        tl.store(scale_ptr + pid_r * stride_sr + pid_c * stride_sc, scale)
    tl.store(q_ptr + r64 * stride_qr + c64 * stride_qc, y.to(q_ptr.dtype.element_ty), mask=mask)


# -- wrappers ---------------------------------------------------------------------------

def _empty_out(r: int, c: int, fmt, layout: str, device) -> torch.Tensor:
    """(r, c) FP8 storage, row-major or column-major (a transposed view of (c, r))."""
    dtype = get_format(fmt).dtype
    if layout == "row":
        return torch.empty((r, c), dtype=dtype, device=device)
    if layout == "col":
        return torch.empty((c, r), dtype=dtype, device=device).t()
    raise ValueError(f"layout must be 'row' or 'col', got {layout!r}")


def quantize_rowwise(x: torch.Tensor, fmt="e4m3") -> Tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 quantization of any 2-D view.

    Args:
        x: (R, C) float32/bf16/fp16, any strides (pass ``b.t()`` for a GEMM's ``b``
            operand, ``dy.t()`` for the wgrad ``a`` operand).
        fmt: 'e4m3' or 'e5m2'.

    Returns:
        q (R, C) row-major FP8, scale (R, 1) float32 with ``x ≈ q * scale``.
    """
    check_float_input(x)
    meta = fp8_meta(fmt)
    r, c = x.shape
    q = _empty_out(r, c, fmt, "row", x.device)
    scale = torch.empty((r, 1), dtype=torch.float32, device=x.device)
    if c == 0:
        raise ValueError("rowwise quantization of rows with zero columns is undefined")
    if r == 0:
        return q, scale
    if x.stride(1) == 1 and c <= MAX_ROW:
        grid = lambda meta_: (triton.cdiv(r, meta_["BLOCK_R"]),)  # noqa: E731
        launch(rowwise_quant_kernel)[grid](x, q, scale, r, c, x.stride(0), x.stride(1),
                                           BLOCK_C=next_pow2(c), **meta)
        return q, scale
    # Two stages over NSPLIT column spans, sized to fill the GPU.
    partial, span = amax_partials(x)
    grid = lambda meta_: (triton.cdiv(r, meta_["BLOCK_R"]), partial.shape[0])  # noqa: E731
    launch(rowwise_cast_split_kernel)[grid](x, q, scale, partial, r, c, x.stride(0), x.stride(1), span,
                                            partial.shape[0], **meta)
    return q, scale


def quantize_rowwise_dual(x: torch.Tensor, fmt="e4m3"
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(x)`` and ``quantize_rowwise(x.t())``: the two layouts a Linear's
    rowwise kernels need of one tensor: of its input ``x`` (M, K), the forward's ``a``
    (rowwise over K) and the weight gradient's ``b`` (``xᵀ`` rowwise over M); of the output
    gradient ``dy`` (M, N), the input gradient's ``a`` and the weight gradient's ``a``
    (``dyᵀ``); of the weight, the forward's and the input gradient's ``b``.

    Two calls, three reads of ``x``. A kernel that also folded each column's amax into
    the one-pass rowwise read (two reads) ran at 0.21-0.48 of a copy's rate on an H100, and
    the two calls at 0.67-0.80, at every Wukong shape timed
    (``bench/bench_quantizers.py``), so it was removed.

    Args:
        x: (R, C) float, any strides.
        fmt: 'e4m3' or 'e5m2'.

    Returns:
        q (R, C) row-major FP8, scale (R, 1), qt (C, R) row-major FP8, scale_t (C, 1).
    """
    q, scale = quantize_rowwise(x, fmt)
    qt, scale_t = quantize_rowwise(x.t(), fmt)
    return q, scale, qt, scale_t


def amax_partials(x: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """Stage 1 of the two-stage rowwise path alone: ``(partial, span)``, where
    ``partial[s, r]`` (float32, (nsplit, R) contiguous) is ``amax |x[r, s*span:(s+1)*span]|``
    (NaN if the span holds one). :func:`reduce_partials` turns a row's partials into its
    amax; :func:`~loka.kernels.triton.gemm_rowwise.gemm_rowwise_inline` does so in the
    GEMM's prologue and casts in its loads, so the FP8 copy is never written."""
    check_float_input(x)
    r, c = x.shape
    if r == 0 or c == 0:
        raise ValueError(f"amax of an empty tensor of shape {tuple(x.shape)} is undefined")
    nsplit, span = split_plan(r, c, transposed=x.stride(1) != 1)
    partial = torch.empty((nsplit, r), dtype=torch.float32, device=x.device)
    grid = lambda meta_: (triton.cdiv(r, meta_["BLOCK_R"]), nsplit)  # noqa: E731
    launch(rowwise_amax_split_kernel)[grid](x, partial, r, c, x.stride(0), x.stride(1), span)
    return partial, span


def quantize_colwise(x: torch.Tensor, fmt="e4m3") -> Tuple[torch.Tensor, torch.Tensor]:
    """Scales along M ("colwise") with the transposed output the wgrad GEMM reads.

    Args:
        x: (M, C) float, e.g. ``dy`` (M, N) or the activation ``x`` (M, K).

    Returns:
        qt (C, M) row-major FP8 (the quantized ``xᵀ``), scale (C, 1) float32: one scale
        per column of ``x``, ``x.t() ≈ qt * scale``.
    """
    check_float_input(x)
    return quantize_rowwise(x.t(), fmt)


def quantize_tensorwise(x: torch.Tensor, fmt="e4m3", layout: str = "row"
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise FP8 quantization in two stages (partial amax per program, then cast).

    Args:
        x: (R, C) float, any strides.
        fmt: 'e4m3' or 'e5m2'.
        layout: 'row' (row-major output) or 'col' (column-major: K-major for a ``b`` operand).

    Returns:
        q (R, C) FP8 in ``layout``, scale (1, 1) float32.
    """
    check_float_input(x)
    meta = fp8_meta(fmt)
    r, c = x.shape
    q = _empty_out(r, c, fmt, layout, x.device)
    if x.numel() == 0:
        raise ValueError("tensorwise quantization of an empty tensor is undefined")
    scale = torch.empty((1, 1), dtype=torch.float32, device=x.device)
    nprog = max(1, min(triton.cdiv(x.numel(), 16384), 512))
    partial = torch.empty((nprog,), dtype=torch.float32, device=x.device)
    launch(tensor_amax_kernel)[(nprog,)](x, partial, r, c, x.stride(0), x.stride(1))
    launch(tensor_cast_kernel)[(nprog,)](x, q, scale, partial, nprog, r, c, x.stride(0), x.stride(1),
                                         q.stride(0), q.stride(1), NPART_P2=next_pow2(nprog), **meta)
    return q, scale


def quantize_blockwise(x: torch.Tensor, fmt="e4m3", block: Tuple[int, int] = (1, BLOCK),
                       layout: str = "row") -> Tuple[torch.Tensor, torch.Tensor]:
    """Blockwise FP8 quantization: (1, 128) blocks for activations, (128, 128) for weights.

    Args:
        x: (R, C) float, any strides.
        block: (1, 128) or (128, 128).
        layout: 'row' or 'col' (column-major output, for a K-major ``b`` operand).

    Returns:
        q (R, C) FP8 in ``layout``, scale (ceil(R / block[0]), ceil(C / 128)) float32.
    """
    check_float_input(x)
    if tuple(block) not in ((1, BLOCK), (BLOCK, BLOCK)):
        raise ValueError(f"block must be (1, {BLOCK}) or ({BLOCK}, {BLOCK}), got {tuple(block)}")
    meta = fp8_meta(fmt)
    r, c = x.shape
    q = _empty_out(r, c, fmt, layout, x.device)
    scale = torch.empty((triton.cdiv(r, block[0]), triton.cdiv(c, BLOCK)), dtype=torch.float32,
                        device=x.device)
    if x.numel() == 0:
        return q, scale
    if block[0] == 1:
        grid = lambda meta_: (triton.cdiv(r, meta_["BLOCK_R"]), triton.cdiv(c, BLOCK))  # noqa: E731
    else:
        grid = (triton.cdiv(r, BLOCK), triton.cdiv(c, BLOCK))
    launch(block_quant_kernel)[grid](x, q, scale, r, c, x.stride(0), x.stride(1), q.stride(0),
                                     q.stride(1), scale.stride(0), scale.stride(1),
                                     SCALE_ROWS=block[0], BLOCK_C=BLOCK, **meta)
    return q, scale


def reference(x: torch.Tensor, fmt="e4m3", granularity="rowwise", operand="a"):
    """The PyTorch reference every kernel here reproduces: :func:`loka.numerics.quantize`."""
    return _reference_quantize(x, fmt, granularity, operand)
