"""The division the Triton quantizers use (``loka.kernels.triton.common.div_by_scale``):
``x / s`` as ``q = x * RN(1/s)`` and two fma corrections, claimed to be the correctly
rounded float32 quotient for ``|x / s| <= ~448`` (every FP8 scale is an amax over the
format's max). The kernels' tests check it bit for bit on a GPU; this test checks the
arithmetic itself, exactly: every operation of the sequence rounded once to float32 with
rational arithmetic (a true fma), on quotients chosen next to the FP8 formats' rounding
ties, where one float32 ulp changes the FP8 value, and on random ones."""

from fractions import Fraction

import numpy as np
import pytest
import torch


def rn32(v: Fraction) -> Fraction:
    """``v`` rounded to the nearest float32 (ties to even), subnormals included."""
    if v == 0:
        return Fraction(0)
    a = abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1  # now 2**e <= a < 2**(e + 1)
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rem = divmod(a, ulp)
    if rem > ulp / 2 or (rem == ulp / 2 and n % 2 == 1):
        n += 1
    return (n * ulp) if v > 0 else -(n * ulp)


def div_by_scale(x: Fraction, s: Fraction) -> Fraction:
    """The kernels' sequence, each operation rounded once (fma: one rounding)."""
    r = rn32(1 / s)
    q = rn32(x * r)
    for _ in range(2):
        e = rn32(q * -s + x)
        q = rn32(e * r + q)
    return q


def fp8_ties(fmt: str):
    """Midpoints between neighbouring positive FP8 values of ``fmt``: the float32
    quotients at which the cast to FP8 changes."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    v = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    v = torch.unique(v[torch.isfinite(v) & (v > 0)]).double()
    return ((v[1:] + v[:-1]) / 2).tolist()


def test_rn32_is_float32_rounding():
    rng = np.random.default_rng(0)
    for v in rng.standard_normal(2000) * np.exp2(rng.integers(-140, 100, 2000)):
        assert rn32(Fraction(float(v))) == Fraction(float(np.float32(v)))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_division_is_correctly_rounded_next_to_fp8_ties(fmt):
    rng = np.random.default_rng(1 if fmt == "e4m3" else 2)
    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    ties = fp8_ties(fmt)
    checked = 0
    for _ in range(120):
        # a scale as the kernels make it: amax * float32(1 / fmt.max), any mantissa
        amax = np.float32(rng.uniform(1, 2) * 2.0 ** rng.integers(-30, 30))
        s = Fraction(float(np.float32(amax * np.float32(1 / fmax))))
        for t in rng.choice(ties, 12):
            x0 = np.float32(float(Fraction(t) * s))
            for k in (-2, -1, 0, 1, 2):  # float32 neighbours of the tie's preimage
                x = Fraction(float(np.float32(x0).view(np.int32).__add__(k).view(np.float32)))
                for sx in (x, -x):
                    assert div_by_scale(sx, s) == rn32(sx / s), (float(sx), float(s))
                    checked += 1
    assert checked == 120 * 12 * 5 * 2


def test_division_is_correctly_rounded_on_random_quotients():
    rng = np.random.default_rng(3)
    for _ in range(4000):
        s = Fraction(float(np.float32(rng.uniform(1, 2) * 2.0 ** rng.integers(-40, 20))))
        x = Fraction(float(np.float32(float(s) * rng.uniform(-448, 448))))
        assert div_by_scale(x, s) == rn32(x / s), (float(x), float(s))
    # the mantissas where reciprocals are least accurate: all ones, and just above 1
    for s in (np.float32(2 - 2 ** -23), np.float32(1 + 2 ** -23), np.float32(1.5)):
        for x in np.float32(rng.uniform(-448, 448, 500)) * s:
            assert div_by_scale(Fraction(float(x)), Fraction(float(s))) == \
                rn32(Fraction(float(x)) / Fraction(float(s)))
