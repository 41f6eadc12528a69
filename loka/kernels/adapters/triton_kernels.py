"""Registry entries for LoKA's Triton kernels (:mod:`loka.kernels.triton`).

=========================  ==========================================  ====================
kernel                      quantization (both operands)                GEMM
=========================  ==========================================  ====================
triton-rowwise              Triton, one pass (two stages for wgrad)      Triton rowwise
triton-rowwise-fastacc      same                                         same, fast accum
triton-rowwise-cublas       same                                         ``_scaled_mm`` rowwise
triton-rowwise-cublas-fastacc  same                                      same, fast accum
triton-rowwise-e5m2         same, gradient operand in e5m2 (dgrad/wgrad) Triton rowwise
triton-rowwise-inline       amax pass only; the GEMM casts in its loads  Triton, fp16 MMA
triton-tensorwise           Triton, two-stage amax                       Triton (scalar scales)
triton-tensorwise-cublas    same                                         ``_scaled_mm``
triton-tensorwise-cublas-fastacc  same                                   same, fast accum
triton-blockwise            Triton, 1x128 / 128x128                      Triton blockwise
triton-blockwise-cublas     same                                         ``F.scaled_mm``
=========================  ==========================================  ====================

Their numerics are those of the emulated recipes (``emulated-rowwise-e4m3`` etc.): the
quantizers are bit-exact with :func:`loka.numerics.quantize`, so a QTensor from any
producer of the same format and granularity is accepted as is.

The Triton calls are ``torch.library.triton_op`` ops whose bodies launch the kernels
through ``torch.library.wrap_triton``: ``torch.compile`` traces into them, Inductor sees
each Triton kernel and launches it from the code it generates (no Python-level op
dispatch per call, captured by CUDA graphs), and their fake implementations are the
bodies themselves. In eager mode the wrappers are called directly (an op's dispatch costs
microseconds, which matter at LRM shapes). This module imports without a GPU; its kernels
then report "runs on cuda, not cpu".
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ...config import GRAD_ROLES, Role
from ...numerics import BLOCK, Granularity, QTensor, get_format
from .. import capabilities as caps
from ..cublas import _scaled_mm as _cublas_scaled_mm
from ..ops import ensure_triton_ops, triton_kernel_op
from ..recipes import check_gemm_operands
from ..registry import YES, Capability, Kernel, Operand, register

_GEMM_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _tk():
    """The kernel modules, looked up at call time (they may be reloaded for the interpreter)."""
    from ..triton import gemm_blockwise, gemm_rowwise, quantize

    return quantize, gemm_rowwise, gemm_blockwise


def _op_body():
    """:func:`loka.kernels.triton.common.op_body`, looked up at call time (Triton is optional)."""
    from ..triton import common

    return common.op_body()


# -- the ops (what torch.compile traces into) ----------------------------------------

def _quantize_fake(x, fmt, granularity, layout):
    r, c = x.shape
    dtype = get_format(fmt).dtype
    q = x.new_empty((r, c) if layout == "row" else (c, r), dtype=dtype)
    if granularity == "rowwise":  # one scale per row of x; 'col' returns them as (1, C)
        shape = (r, 1) if layout == "row" else (1, c)
    elif granularity == "tensorwise":
        shape = (1, 1)
    elif granularity == "blockwise_1x128":
        shape = (r, -(-c // BLOCK))
    else:
        shape = (-(-r // BLOCK), -(-c // BLOCK))
    return q, x.new_empty(shape, dtype=torch.float32)


def _gemm_fake(a, b, *args):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=args[-2])


@triton_kernel_op("loka::triton_quantize", _quantize_fake)
def _quantize_op(x: torch.Tensor, fmt: str, granularity: str, layout: str
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns the FP8 *storage* (row-major (R, C) for layout 'row', the contiguous (C, R)
    transpose for 'col') and the scales."""
    with _op_body():
        q, s = _quantize_direct(x, fmt, granularity, layout)
    return (q if layout == "row" else q.t()), s


def _dual_fake(x, fmt):
    r, c = x.shape
    dtype = get_format(fmt).dtype
    return (x.new_empty((r, c), dtype=dtype), x.new_empty((r, 1), dtype=torch.float32),
            x.new_empty((c, r), dtype=dtype), x.new_empty((c, 1), dtype=torch.float32))


