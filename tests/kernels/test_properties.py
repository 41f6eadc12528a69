"""Properties of the FP8 kernels (loka/kernels/emulated.py, cublas.py): every emulated twin
agrees with its real kernel where the real one runs here (torch's CPU ``_scaled_mm``), on
random shapes (empty, 1, not multiples of 16), input dtypes and distributions
(hypothesis; a few dozen examples each).

Agreement, per output element, with ``S = |A| @ |B|`` over the dequantized operands (the
recipe's own quantization, shared by both twins) computed in float64::

    |emulated - real|  <=  (2**-8 + K * 2**-22) * S  +  K * 2**-126

``2**-8`` covers a bf16 output (the rowwise library writes bf16: half a step is 2**-9 of
the value, the emulated float32 result then rounded once more), ``K * 2**-22`` the two
accumulation orders in float32, ``K * 2**-126`` results near float32's subnormals. It is
asserted where ``S`` is within float32's range: beyond, a partial sum of one twin can
overflow where the other's does not (torch's CPU kernel dequantizes before it reduces, the
emulation after, as GPUs do; on CPUs with AMX it scales a product by one operand's scale
before the other's, so a product of one dequantized operand with the other's FP8 values
must be in range too), and the emulated result must only not be NaN.
"""

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loka.kernels import available, get  # noqa: E402
from loka.kernels.emulated import EMULATED  # noqa: E402
from loka.numerics import FLOAT32_MAX  # noqa: E402
from tests.support import cpu_scaled_mm_scales_operands  # noqa: E402

PROPERTY = settings(max_examples=40, deadline=None, database=None)
REAL_ON_CPU = {k.name for k in available("cpu") if k.library == "cublas"}
TWINS = sorted((name, spec[1]) for name, spec in EMULATED.items() if spec[1] in REAL_ON_CPU)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
KINDS = ["normal", "heavy", "outliers", "huge-a", "tiny-b", "row-scales"]
ROWS = st.one_of(st.sampled_from([0, 1, 3, 17, 64]), st.integers(0, 96))
ALIGNED = st.sampled_from([0, 16, 32, 48, 128, 144])  # K and N: the kernels' alignment


def operands(m, k, n, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    b = torch.randn(k, n, generator=g, dtype=torch.float64)
    big = float(torch.finfo(dtype).max)
    if kind == "heavy":
        a = a / torch.randn(m, k, generator=g, dtype=torch.float64).abs().clamp(min=1e-3)
    elif kind == "outliers" and a.numel():
        a.view(-1)[torch.randint(0, a.numel(), (max(1, a.numel() // 40),), generator=g)] *= 1e3
    elif kind == "huge-a":  # the case: a near the top of the range, b small
        a = a * min(big / 8, 1e38)
        b = b * 1e-10
    elif kind == "tiny-b":
        b = b * 1e-9
    elif kind == "row-scales" and a.numel():
        a = a * torch.pow(10.0, torch.empty(m, 1, dtype=torch.float64).uniform_(-6, 6, generator=g))
    return a.clamp(-big, big).to(dtype), b.clamp(-big, big).to(dtype)


@pytest.mark.skipif(not TWINS, reason="this torch build has no CPU _scaled_mm")
@PROPERTY
@given(twin=st.sampled_from(TWINS), m=ROWS, k=ALIGNED, n=ALIGNED, dtype=st.sampled_from(DTYPES),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 2 ** 31 - 1))
def test_emulated_twins_agree_with_the_real_kernel(twin, m, k, n, dtype, kind, seed):
    emulated, real = get(twin[0]), get(twin[1])
    a, b = operands(m, k, n, dtype, kind, seed)
    e, r = emulated(a, b, torch.float32), real(a, b, torch.float32)
    assert e.shape == r.shape == (m, n) and e.dtype == r.dtype == torch.float32
    assert not e.isnan().any()
    if e.numel() == 0:
        return
    qa, qb = emulated.quantize_a(a), emulated.quantize_b(b)
    da, db = qa.dequantize(torch.float64).abs(), qb.dequantize(torch.float64).abs()
    s = da @ db
    checked = s <= FLOAT32_MAX / 4
    if cpu_scaled_mm_scales_operands():
        # this CPU's kernel multiplies one operand's scale into its products before the
        # other's (tests/support.py): a product of one dequantized operand with the other's
        # FP8 values must stay in range too
        fa, fb = qa.data.double().abs(), qb.data.double().abs()
        checked &= (da @ fb <= FLOAT32_MAX / 4) & (fa @ db <= FLOAT32_MAX / 4)
    tol = (2.0 ** -8 + k * 2.0 ** -22) * s + k * 2.0 ** -126
    diff = (e.double() - r.double()).abs()
    bad = checked & ~(diff <= tol)
    assert not bad.any(), (f"{int(bad.sum())} element(s) disagree; e={e[bad][0].item():.6g} "
                           f"r={r[bad][0].item():.6g} S={s[bad][0].item():.3g}")


@PROPERTY
@given(name=st.sampled_from(sorted(k.name for k in available("cpu"))), m=ROWS,
       k=st.sampled_from([0, 128, 256]), n=st.sampled_from([0, 128]),
       dtype=st.sampled_from(DTYPES), kind=st.sampled_from(KINDS), seed=st.integers(0, 2 ** 31 - 1))
def test_every_kernel_gives_the_right_shape_and_no_nan_from_finite_input(name, m, k, n, dtype,
                                                                        kind, seed):
    kern = get(name)
    a, b = operands(m, k, n, dtype, kind, seed)
    if not kern.is_fp8:  # bf16 and fp32 run in the operands' own dtype
        b = b.to(a.dtype)
    out = kern(a, b, torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    if k == 0:
        assert torch.equal(out, torch.zeros(m, n))
    if kern.is_emulated:  # scales applied in float64: finite operands never give NaN
        assert not out.isnan().any()
