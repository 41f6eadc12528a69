"""Delayed tensorwise scaling (loka.numerics.delayed): the cast with a scale estimated at
earlier calls, and how the ``(est, streak)`` state follows the tensor."""

import math

import pytest
import torch

from loka.numerics import AMAX_EPS, E4M3, E5M2, dequantize, quantize
from loka.numerics.delayed import (DEFAULT_DECAY, HEADROOM, MAX_ESTIMATE, MAX_STREAK, OVERSHOOT,
                                   STREAK_GROWTH, delayed_scale, new_state, next_state,
                                   quantize_delayed, seed_state)


def _state(est, streak=STREAK_GROWTH):
    return torch.tensor(float(est)), torch.tensor(float(streak))


def _values(state):
    return [t.item() for t in state]


def _calls(values, state, n, decay=DEFAULT_DECAY, fmt=E4M3):
    """``n`` calls on the same tensor; the estimates after each."""
    out = []
    for _ in range(n):
        q = quantize_delayed(values, state[0], fmt)
        state = next_state(*state, q, decay)
        out.append(state[0].item())
    return out, state


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cast_is_a_static_tensorwise_quantization_with_the_estimates_scale(fmt, dtype):
    torch.manual_seed(0)
    x = (torch.randn(48, 80) * 3).to(dtype)
    q = quantize_delayed(x, torch.tensor(5.0), fmt)
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


def test_non_finite_values_stay_non_finite_and_leave_the_state_alone():
    x = torch.tensor([[1.0, float("nan"), -2.0], [float("inf"), 0.5, float("-inf")]])
    state = _state(2.0, 16.0)
    q = quantize_delayed(x, state[0], E4M3)
    deq = q.dequantize()
    assert bool(torch.isnan(deq[0, 1])) and bool(torch.isnan(deq[1, 0])) and bool(torch.isnan(deq[1, 2]))
    assert deq[0, 0].item() == 1.0 and deq[0, 2].item() == -2.0 and deq[1, 1].item() == 0.5
    new = next_state(*state, q, DEFAULT_DECAY)
    assert _values(new) == [2.0, 16.0] and all(t.dtype == torch.float32 for t in new)


def test_the_estimate_tracks_a_steady_tensor_to_within_fp8_rounding():
    torch.manual_seed(1)
    x = torch.randn(64, 64).clamp(-2, 2) * 7
    x[0, 0] = 20.0  # amax 20
    ests, state = _calls(x, _state(20.0), 5)
    for e in ests:
        assert e == pytest.approx(20.0, rel=2.0 ** -(E4M3.mantissa_bits + 1))
    assert state[1].item() == STREAK_GROWTH  # no saturation, no streak


def test_growth_per_saturated_call_compounds_and_the_next_fit_trims_an_overshoot():
    x = torch.full((4, 4), 100.0)
    # from an estimate of 1: x4 (saturated, 4 < 50), x16 (64 fits 100 with the headroom)
    ests, state = _calls(x, _state(1.0), 4)
    assert ests[0] == pytest.approx(4.0) and ests[1] == pytest.approx(64.0)
    assert ests[2] == pytest.approx(100.0, rel=2 ** -4) and state[1].item() == STREAK_GROWTH
    # the smallest estimate (a new state's) finds the range within six saturated calls
    ests, _ = _calls(x, new_state(), 8)
    first_fit = next(i for i, e in enumerate(ests) if HEADROOM * e >= 100.0)
    assert first_fit <= 6, ests
    assert 100.0 <= ests[first_fit + 1] <= OVERSHOOT * 100.0 * (1 + 2 ** -4)
    # the streak stops growing at MAX_STREAK (its overshoot stays inside the FP8 range)
    _, after = _calls(x, _state(AMAX_EPS, MAX_STREAK), 1)
    assert after[1].item() == MAX_STREAK
    # right after a growth, an estimate far above the amax is brought to OVERSHOOT x it
    _, grown = _calls(x, _state(1.0), 1)  # saturated: the streak is up
    over = (torch.tensor(1e6), grown[1])
    ests, _ = _calls(x, over, 1)
    assert ests[0] == pytest.approx(OVERSHOOT * 100.0, rel=2 ** -4)


