"""Triton FP8 GEMMs (rowwise/tensorwise epilogue scaling, blockwise) against float64
references of the same quantized operands. Compiled on an FP8 GPU; elsewhere the tests
run under Triton's CPU interpreter in a subprocess (see test_under_interpreter)."""

import importlib
import os

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from loka.kernels import capabilities as caps  # noqa: E402
from loka.numerics import dequantize, quantize, relative_frobenius  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU = not INTERPRETED and caps.triton_available("cuda") and (caps.cuda_capability("cuda") or (0, 0)) >= (8, 9)
DEVICE = "cuda" if GPU else "cpu"
# The interpreter multiplies in float32; tensor cores promote their FP8 accumulator to
# float32 every K tile (fast accumulation: never).
TOL = 2e-3 if GPU else 1e-5
FAST_TOL = 2e-2 if GPU else 1e-5


def test_under_interpreter(run_under_interpreter):
    """Without an FP8 GPU the kernels run under Triton's CPU interpreter, which Triton
    picks when it is first imported: the tests of this file run in a fresh process."""
    if GPU or INTERPRETED:
        pytest.skip("the kernels run in this process")
    run_under_interpreter(__file__, "not test_under_interpreter", min_passed=24)


@pytest.fixture(scope="module")
def G():
    if not (GPU or INTERPRETED):
        pytest.skip("needs an FP8 GPU, or Triton's interpreter (see test_under_interpreter)")
    return importlib.import_module("loka.kernels.triton.gemm_rowwise")


@pytest.fixture(scope="module")
def B():
    if not (GPU or INTERPRETED):
        pytest.skip("needs an FP8 GPU, or Triton's interpreter (see test_under_interpreter)")
    return importlib.import_module("loka.kernels.triton.gemm_blockwise")


