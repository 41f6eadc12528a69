"""loka.Linear's short serving path: a call without gradients on a Linear that serves from
its FP8 weight with a static input scale, on a kernel with a ``static_gemm``, casts x and
runs the GEMM without the autograd Function. It must give the general path's bits, step
aside wherever the general path does more (a producer's FP8 input, a monitor, autocast,
float64, empty input, gradients), and leave a compiled step fewer guards per Linear."""

import copy

import pytest
import torch

import loka
from loka.config import LinearConfig
from loka.dispatch import linear as L
from loka.kernels import ops, registry
from tests.support import LinearChain, guard_leaves, spy_function_calls

TW, RW = "cublas-tensorwise", "cublas-rowwise"


def _linear(kernel, bias=True, dtype=torch.bfloat16, rows=16, amax=3.0, n_in=64, n_out=48):
    torch.manual_seed(0)
    lin = loka.Linear(n_in, n_out, bias=bias, config=LinearConfig(fwd=kernel)).to(dtype)
    lin.quantize_weight()
    lin.set_input_amax(amax, rows=rows)
    return lin


def _general(lin, x):
    """The general path's output for the same state: gradients on (the weight is passed,
    the FP8 weight and the static table still used), detached."""
    with torch.enable_grad():
        return lin(x).detach()


