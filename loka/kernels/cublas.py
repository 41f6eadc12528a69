"""cuBLAS (and the CPU build's) FP8 GEMMs through ``torch._scaled_mm``.

Quantization is plain PyTorch (the recipe's), so under ``torch.compile`` Inductor fuses
it into the op that produces the operand; only the GEMM itself is a library call.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import GRAD_ROLES, Role
from ..numerics import Granularity, QTensor, get_format
from . import capabilities as caps
from . import ops
from .recipes import Recipe, check_gemm_operands
from .registry import YES, Capability, Kernel, register


# bound once, so that traced code (the GEMM call, and the serving path of
# :func:`_make_static_gemm`) reads no attribute of the ``torch`` module: Dynamo checks, per
# call of a compiled step, that every module's ``torch`` it read is the caller's (one
# Python-level check each)
_torch_scaled_mm = torch._scaled_mm
_is_compiling = torch.compiler.is_compiling
_F32, _F64 = torch.float32, torch.float64


def col_major(t: torch.Tensor) -> torch.Tensor:
    """``_scaled_mm`` wants its second operand column-major; a free view when it is."""
    return t if t.stride(0) == 1 else t.t().contiguous().t()


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``_scaled_mm`` wants its first operand row-major with its row stride equal to its
    width, also for one row (``is_contiguous`` accepts any stride along a size-1 dimension,
    e.g. the transpose of an (M, 1) column); a free view when it is."""
    if t.stride(-1) == 1 and t.stride(0) == max(t.shape[1], 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _k_blocks_in_fours(scale: torch.Tensor) -> torch.Tensor:
    """The weight's (K/128, N/128) blockwise scales as ``F.scaled_mm`` reads them: stored
    column-major with the K-blocks padded to a multiple of four (``L4``, torch's own
    check; torch 2.11 on an H100 refused K = 256, "scale_b must have shape 4 x 1"). The
    padding rows are never read."""
    kb, nb = scale.shape
    l4 = -(-kb // 4) * 4
    if l4 == kb:
        return scale.t().contiguous().t()
    padded = scale.new_ones((nb, l4))
    padded[:, :kb] = scale.t()
    return padded.t()


def _scaled_mm(qa: QTensor, qb: QTensor, out_dtype: torch.dtype, fast_accum: bool,
               scaling: "Granularity | str") -> torch.Tensor:
    # ``scaling`` compared by value: traced code that reached one enum member by two paths
    # (a kernel's closure, this module's ``Granularity``) would be checked per call that
    # both are one object
    a = row_major(qa.data)
    b = col_major(qb.data)
    if scaling == "blockwise":
        import torch.nn.functional as F

        # 1x128 scales must be outer-dim-major, (M, K/128) stored column-major, and the
        # weight's 128x128 scales K-major, (K/128, N/128) stored column-major too (torch
        # 2.11 on an H100 refuses row-major ones: "scale_b must have strides (1, K/128)")
        sa = qa.scale.t().contiguous().t()
        sb = _k_blocks_in_fours(qb.scale)
        return F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb,
                           F.ScalingType.BlockWise128x128, output_dtype=out_dtype,
                           use_fast_accum=fast_accum)
    return _gemm(a, b, qa.scale, qb.scale, out_dtype, fast_accum, scaling)


def _gemm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
          out_dtype: torch.dtype, fast_accum: bool, scaling: str) -> torch.Tensor:
    """The tensorwise or rowwise call on FP8 ``a`` (row-major) and ``b`` (column-major)
    with their dequantization scales."""
    if scaling == "tensorwise":
        sa, sb = sa.reshape(()), sb.reshape(())
    else:  # rowwise scales must be contiguous: a static scale broadcast over rows is not
        sa, sb = sa.contiguous(), sb.contiguous()
    if _is_compiling() and ops.scaled_mm_lowered():
        # the same call; its operands' layouts made once per graph (loka.kernels.ops)
        return ops.scaled_mm_op(a, b, sa, sb, out_dtype, fast_accum)
    return _torch_scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _lib_dtype(gemm_out_dtype: Optional[torch.dtype], out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the library returns: the kernel's forced one, else the caller's (float32
    for float64, which cuBLAS does not return)."""
    return gemm_out_dtype or (out_dtype if out_dtype != _F64 else _F32)


def _make_static_gemm(scaling: str, a_format: str, fast_accum: bool,
                      gemm_out_dtype: Optional[torch.dtype]):
    """The kernel's :attr:`~loka.kernels.registry.Kernel.static_gemm` (tensorwise and
    rowwise): ``quantize(x2d, scale=table[...])`` then ``fn``, as the same tensor ops
    (``loka.Linear``'s general path is the reference, bit for bit), with the kernel's
    constants held as plain values."""
    fmt = get_format(a_format)
    fmax, fp8 = float(fmt.max), fmt.dtype

    def static_gemm(x2d, w, table, w_scale, out_dtype):
        m = x2d.shape[0]
        # rowwise: (M, 1) row scales, a slice of the table or its first row broadcast (as
        # loka.Linear._quantize_input: always for a row count traced as a symbol)
        sa = (table.reshape(()) if scaling == "tensorwise" else
              table[:m] if not isinstance(m, torch.SymInt) and m <= table.shape[0]
              else table[:1].expand(m, 1))
        # row-major as cuBLAS needs it (a view of a transpose casts column-major)
        a = row_major((x2d.float() / sa).clamp(-fmax, fmax).to(fp8))
        y = _gemm(a, col_major(w), sa, w_scale, _lib_dtype(gemm_out_dtype, out_dtype),
                  fast_accum, scaling)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    return static_gemm


def make_scaled_mm_kernel(name: str, recipe: Recipe, *, fast_accum: bool = False,
                          roles=None, gemm_out_dtype=None, description: str = "",
                          quantizes_as: Optional[str] = None) -> Kernel:
    """A ``torch._scaled_mm`` kernel. ``gemm_out_dtype`` forces the library's output
    dtype (rowwise and blockwise produce bf16 only); the result is cast to the caller's."""
    scaling = recipe.scaling
    scaling_name = str(scaling)  # a plain string: the enum is read through the recipe

    def fn(a, b, out_dtype):
        check_gemm_operands(a, b, out_dtype)
        qa, qb = recipe.operands(a, b)
        out = _scaled_mm(qa, qb, _lib_dtype(gemm_out_dtype, out_dtype), fast_accum,
                         scaling_name)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    fn.__name__ = name.replace("-", "_")
    probe_out = gemm_out_dtype or torch.bfloat16
    a_dtype = torch.float8_e5m2 if recipe.a_format == "e5m2" else torch.float8_e4m3fn

    def requires(device: torch.device) -> Capability:
        if fast_accum and device.type != "cuda":
            return Capability(False, "fast accumulation exists on CUDA tensor cores only")
        if not caps.has_scaled_mm(device, str(scaling), a_dtype, torch.float8_e4m3fn, probe_out):
            return Capability(False, f"this torch build has no {scaling} _scaled_mm for "
                                     f"{recipe.a_format}x{recipe.b_format} on {device.type}")
        return YES

    align = 128 if scaling is Granularity.BLOCKWISE else 16
    return Kernel(
        name=name, fn=fn, library="cublas", formats=recipe.formats, scaling=str(scaling),
        roles=frozenset(roles) if roles else frozenset(Role), devices=("cpu", "cuda"),
        min_capability=(8, 9), vendor="any", align=align, requires=requires,
        quantize_a=recipe.quantize_a, quantize_b=recipe.quantize_b, fast_accum=fast_accum,
        quantizes_as=quantizes_as,
        static_gemm=(None if scaling is Granularity.BLOCKWISE else
                     _make_static_gemm(scaling_name, recipe.a_format, fast_accum,
                                       gemm_out_dtype)),
        description=description or f"torch._scaled_mm {scaling} {recipe.a_format}x{recipe.b_format}"
                                   + (" fast-accum" if fast_accum else ""),
    )


TW, RW, BW = Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE
for _name, _recipe, _fast, _roles, _out in (
    ("cublas-tensorwise", Recipe(TW), False, None, None),
    ("cublas-tensorwise-fastacc", Recipe(TW), True, None, None),
    ("cublas-tensorwise-e5m2", Recipe(TW, "e5m2", "e4m3"), False, GRAD_ROLES, None),
    ("cublas-rowwise", Recipe(RW), False, None, torch.bfloat16),
    ("cublas-rowwise-fastacc", Recipe(RW), True, None, torch.bfloat16),
    ("cublas-rowwise-e5m2", Recipe(RW, "e5m2", "e4m3"), False, GRAD_ROLES, torch.bfloat16),
    ("cublas-blockwise", Recipe(BW), False, None, torch.bfloat16),
):
    # a fast-accumulation kernel quantizes as its twin without it does
    register(make_scaled_mm_kernel(_name, _recipe, fast_accum=_fast, roles=_roles,
                                   gemm_out_dtype=_out,
                                   quantizes_as=_name[:-len("-fastacc")] if _fast else None))