def operands(m, k, n, granularity="rowwise", a_fmt="e4m3", seed=0):
    """Quantized a (M, K) row-major and b (K, N) column-major, as the kernels read them."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g)
    qa = quantize(a.bfloat16().to(DEVICE), a_fmt, granularity, "a")
    qb = quantize(w.bfloat16().to(DEVICE), "e4m3", granularity, "a")  # per row of W = column of b
    return qa, qb


def ref64(qa, qb_rows):
    """float64 product of the dequantized operands, b = Wᵀ."""
    return dequantize(qa, torch.float64) @ dequantize(qb_rows, torch.float64).t()


@pytest.mark.parametrize("shape", [(70, 200, 48), (128, 64, 32), (33, 512, 96), (256, 128, 256)])
@pytest.mark.parametrize("out_dtype,a_fmt", [(torch.float32, "e4m3"), (torch.bfloat16, "e4m3"),
                                             (torch.float32, "e5m2")])
def test_rowwise_gemm_matches_float64(G, shape, out_dtype, a_fmt):
    m, k, n = shape
    qa, qw = operands(m, k, n, a_fmt=a_fmt)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), out_dtype=out_dtype)
    assert y.shape == (m, n) and y.dtype == out_dtype
    tol = TOL if out_dtype == torch.float32 else 4e-3  # bf16 output: its own rounding
    assert relative_frobenius(y, ref64(qa, qw)) < tol


@pytest.mark.parametrize("fast_accum", [False, True])
def test_tensorwise_scales_and_fast_accumulation(G, fast_accum):
    qa, qw = operands(96, 256, 64, granularity="tensorwise")
    assert qa.scale.shape == (1, 1)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale, out_dtype=torch.float32,
                       fast_accum=fast_accum)
    assert relative_frobenius(y, ref64(qa, qw)) < (FAST_TOL if fast_accum else TOL)


@pytest.mark.parametrize("activation", [None, "hardswish"])
def test_fused_bias_and_hardswish_epilogue(G, activation):
    qa, qw = operands(64, 128, 80)
    bias = torch.randn(80).bfloat16().to(DEVICE)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                       activation=activation, out_dtype=torch.float32)
    ref = ref64(qa, qw) + bias.double()
    if activation == "hardswish":
        ref = torch.nn.functional.hardswish(ref)
        assert (y < 0).any() and (y >= -0.375).all()  # hardswish's minimum is -3/8
    assert relative_frobenius(y, ref) < TOL


@pytest.mark.parametrize("n,fmt", [(48, "e4m3"), (256, "e5m2"), (320, "e4m3")])  # 320: two kernels
def test_fp8_output_is_the_next_layers_rowwise_quantization(G, n, fmt):
    qa, qw = operands(64, 64, n)
    bias = torch.randn(n).bfloat16().to(DEVICE)
    q, s = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                          activation="hardswish", fp8_out=fmt)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                       activation="hardswish", out_dtype=torch.bfloat16)
    ref = quantize(y, fmt, "rowwise", "a")
    assert q.dtype == ref.data.dtype and s.shape == (64, 1)
    # same kernel, same values up to the accumulation order of the chosen tiles
    torch.testing.assert_close(s, ref.scale, rtol=2 ** -7, atol=0)
    differ = (q.float() != ref.data.float()).float().mean().item()
    assert differ < 0.01
    assert relative_frobenius(dequantize(ref).double(), y.double()) < 0.07


def test_blockwise_gemm_matches_float64(B):
    m, k, n = 70, 300, 200  # ragged K and N blocks
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 6, (1, k), generator=g).float()))
    w = torch.randn(n, k, generator=g)
    qa = quantize(a.bfloat16().to(DEVICE), "e4m3", "blockwise", "a")
    qb = quantize(w.t().bfloat16().to(DEVICE), "e4m3", "blockwise", "b")
    y = B.gemm_blockwise(qa.data, qb.data, qa.scale, qb.scale, torch.float32)
    ref = dequantize(qa, torch.float64) @ dequantize(qb, torch.float64)
    assert relative_frobenius(y, ref) < TOL
    torch.testing.assert_close(y, B.reference(qa.data, qb.data, qa.scale, qb.scale, torch.float32),
                               rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_bad_inputs_raise(G, B):
    qa, qw = operands(32, 64, 32)
    a, b, sa, sb = qa.data, qw.data.t(), qa.scale, qw.scale.t()
    with pytest.raises(TypeError, match="float8"):
        G.gemm_rowwise(a.float(), b, sa, sb)
    with pytest.raises(ValueError, match="do not match"):
        G.gemm_rowwise(a, b[:32], sa, sb)
    with pytest.raises(ValueError, match="scale_a"):
        G.gemm_rowwise(a, b, sa[:16], sb)
    with pytest.raises(TypeError, match="scale_b"):
        G.gemm_rowwise(a, b, sa, sb.double())
    with pytest.raises(ValueError, match="bias"):
        G.gemm_rowwise(a, b, sa, sb, bias=torch.zeros(31, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        G.gemm_rowwise(a, b, sa, sb, activation="gelu")
    with pytest.raises(ValueError, match="blockwise scales"):
        B.gemm_blockwise(a, b, sa, sb)
    empty = G.gemm_rowwise(a[:0], b, sa[:0], sb)
    assert empty.shape == (0, 32)


def test_split_k_for_a_long_reduction(G, monkeypatch):
    """wgrad-like shape (few output tiles, long K): partial sums over K splits, added."""
    monkeypatch.setattr(G, "SPLIT_K_UNIT", 128)  # small K splits, so the interpreter stays quick
    assert G.split_k(32, 64, 8192) > 1 and G.split_k(4096, 4096, 8192) == 1
    assert G.k_ranges(32, 48, 1200) == (10, 128)  # the GEMM below runs in 10 K ranges
    qa, qw = operands(32, 1200, 48)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), out_dtype=torch.float32)
    assert relative_frobenius(y, ref64(qa, qw)) < TOL


def blocknorm_stats(y, block):
    """float64 mean square of each row's blocks of ``block`` columns (the last one shorter)."""
    y = y.double()
    return torch.stack([y[:, j:j + block].pow(2).mean(1) for j in range(0, y.shape[1], block)], 1)