@pytest.mark.parametrize("kernel", [TW, RW])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 64), (2, 5, 64), (40, 64)])
def test_the_short_path_gives_the_general_paths_bits(kernel, bias, dtype, shape):
    """Rows within the table and beyond it (40 > 16: rowwise broadcasts the table's first
    row); 2-D and 3-D inputs; against the general path bit for bit and a float64
    reference within FP8's error."""
    lin = _linear(kernel, bias=bias, dtype=dtype)
    assert lin._static_key == lin._kernel_keys[0]
    x = torch.randn(*shape, dtype=dtype) * 2
    x[..., 0] = 50.0  # beyond the static amax: saturates at the format's max
    with torch.no_grad():
        y = lin(x)
    ref = _general(lin, x)
    assert y.shape == (*shape[:-1], 48) and y.dtype == dtype
    assert torch.equal(y.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    # float64: the same saturating cast, then an exact GEMM
    q = lin.weight_q
    s = float(lin.input_amax) / 448.0
    x2 = x.reshape(-1, 64).double()
    xq = (x2 / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    w = q.data.double() * q.scale.double().reshape(1, -1)
    exact = xq @ w + (lin.bias.double() if bias else 0.0)
    exact = exact.detach()
    err = (y.reshape(-1, 48).double() - exact).abs().max() / exact.abs().max()
    # rowwise GEMMs return bf16 whatever the caller's dtype (then cast): bf16's rounding
    bf16_out = dtype == torch.bfloat16 or kernel == RW
    assert float(err) < (1e-2 if bf16_out else 1e-5)


@pytest.mark.parametrize("static", [True, False])
def test_the_short_paths_run_no_autograd_function_and_step_aside_where_they_must(
        monkeypatch, static):
    """Both short paths, the static one and its dynamic twin (no static scale,
    tests/dispatch/test_serve_path.py), leave the same calls to the general path."""
    lin = _linear(TW)
    if not static:
        lin.set_input_amax(None)
    assert (lin._static_key, lin._serve_key) == ((TW, None) if static else (None, TW))
    calls = spy_function_calls(monkeypatch)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = lin(x)
        with torch.inference_mode():
            assert torch.equal(lin(x), y)
        assert calls == []
        # a producer's FP8 input: the general path consumes it
        q = lin.kernels[0].quantize_a(x.reshape(-1, 64))
        y_q = lin(x, x_q=q)
        assert len(calls) == 1
        if not static:  # the same dynamic cast the short path made
            assert torch.equal(y_q, y)
        # autocast to bf16 on a float32 input
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x.float())
        assert len(calls) == 2
        # float64 input (autocast leaves it; the general path saturates it first)
        lin.float()
        lin(x.double())
        assert len(calls) == 3
        lin.to(torch.bfloat16)
        # an empty input
        assert lin(x[:0]).shape == (0, 48)
        assert len(calls) == 3  # the empty case returns before the Function too
        with pytest.raises(ValueError, match=r"expected input \(\*, 64\)"):
            lin(torch.randn(4, 63, dtype=torch.bfloat16))
    # a monitor (the guard's statistics) takes the general path
    lin.monitor = L.SiteMonitor()
    with torch.no_grad():
        y2 = lin(x)
    assert len(calls) == 4 and torch.equal(y, y2)
    # gradients on: the general path
    lin.monitor = None
    lin(x)
    assert len(calls) == 5


def test_the_short_path_hands_cublas_a_row_major_operand_whatever_the_input_layout(
        monkeypatch):
    """cuBLAS (on a GPU) takes a row-major a only: a 2-D input that is a transpose, or a
    (1, T, K) view of one, casts column-major unless the short path makes it row-major, as
    the general path's ``row_major`` does. The CPU's _scaled_mm accepts either, so the
    layout is checked at the call."""
    from loka.kernels import cublas
    seen = []
    real = cublas._torch_scaled_mm

    def spy(a, b, **kw):
        seen.append((a.stride(), tuple(a.shape)))
        return real(a, b, **kw)
    monkeypatch.setattr(cublas, "_torch_scaled_mm", spy)
    for kernel in (TW, RW):
        lin = _linear(kernel)
        base = torch.randn(64, 12, dtype=torch.bfloat16)
        for x in (base.t(), base.t().unsqueeze(0)):
            assert not x.reshape(-1, 64).is_contiguous()
            seen.clear()
            with torch.no_grad():
                y = lin(x)
            (stride, shape), = seen
            assert stride == (64, 1) and shape == (12, 64)
            assert torch.equal(y.view(torch.int16), _general(lin, x).view(torch.int16))


def test_inputs_the_general_path_refuses_are_refused_on_the_short_path_too():
    """An FP8 input (floating point, but not one a Linear quantizes) and a weight_q set by
    hand in another format or granularity than the forward kernel's: the general path
    raises, so the short path must not serve them."""
    lin = _linear(TW, bias=False)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(TypeError, match="quantize expects"):
        lin(x.to(torch.float8_e4m3fn))
    from loka.numerics import quantize
    lin.weight_q = quantize(lin.weight.detach().t().float(), "e5m2", "tensorwise", "b")
    assert lin._static_key is None
    with torch.no_grad(), pytest.raises(ValueError, match="quantized as"):
        lin(x)
    lin.weight_q = quantize(lin.weight.detach().t().float(), "e4m3", "rowwise", "b")
    assert lin._static_key is None
    lin.quantize_weight()  # the kernel's own quantization: the short path again
    assert lin._static_key == TW


def test_the_static_key_follows_the_state():
    lin = _linear(TW)
    assert lin._static_key == TW
    lin.set_input_amax(None)
    assert lin._static_key is None  # dynamic scales: the general path
    lin.set_input_amax(2.0, rows=8)
    assert lin._static_key == TW
    lin.drop_weight()
    assert lin._static_key == TW  # the FP8 weight is what it serves from
    with torch.no_grad():
        assert lin(torch.randn(4, 64, dtype=torch.bfloat16)).shape == (4, 48)
    lin = _linear(TW)
    lin.set_config(LinearConfig(fwd=RW))  # new kernels clear the FP8 weight and the scale
    assert lin._static_key is None
    lin.weight_q = None
    assert lin._static_key is None
    # an emulated kernel has no static_gemm: the general path
    emu = loka.Linear(64, 48, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    emu.quantize_weight()
    emu.set_input_amax(3.0, rows=4)
    assert registry.get("emulated-rowwise-e4m3").static_gemm is None and emu._static_key is None
    # a kernel marked opaque runs through its op: its runnable copy drops static_gemm
    assert ops.runnable(registry.get(TW)).static_gemm is not None
    ops.mark_opaque(TW)
    try:
        assert ops.runnable(registry.get(TW)).static_gemm is None
    finally:
        ops.unmark_opaque(TW)
    # to_linear drops the key with the rest of loka's attributes
    plain = _linear(TW).to_linear()
    assert "_static_key" not in plain.__dict__


def test_a_copy_serves_the_same_bits():
    lin = _linear(RW)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    twin = copy.deepcopy(lin)
    with torch.no_grad():
        assert torch.equal(lin(x), twin(x))
    assert twin._static_key == RW


def test_a_compiled_static_serving_step_guards_few_more_leaves_per_site_than_bf16():
    """Per FP8 site the guard tree grows by the three held tensors (FP8 weight, its scale,
    the scale table) and a few flags, not by the kernel's Python (the general path had 24
    leaves per site against bf16's 11, over a hundred more with the first site, and a
    dozen Python-level aliasing guards); distinct static scales add no aliasing guard."""
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    counts = {}
    for n in (2, 4):
        torch.manual_seed(0)
        bf16 = LinearChain(n).to(torch.bfloat16).eval()
        plan = loka.Plan.uniform(bf16, TW)
        plan.static_scales = {name: 3.0 + i for i, name in enumerate(plan.sites)}
        fp8 = copy.deepcopy(bf16)
        loka.apply(fp8, plan, inference=True)
        assert all(m._static_key == TW for m in fp8.modules() if isinstance(m, loka.Linear))
        counts[n] = (guard_leaves(bf16, x), guard_leaves(fp8, x))
    (b2, _), (f2, lam2) = counts[2]
    (b4, lam_b), (f4, lam4) = counts[4]
    per_site = ((f4 - b4) - (f2 - b2)) / 2
    assert 0 < per_site <= 20, per_site
    assert lam4 == lam2 == lam_b  # no aliasing guard per site
    assert f2 - b2 <= 40 + 2 * per_site  # the first site's share of shared guards is small

