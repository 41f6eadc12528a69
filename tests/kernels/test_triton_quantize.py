"""Triton FP8 quantization kernels against loka.numerics.quantize: exact scales, exact FP8
values. On a GPU with FP8 (sm_89+) they run compiled; elsewhere under Triton's CPU
interpreter (the same kernels, with the interpreter's non-RNE float cast replaced by an
exact rounding in float32, see loka.kernels.triton.common)."""

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from loka.kernels import capabilities as caps  # noqa: E402
from loka.numerics import quantize  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU = not INTERPRETED and caps.triton_available("cuda") and (caps.cuda_capability("cuda") or (0, 0)) >= (8, 9)
DEVICE = "cuda" if GPU else "cpu"
FORMATS = ["e4m3", "e5m2"]


def test_under_interpreter(run_under_interpreter):
    """Without an FP8 GPU the kernels run under Triton's CPU interpreter, which Triton
    picks when it is first imported: the tests of this file run in a fresh process."""
    if GPU or INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_under_interpreter(__file__, "not test_under_interpreter", min_passed=18)


@pytest.fixture(scope="module")
def Q():
    """The quantize module (compiled on an FP8 GPU, interpreted under TRITON_INTERPRET=1)."""
    if not (GPU or INTERPRETED):
        pytest.skip("needs an FP8 GPU, or Triton's interpreter (see test_under_interpreter)")
    return importlib.import_module("loka.kernels.triton.quantize")


