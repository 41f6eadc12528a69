"""``torch.library`` custom ops: opaque GEMM kernels as single graph nodes.

Most kernels (the emulated ones, ``cublas-*``, torchao's) are plain PyTorch around one
library call: ``torch.compile`` traces them, and Inductor fuses their quantization (amax,
scale, cast) into the op that produced the operand. That is the preferred path and needs
nothing here. LoKA's Triton kernels are custom ops of their own and trace as well.

Kernels that Dynamo cannot trace (C++ library ops without fake implementations, as FBGEMM's
may be, hand-written launchers, anything with Python-side work) would break the graph.
They are *opaque*: ``loka.Linear`` calls them through ``torch.ops.loka.gemm``, a custom
op taking the kernel's registry name as a string, with a fake (meta) implementation that
gives the output's shape and dtype.
The kernel is looked up by name inside the op, so the choice is still made once, when
the Linear's config is set: the name is a constant of the compiled graph.

A kernel is opaque when its library is in :data:`OPAQUE_LIBRARIES` or its name was
passed to :func:`mark_opaque`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable, List, Optional, Set

import torch

from . import registry
from .registry import Kernel
from ..numerics import QTensor, as_granularity, get_format, operand_block

OPAQUE_LIBRARIES = frozenset({"fbgemm"})
"""kernel libraries whose calls are not traced by Dynamo"""
_OPAQUE_NAMES: Set[str] = set()


class TritonKernelOp:
    """A ``torch.library`` op whose body launches LoKA's Triton kernels, registered on
    first need (:func:`register_triton_ops`).

    On a GPU it is a ``torch.library.triton_op``: its body launches each kernel through
    ``torch.library.wrap_triton`` (see :func:`loka.kernels.triton.common.launch`), so
    ``torch.compile`` traces into it and Inductor launches the kernels from the code it
    generates: no Python-level op dispatch per call, captured by CUDA graphs. The body is
    its own fake implementation. Under Triton's CPU interpreter (``TRITON_INTERPRET=1``)
    the kernels are plain Python and cannot be traced, so it is a ``custom_op`` with the
    given ``fake`` (output shapes and dtypes), which must agree with the body.

    Registration is deferred because creating a ``triton_op`` imports Triton and
    torch.compile's machinery, seconds that ``import loka`` should not pay; it happens
    when :mod:`loka.kernels.triton` is imported (before any of its kernels runs), when a
    Triton kernel is checked against a device, or at the first call."""

    def __init__(self, name: str, fn: Callable, fake: Callable) -> None:
        self.name, self.fn, self.fake = name, fn, fake
        self.op: Optional[Callable] = None
        self._autograd: Optional[tuple] = None
        functools.update_wrapper(self, fn)

    def register(self) -> Callable:
        if self.op is None:
            if os.environ.get("TRITON_INTERPRET", "0") == "1":
                op = torch.library.custom_op(self.name, mutates_args=())(self.fn)
                op.register_fake(self.fake)
            else:
                op = torch.library.triton_op(self.name, self.fn, mutates_args=())
            if self._autograd is not None:
                op.register_autograd(self._autograd[0], setup_context=self._autograd[1])
            self.op = op
        return self.op

    def register_autograd(self, backward: Callable, *, setup_context: Callable) -> None:
        self._autograd = (backward, setup_context)
        if self.op is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

    def __call__(self, *args, **kwargs):
        # looked up in torch.ops after the registration: under tracing the registration
        # runs eagerly and Dynamo would not see it change ``self.op``
        ensure_triton_ops()
        namespace, name = self.name.split("::")
        return getattr(getattr(torch.ops, namespace), name)(*args, **kwargs)


_PENDING: List[TritonKernelOp] = []


def triton_kernel_op(name: str, fake: Callable) -> Callable[[Callable], TritonKernelOp]:
    """Declare ``fn`` as the :class:`TritonKernelOp` ``name`` (``'loka::...'``)."""

    def declare(fn: Callable) -> TritonKernelOp:
        op = TritonKernelOp(name, fn, fake)
        _PENDING.append(op)
        return op

    return declare


def register_triton_ops() -> None:
    """Register every declared :class:`TritonKernelOp` (idempotent)."""
    for op in _PENDING:
        op.register()


def ensure_triton_ops() -> bool:
    """Make sure the ops exist before ``torch.ops.loka.<name>`` is looked up:
    :func:`register_triton_ops`, cheap once they do, and run eagerly (not in the graph)
    even while Dynamo traces a caller."""
    register_triton_ops()
    return True


# What torch.compiler.assume_constant_result does (Dynamo calls the function eagerly while
# tracing and uses its result as a constant), without importing torch._dynamo when loka is
# imported; tests/kernels/test_triton_traced.py checks that a first trace registers the ops.
ensure_triton_ops._dynamo_marked_constant = True


def mark_opaque(name: str) -> None:
    """Route the kernel ``name`` through ``torch.ops.loka.gemm`` (set before applying)."""
    _OPAQUE_NAMES.add(name)


def unmark_opaque(name: str) -> None:
    _OPAQUE_NAMES.discard(name)


def is_opaque(kernel: Kernel) -> bool:
    return kernel.name in _OPAQUE_NAMES or kernel.library in OPAQUE_LIBRARIES


def _qtensor(data: torch.Tensor, scale: torch.Tensor, kernel: Kernel, operand: str) -> QTensor:
    """Rebuild the QTensor a kernel's quantizer made, from its two tensors."""
    fmt = get_format(kernel.formats[0 if operand == "a" else 1])
    gran = as_granularity(kernel.scaling)
    br, bc = operand_block(gran, operand)
    r, c = data.shape
    return QTensor(data, scale, fmt, (r if br == -1 else br, c if bc == -1 else bc), gran)