@triton_kernel_op("loka::triton_quantize_dual", _dual_fake)
def _quantize_dual_op(x: torch.Tensor, fmt: str
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (R, C), scale (R, 1), qt (C, R), scale_t (C, 1)): x and xᵀ rowwise."""
    with _op_body():
        return _tk()[0].quantize_rowwise_dual(x, fmt)


@triton_kernel_op("loka::triton_gemm", _gemm_fake)
def _gemm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             scaling: str, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    with _op_body():
        return _gemm_direct(a, b, scale_a, scale_b, scaling, out_dtype, fast_accum)


@triton_kernel_op("loka::triton_gemm_inline", _gemm_fake)
def _gemm_inline_op(a: torch.Tensor, b: torch.Tensor, scale_a: Optional[torch.Tensor],
                    scale_b: Optional[torch.Tensor], a_fmt: str, b_fmt: str,
                    out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    with _op_body():
        return _tk()[1].gemm_rowwise_inline(a, b, a_fmt, b_fmt, scale_a=scale_a,
                                            scale_b=scale_b, out_dtype=out_dtype,
                                            fast_accum=fast_accum)


def _quantize_direct(x, fmt, granularity, layout):
    quantize, _, _ = _tk()
    if granularity == "rowwise":
        if layout == "row":
            return quantize.quantize_rowwise(x, fmt)
        q, s = quantize.quantize_rowwise(x.t(), fmt)
        return q.t(), s.reshape(1, -1)  # (1, C) with canonical strides, as the fake
    if granularity == "tensorwise":
        return quantize.quantize_tensorwise(x, fmt, layout)
    if granularity == "blockwise_1x128":
        return quantize.quantize_blockwise(x, fmt, (1, BLOCK), layout)
    if granularity == "blockwise_128x128":
        return quantize.quantize_blockwise(x, fmt, (BLOCK, BLOCK), layout)
    raise ValueError(f"unknown granularity {granularity!r}")


def _gemm_direct(a, b, scale_a, scale_b, scaling, out_dtype, fast_accum):
    _, gemm_rowwise, gemm_blockwise = _tk()
    if scaling == "blockwise":
        return gemm_blockwise.gemm_blockwise(a, b, scale_a, scale_b, out_dtype)
    return gemm_rowwise.gemm_rowwise(a, b, scale_a, scale_b, out_dtype=out_dtype,
                                     fast_accum=fast_accum)


def triton_quantize(x: torch.Tensor, fmt: str, granularity: str, layout: str = "row"
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize through the op when compiling (Inductor then sees the kernels), directly
    otherwise.

    Returns (q (R, C) in ``layout``, scales)."""
    if torch.compiler.is_compiling():
        ensure_triton_ops()
        q, s = torch.ops.loka.triton_quantize(x, fmt, granularity, layout)
        return (q if layout == "row" else q.t()), s
    return _quantize_direct(x, fmt, granularity, layout)