def heavy_tailed(r, c, dtype=torch.bfloat16, seed=0):
    """Rows of very different magnitudes, an outlier column, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-10, 10, (r, 1), generator=g).float())
    x[:, c // 3] *= 50
    x[r // 2] = 0
    return x.to(dtype).to(DEVICE)


def assert_same(q, scale, ref):
    """Bit-exact scales and FP8 values (NaN where the reference has NaN)."""
    assert scale.dtype == torch.float32
    assert torch.equal(scale.reshape(ref.scale.shape).cpu(), ref.scale.cpu())
    assert q.dtype == ref.data.dtype and tuple(q.shape) == tuple(ref.data.shape)
    a, b = q.float().cpu(), ref.data.float().cpu()
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)), (a != b).sum()
    # the bytes, so the sign of a zero counts too (NaN's sign bit is free)
    keep = ~torch.isnan(a)
    qb, rb = q.contiguous().cpu().view(torch.uint8), ref.data.contiguous().cpu().view(torch.uint8)
    assert torch.equal(qb[keep], rb[keep]), (qb[keep] != rb[keep]).sum()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,dtype", [((37, 300), torch.bfloat16), ((1, 64), torch.bfloat16),
                                         ((130, 16), torch.float16), ((37, 300), torch.float32)])
def test_rowwise_one_pass_is_exact(Q, fmt, shape, dtype):
    x = heavy_tailed(*shape, dtype=dtype)
    q, s = Q.quantize_rowwise(x, fmt)
    assert q.is_contiguous() and s.shape == (shape[0], 1)
    assert_same(q, s, quantize(x, fmt, "rowwise", "a"))


def every_bf16_ratio(dtype=torch.bfloat16):
    """One row per bf16 amax mantissa (amax in [8, 16)), holding the amax and every bf16
    value below it over the 42 binades an FP8 format resolves, with alternating signs:
    every pair of values and scales a bf16 tensor can give its quantizer, up to powers of
    two (128 rows of 5377 values)."""
    mant = 1 + torch.arange(128, dtype=torch.float64) / 128
    binades = torch.exp2(3 - torch.arange(42, dtype=torch.float64))
    ys = (mant[None, :] * binades[:, None]).reshape(-1)
    rows = []
    for amax in mant * 8:
        y = torch.cat([amax.reshape(1), ys[ys < amax]])
        y = torch.cat([y, torch.zeros(ys.numel() + 1 - y.numel(), dtype=torch.float64)])
        rows.append(y * torch.where(torch.arange(y.numel()) % 2 == 1, -1.0, 1.0))
    return torch.stack(rows).to(dtype).to(DEVICE)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transposed", [False, True])
def test_every_bf16_value_and_scale_is_exact(Q, fmt, transposed):
    """Every (value, amax) pair of bf16 through the one-pass and the two-stage quantizer:
    the FP8 bytes and scales equal the PyTorch reference's. On a GPU this is the
    hardware check of the one-correction division the kernels use for 16-bit inputs
    (``X16``; its arithmetic is checked in ``test_exact_division.py``)."""
    x = every_bf16_ratio()
    if transposed:  # the two-stage path over a transposed view
        x = x.t().contiguous().t()
    q, s = Q.quantize_rowwise(x, fmt)
    assert_same(q, s, quantize(x, fmt, "rowwise", "a"))


# The transposed (dgrad b, wgrad a and b) operands of the Wukong `paper` GEMMs: (rows, columns)
# of the view the two-stage path quantizes. Two waves of programs left these at 32-128.
WUKONG_TRANSPOSED = {"top_mlp.1 dgrad Wᵀ": (2048, 1024), "fm_mlp.0 dgrad Wᵀ": (2048, 2048),
                     "fm_mlp.0 wgrad dyᵀ": (2048, 4096), "top_mlp.0 dgrad Wᵀ": (2048, 16384),
                     "top_mlp.2 wgrad xᵀ": (1024, 4096), "fm_projection wgrad dyᵀ": (32, 1 << 20)}


@pytest.mark.parametrize("case", sorted(WUKONG_TRANSPOSED))
def test_split_plan_fills_the_gpu_and_tiles_the_columns(case):
    tq = importlib.import_module("loka.kernels.triton.quantize")
    r, c = WUKONG_TRANSPOSED[case]
    nsplit, span = tq.split_plan(r, c, transposed=True)
    unit = tq._SPAN_UNIT[True]
    assert span % unit == 0 and (nsplit - 1) * span < c <= nsplit * span
    # at least two waves of 132 SMs at every Wukong operand (64-row blocks)
    assert -(-r // 64) * nsplit >= 256, (nsplit, span)


@pytest.mark.parametrize("r,c", [(1, 4096), (32, 1 << 20), (40, 4096), (2048, 1024), (20, 2100)])
@pytest.mark.parametrize("transposed", [True, False])
def test_split_configs_are_of_the_views_family(r, c, transposed):
    """Each kept tile is of the view's own family (tall tiles for a transposed view, wide
    ones for a row-major one), never larger than the tensor, and a tensor smaller than
    every tile still gets one."""
    tq = importlib.import_module("loka.kernels.triton.quantize")
    kept = tq._prune_split(tq._SPLIT_CONFIGS, {"R": r, "C": c, "stride_xc": c if transposed else 1})
    assert kept
    for cfg in kept:
        tile = (cfg.kwargs["BLOCK_R"], cfg.kwargs["BLOCK_C"], cfg.num_warps)
        assert (tile in tq._ROW_TILES) == (not transposed)
        assert (tile in tq._TALL_TILES) == transposed
    assert len(kept) == 1 or all(cfg.kwargs["BLOCK_R"] <= max(4, r) * 2 for cfg in kept)
    assert tq.split_plan(r, c, transposed)[1] % tq._SPAN_UNIT[transposed] == 0


@pytest.mark.parametrize("transposed", [True, False])
def test_tiles_that_overhang_a_span_read_none_of_the_next(Q, transposed, monkeypatch):
    """Spans that no tile divides (unit 48 or 384 against tiles 64-1024 wide): every
    partial amax is its own span's, with a NaN and a huge value placed just past a span's
    end (a tile reading over the end would carry them into the wrong partial), and the
    quantized output is exact."""
    monkeypatch.setattr(Q, "MAX_ROW", 64)
    monkeypatch.setattr(Q, "_SPAN_UNIT", {True: 48, False: 384})
    x = heavy_tailed(1000, 40).t() if transposed else heavy_tailed(40, 1000)
    nsplit, span = Q.split_plan(40, 1000, transposed)
    assert span % (256 if transposed else 512) and nsplit >= 2, (nsplit, span)
    x[3, span], x[5, span + 1] = float("nan"), 1e30
    partial, got_span = Q.amax_partials(x)
    assert got_span == span and partial.shape == (nsplit, 40)
    ref = torch.stack([x[:, i * span:(i + 1) * span].float().abs().amax(1) for i in range(nsplit)])
    assert torch.equal(partial.cpu().nan_to_num(-1.0), ref.cpu().nan_to_num(-1.0))
    assert not partial[0, 3].isnan() and partial[1, 3].isnan()
    assert partial[0, 5] < 1e3 and partial[1, 5] > 1e29
    x[3, span] = 0.5  # (a NaN row's scale is NaN, which torch.equal cannot compare)
    q, s = Q.quantize_rowwise(x)
    assert_same(q, s, quantize(x, "e4m3", "rowwise", "a"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("transposed", [True, False])
def test_rowwise_two_stage_is_exact(Q, fmt, transposed, monkeypatch):
    # transposed views, and rows longer than MAX_ROW (lowered here), take the split path
    monkeypatch.setattr(Q, "MAX_ROW", 64)
    x = heavy_tailed(20, 2100) if not transposed else heavy_tailed(2100, 40).t()  # 3 spans
    q, s = Q.quantize_rowwise(x, fmt)
    assert q.is_contiguous()
    assert_same(q, s, quantize(x, fmt, "rowwise", "a"))


def test_many_spans_reduce_in_chunks_with_nan_and_inf(Q):
    """A transposed view split into more spans than stage 2 loads at once (64 > 32): the
    chunked reduction of the partials still gives every row its exact scale, and a NaN or
    an inf in the second chunk of spans still reaches its row's scale."""
    x = heavy_tailed(4096, 40)  # viewed as (40, 4096), contiguous along the 40 rows
    x[3000, 7], x[3500, 11] = float("nan"), float("inf")
    nsplit, span = Q.split_plan(40, 4096, transposed=True)
    assert nsplit > Q._PARTS_CHUNK.value and 3000 // span >= Q._PARTS_CHUNK.value
    q, s = Q.quantize_rowwise(x.t())
    ref = quantize(x.t(), "e4m3", "rowwise", "a")
    got = s.reshape(ref.scale.shape).cpu()
    assert got[7].isnan().all() and got[11].isinf().all()
    finite = [i for i in range(40) if i not in (7, 11)]
    assert torch.equal(got[finite], ref.scale[finite].cpu())
    assert torch.equal(q[finite].float().cpu(), ref.data[finite].float().cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_colwise_gives_the_transposed_operand(Q, fmt):
    dy = heavy_tailed(200, 48)
    qt, s = Q.quantize_colwise(dy, fmt)
    assert qt.shape == (48, 200) and qt.is_contiguous() and s.shape == (48, 1)
    # a wgrad 'a' operand dyᵀ (N, M), and a 'b' operand x (M, K) scaled along M
    assert_same(qt, s, quantize(dy.t(), fmt, "rowwise", "a"))
    ref_b = quantize(dy, fmt, "rowwise", "b")
    assert torch.equal(s.t().cpu(), ref_b.scale.cpu())
    assert torch.equal(qt.t().float().cpu(), ref_b.data.float().cpu())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,dtype", [((200, 48), torch.bfloat16), ((37, 300), torch.float32),
                                         ((130, 256), torch.bfloat16)])
