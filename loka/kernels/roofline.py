"""Lower bounds on a GEMM kernel's time from a device's peak rates (a roofline), and the
bound on Triton autotuning while kernels are timed.

The Probe times every candidate kernel at every site shape; on a fresh machine that is its
largest cost (each new shape compiles and autotunes). Before timing, it asks here whether a
kernel could beat the measured baseline by ``min_speedup`` *even at the device's peak
rates*; where it cannot, timing it says nothing the plan can use. The bound is a true
lower bound only with true peaks, so a device missing from :data:`PEAKS` is never pruned.

Peaks are dense (no sparsity) tensor-core rates and HBM bandwidth from NVIDIA's data
sheets: H100 SXM5 and H200 SXM (989 TFLOP/s bf16, 1979 TFLOP/s FP8; 3.35 and 4.8 TB/s),
H100 PCIe (756 / 1513 TFLOP/s; 2.0 TB/s), L40S (362 / 733 TFLOP/s; 0.864 TB/s), L4
(121 / 242 TFLOP/s; 0.3 TB/s).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ["Peaks", "PEAKS", "peaks_for", "fp8_time_lower_bound_us", "max_speedup",
           "autotune_limit", "max_autotune_configs", "device_peaks"]


@dataclass(frozen=True)
class Peaks:
    """A device's dense peak rates."""

    bf16_tflops: float
    fp8_tflops: float
    hbm_tbps: float


PEAKS: Dict[str, Peaks] = {
    # matched in order against the device name (torch.cuda.get_device_name), lower-cased
    "h200": Peaks(989.4, 1978.9, 4.8),
    "h100 pcie": Peaks(756.0, 1513.0, 2.0),
    "h100": Peaks(989.4, 1978.9, 3.35),
    "l40s": Peaks(362.0, 733.0, 0.864),
    "l4": Peaks(121.0, 242.0, 0.3),
}


def peaks_for(device_name: str) -> Optional[Peaks]:
    """The peak rates of a device by its name, or None for a device not in :data:`PEAKS`."""
    name = device_name.lower()
    for key, peaks in PEAKS.items():
        if key in name:
            return peaks
    return None


def fp8_time_lower_bound_us(shape: Tuple[int, int, int], peaks: Peaks, *,
                            quantizes_a: bool = True, quantizes_b: bool = True,
                            in_bytes: int = 2, out_bytes: int = 2) -> float:
    """A lower bound (microseconds) on an FP8 GEMM ``(M, K) @ (K, N)`` that quantizes its
    high-precision operands itself: the GEMM at the FP8 peak or reading its FP8 operands
    and writing its output at full bandwidth, whichever is longer, plus each quantized
    operand read in ``in_bytes`` and written in one byte at full bandwidth."""
    m, k, n = shape
    if min(m, k, n) <= 0:
        raise ValueError(f"a GEMM shape needs positive dimensions, got {shape}")
    bw = peaks.hbm_tbps * 1e12
    gemm = max(2.0 * m * k * n / (peaks.fp8_tflops * 1e12), (m * k + k * n + out_bytes * m * n) / bw)
    quant = ((m * k if quantizes_a else 0) + (k * n if quantizes_b else 0)) * (in_bytes + 1) / bw
    return (gemm + quant) * 1e6


def max_speedup(baseline_us: float, shape: Tuple[int, int, int], peaks: Peaks, **kw) -> float:
    """The most an FP8 kernel could gain over a baseline measured at ``baseline_us``."""
    return baseline_us / fp8_time_lower_bound_us(shape, peaks, **kw)


_LIMIT = threading.local()


@contextlib.contextmanager
def autotune_limit(configs: Optional[int]) -> Iterator[None]:
    """Inside, LoKA's Triton autotuners try at most ``configs`` configurations per new key
    (the largest tiles that fit the shape); None: no limit."""
    if configs is not None and configs < 1:
        raise ValueError(f"autotune_limit needs at least one config, got {configs}")
    before = getattr(_LIMIT, "configs", None)
    _LIMIT.configs = configs
    try:
        yield
    finally:
        _LIMIT.configs = before


def max_autotune_configs() -> Optional[int]:
    """The limit set by :func:`autotune_limit` in this thread (None: none)."""
    return getattr(_LIMIT, "configs", None)


def device_peaks(device: torch.device) -> Optional[Peaks]:
    """:func:`peaks_for` the CUDA device ``device``; None elsewhere."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peaks_for(torch.cuda.get_device_name(device))
