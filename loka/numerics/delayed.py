"""Delayed tensorwise scaling: a tensor's scale comes from the amax seen at earlier calls.

Dynamic tensorwise scaling needs the amax of the whole tensor before the first element
can be cast, so under ``torch.compile`` the tensor is read (or its producer recomputed)
twice: once by the amax reduction, once by the cast. With a scale known in advance the
cast is a pointwise op that Inductor fuses into the kernel that produced the tensor, and
the amax the next call needs is taken from the FP8 result inside that same kernel.

Each operand keeps a float32 state ``(est, streak)``: ``est`` estimates its amax,
``streak`` is the factor the next saturated call multiplies it by.

- scale: ``s = HEADROOM * est / fmt.max``: values up to ``HEADROOM`` times the estimate fit
  without saturating, at the price of ``log2(HEADROOM)`` binades at the bottom of the
  format's range;
- after the cast, ``seen = max|q| * s`` (the amax to within FP8 rounding), from the FP8
  values themselves: an amax of the high-precision values would be a second reader of
  the producer, which Inductor does not fuse with the cast;
- saturated (``max|q| == fmt.max``: some value beyond ``HEADROOM * est`` was clipped): the
  true amax is not known, so the estimate is multiplied by ``streak``, which grows
  ``STREAK_GROWTH``-fold per consecutive saturated call (4, 16, 64, ... up to
  ``MAX_STREAK``): a 10x jump saturates two calls, an estimate 1e12 times too small six;
- otherwise ``est = max(seen, decay * est)``: a shrinking tensor's scale follows it down
  geometrically, and an operand whose amax alternates (a Linear shared by two inputs)
  keeps the larger; right after a growth, which may have overshot, the estimate is also
  brought to at most ``OVERSHOOT`` times what was seen;
- a tensor whose FP8 values are all zero (``seen == 0``: all-zero, or every value below the
  format's smallest step) only decays the estimate; the estimate stays within
  ``[AMAX_EPS, MAX_ESTIMATE]``;
- NaN or Inf in the tensor leave the state as it was, and the cast turns each of them
  into NaN, so a non-finite input still gives a non-finite GEMM output (saturation would
  hide it otherwise).

Saturation is visible in the FP8 values and underflow is not, so an estimate too small is
found quickly and one too large only by decay: a new state starts low,
``(AMAX_EPS, STREAK_GROWTH)``. A Linear's first training call quantizes dynamically and seeds
``est`` with that call's amax (:func:`seed_state`), unless the amax is zero or not finite.
"""

from __future__ import annotations

from typing import Tuple

import torch

from .formats import FP8Format, get_format
from .scaling import AMAX_EPS, Granularity, QTensor, in_memory_order, is_fp8_dtype, saturate_float64

HEADROOM = 2.0
"""the scale leaves this factor above the estimated amax before values saturate"""
DEFAULT_DECAY = 0.9
"""per-call factor by which an estimate above what is seen shrinks toward it"""
STREAK_GROWTH = 4.0
"""the first saturated call multiplies the estimate by this, each further one by this
much more than the last"""
MAX_STREAK = 4.0 ** 6
"""the largest single growth (12 binades: a value the growth overshot by stays inside the
FP8 range, so the next call sees it)"""
OVERSHOOT = 64.0
"""after a growth, the next call that fits brings the estimate to at most this multiple of
the amax it saw (a Linear whose amax alternates between values more than
``HEADROOM * OVERSHOOT`` apart clips its larger calls)"""
MAX_ESTIMATE = float(torch.finfo(torch.float32).max) / MAX_STREAK
"""the largest estimate (its next growth stays finite)"""


FUSING_TORCH = (2, 13)
"""the first torch whose Inductor was seen to compute the new estimate inside the cast's
kernel; torch 2.11's reduces for it in a kernel of its own (docs/dispatch.md)"""


def inductor_fuses_the_estimate(version: str = torch.__version__) -> bool:
    """Whether this torch's Inductor is known to take the next estimate in the cast's own
    kernel (``version`` like ``"2.11.0+cu130"``); before :data:`FUSING_TORCH`, delayed
    scaling keeps an amax pass per operand under ``torch.compile``."""
    try:
        major, minor = (int(v) for v in version.split("+")[0].split(".")[:2])
    except ValueError:
        return True  # a build whose version this cannot read: no claim about it
    return (major, minor) >= FUSING_TORCH


def check_decay(value, name: str = "decay") -> float:
    """``value`` as a decay, a number in (0, 1] (not a bool); ValueError naming ``name``
    otherwise. The one check of every entry point that takes a decay."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a decay in (0, 1], got {value!r}")
    return float(value)


def new_state(device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fresh ``(est, streak)`` state: two float32 scalars (shape ())."""
    return (torch.full((), AMAX_EPS, dtype=torch.float32, device=device),
            torch.full((), STREAK_GROWTH, dtype=torch.float32, device=device))


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


def next_state(est: torch.Tensor, streak: torch.Tensor, q: QTensor,
               decay: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``(est, streak)`` state after observing ``q``, a :func:`quantize_delayed` result
    made with ``est`` (module docstring); scalars of the inputs' shape and dtype. No host
    synchronization: scalar functions of the cast's amax reduction, so that Inductor
    computes (and stores) them in that reduction's last kernel."""
    if q.data.numel() == 0:
        return est, streak
    e, k = est.float(), streak.float()
    qmax = in_memory_order(q.data).float().abs().amax()
    seen = qmax * q.scale.reshape(())
    saturated = qmax >= q.fmt.max
    kept = torch.where(k > STREAK_GROWTH, torch.minimum(decay * e, OVERSHOOT * seen), decay * e)
    fits = torch.where(seen > 0, torch.maximum(seen, kept), decay * e)
    new_e = torch.where(saturated, e * k, fits).clamp(AMAX_EPS, MAX_ESTIMATE)
    new_k = torch.where(saturated, (k * STREAK_GROWTH).clamp(max=MAX_STREAK),
                        torch.full_like(k, STREAK_GROWTH))
    ok = torch.isfinite(qmax) & torch.isfinite(new_e)
    return (torch.where(ok, new_e, e).to(est.dtype).reshape(est.shape),
            torch.where(ok, new_k, k).to(streak.dtype).reshape(streak.shape))


def seed_state(est: torch.Tensor, streak: torch.Tensor,
               q: QTensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The state after a dynamically quantized tensorwise ``q``: its amax as the estimate,
    a fresh streak; the state unchanged where that amax is not finite or is zero (an
    all-zero tensor says nothing about the next one)."""
    amax = q.scale.float().reshape(()) * q.fmt.max
    good = torch.isfinite(amax) & (amax > 1.5 * AMAX_EPS)
    return (torch.where(good, amax.clamp(max=MAX_ESTIMATE), est.float()).to(est.dtype)
            .reshape(est.shape),
            torch.where(good, torch.full_like(amax, STREAK_GROWTH),
                        streak.float()).to(streak.dtype).reshape(streak.shape))