@pytest.mark.parametrize("n,block,kw", [
    (1024, 256, {}),                                      # tiles inside one block
    (1000, 256, dict(bias=True, activation="hardswish")),  # a last block of 232 columns
    (96, 16, {}),                                         # several blocks in one tile
    (200, 512, {}),                                       # a block longer than the row
])
def test_blocknorm_statistics_epilogue(G, n, block, kw):
    """The epilogue's mean squares are those of the output as stored, block by block, and
    with them the next BlockNorm needs no reduction of its own."""
    from loka.mods.blocknorm import BlockNorm

    qa, qw = operands(48, 128, n, seed=n)
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(n).bfloat16().to(DEVICE)
    y, ms = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), norm_stats=block, **kw)
    y_plain = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), **kw)
    assert torch.equal(y, y_plain)  # the statistics change nothing of the output
    assert ms.shape == (48, -(-n // block)) and ms.dtype == torch.float32
    torch.testing.assert_close(ms.double(), blocknorm_stats(y, block), rtol=1e-5, atol=0)
    # the next norm from the statistics alone: BlockNorm's output, to its rounding
    eps = 1e-6
    b = min(block, n)
    scale = torch.rsqrt(ms + eps).repeat_interleave(b, 1)[:, :n]
    normed = (y.float() * scale).to(y.dtype)
    ref = BlockNorm(block, eps)(y)
    assert (normed != ref).float().mean().item() < 0.01
    torch.testing.assert_close(normed.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("n", [128, 320])  # 320: quantized by a second kernel
def test_blocknorm_statistics_with_fp8_output(G, n):
    """With an FP8 output the statistics are those of the bf16 output it quantizes."""
    qa, qw = operands(32, 64, n)
    q, s, ms = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), fp8_out="e4m3",
                              norm_stats=64)
    y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), out_dtype=torch.bfloat16)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (32, 1) and ms.shape == (32, -(-n // 64))
    torch.testing.assert_close(ms.double(), blocknorm_stats(y, 64), rtol=1e-5, atol=0)


def test_blocknorm_statistics_survive_autotuning(G, monkeypatch):
    """The autotuner launches every config on the same arguments before the real launch;
    statistics added by atomics must not pile up over those launches. Forced here with two
    configs and a benchmark that launches each twice (on a GPU, any fresh shape does it)."""
    tuner = G.rowwise_gemm_kernel
    launches = []

    def bench(kernel_call, quantiles=None):
        kernel_call()
        kernel_call()
        launches.append(2)
        return [1.0, 1.0, 1.0]
    monkeypatch.setattr(tuner, "do_bench", bench)
    monkeypatch.setattr(tuner, "early_config_prune", lambda cfgs, nargs, **kw: list(cfgs[:2]))
    monkeypatch.setattr(tuner, "cache", {})
    qa, qw = operands(16, 64, 48, seed=7)
    y, ms = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), norm_stats=16)
    assert launches == [2, 2]  # both configs were benchmarked on these very arguments
    torch.testing.assert_close(ms.double(), blocknorm_stats(y, 16), rtol=1e-5, atol=0)


def test_blocknorm_statistics_need_a_power_of_two_block(G):
    qa, qw = operands(32, 64, 64)
    for bad in (0, 100, -256, 2.0):
        with pytest.raises(ValueError, match="power of two"):
            G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), norm_stats=bad)
    y, ms = G.gemm_rowwise(qa.data[:0], qw.data.t(), qa.scale[:0], qw.scale.t(), norm_stats=32)
    assert y.shape == (0, 64) and ms.shape == (0, 2)


# -- inline quantization (the GEMM casts its float operands in its loads) -----------------

def inline_operands(m, k, n, a_transposed, seed=0):
    """Float a (M, K), row-major or a transposed view as loka.Linear's wgrad passes dyᵀ, and
    b (K, N) row-major, with rows of a and columns of b spread over 2**-4..2**4."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=g).float())
    b = torch.randn(k, n, generator=g) * torch.exp2(torch.randint(-4, 5, (1, n), generator=g).float())
    a = a.bfloat16().to(DEVICE)
    if a_transposed:
        a = a.t().contiguous().t()
    return a, b.bfloat16().to(DEVICE)


@pytest.mark.parametrize("m,k,n,a_transposed,a_fmt", [
    (32, 2048, 64, True, "e4m3"),   # wgrad-like: K split into 16 partial sums
    (1, 1536, 96, False, "e4m3"),   # one row (the logit layer's wgrad)
    (70, 300, 40, True, "e5m2"),    # unaligned, no split, an e5m2 gradient operand
])
def test_inline_quantization_is_quantize_then_gemm(G, monkeypatch, m, k, n, a_transposed, a_fmt):
    """The FP8 values and scales cast in the loads are the quantizers': the product equals
    the rowwise GEMM of quantize_rowwise's operands up to float32 summation order, and the
    float64 product of the dequantized operands within the GEMM's tolerance."""
    from loka.kernels.triton.quantize import quantize_rowwise

    monkeypatch.setattr(G, "INLINE_SPLIT_UNIT", 128)  # K splits at interpreter-sized K
    a, b = inline_operands(m, k, n, a_transposed)
    y = G.gemm_rowwise_inline(a, b, a_fmt, "e4m3", out_dtype=torch.float32)
    qa, sa = quantize_rowwise(a, a_fmt)
    qb, sb = quantize_rowwise(b.t())
    ref = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert relative_frobenius(y, ref) < TOL
    two_step = G.gemm_rowwise(qa, qb.t(), sa, sb.t(), out_dtype=torch.float32)
    torch.testing.assert_close(y, two_step, rtol=TOL, atol=TOL * ref.abs().max().item())
    if m * n > 1:  # and FP8 it is: the bf16 product differs by FP8's rounding, not less
        assert 5e-3 < relative_frobenius(y, a.double() @ b.double()) < 0.08
    assert G.split_k(m, n, k, tile=64, unit=128) == (16 if k == 2048 else 12 if k == 1536 else 1)


