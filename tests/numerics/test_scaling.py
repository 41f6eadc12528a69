import math

import pytest
import torch

from loka.numerics import (AMAX_EPS, E4M3, FORMATS, Granularity, compute_scales, dequantize,
                           fake_quantize, in_memory_order, quantize, relative_frobenius,
                           rowwise_relative_error, sqnr)

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


# -- reliability (issue 29): empty operands, values beyond float32, bad static scales ------
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("operand,shape", [("a", (0, 160)), ("a", (16, 0)), ("b", (160, 0)),
                                           ("b", (0, 16)), ("a", (0, 0))])
def test_empty_operands_quantize_and_dequantize(gran, operand, shape):
    q = quantize(torch.empty(*shape), "e4m3", gran, operand)
    out = dequantize(q)
    assert out.shape == shape and out.dtype == torch.float32
    assert q.data.shape == shape and q.data.dtype == torch.float8_e4m3fn
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


def test_empty_tensorwise_scale_is_one_finite_number():
    q = quantize(torch.empty(0, 160), "e4m3", "tensorwise")
    assert q.scale.shape == (1, 1) and q.scale.item() == pytest.approx(AMAX_EPS / 448)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("value", [1e300, -1e300, 1e39])
def test_finite_values_beyond_float32_saturate_and_never_give_nan(fmt, gran, value):
    x = torch.randn(8, 256, dtype=torch.float64)
    x[0, :3] = value  # the rest of the tensor keeps its own scale where blocks allow
    q = quantize(x, fmt, gran)
    out = dequantize(q, torch.float64)
    assert not out.isnan().any() and torch.isfinite(q.scale).all()
    f32max = torch.finfo(torch.float32).max
    assert out[0, 0].item() == pytest.approx(math.copysign(f32max, value), rel=1e-6)
    if gran != "mx":  # MX rounds its power-of-two scale up: 2**128 is inf in float32
        assert torch.isfinite(dequantize(q)).all()  # saturated, not overflowed
    assert not dequantize(q).isnan().any()


def test_float64_infinity_and_nan_still_propagate():
    x = torch.randn(4, 32, dtype=torch.float64)
    x[0, 0] = math.inf
    assert not torch.isfinite(fake_quantize(x)).all()
    x[0, 0] = math.nan
    assert fake_quantize(x).isnan().any()


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_static_scale_must_be_finite_and_positive(scale):
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.randn(4, 16), scale=torch.tensor([scale]))


def test_static_scale_must_have_one_value_per_block():
    with pytest.raises(ValueError, match="scale"):
        quantize(torch.randn(4, 16), granularity="rowwise", scale=torch.ones(3))
    q = quantize(torch.randn(4, 16), granularity="rowwise", scale=torch.ones(4))  # (4,) reshapes
    assert q.scale.shape == (4, 1)


def test_static_scale_check_can_be_left_to_the_caller():
    # loka.Linear validates its static input scale once (set_input_amax), not per call
    q = quantize(torch.randn(4, 16), scale=torch.tensor(0.5), check_scale=False)
    assert q.scale.item() == 0.5


def test_a_whole_tensor_amax_reads_a_transposed_view_in_memory_order():
    """in_memory_order gives the contiguous transpose of a transposed view (the same amax,
    read without a row's stride) and leaves every other tensor as it is; the tensorwise
    and one-row scales of a transposed view equal those of its contiguous copy, against a
    float64 reference."""
    torch.manual_seed(0)
    w = torch.randn(48, 80) * 3
    wt = w.t()
    assert in_memory_order(wt).data_ptr() == w.data_ptr() and in_memory_order(wt).is_contiguous()
    assert in_memory_order(w) is w
    strided = torch.randn(40, 100)[:, ::2]  # neither it nor its transpose is contiguous
    assert in_memory_order(strided) is strided
    cube = torch.randn(2, 3, 4).transpose(0, 2)
    assert in_memory_order(cube) is cube  # 2-D only
    ref = float(w.double().abs().max()) / E4M3.max
    for view in (wt, wt.contiguous()):
        s = compute_scales(view, E4M3, (-1, -1))
        assert s.shape == (1, 1) and abs(float(s) - ref) <= 1e-7 * ref
    one_row = torch.randn(1, 64)
    col = one_row.t()  # (64, 1), its transpose contiguous: one block either way
    s = compute_scales(col, E4M3, (-1, 1))
    assert s.shape == (1, 1)
    assert abs(float(s) - float(one_row.double().abs().max()) / E4M3.max) <= 1e-7 * float(s)
    q = quantize(wt, E4M3, "tensorwise", "b")
    assert torch.equal(q.scale, quantize(wt.contiguous(), E4M3, "tensorwise", "b").scale)


