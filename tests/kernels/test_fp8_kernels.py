"""Numerics of the FP8 kernels: emulated twins vs the real torch._scaled_mm on the CPU,
and the accuracy regimes of each scaling granularity against float64 references."""

import math

import pytest
import torch

from loka.config import Role
from loka.kernels import available, gemm, get
from loka.kernels.emulated import EMULATED
from loka.numerics import mere, quantize, rowwise_relative_error, sqnr
from tests.support import assert_finite_operands, cpu_scaled_mm_scales_operands

REAL_ON_CPU = [k.name for k in available("cpu") if k.library == "cublas"]
TWINS = [(n, spec[1]) for n, spec in EMULATED.items() if spec[1] in REAL_ON_CPU]


def test_cpu_build_has_real_fp8_kernels():
    assert "cublas-tensorwise" in REAL_ON_CPU


@pytest.mark.parametrize("emulated,real", TWINS)
@pytest.mark.parametrize("shape", [(64, 128, 32), (128, 512, 256), (16, 64, 48)])
def test_emulated_twin_matches_real_kernel(emulated, real, shape):
    m, k, n = shape
    a, b = torch.randn(m, k) * 3, torch.randn(k, n)
    e, r = get(emulated)(a, b, torch.float32), get(real)(a, b, torch.float32)
    if get(real).scaling == "rowwise":
        # the library writes bf16 for rowwise: agree to one bf16 ulp (double rounding)
        torch.testing.assert_close(e.bfloat16().float(), r, rtol=2 ** -7, atol=0)
    else:
        rel = ((e - r).abs().max() / r.abs().max()).item()
        assert rel < 1e-5


def _fp8_kernels(role="fwd"):
    return [k.name for k in available("cpu", shape=(128, 256, 256), role=role, fp8_only=True)]


@pytest.mark.parametrize("name", _fp8_kernels())
def test_sqnr_on_gaussian_inputs(name):
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    ref = a.double() @ b.double()
    out = get(name)(a, b, torch.float32)
    db = sqnr(out, ref)
    fmt = get(name).formats[0]
    # e4m3: ~28 dB is typical (3 mantissa bits); e5m2 operands lose ~6 dB (2 bits)
    assert db >= (25.0 if fmt.startswith("e4m3") else 19.0), db
    assert db <= 40.0  # it is FP8, not a float32 GEMM in disguise


def _outlier_rows(mag, m=256, k=512):
    a = torch.randn(m, k, dtype=torch.float64)
    a[::32] *= mag
    return a


def test_rowwise_beats_tensorwise_on_extreme_outlier_rows():
    a, b = _outlier_rows(1e5), torch.randn(512, 256, dtype=torch.float64)
    ref = a @ b
    tw = rowwise_relative_error(get("emulated-tensorwise-e4m3")(a.float(), b.float(), torch.float64), ref).mean()
    rw = rowwise_relative_error(get("emulated-rowwise-e4m3")(a.float(), b.float(), torch.float64), ref).mean()
    assert tw >= 3 * rw, (tw, rw)
    assert rw < 0.05


def test_moderate_outlier_rows_fit_e4m3_range():
    # at 1e3x the ordinary rows still lie in e4m3's normal range: the two are close
    a, b = _outlier_rows(1e3), torch.randn(512, 256, dtype=torch.float64)
    ref = a @ b
    tw = rowwise_relative_error(get("emulated-tensorwise-e4m3")(a.float(), b.float(), torch.float64), ref).mean()
    rw = rowwise_relative_error(get("emulated-rowwise-e4m3")(a.float(), b.float(), torch.float64), ref).mean()
    assert tw < 1.25 * rw and tw < 0.05


def test_blockwise_at_least_as_good_as_rowwise_on_block_outliers():
    # each row has one 128-wide K block of outliers; b damps that block so that every
    # block contributes to the output: rowwise pushes the ordinary blocks into underflow
    m, k, n = 128, 512, 128
    a = torch.randn(m, k, dtype=torch.float64)
    b = torch.randn(k, n, dtype=torch.float64)
    for i in range(m):
        blk = (i % 4) * 128
        a[i, blk:blk + 128] *= 1e5
    b[:128] /= 1e5
    ref = a @ b
    errs = {}
    for g in ("tensorwise", "rowwise", "blockwise"):
        out = get(f"emulated-{g}-e4m3")(a.float(), b.float(), torch.float64)
        errs[g] = rowwise_relative_error(out, ref).mean().item()
    assert errs["blockwise"] <= errs["rowwise"] <= errs["tensorwise"] * 1.01
    assert errs["blockwise"] < 0.05 and errs["rowwise"] > 1.5 * errs["blockwise"], errs


@pytest.mark.parametrize("name", ["emulated-tensorwise-e4m3", "cublas-tensorwise",
                                  "emulated-rowwise-e4m3", "emulated-blockwise-e4m3"])
def test_non_finite_inputs_propagate(name):
    a, b = torch.randn(32, 128), torch.randn(128, 32)
    a[0, 0] = math.inf
    out = get(name)(a, b, torch.float32)
    assert not torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["emulated-tensorwise-e4m3", "cublas-tensorwise", "emulated-rowwise-e4m3"])
def test_zero_operands_give_zero(name):
    out = get(name)(torch.zeros(16, 64), torch.randn(64, 32), torch.float32)
    assert torch.equal(out, torch.zeros(16, 32))


