import math

import pytest
import torch

from loka.numerics import (AMAX_EPS, FORMATS, Granularity, dequantize, fake_quantize, quantize,
                           relative_frobenius, rowwise_relative_error, sqnr)

GRANS = ["tensorwise", "rowwise", "blockwise", "mx"]


def _ref_scales(x: torch.Tensor, fmt, block):
    """float64 reference of blockwise amax / max, with explicit loops."""
    r, c = x.shape
    br, bc = block
    out = torch.empty(-(-r // br), -(-c // bc), dtype=torch.float64)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            blk = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc].double()
            out[i, j] = max(blk.abs().max().item(), AMAX_EPS) / fmt.max
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("shape", [(64, 256), (33, 200)])  # the second has ragged blocks
def test_scales_match_float64_reference(fmt, gran, operand, shape):
    x = torch.randn(*shape) * torch.logspace(-2, 2, shape[1])
    q = quantize(x, fmt, gran, operand)
    ref = _ref_scales(x, q.fmt, q.block)
    if gran == "mx":  # e8m0: rounded up to a power of two
        ref = torch.exp2(torch.ceil(torch.log2(ref)))
        assert torch.equal(q.scale.double(), ref)
    else:
        torch.testing.assert_close(q.scale.double(), ref, rtol=2e-7, atol=0)
    assert q.data.dtype == q.fmt.dtype and q.data.shape == x.shape
    # nothing saturates when scales come from the amax
    assert q.data.float().abs().max() <= q.fmt.max


@pytest.mark.parametrize("gran", GRANS)
def test_roundtrip_error_bounded_by_format_precision(gran):
    x = torch.randn(128, 256)
    y = fake_quantize(x, "e4m3", gran, "a")
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal numbers
    normal = x.abs() > 0.05 * x.abs().max()
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-6
    assert relative_frobenius(y, x) < 0.04


def test_all_zero_tensor_gives_zeros_not_nan():
    for gran in GRANS:
        q = quantize(torch.zeros(16, 256), "e4m3", gran)
        assert torch.isfinite(q.scale).all()
        assert torch.equal(dequantize(q), torch.zeros(16, 256))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
def test_non_finite_propagates_without_raising(bad, gran):
    x = torch.randn(32, 128)
    x[3, 5] = bad
    y = dequantize(quantize(x, "e4m3", gran))
    assert not torch.isfinite(y).all()
    if gran == "rowwise":  # only the poisoned row is affected
        finite_rows = torch.isfinite(y).all(dim=1)
        assert not finite_rows[3] and finite_rows.sum() == 31


def test_power_of_two_scales_round_up():
    x = torch.randn(64, 128) * 3.7
    q = quantize(x, "e4m3", "rowwise", power_of_two=True)
    log2 = torch.log2(q.scale)
    assert torch.equal(log2, torch.round(log2))
    exact = quantize(x, "e4m3", "rowwise")
    assert (q.scale >= exact.scale).all() and (q.scale < 2 * exact.scale).all()


def test_static_scale_saturates():
    x = torch.full((4, 16), 1000.0)
    q = quantize(x, "e4m3", "tensorwise", scale=torch.tensor(1.0))
    assert torch.equal(q.data.float(), torch.full((4, 16), 448.0))


def test_rowwise_blocks_follow_the_reduction_dim():
    assert quantize(torch.randn(8, 32), granularity="rowwise", operand="a").scale.shape == (8, 1)
    assert quantize(torch.randn(32, 8), granularity="rowwise", operand="b").scale.shape == (1, 8)
    assert quantize(torch.randn(8, 256), granularity="blockwise", operand="a").scale.shape == (8, 2)
    assert quantize(torch.randn(256, 384), granularity="blockwise", operand="b").scale.shape == (2, 3)


def test_qtensor_transpose_keeps_values():
    q = quantize(torch.randn(16, 256), "e4m3", "blockwise", "a")
    assert torch.equal(q.t().dequantize(), q.dequantize().t())


@pytest.mark.parametrize("bad,err", [
    (torch.randn(4, 4, 4), ValueError), (torch.ones(4, 4, dtype=torch.int32), TypeError),
    (torch.ones(4, 4).to(torch.float8_e4m3fn), TypeError)])
def test_quantize_rejects_bad_input(bad, err):
    with pytest.raises(err):
        quantize(bad)


def test_quantize_rejects_bad_granularity():
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 4), granularity="columnwise")
    with pytest.raises(ValueError, match="operand"):
        quantize(torch.randn(4, 4), granularity="rowwise", operand="c")
