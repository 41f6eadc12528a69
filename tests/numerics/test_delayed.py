"""Delayed tensorwise scaling (loka.numerics.delayed): the cast with a scale estimated at
earlier steps, and how the estimate follows the tensor."""

import pytest
import torch

from loka.numerics import E4M3, E5M2, dequantize, quantize
from loka.numerics.delayed import (DEFAULT_DECAY, GROWTH, HEADROOM, delayed_scale, next_amax,
                                   quantize_delayed, seed_amax)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cast_is_a_static_tensorwise_quantization_with_the_estimates_scale(fmt, dtype):
    torch.manual_seed(0)
    x = (torch.randn(48, 80) * 3).to(dtype)
    est = torch.tensor(5.0)
    q = quantize_delayed(x, est, fmt)
    s = HEADROOM * 5.0 / fmt.max
    ref = quantize(x, fmt, "tensorwise", "a", scale=torch.tensor(s))
    assert q.scale.shape == (1, 1) and float(q.scale) == pytest.approx(s, rel=1e-7)
    assert torch.equal(q.data.float(), ref.data.float())
    assert q.block == (48, 80) and q.fmt == fmt


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_values_within_the_headroom_round_to_fp8_and_beyond_it_saturate(fmt):
    x = torch.cat([torch.linspace(-9.9, 9.9, 199), torch.tensor([10.5, -30.0, 1e6])]).reshape(2, -1)
    est = torch.tensor(5.0)  # values up to HEADROOM * 5 = 10 fit
    deq = dequantize(quantize_delayed(x, est, fmt), torch.float64)
    x64 = x.double()
    inside = x64.abs() <= HEADROOM * 5.0
    # round to nearest: half a step of the format's mantissa, relative (normal values), or
    # half the subnormal step (absolute)
    step = 2.0 ** -fmt.mantissa_bits
    tiny = float(delayed_scale(est, fmt)) * fmt.min_normal * 2.0 ** -fmt.mantissa_bits
    err = (deq - x64).abs()
    assert bool((err[inside] <= x64.abs()[inside] * step / 2 + tiny / 2 + 1e-12).all())
    limit = fmt.max * float(delayed_scale(est, fmt))
    assert torch.allclose(deq[~inside].abs(), torch.full_like(deq[~inside], limit))
    assert bool((deq[~inside].sign() == x64[~inside].sign()).all())


def test_non_finite_values_stay_non_finite_and_leave_the_estimate_alone():
    x = torch.tensor([[1.0, float("nan"), -2.0], [float("inf"), 0.5, float("-inf")]])
    est = torch.tensor(2.0)
    q = quantize_delayed(x, est, E4M3)
    deq = q.dequantize()
    assert bool(torch.isnan(deq[0, 1])) and bool(torch.isnan(deq[1, 0])) and bool(torch.isnan(deq[1, 2]))
    assert deq[0, 0].item() == 1.0 and deq[0, 2].item() == -2.0 and deq[1, 1].item() == 0.5
    new = next_amax(est, q, DEFAULT_DECAY)
    assert new.item() == 2.0 and new.dtype == torch.float32 and new.shape == ()


def test_the_estimate_tracks_a_steady_tensor_to_within_fp8_rounding():
    torch.manual_seed(1)
    est = torch.tensor(1.0)
    for _ in range(5):
        x = torch.randn(64, 64).clamp(-2, 2) * 7
        x[0, 0] = 20.0  # amax 20: saturates twice, then fits
        q = quantize_delayed(x, est, E4M3)
        est = next_amax(est, q, 1.0 if _ == 0 else DEFAULT_DECAY)
    assert est.item() == pytest.approx(20.0, rel=2.0 ** -(E4M3.mantissa_bits + 1))


def test_a_saturated_tensor_grows_the_estimate_and_a_shrinking_one_decays_it():
    est = torch.tensor(1.0)
    x = torch.full((4, 4), 100.0)  # 50x the headroom of the estimate
    q = quantize_delayed(x, est, E4M3)
    grown = next_amax(est, q, DEFAULT_DECAY)
    assert grown.item() == pytest.approx(GROWTH * HEADROOM * 1.0)  # the largest that fit, doubled
    seen = []
    for _ in range(6):  # grows geometrically until the tensor fits
        q = quantize_delayed(x, grown, E4M3)
        grown = next_amax(grown, q, DEFAULT_DECAY)
        seen.append(grown.item())
    assert seen[-1] == pytest.approx(100.0, rel=2.0 ** -4)
    small = torch.full((4, 4), 1.0)
    q = quantize_delayed(small, grown, E4M3)
    assert next_amax(grown, q, 0.5).item() == pytest.approx(grown.item() * 0.5)


def test_the_first_call_seeds_the_estimate_from_a_dynamic_quantization():
    x = torch.randn(32, 16) * 3
    q = quantize(x, E4M3, "tensorwise", "a")
    assert seed_amax(q).item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    bad = quantize(torch.tensor([[1.0, float("inf")]]), E4M3, "tensorwise", "a")
    assert seed_amax(bad).item() == 0.0  # no estimate from a non-finite tensor


def test_empty_and_bad_input():
    q = quantize_delayed(torch.empty(0, 8), torch.tensor(3.0), E4M3)
    assert q.data.shape == (0, 8) and q.data.dtype == E4M3.dtype
    assert next_amax(torch.tensor(3.0), q, DEFAULT_DECAY).item() == 3.0
    with pytest.raises(ValueError, match="2-D"):
        quantize_delayed(torch.ones(2, 3, 4), torch.tensor(1.0), E4M3)
    with pytest.raises(TypeError, match="float32/bf16/fp16"):
        quantize_delayed(torch.ones(2, 3, dtype=torch.int32), torch.tensor(1.0), E4M3)
    with pytest.raises(TypeError, match="float32/bf16/fp16"):
        quantize_delayed(torch.ones(2, 3).to(torch.float8_e4m3fn), torch.tensor(1.0), E4M3)
    # a zero estimate (none yet) gives the smallest scale, never a zero one
    assert delayed_scale(torch.tensor(0.0), E4M3).item() > 0