def triton_quantize_dual(x: torch.Tensor, fmt: str
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~loka.kernels.triton.quantize.quantize_rowwise_dual` through the op when
    compiling, directly otherwise."""
    if torch.compiler.is_compiling():
        ensure_triton_ops()
        return torch.ops.loka.triton_quantize_dual(x, fmt)
    return _tk()[0].quantize_rowwise_dual(x, fmt)


def triton_gemm(a, b, scale_a, scale_b, scaling: str, out_dtype: torch.dtype,
                fast_accum: bool = False) -> torch.Tensor:
    if torch.compiler.is_compiling():
        ensure_triton_ops()
        return torch.ops.loka.triton_gemm(a, b, scale_a, scale_b, scaling, out_dtype, fast_accum)
    return _gemm_direct(a, b, scale_a, scale_b, scaling, out_dtype, fast_accum)


def triton_gemm_inline(a: Operand, b: Operand, a_fmt: str, b_fmt: str, out_dtype: torch.dtype,
                       fast_accum: bool = False) -> torch.Tensor:
    """:func:`~loka.kernels.triton.gemm_rowwise.gemm_rowwise_inline` of float or rowwise
    QTensor operands (a QTensor's FP8 data and scales are used as they are)."""
    sa = sb = None
    if isinstance(a, QTensor):
        a, sa = a.data, a.scale
    if isinstance(b, QTensor):
        b, sb = b.data, b.scale
    if torch.compiler.is_compiling():
        ensure_triton_ops()
        return torch.ops.loka.triton_gemm_inline(a, b, sa, sb, a_fmt, b_fmt, out_dtype,
                                                 fast_accum)
    return _tk()[1].gemm_rowwise_inline(a, b, a_fmt, b_fmt, scale_a=sa, scale_b=sb,
                                        out_dtype=out_dtype, fast_accum=fast_accum)


# -- quantizers returning QTensors -------------------------------------------------------

def make_quantizers(granularity: Granularity, a_format: str, b_format: str
                    ) -> Tuple[Callable[[torch.Tensor], QTensor], Callable[[torch.Tensor], QTensor]]:
    """``quantize_a`` (row-major a (M, K)) and ``quantize_b`` (K-major b (K, N)) with the
    block shapes :func:`loka.numerics.quantize` gives the same operands."""
    fa, fb = get_format(a_format), get_format(b_format)

    def quantize_a(a: torch.Tensor) -> QTensor:
        m, k = a.shape
        if granularity is Granularity.ROWWISE:
            q, s = triton_quantize(a, fa.name, "rowwise")
            return QTensor(q, s, fa, (1, max(k, 1)), granularity)
        if granularity is Granularity.TENSORWISE:
            q, s = triton_quantize(a, fa.name, "tensorwise")
            return QTensor(q, s, fa, (max(m, 1), max(k, 1)), granularity)
        q, s = triton_quantize(a, fa.name, "blockwise_1x128")
        return QTensor(q, s, fa, (1, BLOCK), granularity)

    def quantize_b(b: torch.Tensor) -> QTensor:
        k, n = b.shape
        if granularity is Granularity.ROWWISE:
            q, s = triton_quantize(b, fb.name, "rowwise", layout="col")
            return QTensor(q, s, fb, (max(k, 1), 1), granularity)
        if granularity is Granularity.TENSORWISE:
            q, s = triton_quantize(b, fb.name, "tensorwise", layout="col")
            return QTensor(q, s, fb, (max(k, 1), max(n, 1)), granularity)
        q, s = triton_quantize(b, fb.name, "blockwise_128x128", layout="col")
        return QTensor(q, s, fb, (BLOCK, BLOCK), granularity)

    return quantize_a, quantize_b


def make_dual_quantizer(a_format: str) -> Callable[[torch.Tensor], Tuple[QTensor, QTensor]]:
    """``t (R, C) -> (t's rowwise a operand, tᵀ's rowwise a operand)`` by the two-layout
    quantizer (:func:`triton_quantize_dual`): the same QTensors as two ``quantize_a`` calls."""
    fa = get_format(a_format)

    def quantize_dual(t: torch.Tensor) -> Tuple[QTensor, QTensor]:
        r, c = t.shape
        q, s, qt, st = triton_quantize_dual(t, fa.name)
        return (QTensor(q, s, fa, (1, max(c, 1)), Granularity.ROWWISE),
                QTensor(qt, st, fa, (1, max(r, 1)), Granularity.ROWWISE))

    return quantize_dual


def _checked(q: QTensor, fmt, granularity: Granularity, operand: str) -> QTensor:
    if q.fmt != get_format(fmt) or q.granularity != granularity:
        raise ValueError(f"operand {operand} was quantized as {q.fmt}/{q.granularity}, but this "
                         f"kernel needs {get_format(fmt)}/{granularity}")
    return q


def make_triton_kernel(name: str, granularity: Granularity, *, gemm: str,
                       a_format: str = "e4m3", b_format: str = "e4m3",
                       fast_accum: bool = False, roles=None, same_bits_as: Optional[str] = None,
                       description: str) -> Kernel:
    """A registry kernel: Triton quantization of both operands, then ``gemm``:
    'triton' (LoKA's Triton GEMM) or 'cublas' (``torch._scaled_mm`` / ``F.scaled_mm``);
    or 'triton-inline' (rowwise only): the Triton GEMM that casts float operands in its
    own loads after one amax pass each (QTensor operands are used as they are).
    ``same_bits_as``: the cuBLAS kernel whose PyTorch quantizers these Triton ones match bit
    for bit, with the same GEMM call (``Kernel.same_bits_as``)."""
    if gemm == "triton-inline" and granularity is not Granularity.ROWWISE:
        raise ValueError("the inline-quantizing GEMM is rowwise")
    quantize_a, quantize_b = make_quantizers(granularity, a_format, b_format)
    scaling = "blockwise" if granularity is Granularity.BLOCKWISE else "rowwise"

    def fn(a, b, out_dtype):
        check_gemm_operands(a, b, out_dtype)
        if gemm == "triton-inline":
            a = _checked(a, a_format, granularity, "a") if isinstance(a, QTensor) else a
            b = _checked(b, b_format, granularity, "b") if isinstance(b, QTensor) else b
            lib_dtype = out_dtype if out_dtype in _GEMM_OUT else torch.float32
            out = triton_gemm_inline(a, b, a_format, b_format, lib_dtype, fast_accum)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        qa = _checked(a, a_format, granularity, "a") if isinstance(a, QTensor) else quantize_a(a)
        qb = _checked(b, b_format, granularity, "b") if isinstance(b, QTensor) else quantize_b(b)
        if gemm == "cublas":
            lib_dtype = torch.bfloat16 if granularity is not Granularity.TENSORWISE else (
                out_dtype if out_dtype in _GEMM_OUT else torch.float32)
            out = _cublas_scaled_mm(qa, qb, lib_dtype, fast_accum, granularity)
        else:
            lib_dtype = out_dtype if out_dtype in _GEMM_OUT else torch.float32
            out = triton_gemm(qa.data, qb.data, qa.scale, qb.scale, scaling, lib_dtype, fast_accum)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    fn.__name__ = name.replace("-", "_")
    a_dtype = get_format(a_format).dtype

    def requires(device: torch.device) -> Capability:
        if not caps.triton_available(device):
            return Capability(False, "Triton kernels need triton and a CUDA device")
        ensure_triton_ops()  # before any compiled model traces them
        if gemm == "cublas" and not caps.has_scaled_mm(device, str(granularity), a_dtype,
                                                        torch.float8_e4m3fn, torch.bfloat16):
            return Capability(False, f"this torch build has no {granularity} scaled_mm on "
                                     f"{device}")
        return YES

    return Kernel(
        name=name, fn=fn, library="triton", formats=(a_format, b_format),
        scaling=str(granularity), roles=frozenset(roles) if roles else frozenset(Role),
        devices=("cuda",), min_capability=(8, 9), vendor="nvidia",
        align=BLOCK if granularity is Granularity.BLOCKWISE else 16, requires=requires,
        quantize_a=quantize_a, quantize_b=quantize_b, fast_accum=fast_accum,
        same_bits_as=same_bits_as,
        # the inline GEMM casts float operands in its own loads: no FP8 copies to share
        quantize_dual=(make_dual_quantizer(a_format)
                       if granularity is Granularity.ROWWISE and gemm != "triton-inline" else None),
        description=description)


TW, RW, BW = Granularity.TENSORWISE, Granularity.ROWWISE, Granularity.BLOCKWISE
TRITON_KERNELS = (
    make_triton_kernel("triton-rowwise", RW, gemm="triton",
                       description="Triton one-pass rowwise quantization + Triton rowwise GEMM "
                                   "(float32 promotion every K tile)"),
    make_triton_kernel("triton-rowwise-fastacc", RW, gemm="triton", fast_accum=True,
                       description="Triton rowwise quantization + Triton rowwise GEMM, fast "
                                   "accumulation"),
    make_triton_kernel("triton-rowwise-cublas", RW, gemm="cublas",
                       same_bits_as="cublas-rowwise",
                       description="Triton rowwise quantization + torch._scaled_mm rowwise"),
    make_triton_kernel("triton-rowwise-cublas-fastacc", RW, gemm="cublas", fast_accum=True,
                       same_bits_as="cublas-rowwise-fastacc",
                       description="Triton rowwise quantization + torch._scaled_mm rowwise, "
                                   "fast accumulation"),
    make_triton_kernel("triton-rowwise-e5m2", RW, gemm="triton", a_format="e5m2",
                       roles=GRAD_ROLES,
                       description="Triton rowwise quantization (e5m2 gradient) + Triton GEMM"),
    make_triton_kernel("triton-rowwise-inline", RW, gemm="triton-inline",
                       description="Triton rowwise amax pass + Triton rowwise GEMM that casts "
                                   "each loaded tile to FP8 and multiplies the FP8 values "
                                   "exactly on the fp16 tensor cores (no FP8 copy written; "
                                   "float32 accumulation)"),
    make_triton_kernel("triton-tensorwise", TW, gemm="triton",
                       description="Triton two-stage tensorwise quantization + Triton GEMM"),
    make_triton_kernel("triton-tensorwise-cublas", TW, gemm="cublas",
                       same_bits_as="cublas-tensorwise",
                       description="Triton tensorwise quantization + torch._scaled_mm"),
    make_triton_kernel("triton-tensorwise-cublas-fastacc", TW, gemm="cublas", fast_accum=True,
                       same_bits_as="cublas-tensorwise-fastacc",
                       description="Triton tensorwise quantization + torch._scaled_mm, fast "
                                   "accumulation"),
    make_triton_kernel("triton-blockwise", BW, gemm="triton",
                       description="Triton 1x128/128x128 quantization + Triton blockwise GEMM"),
    make_triton_kernel("triton-blockwise-cublas", BW, gemm="cublas",
                       description="Triton 1x128/128x128 quantization + F.scaled_mm blockwise"),
)
for _kernel in TRITON_KERNELS:
    register(_kernel)
