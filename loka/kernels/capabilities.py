"""Every "can this machine do X?" question, asked once and cached.

Other modules ask here instead of wrapping calls in try/except. Optional libraries
(triton, torchao, fbgemm_gpu) are imported only in this module.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional, Tuple

import torch


def device_type(device: "torch.device | str | None") -> str:
    if device is None:
        return "cpu"
    return torch.device(device).type


def cuda_capability(device: "torch.device | str | None" = None) -> Optional[Tuple[int, int]]:
    """(major, minor) of a CUDA device, or None off CUDA / without a GPU."""
    if device_type(device) != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_capability(torch.device(device).index or 0)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


def torch_version() -> Tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def _probe_scaled_mm(dev: str, scaling: str, a_dtype: torch.dtype, b_dtype: torch.dtype,
                     out_dtype: torch.dtype) -> bool:
    """Run one tiny ``_scaled_mm`` of the given kind: the only reliable capability test."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    device = torch.device(dev)
    if device.type == "cuda" and not torch.cuda.is_available():
        return False
    # K of four 128-blocks: the weight's blockwise scales then have one layout only
    m, k, n = 16, 512, 128
    try:
        a = torch.ones(m, k, device=device).to(a_dtype)
        b = torch.ones(n, k, device=device).to(b_dtype).t()
        if scaling == "tensorwise":
            sa = torch.ones((), device=device)
            sb = torch.ones((), device=device)
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        elif scaling == "rowwise":
            sa = torch.ones(m, 1, device=device)
            sb = torch.ones(1, n, device=device)
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        elif scaling == "blockwise":
            import torch.nn.functional as F
            if not hasattr(F, "scaled_mm"):
                return False
            sa = torch.ones(k // 128, m, device=device).t()
            sb = torch.ones(n // 128, k // 128, device=device).t()  # K-major
            F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x128, sb,
                        F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
        else:
            return False
        return True
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False


def has_scaled_mm(device, scaling: str, a_dtype=torch.float8_e4m3fn,
                  b_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16) -> bool:
    """Whether ``torch._scaled_mm`` (or ``F.scaled_mm`` for blockwise) runs this recipe."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
    return _probe_scaled_mm(str(dev), scaling, a_dtype, b_dtype, out_dtype)


SLOW_CPU_FP8 = 50.0
"""a CPU ``torch._scaled_mm`` this many times slower than a float32 ``mm``
(:func:`cpu_scaled_mm_slowdown`) makes a CPU run that calls it on every step take minutes
instead of seconds: the demo's default CPU kernels leave it out, a CPU Probe that measures
it says so"""


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_slowdown(n: int = 128, calls: int = 3) -> Optional[float]:
    """How many times longer the CPU build's tensorwise ``torch._scaled_mm`` takes than a
    float32 ``mm`` of the same (n, n, n) shape, best of ``calls`` each; None where there is
    none. Some CPU builds run it through a reference path orders of magnitude slower than
    a GEMM (a CPU with AMX but no FP8 units), where a CPU run that calls it on every step
    takes minutes instead of seconds. Measured once per process (a few milliseconds where
    it is fast)."""
    import time

    if not has_scaled_mm("cpu", "tensorwise", out_dtype=torch.float32):
        return None
    a = torch.ones(n, n).to(torch.float8_e4m3fn)
    b = torch.ones(n, n).to(torch.float8_e4m3fn).t()
    one = torch.ones(())
    af, bf = a.float(), b.float()

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return max(min(times), 1e-9)
    fp8 = best(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32))
    return fp8 / best(lambda: af @ bf)


@functools.lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - broken installs count as absent
        return False


def triton_available(device=None) -> bool:
    """Triton kernels run: triton importable and a CUDA (or ROCm) device present."""
    return device_type(device) == "cuda" and torch.cuda.is_available() and module_available("triton")


def torchao_available() -> bool:
    return module_available("torchao.float8")


def fbgemm_genai_available() -> bool:
    if not module_available("fbgemm_gpu.experimental.gen_ai"):
        return False
    return hasattr(torch.ops.fbgemm, "f8f8bf16_rowwise")


def summary(device=None) -> dict:
    """What this machine offers, for ``loka kernels`` and reports."""
    return {
        "torch": torch.__version__,
        "device": str(device or "cpu"),
        "cuda_capability": cuda_capability(device),
        "rocm": is_rocm(),
        "scaled_mm_tensorwise": has_scaled_mm(device, "tensorwise", out_dtype=torch.float32),
        "scaled_mm_rowwise": has_scaled_mm(device, "rowwise"),
        "scaled_mm_blockwise": has_scaled_mm(device, "blockwise"),
        "triton": triton_available(device),
        "torchao": torchao_available(),
        "fbgemm_genai": fbgemm_genai_available(),
    }