@torch.library.custom_op("loka::gemm", mutates_args=())
def gemm(a: torch.Tensor, a_scale: Optional[torch.Tensor], b: torch.Tensor,
         b_scale: Optional[torch.Tensor], kernel: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``a (M, K) @ b (K, N) -> (M, N)`` on the registered kernel ``kernel``.

    An operand with a scale is FP8 data quantized by that kernel's quantizer (a weight
    quantized once, or an activation from a fused producer); without, high precision.
    """
    kern = registry.get(kernel)
    qa = a if a_scale is None else _qtensor(a, a_scale, kern, "a")
    qb = b if b_scale is None else _qtensor(b, b_scale, kern, "b")
    return kern(qa, qb, out_dtype)


@gemm.register_fake
def _(a, a_scale, b, b_scale, kernel, out_dtype):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"loka::gemm shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _call_op(name: str, a, b, out_dtype: torch.dtype) -> torch.Tensor:
    a_data, a_scale = (a.data, a.scale) if isinstance(a, QTensor) else (a, None)
    b_data, b_scale = (b.data, b.scale) if isinstance(b, QTensor) else (b, None)
    return torch.ops.loka.gemm(a_data, a_scale, b_data, b_scale, name, out_dtype)


def runnable(kernel: Kernel) -> Kernel:
    """The kernel as ``loka.Linear`` calls it: itself when traceable, else a copy whose
    ``fn`` goes through ``torch.ops.loka.gemm`` (same name, quantizers and alignment; no
    ``static_gemm``, which would trace the GEMM)."""
    if not is_opaque(kernel):
        return kernel
    return dataclasses.replace(kernel, fn=functools.partial(_call_op, kernel.name),
                               static_gemm=None)


# -- torch._scaled_mm as compiled code sees it ------------------------------------------
#
# ``aten._scaled_mm`` carries the ``needs_exact_strides`` tag: before its lowering runs,
# Inductor copies every operand that is not yet a buffer of the strides eager tracing saw,
# once per call. Two GEMMs reading one FP8 tensor that is a view of an unrealized cast (the
# static cast of a transposed activation, reshaped to 2-D: Wukong's two Linears over one
# layer output) then get two copies of it, each reading the high-precision tensor again.
# ``loka::scaled_mm`` is the same call with a flexible layout; its lowering makes each
# operand that layout once per graph and hands the same buffer to every GEMM that reads it
# (bench/BENCHMARKS.md, "One FP8 copy of a tensor two Linears read"), then emits Inductor's
# own ``_scaled_mm`` lowering: the compiled code calls the same extern kernel, with no
# Python dispatch of its own. Compiled graphs cached by Inductor before a change of this
# lowering keep the code it made then (the cache key does not hold a lowering's source).

_SCALED_MM_LOWERED: Optional[bool] = None


@torch.library.custom_op("loka::scaled_mm", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b)`` (a row-major, b column-major)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


@scaled_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"loka::scaled_mm shapes do not match: a {tuple(a.shape)} @ "
                         f"b {tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


scaled_mm_op = torch.ops.loka.scaled_mm
"""the op, bound once: code Dynamo traces reads it without reading the ``torch`` module
(whose every reader, module by module, compiled code checks is one object per call)"""


def _register_scaled_mm_lowering() -> bool:
    """Register the Inductor lowering of ``loka::scaled_mm`` (comment above); False where
    this Inductor lacks what it uses (compiled code then calls ``torch._scaled_mm``)."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import lowerings, register_lowering
        from torch._inductor.virtualized import V
    except Exception:  # noqa: BLE001 - an Inductor without these: the plain call stays
        return False
    aten_lowering = lowerings.get(torch.ops.aten._scaled_mm.default)
    if aten_lowering is None:
        return False

    def operand_key(x):
        # what the operand computes, as Inductor prints an elementwise function of its
        # inputs: two casts of one tensor traced apart (one per Linear) print alike and
        # are made once; anything that does not print is keyed by itself
        try:
            body = ir.Pointwise(device=x.get_device(), dtype=x.get_dtype(),
                                inner_fn=x.make_loader(), ranges=list(x.get_size()))
            return ("expr", str(x.get_dtype()), tuple(x.get_size()), body.inner_fn_str())
        except Exception:  # noqa: BLE001 - no printable body: no sharing
            return ("node", id(x))

    def fixed(x, column_major: bool = False):
        # the strides the eager call gives cuBLAS (a row-major, b column-major, contiguous
        # scales), made once per graph for each operand node and shared by its readers
        size = list(x.get_size())
        if not size:
            return x
        made = V.graph.__dict__.setdefault("_loka_scaled_mm_operands", {})
        key = (operand_key(x), column_major)
        if key in made:
            return made[key][1]
        strides = [1, size[0]] if column_major else ir.FlexibleLayout.contiguous_strides(size)
        out = ir.ExternKernel.require_exact_strides(x, strides)
        made[key] = (x, out)  # x held: its id names it for the graph's lifetime
        return out

    def lower(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
        return aten_lowering(fixed(a), fixed(b, column_major=True), fixed(scale_a),
                             fixed(scale_b), None, None, out_dtype, use_fast_accum)

    try:
        register_lowering(torch.ops.loka.scaled_mm.default, type_promotion_kind=None)(lower)
    except Exception:  # noqa: BLE001 - registered by another copy of this module, or refused
        return False
    return True


def scaled_mm_lowered() -> bool:
    """Whether compiled code may call ``loka::scaled_mm`` (its lowering registered on the
    first ask; ``LOKA_INDUCTOR_SCALED_MM=0`` keeps ``torch._scaled_mm``). Run eagerly, a
    constant of the graph, even while Dynamo traces a caller."""
    global _SCALED_MM_LOWERED
    if _SCALED_MM_LOWERED is None:
        _SCALED_MM_LOWERED = (os.environ.get("LOKA_INDUCTOR_SCALED_MM", "1") != "0"
                              and _register_scaled_mm_lowering())
    return _SCALED_MM_LOWERED


scaled_mm_lowered._dynamo_marked_constant = True
