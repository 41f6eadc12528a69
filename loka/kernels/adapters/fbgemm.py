"""FBGEMM GenAI's FP8 kernels (``fbgemm-gpu-genai``) as registry kernels.

Imported only when :func:`loka.kernels.capabilities.fbgemm_genai_available` says the ops
are registered; the ops themselves are looked up at call time, so importing this module
never touches CUDA. Ops used (``fbgemm_gpu/experimental/gen_ai/src/quantize``):

* ``quantize_fp8_per_row(x) -> [xq (M, K) e4m3, x_scale (M,)]``, x_scale dequantizes;
* ``f8f8bf16_rowwise(xq (M, K), wq (N, K), x_scale (M,), w_scale (N,), bias=None,
  use_fast_accum=True) -> (M, N) bf16`` (CUTLASS, row-major operands, K contiguous);
* ``quantize_fp8_per_tensor(x) -> [xq, scale]`` and ``f8f8bf16(xq, wq, x_scale *
  w_scale, use_fast_accum=True)`` for tensorwise scaling.

FBGEMM wants the weight as (N, K) row-major, i.e. the GEMM's ``b`` (K, N) column-major,
the layout LoKA's ``quantize_b`` returns; a wgrad ``a`` operand (``dyᵀ``) is made
contiguous first, as FBGEMM's quantizers read rows. Its quantization numerics are its own
(they clamp the scale from below), so the emulated twin is only approximate.

=================  ==========================================================
fbgemm-rowwise      per-row quantization + CUTLASS rowwise GEMM, fast accumulation
fbgemm-tensorwise   per-tensor quantization + CUTLASS tensorwise GEMM, fast accumulation
=================  ==========================================================
"""

from __future__ import annotations

import torch

from ...config import Role
from ...numerics import E4M3, Granularity, QTensor
from .. import capabilities as caps
from ..recipes import check_gemm_operands
from ..registry import YES, Capability, Kernel, register


def _ops():
    """``torch.ops.fbgemm``, with the GenAI library loaded (lazily, once)."""
    import fbgemm_gpu.experimental.gen_ai  # noqa: F401  (registers the ops)

    return torch.ops.fbgemm


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def _quantize_rows(x: torch.Tensor):
    """(xq (R, C) e4m3, dequant scale (R,)) of a row-major copy of x."""
    xq, scale = _ops().quantize_fp8_per_row(_rows(x))
    return xq, scale.float().reshape(-1)


def _quantize_tensor(x: torch.Tensor):
    xq, scale = _ops().quantize_fp8_per_tensor(_rows(x))
    return xq, scale.float().reshape(1, 1)


def make_fbgemm_kernel(name: str, granularity: Granularity) -> Kernel:
    rowwise = granularity is Granularity.ROWWISE

    def quantize_a(a: torch.Tensor) -> QTensor:
        m, k = a.shape
        if rowwise:
            xq, s = _quantize_rows(a)
            return QTensor(xq, s.reshape(m, 1), E4M3, (1, max(k, 1)), granularity)
        xq, s = _quantize_tensor(a)
        return QTensor(xq, s, E4M3, (max(m, 1), max(k, 1)), granularity)

    def quantize_b(b: torch.Tensor) -> QTensor:
        k, n = b.shape
        if rowwise:  # per column of b = per row of bᵀ (N, K)
            wq, s = _quantize_rows(b.t())
            return QTensor(wq.t(), s.reshape(1, n), E4M3, (max(k, 1), 1), granularity)
        wq, s = _quantize_tensor(b.t())
        return QTensor(wq.t(), s, E4M3, (max(k, 1), max(n, 1)), granularity)

    def operand(x, quantizer, which: str) -> QTensor:
        if isinstance(x, QTensor):
            if x.fmt != E4M3 or x.granularity != granularity:
                raise ValueError(f"operand {which} was quantized as {x.fmt}/{x.granularity}, "
                                 f"but this kernel needs e4m3/{granularity}")
            return x
        return quantizer(x)

    def fn(a, b, out_dtype):
        check_gemm_operands(a, b, out_dtype)
        qa, qb = operand(a, quantize_a, "a"), operand(b, quantize_b, "b")
        xq, wq = _rows(qa.data), _rows(qb.data.t())  # (M, K) and (N, K), both row-major
        if rowwise:
            out = _ops().f8f8bf16_rowwise(xq, wq, qa.scale.reshape(-1).contiguous(),
                                          qb.scale.reshape(-1).contiguous(), use_fast_accum=True)
        else:
            out = _ops().f8f8bf16(xq, wq, (qa.scale * qb.scale).reshape(()), use_fast_accum=True)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    fn.__name__ = name.replace("-", "_")

    def requires(device: torch.device) -> Capability:
        if not caps.fbgemm_genai_available():
            return Capability(False, "fbgemm-gpu-genai is not installed")
        cc = caps.cuda_capability(device)
        if cc is None or cc < (9, 0):
            return Capability(False, f"FBGEMM's CUTLASS FP8 kernels need sm_90+, have {cc}")
        return YES

    return Kernel(
        name=name, fn=fn, library="fbgemm", formats=("e4m3", "e4m3"), scaling=str(granularity),
        roles=frozenset(Role), devices=("cuda",), min_capability=(9, 0), vendor="nvidia",
        align=16, requires=requires, quantize_a=quantize_a, quantize_b=quantize_b,
        fast_accum=True,
        description=f"FBGEMM GenAI {granularity}: quantize_fp8_per_"
                    f"{'row' if rowwise else 'tensor'} + CUTLASS f8f8bf16"
                    f"{'_rowwise' if rowwise else ''}")


FBGEMM_KERNELS = (make_fbgemm_kernel("fbgemm-rowwise", Granularity.ROWWISE),
                  make_fbgemm_kernel("fbgemm-tensorwise", Granularity.TENSORWISE))
for _kernel in FBGEMM_KERNELS:
    register(_kernel)
