"""High-precision kernels: the bf16 baseline and float32 references."""

from __future__ import annotations

import torch

from ..numerics import QTensor
from .recipes import check_gemm_operands
from .registry import Kernel, register


def _plain(x):
    return x.dequantize() if isinstance(x, QTensor) else x


def _baseline(a, b, out_dtype):
    """The GEMM in the operands' own dtype (bf16 in a bf16 model): what FP8 replaces."""
    a, b = _plain(a), _plain(b)
    check_gemm_operands(a, b, out_dtype)
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    return torch.mm(a, b).to(out_dtype)


_MATMUL = torch.backends.cuda.matmul


def matmul_state():
    """The float32 matmul flag :func:`_float32_gemm` sets, as this process holds it:
    ``('fp32_precision', value)``, or ``('allow_tf32', value)`` on a torch without it."""
    if hasattr(_MATMUL, "fp32_precision"):
        return "fp32_precision", _MATMUL.fp32_precision
    return "allow_tf32", bool(_MATMUL.allow_tf32)


def restore_matmul_state(state) -> None:
    """Set the flag back to ``state`` (:func:`matmul_state`): the value torch reports for
    it, which is what the compile caches' keys read. (Where the matmul flag was 'none' and
    inherited a global ``torch.backends.fp32_precision``, torch reports the inherited value,
    and it is set explicitly: later changes of the global setting then no longer reach it.)"""
    name, value = state
    setattr(_MATMUL, name, value)


def _set_tf32(on: bool) -> None:
    """TF32 on or off through ``fp32_precision`` where this torch has it. The legacy
    ``allow_tf32`` would set it too ('ieee' for off where it was 'none': the same numerics
    under another name), and setting ``allow_tf32`` back would leave it so; it is part of the
    compile caches' keys, so graphs compiled before and after would share no key. Mixing
    the two interfaces also makes torch refuse to read ``allow_tf32``."""
    if hasattr(_MATMUL, "fp32_precision"):
        _MATMUL.fp32_precision = "tf32" if on else "ieee"
    else:
        _MATMUL.allow_tf32 = on


def _float32_gemm(a, b, out_dtype, allow_tf32: bool):
    a, b = _plain(a), _plain(b)
    check_gemm_operands(a, b, out_dtype)
    prev = matmul_state()
    _set_tf32(allow_tf32)
    try:
        return torch.mm(a.float(), b.float()).to(out_dtype)
    finally:
        restore_matmul_state(prev)


def _fp32(a, b, out_dtype):
    """float32 GEMM with TF32 disabled."""
    return _float32_gemm(a, b, out_dtype, allow_tf32=False)


def _tf32(a, b, out_dtype):
    """float32 inputs on TF32 tensor cores."""
    return _float32_gemm(a, b, out_dtype, allow_tf32=True)


register(Kernel("bf16", _baseline, library="torch", formats=("bf16", "bf16"),
                description="baseline: torch.mm in the model's dtype (bf16 in bf16 models)"))
register(Kernel("fp32", _fp32, library="torch", formats=("fp32", "fp32"),
                description="float32 reference, TF32 off"))
register(Kernel("tf32", _tf32, library="torch", formats=("tf32", "tf32"), devices=("cuda",),
                min_capability=(8, 0), description="float32 inputs on TF32 tensor cores"))