def test_dual_quantization_is_both_rowwise_calls_bit_for_bit(Q, fmt, shape, dtype):
    """One read for x and its column amaxes, one for xᵀ: the same bits as quantizing x and
    x.t() separately (the forward's a and the weight gradient's b; dy's two a operands)."""
    x = heavy_tailed(*shape, dtype=dtype)
    q, s, qt, st = Q.quantize_rowwise_dual(x, fmt)
    assert q.is_contiguous() and qt.is_contiguous() and qt.shape == shape[::-1]
    assert s.shape == (shape[0], 1) and st.shape == (shape[1], 1)
    assert_same(q, s, quantize(x, fmt, "rowwise", "a"))
    assert_same(qt, st, quantize(x.t(), fmt, "rowwise", "a"))
    q2, s2 = Q.quantize_rowwise(x.t(), fmt)
    assert torch.equal(st.cpu(), s2.cpu()) and torch.equal(qt.view(torch.uint8).cpu(),
                                                           q2.view(torch.uint8).cpu())


def test_dual_quantization_with_nan_and_inf_columns_and_a_strided_input(Q):
    x = torch.randn(40, 64)
    x[3, 7], x[11, 20] = float("nan"), float("-inf")
    x = x.to(DEVICE)
    q, s, qt, st = Q.quantize_rowwise_dual(x)
    ref, ref_t = quantize(x, "e4m3", "rowwise", "a"), quantize(x.t(), "e4m3", "rowwise", "a")
    for got, want in ((s, ref.scale), (st, ref_t.scale)):
        assert torch.equal(got.cpu().isnan(), want.cpu().isnan())
        assert torch.equal(got.cpu().isinf(), want.cpu().isinf())
        finite = torch.isfinite(want.cpu())
        assert torch.equal(got.cpu()[finite], want.cpu()[finite])
    assert st[7].isnan().all() and st[20].isinf().all() and torch.isfinite(st[:7]).all()
    # a view whose rows are not contiguous: the two separate calls, same results
    xs = heavy_tailed(64, 96).t()
    q, s, qt, st = Q.quantize_rowwise_dual(xs)
    assert_same(q, s, quantize(xs, "e4m3", "rowwise", "a"))
    assert_same(qt, st, quantize(xs.t(), "e4m3", "rowwise", "a"))
    with pytest.raises(ValueError, match="zero columns"):
        Q.quantize_rowwise_dual(torch.zeros(4, 0, device=DEVICE))