def test_whole_tensor_reductions_are_given_the_memory_order_tensor(monkeypatch):
    """The amax of a dynamic tensorwise scale and of a delayed estimate is taken over the
    contiguous transpose of a transposed view (the values above cannot show it: they are
    equal either way); a rowwise scale of a transposed view keeps its own blocks."""
    import loka.numerics.delayed as delayed
    import loka.numerics.scaling as scaling
    seen = []
    real = scaling._blocked
    monkeypatch.setattr(scaling, "_blocked", lambda x, br, bc: (seen.append(
        (x.is_contiguous(), (br, bc))), real(x, br, bc))[1])
    w = torch.randn(48, 80)
    compute_scales(w.t(), E4M3, (-1, -1))
    assert seen == [(True, (48, 80))]
    seen.clear()
    compute_scales(w.t(), E4M3, (1, -1))  # one scale per row of wᵀ: not one block
    assert seen == [(False, (1, 48))]
    orders = []
    monkeypatch.setattr(delayed, "in_memory_order",
                        lambda t: (orders.append(t.is_contiguous()), scaling.in_memory_order(t))[1])
    est, streak = delayed.new_state()
    q = delayed.quantize_delayed(w.t(), est.fill_(3.0), E4M3)
    assert not q.data.is_contiguous() and q.data.t().is_contiguous()
    delayed.next_state(est, streak, q, 0.9)
    assert orders == [False]  # the FP8 wᵀ went through in_memory_order