@pytest.mark.parametrize("m,k,n", [(32, 1 << 20, 64), (64, 1 << 20, 64), (48, 64, 160),
                                   (1, 4096, 1024), (4096, 2048, 2048)])
def test_inline_configs_fit_registers_and_shared_memory(m, k, n):
    """The inline GEMM tunes over its own tiles only, each within its register budget
    (float values a thread holds) and, after the stage cap, within the shared memory an
    H100/H200 block may use; an M of 32 runs transposed (the wrapper swaps the operands)
    and gets 32-column tiles, so it is not loaded and cast twice."""
    G = importlib.import_module("loka.kernels.triton.gemm_rowwise")
    meta = {"QA_MAX": 448.0, "QB_MAX": 448.0}
    if G.inline_transposed(m, n):
        m, n = n, m
    kept = G._prune(G.GEMM_CONFIGS, {"M": m, "N": n, "K": k}, **meta)
    assert kept
    tiles = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps)
             for c in G.INLINE_CONFIGS}
    for c in kept:
        bm, bn, bk = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        assert (bm, bn, bk, c.num_warps) in tiles
        assert (bm + bn) * bk // (32 * c.num_warps) <= G.INLINE_TILE_ELEMENTS // 128
        assert (bm + bn) * bk * 2 * (c.num_stages + 1) <= G.INLINE_SHARED_BYTES
        assert 1 <= c.num_stages
    if n == 32:
        assert any(c.kwargs["BLOCK_N"] == 32 for c in kept)
    assert all(c.kwargs["BLOCK_M"] >= 64 or c.num_warps == 8 for c in kept)  # no spilling tile
    # the plain FP8 GEMM never sees the inline tiles
    plain = G._prune(G.GEMM_CONFIGS, {"M": m, "N": n, "K": k}, QA_MAX=0.0, QB_MAX=0.0)
    assert all(c in G.GEMM_CONFIGS for c in plain)


def test_inline_quantization_beside_an_fp8_operand(G):
    """One operand arrives in FP8 (a weight quantized once), the other is cast inline."""
    from loka.kernels.triton.quantize import quantize_rowwise

    a, b = inline_operands(48, 256, 32, False, seed=3)
    qb, sb = quantize_rowwise(b.t())
    y = G.gemm_rowwise_inline(a, qb.t(), scale_b=sb.t(), out_dtype=torch.float32)
    qa, sa = quantize_rowwise(a)
    ref = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    assert relative_frobenius(y, ref) < TOL
    qa_t, sa_t = quantize_rowwise(a, "e4m3")
    y2 = G.gemm_rowwise_inline(qa_t, b, scale_a=sa_t, out_dtype=torch.bfloat16)
    assert y2.dtype == torch.bfloat16 and relative_frobenius(y2, ref) < 4e-3


@pytest.mark.parametrize("fp8", ["a", "b", None])
def test_inline_gemm_with_m_under_64_runs_transposed(G, fp8):
    """M = 16 < N = 96: the wrapper computes cᵀ = bᵀ aᵀ (64-row MMA tiles filled by N),
    with either operand in FP8 or neither; the product is still (M, N), row-major, and
    each operand keeps its own scales (rows of a, columns of b, distinct powers of two)."""
    from loka.kernels.triton.quantize import quantize_rowwise

    a, b = inline_operands(16, 320, 96, True, seed=7)
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b.t())
    ref = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    kw = {"a": dict(a=qa, scale_a=sa, b=b), "b": dict(a=a, b=qb.t(), scale_b=sb.t()),
          None: dict(a=a, b=b)}[fp8]
    y = G.gemm_rowwise_inline(out_dtype=torch.float32, **kw)
    assert y.shape == (16, 96) and y.is_contiguous()
    assert relative_frobenius(y, ref) < TOL
    # each row and column on its own scale: a swapped scale would be off by 2**k
    assert ((y - ref).abs() <= TOL * ref.abs().amax(1, keepdim=True) + 1e-30).all()