def test_prequantized_operands_are_used_as_is():
    k = get("emulated-rowwise-e4m3")
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    qa, qb = k.quantize_a(a), k.quantize_b(b)
    torch.testing.assert_close(k(qa, qb, torch.float32), k(a, b, torch.float32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="quantized as"):
        k(quantize(a, "e4m3", "tensorwise"), b, torch.float32)


def test_fp8_error_vs_bf16_on_heavy_tails():
    # ANCHORS: relative Frobenius error tensorwise ~0.037, bf16 ~0.003 on such data
    a = torch.distributions.StudentT(3.0).sample((256, 512))
    b = torch.randn(512, 256)
    ref = a.double() @ b.double()
    bf16 = get("bf16")(a.bfloat16(), b.bfloat16(), torch.float32)
    fp8 = get("emulated-tensorwise-e4m3")(a, b, torch.float32)
    assert mere(bf16, ref) * 4 < mere(fp8, ref)


# -- reliability (issue 29) ----------------------------------------------------------------
CPU_KERNELS = [k.name for k in available("cpu")]


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("m,k,n", [(0, 128, 128), (128, 0, 128), (128, 128, 0), (0, 0, 0)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_empty_gemm_gives_an_empty_or_zero_result(name, m, k, n, out_dtype):
    out = gemm(name, torch.randn(m, k), torch.randn(k, n), out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.equal(out, torch.zeros(m, n, dtype=out_dtype))  # K = 0: the empty sum


@pytest.mark.parametrize("name", [n for n in CPU_KERNELS if get(n).is_fp8])
def test_empty_gemm_takes_prequantized_empty_operands(name):
    kern = get(name)
    qa, qb = kern.quantize_a(torch.randn(0, 64)), kern.quantize_b(torch.randn(64, 32))
    assert kern(qa, qb, torch.float32).shape == (0, 32)


def test_empty_gemm_still_checks_shapes():
    with pytest.raises(ValueError, match="do not match"):
        gemm("cublas-tensorwise", torch.randn(0, 16), torch.randn(32, 8))


@pytest.mark.parametrize("emulated,real", TWINS)
@pytest.mark.parametrize("a_val,b_val", [(3e38, 1e-10), (1e-10, 3e38), (3e38, -1e-10),
                                         (-1e-10, 1e-10), (1e20, 1e15)])
def test_twins_agree_on_extreme_finite_operands(emulated, real, a_val, b_val):
    # the exact product stays within float32: neither kernel may overflow on the way (and
    # every amax is above AMAX_EPS, below which a block quantizes to zeros by design)
    a, b = torch.full((16, 128), a_val), torch.full((128, 16), b_val)
    e = get(emulated)(a, b, torch.float32)
    expected = a_val * b_val * 128
    assert torch.isfinite(e).all()
    torch.testing.assert_close(e.double(), torch.full_like(e, expected).double(), rtol=2 ** -7, atol=0)
    r = get(real)(a, b, torch.float32)
    if not torch.isfinite(r).all() and get(real).scaling == "tensorwise" and \
            cpu_scaled_mm_scales_operands():
        # the CPU build's GEMM scales the operands before it accumulates here, where cuBLAS
        # scales the accumulator (tests/support.py), and overflows on the way; LoKA's
        # operands are finite
        assert_finite_operands(get(real), a, b)
        return
    assert torch.isfinite(r).all()
    torch.testing.assert_close(e.bfloat16().float(), r.bfloat16().float(), rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("name", [n for n in CPU_KERNELS if get(n).is_fp8])
@pytest.mark.parametrize("value", [1e300, 3e38])
def test_finite_operands_never_give_nan(name, value):
    torch.manual_seed(0)
    a = torch.randn(16, 64, dtype=torch.float64)
    a[:, :4] = value
    a[:, 4:8] = -value
    b = torch.randn(64, 32, dtype=torch.float64)
    out = get(name)(a, b, torch.float64)
    if out.isnan().any() and get(name).scaling == "tensorwise" and \
            cpu_scaled_mm_scales_operands():
        # the CPU build's GEMM scales the operands before it accumulates here, where cuBLAS
        # scales the accumulator (tests/support.py): its NaN is the library's order of
        # arithmetic; what LoKA hands it is finite
        assert_finite_operands(get(name), a, b)
        return
    assert not out.isnan().any()
    if get(name).is_emulated:  # scales applied in float64: the float64 result is finite
        assert torch.isfinite(out).all()


@pytest.mark.skipif(not hasattr(torch.nn.functional, "scaled_mm"), reason="no F.scaled_mm")
@pytest.mark.parametrize("k", [128, 256, 384, 512, 640])
def test_blockwise_weight_scales_are_laid_out_as_scaled_mm_checks_them(k):
    """F.scaled_mm reads a weight's 128x128 scales with its K-blocks padded to a multiple of
    four (its meta function checks it; torch 2.11 on an H100 refused K = 256 otherwise).
    Checked on meta tensors, and the padded table holds the scales where they were."""
    from loka.kernels.cublas import _k_blocks_in_fours, _scaled_mm
    from loka.numerics import Granularity, QTensor, get_format
    m, n, fmt = 128, 256, get_format("e4m3")
    a = torch.empty(m, k, device="meta", dtype=torch.float8_e4m3fn)
    b = torch.empty(n, k, device="meta", dtype=torch.float8_e4m3fn).t()
    qa = QTensor(a, torch.empty(m, k // 128, device="meta"), fmt, (1, 128),
                 Granularity.BLOCKWISE)
    qb = QTensor(b, torch.empty(k // 128, n // 128, device="meta"), fmt, (128, 128),
                 Granularity.BLOCKWISE)
    out = _scaled_mm(qa, qb, torch.bfloat16, False, Granularity.BLOCKWISE)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    scale = torch.rand(k // 128, n // 128) + 0.5
    padded = _k_blocks_in_fours(scale)
    l4 = -(-(k // 128) // 4) * 4
    assert padded.shape == (l4, n // 128) and padded.stride() == (1, l4)
    assert torch.equal(padded[:k // 128], scale)