def test_no_code_calls_the_granularity_enum_on_a_value_torch_2_11_cannot_trace():
    """Dynamo in torch 2.11 fails on ``Granularity(Granularity.TENSORWISE)`` inside a
    compiled region (a compiled delayed Linear's first call did, on the GPU): loka calls
    ``as_granularity`` instead, which returns members as they are and looks names up."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[2] / "loka"
    calls = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"(?<![\w`])(?:[A-Za-z_]\w*\.)*Granularity\(", line.split("#")[0])
             and "class Granularity(" not in line]
    assert calls == []
    from loka.numerics import as_granularity
    for g in Granularity:
        assert as_granularity(g) is g and as_granularity(g.value) is g
    for bad in ("row", None, 3):
        with pytest.raises(ValueError, match="not a valid Granularity"):
            as_granularity(bad)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_requantize_transposed_dequantizes_as_the_direct_quantization(fmt):
    """Power-of-two rowwise rows, requantized along the other axis, dequantize to exactly
    the direct power-of-two quantization of ``x.t()`` (float64) where every value is normal
    under both scales: features spread over a decade and a half, outlier channels 100x."""
    from loka.numerics import requantize_transposed

    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 96, generator=g) * torch.exp(torch.randn(96, generator=g))
    x[:, [5, 40]] *= 100
    q = quantize(x, fmt, "rowwise", "a", power_of_two=True)
    r = requantize_transposed(q)
    direct = quantize(x.t(), fmt, "rowwise", "a", power_of_two=True)
    assert r.data.shape == (96, 512) and r.scale.shape == (96, 1) and r.data.is_contiguous()
    assert r.granularity == Granularity.ROWWISE and r.block == (1, 512)
    assert torch.equal(torch.frexp(r.scale)[0], torch.full_like(r.scale, 0.5))
    fp = FORMATS[fmt]
    mine, ref = r.dequantize(torch.float64), direct.dequantize(torch.float64)
    normal = ((x.t().double().abs() / q.scale.t().double() >= fp.min_normal)
              & (x.t().double().abs() / direct.scale.double() >= fp.min_normal)
              & (x.t().double().abs() / r.scale.double() >= fp.min_normal))
    assert normal.double().mean() > 0.97
    assert torch.equal(mine[normal], ref[normal])
    # the rest was rounded twice: within both roundings' half steps of x
    xt = x.t().double()
    half_sub = fp.min_normal * 2.0 ** -(fp.mantissa_bits + 1)
    bound = (xt.abs() * 2.0 ** -(fp.mantissa_bits + 1)
             + (q.scale.t().double() + r.scale.double()) * half_sub)
    assert ((mine - xt).abs() <= bound).all()


def test_requantize_transposed_rounds_twice_only_below_the_normal_range():
    """A row whose largest value is 2**16 times its others puts those below e4m3's normal
    range under the row's scale: requantized, they keep only the row's subnormal grid
    (the direct quantization keeps more), and stay within the two half steps."""
    from loka.numerics import requantize_transposed

    x = torch.full((4, 8), 1.3)
    x[0, 0] = 1.3 * 2.0 ** 16
    q = quantize(x, "e4m3", "rowwise", "a", power_of_two=True)
    r = requantize_transposed(q).dequantize(torch.float64)
    direct = quantize(x.t(), "e4m3", "rowwise", "a", power_of_two=True).dequantize(
        torch.float64)
    xt = x.t().double()
    # x's rows and columns without the outlier: normal under both scales, as direct
    assert torch.equal(r[1:, 1:], direct[1:, 1:])
    # the outlier's row's other values: on the row's subnormal grid, coarser than direct's
    off = (r[1:, 0] - xt[1:, 0]).abs()
    assert (off > (direct[1:, 0] - xt[1:, 0]).abs()).all()
    step = q.scale[0, 0].double() * 2.0 ** -9  # e4m3's subnormal step under the row's scale
    assert (off <= step / 2).all()


def test_requantize_transposed_refuses_what_it_cannot_requantize():
    from loka.numerics import requantize_transposed

    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match="power-of-two scales"):
        requantize_transposed(quantize(x, "e4m3", "rowwise", "a"))
    with pytest.raises(ValueError, match="rowwise QTensor with one scale per row"):
        requantize_transposed(quantize(x, "e4m3", "tensorwise", "a", power_of_two=True))
    with pytest.raises(ValueError, match="rowwise QTensor with one scale per row"):
        requantize_transposed(quantize(x, "e4m3", "rowwise", "b", power_of_two=True))
    # unchecked, the scales are taken as they are (the caller made them powers of two)
    plain = quantize(x, "e4m3", "rowwise", "a")
    assert requantize_transposed(plain, check_scale=False).data.shape == (32, 16)
    # no rows: every column's scale is finite, no data; no columns: no rows out
    empty = requantize_transposed(quantize(x[:0], "e4m3", "rowwise", "a", power_of_two=True))
    assert empty.data.shape == (32, 0) and torch.isfinite(empty.scale).all()
    none = requantize_transposed(quantize(x[:, :0], "e4m3", "rowwise", "a", power_of_two=True))
    assert none.data.shape == (0, 16) and none.scale.shape == (0, 1)


def test_requantize_transposed_column_scale_doubles_where_its_largest_value_rounds_up():
    """Column 0's largest value (1.6 * 2**-9) is below its row's normal range (the row
    holds 448) and rounds up to 2**-8: the requantized column's scale is twice the direct
    one's, and the column's other value, normal under its row's scale and the direct
    column scale but not under the doubled one, lands on that coarser grid (1.5 instead of
    1.375, times 2**-23), within half its step of x."""
    from loka.numerics import requantize_transposed

    x = torch.tensor([[1.6 * 2.0 ** -9, 448.0], [1.375 * 2.0 ** -23, 1.375 * 2.0 ** -23]])
    q = quantize(x, "e4m3", "rowwise", "a", power_of_two=True)
    r = requantize_transposed(q)
    d = quantize(x.t(), "e4m3", "rowwise", "a", power_of_two=True)
    assert r.scale[0, 0] == 2 * d.scale[0, 0] == 2.0 ** -16
    mine, ref = r.dequantize(torch.float64), d.dequantize(torch.float64)
    assert ref[0, 1] == 1.375 * 2.0 ** -23 and mine[0, 1] == 1.5 * 2.0 ** -23
    half_step = r.scale[0, 0].double() * 2.0 ** -9 / 2  # e4m3's subnormal step, halved
    assert abs(mine[0, 1] - x[1, 0].double()) <= half_step


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_requantize_transposed_saturates_near_float32_max_and_spreads_nan(fmt):
    """Values FP8 rounds to 2**128 under a power-of-two scale dequantize to float32's
    largest, as ``quantize`` saturates: finite scales and values equal to the direct
    quantization's. A NaN reaches every value (its row's scale, then every column's)."""
    from loka.numerics import FLOAT32_MAX, requantize_transposed

    x = torch.tensor([[3.4e38, -3.386e38, 3.3e38], [3.233e38, 3.0e38, -3.39e38]])
    r = requantize_transposed(quantize(x, fmt, "rowwise", "a", power_of_two=True))
    d = quantize(x.t(), fmt, "rowwise", "a", power_of_two=True)
    assert torch.isfinite(r.scale).all() and torch.equal(r.scale, d.scale)
    assert torch.equal(r.dequantize(torch.float64), d.dequantize(torch.float64))
    assert r.dequantize(torch.float64).abs().max() <= FLOAT32_MAX * 1.0000001
    nan = torch.tensor([[1.0, -2.0, 3.0], [4.0, 5.0, float("nan")]])
    q = quantize(nan, fmt, "rowwise", "a", power_of_two=True)
    assert torch.isnan(q.scale[1, 0]) and torch.isfinite(q.scale[0, 0])
    out = requantize_transposed(q)  # the check passes over the NaN scale
    assert torch.isnan(out.dequantize()).all()
