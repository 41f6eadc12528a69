"""Properties of quantize/dequantize (loka/numerics/scaling.py) on random shapes, dtypes and
distributions (hypothesis; a few dozen examples each, so CI stays fast).

The bound asserted per element, for a block with dequantization scale ``s`` and an FP8
format of ``m`` mantissa bits and smallest normal ``n``::

    |dequantize(quantize(x)) - x|  <=  (2**-(m + 1) + 2**-20) * max(|x|, n * s)

Why: ``x / s`` lies within the format's range (``s >= amax / fmt.max``), and rounding to
nearest there is off by at most half a step: ``2**-(m+1)`` of the value for a normal FP8
number, and ``2**-(m+1) * n`` in absolute terms for a subnormal one (the step below ``n``
is ``n * 2**-m``). Multiplying back by ``s`` gives the bound in the units of ``x``. The
``2**-20`` covers the float32 arithmetic around it (the scale's own rounding, the division,
the cast of the input to float32). The ``n * s`` term is also what makes blocks whose amax
is below ``AMAX_EPS`` quantize to zeros (by design): their ``s`` is ``AMAX_EPS / fmt.max``.
Values beyond float32's range (float64 input) are not in range: they saturate to
``±float32 max`` (asserted separately).
"""

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loka.numerics import FLOAT32_MAX, FORMATS, dequantize, quantize  # noqa: E402

PROPERTY = settings(max_examples=40, deadline=None, database=None)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
DISTRIBUTIONS = ["normal", "heavy", "outliers", "tiny", "huge", "zeros", "row-scales"]
GRANULARITIES = ["tensorwise", "rowwise", "blockwise", "mx"]
SIZES = st.one_of(st.sampled_from([0, 1, 15, 16, 17, 127, 128, 129, 257]),
                  st.integers(min_value=0, max_value=300))


def sample(shape, dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` drawn from ``kind``, finite in ``dtype`` (generated in float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    big = float(torch.finfo(dtype).max)
    if kind == "heavy":  # Cauchy-like tails
        x = x / torch.randn(shape, generator=g, dtype=torch.float64).abs().clamp(min=1e-3)
    elif kind == "outliers" and x.numel():
        idx = torch.randint(0, x.numel(), (max(1, x.numel() // 50),), generator=g)
        x.view(-1)[idx] *= 1e4
    elif kind == "tiny":
        x = x * 1e-20
    elif kind == "huge":  # beyond float32 for float64 inputs: they saturate
        x = x * (1e300 if dtype == torch.float64 else big / 16)
    elif kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
    elif kind == "row-scales" and x.numel():
        x = x * torch.pow(10.0, torch.empty(shape[0], 1, dtype=torch.float64).uniform_(-8, 8, generator=g))
    x = x.clamp(-big, big)
    return x.to(dtype)


def expanded_scale(q, shape) -> torch.Tensor:
    """The dequantization scale of every element, (R, C) float64."""
    br, bc = q.block
    s = q.scale.double().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return s[:shape[0], :shape[1]]


@PROPERTY
@given(rows=SIZES, cols=SIZES, dtype=st.sampled_from(DTYPES), kind=st.sampled_from(DISTRIBUTIONS),
       fmt=st.sampled_from(sorted(FORMATS)), granularity=st.sampled_from(GRANULARITIES),
       operand=st.sampled_from(["a", "b"]), seed=st.integers(0, 2 ** 31 - 1))
def test_dequantized_values_are_within_half_an_fp8_step(rows, cols, dtype, kind, fmt, granularity,
                                                         operand, seed):
    x = sample((rows, cols), dtype, kind, seed)
    q = quantize(x, fmt, granularity, operand)
    out = dequantize(q, torch.float64)
    assert out.shape == x.shape and q.data.dtype == q.fmt.dtype
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert not out.isnan().any()
    if x.numel() == 0:
        return
    x64 = x.double()
    in_range = x64.abs() <= FLOAT32_MAX
    saturated = ~in_range
    assert torch.equal(out[saturated].abs() >= FLOAT32_MAX * (1 - 2 ** -20),
                       torch.ones_like(out[saturated], dtype=torch.bool))
    m, n = q.fmt.mantissa_bits, q.fmt.min_normal
    s = expanded_scale(q, x.shape)
    bound = (2.0 ** -(m + 1) + 2.0 ** -20) * torch.maximum(x64.abs(), n * s)
    err = (out - x64).abs()
    bad = in_range & (err > bound)
    assert not bad.any(), (f"{int(bad.sum())} element(s) beyond the bound; worst x="
                           f"{x64[bad][0].item():.6g} got {out[bad][0].item():.6g}")


@PROPERTY
@given(rows=SIZES, cols=SIZES, dtype=st.sampled_from(DTYPES), kind=st.sampled_from(DISTRIBUTIONS),
       granularity=st.sampled_from(GRANULARITIES), seed=st.integers(0, 2 ** 31 - 1))
def test_quantization_is_deterministic_and_idempotent(rows, cols, dtype, kind, granularity, seed):
    x = sample((rows, cols), dtype, kind, seed)
    q1, q2 = quantize(x, "e4m3", granularity), quantize(x, "e4m3", granularity)
    assert torch.equal(q1.data.view(torch.uint8), q2.data.view(torch.uint8))
    assert torch.equal(q1.scale, q2.scale)
    if granularity == "mx" or x.numel() == 0:
        return  # MX rounds its scale to a power of two: a second pass may pick another one
    # the values an FP8 kernel multiplies quantize to themselves (up to the scale's rounding)
    again = dequantize(quantize(dequantize(q1), "e4m3", granularity))
    torch.testing.assert_close(again, dequantize(q1), rtol=2 ** -3, atol=0)


@PROPERTY
@given(rows=SIZES, cols=SIZES, granularity=st.sampled_from(GRANULARITIES),
       value=st.floats(min_value=1e-300, max_value=1e308), sign=st.sampled_from([1.0, -1.0]))
def test_finite_float64_never_becomes_nan(rows, cols, granularity, value, sign):
    x = torch.full((rows, cols), sign * value, dtype=torch.float64)
    for fmt in FORMATS:
        q = quantize(x, fmt, granularity)
        assert not dequantize(q, torch.float64).isnan().any()
        assert not dequantize(q).isnan().any() and torch.isfinite(q.scale).all()
        if x.numel() and value > math.sqrt(FLOAT32_MAX) and value <= FLOAT32_MAX and granularity != "mx":
            assert torch.isfinite(dequantize(q)).all()