def test_inline_quantization_propagates_nan_and_inf_like_the_quantizers(G, monkeypatch):
    """An inf in a row of a makes that row's scale inf and its output NaN (inf / inf), a NaN
    in a column of b poisons that column, in every K split: the quantizers' semantics.
    The other outputs stay finite and exact."""
    from loka.kernels.triton.quantize import quantize_rowwise

    monkeypatch.setattr(G, "INLINE_SPLIT_UNIT", 128)
    a, b = inline_operands(32, 2048, 64, True, seed=5)
    a[3, 1500] = float("inf")  # in the twelfth K split
    b[100, 7] = float("nan")   # in the first
    y = G.gemm_rowwise_inline(a, b, out_dtype=torch.float32)
    assert torch.isnan(y[3]).all() and torch.isnan(y[:, 7]).all()
    finite = torch.ones_like(y, dtype=torch.bool)
    finite[3], finite[:, 7] = False, False
    assert torch.isfinite(y[finite]).all()
    qa, sa = quantize_rowwise(a)
    qb, sb = quantize_rowwise(b.t())
    ref = (qa.double() * sa.double()) @ (qb.double() * sb.double()).t()
    assert torch.isnan(ref[3]).all() and torch.isnan(ref[:, 7]).all()
    assert relative_frobenius(y[finite], ref[finite]) < TOL


def test_inline_quantization_rejects_bad_operands(G):
    a, b = inline_operands(16, 64, 32, False)
    qa = torch.zeros(16, 64, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="needs its scale_a"):
        G.gemm_rowwise_inline(qa, b)
    with pytest.raises(ValueError, match="no scale_b"):
        G.gemm_rowwise_inline(a, b, scale_b=torch.ones(1, 32, device=DEVICE))
    with pytest.raises(ValueError, match="do not match"):
        G.gemm_rowwise_inline(a, b[:32])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        G.gemm_rowwise_inline(a.to(torch.int32), b)
    with pytest.raises(ValueError, match="2-D"):
        G.gemm_rowwise_inline(a[0], b)
    with pytest.raises(ValueError, match="K = 0"):
        G.gemm_rowwise_inline(a[:, :0], b[:0])
    with pytest.raises(ValueError, match="e4m3 and e5m2"):
        G.gemm_rowwise_inline(a, b, "e4m3fnuz")
    with pytest.raises(TypeError, match="out_dtype"):
        G.gemm_rowwise_inline(a, b, out_dtype=torch.int8)
    empty = G.gemm_rowwise_inline(a[:0], b)
    assert empty.shape == (0, 32) and empty.dtype == torch.bfloat16


def test_in_an_op_body_the_gemms_pass_no_tensor_twice(G):
    """Inside a triton op's body (what tracing records) every launch gets distinct tensors
    (loka.kernels.triton.common.launch): unused pointers are placeholders of their own, not
    the output again. The results equal the launches outside a body."""
    from loka.kernels.triton import common
    qa, qw = operands(64, 128, 48)
    bias = torch.randn(48).to(DEVICE)
    a = (torch.randn(64, 128) * 3).bfloat16().to(DEVICE)
    b = torch.randn(48, 128).bfloat16().to(DEVICE).t()
    calls = (lambda: G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t()),
             lambda: G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias),
             lambda: G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(),
                                    fp8_out="e4m3")[0],
             lambda: G.gemm_rowwise_inline(a, b))
    for call in calls:
        outside = call()
        with common.op_body():
            inside = call()
        assert torch.equal(inside.float(), outside.float())


def test_a_tensor_passed_twice_to_a_kernel_in_an_op_body_is_refused():
    from loka.kernels.triton import common
    t, u = torch.zeros(8), torch.zeros(8)
    common.check_distinct("k", [t, u, 3, None, torch.zeros(0)])  # distinct: no error
    for args in ([t, u, t], [t, t[2:]], [t.view(2, 4), t]):
        with pytest.raises(ValueError, match="k: arguments 0 and 2|k: arguments 0 and 1"):
            common.check_distinct("k", args)
