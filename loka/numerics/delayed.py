"""Delayed tensorwise scaling: a tensor's scale comes from the amax seen at earlier steps.

Dynamic tensorwise scaling needs the amax of the whole tensor before the first element
can be cast, so under ``torch.compile`` the tensor is read (or its producer recomputed)
twice: once by the amax reduction, once by the cast. With a scale known in advance the
cast is a pointwise op that Inductor fuses into the kernel that produced the tensor, and
the amax that the next step needs is taken from the FP8 result inside that same kernel.

The estimate ``est`` of a tensor's amax is one float32 scalar per operand:

- scale: ``s = HEADROOM * est / fmt.max``; values up to ``HEADROOM`` times the estimate
  fit without saturation, at the price of ``log2(HEADROOM)`` binades at the bottom of the
  format's range;
- after the cast, ``seen = max|q| * s`` (the tensor's amax to within FP8 rounding); when
  ``max|q|`` reaches ``fmt.max`` the tensor saturated and the estimate grows to
  ``GROWTH * fmt.max * s``; otherwise it becomes ``max(seen, decay * est)``, so a
  shrinking tensor's scale follows it down geometrically;
- a non-finite observation (a NaN or Inf in the tensor) leaves the estimate unchanged,
  and the cast turns each non-finite input into NaN, so a non-finite input still gives a
  non-finite GEMM output (saturation would hide it otherwise).

A Linear starts with no estimate: its first training call quantizes dynamically and
seeds ``est`` from that call's amax (:func:`seed_amax`).
"""

from __future__ import annotations

import torch

from .formats import FP8Format, get_format
from .scaling import AMAX_EPS, Granularity, QTensor, is_fp8_dtype, saturate_float64

HEADROOM = 2.0
"""the scale leaves this factor above the estimated amax before values saturate"""
GROWTH = 2.0
"""after a saturated step the estimate becomes this multiple of the largest value that fit"""
DEFAULT_DECAY = 0.9
"""per-step factor by which an estimate above what is seen shrinks toward it"""


def delayed_scale(est: torch.Tensor, fmt: "FP8Format | str") -> torch.Tensor:
    """The float32 dequantization scale (shape ()) for an amax estimate ``est``."""
    fmt = get_format(fmt)
    return est.float().reshape(()).clamp(min=AMAX_EPS) * (HEADROOM / fmt.max)


def quantize_delayed(x: torch.Tensor, est: torch.Tensor, fmt: "FP8Format | str") -> QTensor:
    """Tensorwise FP8 ``x`` (R, C) with the scale of the estimate ``est``: no reduction
    over ``x``; values beyond ``HEADROOM * est`` saturate, non-finite values become NaN."""
    if x.dim() != 2:
        raise ValueError(f"quantize_delayed expects a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point() or is_fp8_dtype(x.dtype):
        raise TypeError(f"quantize_delayed expects a float32/bf16/fp16 tensor, got {x.dtype}")
    fmt = get_format(fmt)
    s = delayed_scale(est, fmt)
    wide = saturate_float64(x).float()
    # + wide * 0: NaN where x is not finite (Inf would saturate to a finite value), 0 else
    data = (wide / s + wide * 0).clamp(-fmt.max, fmt.max)
    r, c = x.shape
    return QTensor(data.to(fmt.dtype), s.reshape(1, 1), fmt, (max(r, 1), max(c, 1)),
                   Granularity.TENSORWISE)


def next_amax(est: torch.Tensor, q: QTensor, decay: float) -> torch.Tensor:
    """The estimate after observing ``q`` (a :func:`quantize_delayed` result made with
    ``est``); same shape and dtype as ``est``. No host synchronization."""
    if q.data.numel() == 0:
        return est
    qmax = q.data.float().abs().amax()
    s = q.scale.reshape(())
    limit = q.fmt.max
    new = torch.where(qmax >= limit, GROWTH * limit * s,
                      torch.maximum(qmax * s, decay * est.reshape(()).float()))
    new = torch.where(torch.isfinite(new), new, est.reshape(()).float())
    return new.reshape(est.shape).to(est.dtype)


def seed_amax(q: QTensor) -> torch.Tensor:
    """The amax a dynamically quantized tensorwise ``q`` was scaled by (shape ()); a
    non-finite one (the tensor held NaN or Inf) seeds nothing: 0, no estimate yet."""
    amax = q.scale.float().reshape(()) * q.fmt.max
    return torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