@pytest.mark.parametrize("ratio", [10.0, 50.0, 100.0])
def test_an_operand_whose_amax_alternates_stops_clipping(ratio):
    """A Linear used by two inputs of different sizes: after a few calls the estimate
    covers the larger and no call saturates (the estimate decays between the large ones
    by one factor of ``decay`` only)."""
    small, big = torch.full((4, 4), 1.0), torch.full((4, 4), ratio)
    state = _state(1.0)
    saturated = []
    for i in range(40):
        t = big if i % 2 else small
        q = quantize_delayed(t, state[0], E4M3)
        saturated.append(bool(q.data.float().abs().max() >= E4M3.max))
        state = next_state(*state, q, DEFAULT_DECAY)
    assert not any(saturated[10:]), saturated


def test_a_shrinking_tensor_decays_the_estimate_and_an_all_zero_one_only_decays_it():
    small = torch.full((4, 4), 90.0)
    ests, _ = _calls(small, _state(100.0), 1, decay=0.5)
    assert ests[0] == pytest.approx(90.0, rel=2 ** -4)  # max(seen, 0.5 * 100)
    ests, _ = _calls(torch.full((4, 4), 30.0), _state(100.0), 1, decay=0.9)
    assert ests[0] == pytest.approx(90.0)  # no growth before: only the decay
    ests, state = _calls(torch.zeros(4, 4), _state(8.0), 2, decay=0.5)
    assert ests == [4.0, 2.0] and state[1].item() == STREAK_GROWTH


@pytest.mark.parametrize("decay", [0.1, 0.9, 1.0])
def test_the_estimate_never_reaches_zero_or_infinity(decay):
    """A long all-zero stretch decays the estimate only down to AMAX_EPS, from where tiny
    gradients are found by growth (seven calls at most); growth stops short of overflow."""
    _, state = _calls(torch.zeros(4, 4), _state(1.0), 300, decay=decay)
    assert state[0].item() >= AMAX_EPS * (1 - 1e-6) and math.isfinite(state[0].item())
    tiny = torch.full((4, 4), 1e-6)
    ests, _ = _calls(tiny, state, 8, decay=decay)
    assert any(HEADROOM * e >= 1e-6 for e in ests[:7]), ests
    huge = torch.full((2, 2), 3e38)
    ests, state = _calls(huge, _state(MAX_ESTIMATE / 2, MAX_STREAK), 3)
    assert all(math.isfinite(e) for e in ests) and max(ests) <= MAX_ESTIMATE


def test_the_first_call_seeds_from_a_dynamic_quantization_unless_it_says_nothing():
    x = torch.randn(32, 16) * 3
    q = quantize(x, E4M3, "tensorwise", "a")
    seeded = seed_state(*_state(1.0, 64.0), q)
    assert seeded[0].item() == pytest.approx(x.abs().max().item(), rel=1e-6)
    assert seeded[1].item() == STREAK_GROWTH
    for bad in (torch.tensor([[1.0, float("inf")]]), torch.zeros(3, 3)):
        q = quantize(bad, E4M3, "tensorwise", "a")
        assert _values(seed_state(*_state(7.0), q)) == [7.0, STREAK_GROWTH]
    fresh = new_state()
    assert _values(fresh) == [pytest.approx(AMAX_EPS), STREAK_GROWTH]
    assert all(t.dtype == torch.float32 and t.shape == () for t in fresh)


def test_empty_and_bad_input():
    q = quantize_delayed(torch.empty(0, 8), torch.tensor(3.0), E4M3)
    assert q.data.shape == (0, 8) and q.data.dtype == E4M3.dtype
    assert _values(next_state(*_state(3.0), q, DEFAULT_DECAY)) == [3.0, STREAK_GROWTH]
    with pytest.raises(ValueError, match="2-D"):
        quantize_delayed(torch.ones(2, 3, 4), torch.tensor(1.0), E4M3)
    with pytest.raises(TypeError, match="float32/bf16/fp16"):
        quantize_delayed(torch.ones(2, 3, dtype=torch.int32), torch.tensor(1.0), E4M3)
    with pytest.raises(TypeError, match="float32/bf16/fp16"):
        quantize_delayed(torch.ones(2, 3).to(torch.float8_e4m3fn), torch.tensor(1.0), E4M3)
    # a zero estimate gives the smallest scale, never a zero one (no NaN from 0/0)
    assert delayed_scale(torch.tensor(0.0), E4M3).item() > 0
    q = quantize_delayed(torch.zeros(2, 2), torch.tensor(0.0), E4M3)
    assert not bool(torch.isnan(q.data.float()).any())
    assert math.isfinite(float(next_state(*_state(0.0), q, DEFAULT_DECAY)[0]))