def test_untuned_calls_launch_one_config_and_leave_no_autotuning_behind(Q):
    """Inside ``untuned()`` a new shape is launched with one config and forgotten on exit;
    a shape tuned before stays tuned; the outputs are the same bits."""
    from loka.kernels.triton import common
    tuner = Q.rowwise_quant_kernel
    x_kept, x_new = heavy_tailed(24, 40), heavy_tailed(43, 29)  # 43 x 29: no other test's
    Q.quantize_rowwise(x_kept)
    before = set(tuner.cache)
    with common.untuned():
        from loka.kernels.roofline import max_autotune_configs
        assert max_autotune_configs() == 1
        Q.quantize_rowwise(x_kept)
        assert set(tuner.cache) == before  # a shape tuned before is reused
        q, s = Q.quantize_rowwise(x_new)
        assert len(tuner.cache) == len(before) + 1  # tuned inside, at one config
    assert set(tuner.cache) == before and max_autotune_configs() is None
    assert_same(q, s, quantize(x_new, "e4m3", "rowwise", "a"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout,shape", [("row", (37, 300)), ("col", (37, 300)), ("row", (512, 96))])
def test_tensorwise_two_stage_is_exact(Q, fmt, layout, shape):
    x = heavy_tailed(*shape)
    q, s = Q.quantize_tensorwise(x, fmt, layout)
    assert s.shape == (1, 1)
    assert q.is_contiguous() == (layout == "row") and q.t().is_contiguous() == (layout == "col")
    assert_same(q, s, quantize(x, fmt, "tensorwise"))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block,operand,layout", [((1, 128), "a", "row"),
                                                  ((128, 128), "b", "col"),
                                                  ((128, 128), "b", "row")])
