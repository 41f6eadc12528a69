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


# -- one correction for 16-bit values (``X16``) ----------------------------------------

def _one_correction(y: np.ndarray, s: np.float32, r: np.float32) -> np.ndarray:
    """``q0 = RN(y r)``, ``q1 = fma(fma(q0, -s, y), r, q0)`` in float32, each fma rounded
    once: the residual ``y - s q0`` is exact in float64 (``s q0`` has 48 bits and is within
    a factor 2 of ``y``), the final sum is rounded in float64 and, where that could have
    made a float32 tie, again exactly with rationals."""
    q0 = (y * r).astype(np.float32)
    e = (y.astype(np.float64) - np.float64(s) * q0.astype(np.float64)).astype(np.float32)
    t = q0.astype(np.float64) + e.astype(np.float64) * np.float64(r)
    out = t.astype(np.float32)
    lo, hi = np.nextafter(out, np.float32(-np.inf)), np.nextafter(out, np.float32(np.inf))
    o64 = out.astype(np.float64)
    near = np.minimum(np.abs(t - (o64 + lo) / 2), np.abs(t - (o64 + hi) / 2)) \
        <= (hi.astype(np.float64) - lo) * 1e-6
    for i in np.nonzero(near)[0]:
        exact = Fraction(float(q0[i])) + Fraction(float(e[i])) * Fraction(float(r))
        out[i] = np.float32(float(rn32(exact)))
    return out


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("mant_bits", [7, 10])
def test_one_correction_gives_the_fp8_value_for_16_bit_inputs(fmt, mant_bits):
    """The claim behind ``X16``: for bf16 (7 mantissa bits) and fp16 (10 bits) values
    ``y`` and any amax of the same format, one correction gives the FP8 value of the
    correctly rounded quotient, for every ``y <= amax`` over 42 binades below the amax
    (past them both are zero in either format). The quotient alone (no correction) is
    checked to differ somewhere, so this test can fail."""
    from loka.numerics.scaling import AMAX_EPS

    fmax = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    mant = (1 + np.arange(2 ** mant_bits) / 2 ** mant_bits).astype(np.float32)
    c = np.float32(1) / np.float32(fmax)

    def fp8(v):
        return torch.from_numpy(np.clip(v, -fmax, fmax)).to(dtype).view(torch.uint8).numpy()

    checked = no_correction_differs = 0
    amaxes = list(mant * np.float32(8)) + [np.float32(AMAX_EPS / 2)]
    for amax in amaxes:
        s = np.float32(np.float32(max(amax, np.float32(AMAX_EPS))) * c)
        r = np.float32(np.float32(1) / s)
        e0 = int(np.floor(np.log2(amax)))
        y = (mant[None, :] * np.exp2(e0 - np.arange(42.0))[:, None]).astype(np.float32).ravel()
        y = y[y <= amax]
        want = fp8((y / s).astype(np.float32))  # IEEE division, as torch divides
        got = fp8(_one_correction(y, s, r))
        assert np.array_equal(got, want), (float(amax), y[got != want][:5])
        assert np.array_equal(fp8(_one_correction(-y, s, r)), fp8((-y / s).astype(np.float32)))
        no_correction_differs += int((fp8((y * r).astype(np.float32)) != want).sum())
        checked += y.size
    assert checked > 40 * len(amaxes) * 2 ** mant_bits // 2
    assert no_correction_differs > 0