def test_blockwise_is_exact(Q, fmt, block, operand, layout):
    x = heavy_tailed(130, 300)  # ragged last blocks in both dims
    q, s = Q.quantize_blockwise(x, fmt, block, layout)
    assert s.shape == (-(-130 // block[0]), 3)
    assert_same(q, s, quantize(x, fmt, "blockwise", operand))


@pytest.mark.parametrize("kind", ["rowwise", "tensorwise"])
def test_non_finite_inputs_give_non_finite_scales(Q, kind):
    x = torch.randn(8, 64)
    x[2, 5], x[3, 1] = float("nan"), float("inf")
    x = x.to(DEVICE)
    q, s = (Q.quantize_rowwise(x) if kind == "rowwise" else Q.quantize_tensorwise(x))
    ref = quantize(x, "e4m3", kind, "a")
    assert torch.equal(s.reshape(ref.scale.shape).cpu().isnan(), ref.scale.cpu().isnan())
    assert torch.equal(s.reshape(ref.scale.shape).cpu().isinf(), ref.scale.cpu().isinf())
    if kind == "rowwise":
        finite = [0, 1, 4, 5, 6, 7]
        assert torch.equal(s[finite].cpu(), ref.scale[finite].cpu())
        assert torch.equal(q[finite].float().cpu(), ref.data[finite].float().cpu())
        if GPU:  # the interpreter casts NaN to a finite value; the GPU keeps it NaN
            assert q[2].float().isnan().all()
            # the row with inf: scale inf, finite values / inf = ±0, inf / inf = NaN
            assert torch.equal(q[3].float().cpu().isnan(), ref.data[3].float().cpu().isnan())
            keep = ~ref.data[3].float().cpu().isnan()
            assert torch.equal(q[3].cpu().view(torch.uint8)[keep],
                               ref.data[3].cpu().view(torch.uint8)[keep])


@pytest.mark.parametrize("fmt", FORMATS)
def test_quotients_next_to_fp8_ties_round_as_the_reference(Q, fmt):
    """Rows whose quotients x / scale sit within two float32 ulps of the points where the
    FP8 value changes (the midpoints of the FP8 grid), with both signs and signed zeros:
    a division one ulp off shows here. The first column holds the row's amax."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    ties = (grid[1:] + grid[:-1]) / 2
    fmax = grid.max().item()
    g = torch.Generator().manual_seed(5)
    rows = 64
    amax = (1 + torch.rand(rows, 1, generator=g)) * torch.exp2(
        torch.randint(-20, 20, (rows, 1), generator=g).float())
    scale = (amax.to(DEVICE) / fmax).cpu()  # as the reference computes it on this device
    t = ties[torch.randint(0, len(ties), (rows, 200), generator=g)]
    x = (t.double() * scale.double()).float()
    ulps = torch.randint(-2, 3, x.shape, generator=g)
    x = (x.view(torch.int32) + ulps.int()).view(torch.float32)  # float32 neighbours
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, -x, x)
    x = torch.cat([amax, x, torch.zeros(rows, 2), -torch.zeros(rows, 2)], dim=1).to(DEVICE)
    q, s = Q.quantize_rowwise(x, fmt)
    assert_same(q, s, quantize(x, fmt, "rowwise", "a"))
    q, s = Q.quantize_tensorwise(x[:1], fmt)
    assert_same(q, s, quantize(x[:1], fmt, "tensorwise", "a"))


def test_zero_rows_quantize_to_zero_with_tiny_scale(Q):
    x = torch.zeros(4, 32, device=DEVICE)
    q, s = Q.quantize_rowwise(x)
    assert torch.equal(q.float().cpu(), torch.zeros(4, 32))
    assert torch.allclose(s.cpu(), torch.full((4, 1), 1e-12 / 448.0))


def test_empty_and_bad_inputs(Q):
    q, s = Q.quantize_rowwise(torch.empty(0, 16, device=DEVICE))
    assert q.shape == (0, 16) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="zero columns"):
        Q.quantize_rowwise(torch.empty(4, 0, device=DEVICE))
    with pytest.raises(ValueError, match="empty"):
        Q.quantize_tensorwise(torch.empty(0, 4, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize_rowwise(torch.randn(4, device=DEVICE))
    with pytest.raises(TypeError, match="float32"):
        Q.quantize_rowwise(torch.ones(4, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="e4m3 and e5m2"):
        Q.quantize_rowwise(torch.randn(4, 4, device=DEVICE), "e4m3fnuz")
    with pytest.raises(ValueError, match="block must be"):
        Q.quantize_blockwise(torch.randn(4, 4, device=DEVICE), block=(1, 64))
    with pytest.raises(ValueError, match="layout"):
        Q.quantize_tensorwise(torch.randn(4, 4, device=DEVICE), layout="diag")


def test_interpreter_rounding_matches_torch_cast_everywhere(Q):
    """The float32 pre-rounding used under the interpreter is the FP8 cast itself: check it
    against torch on values spanning the whole range, subnormals and ties included."""
    if GPU:
        pytest.skip("the soft rounding runs under the interpreter only")
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        fmax = torch.finfo(dtype).max
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[torch.isfinite(grid)]
        mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties
        x = torch.cat([grid, mids, torch.randn(2000) * fmax / 8]).clamp(-fmax, fmax)
        q, s = Q.quantize_tensorwise(x.reshape(1, -1), fmt)
        ref = quantize(x.reshape(1, -1), fmt, "tensorwise")
        assert_same(q, s, ref)
