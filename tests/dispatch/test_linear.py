import math

import pytest
import torch
from torch import nn

import loka
from loka.config import LinearConfig, Role
from loka.kernels import Kernel, get, register, unregister
from loka.kernels.registry import Library
from loka.numerics import sqnr
from tests.support import assert_finite_operands, cpu_scaled_mm_scales_operands

FP8 = ["emulated-tensorwise-e4m3", "emulated-rowwise-e4m3", "emulated-blockwise-e4m3",
       "cublas-tensorwise", "cublas-rowwise"]


def _pair(dtype, bias, k=128, n=256):
    ref = nn.Linear(k, n, bias=bias).to(dtype)
    lin = loka.Linear(k, n, bias=bias, dtype=dtype)
    lin.load_state_dict(ref.state_dict())
    return ref, lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(8,), (4, 6), (2, 3, 5)])
@pytest.mark.parametrize("mixed", [False, True])
def test_baseline_roles_are_bit_identical_to_nn_linear(dtype, bias, lead, mixed):
    ref, lin = _pair(dtype, bias)
    if mixed:  # fwd on FP8 routes through the autograd.Function; baseline roles stay exact
        lin.set_config(LinearConfig(fwd="emulated-rowwise-e4m3"))
    strides = []  # the weight gradient as the backward returns it, before accumulation
    lin.weight.register_hook(lambda g: strides.append(g.stride()))
    x = torch.randn(*lead, 128, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), lin(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    if not mixed:
        assert torch.equal(y1, y2)
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(ref.weight.grad, lin.weight.grad)
    # the gradient arrives in the weight's layout (a transposed one costs a copy per step)
    assert strides == [lin.weight.stride()]
    if bias:
        assert torch.equal(ref.bias.grad, lin.bias.grad)


def _f64_reference(x, lin, g):
    x64 = x.double().requires_grad_()
    w64 = lin.weight.detach().double().requires_grad_()
    y = x64 @ w64.t()
    if lin.bias is not None:
        y = y + lin.bias.detach().double()
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad


@pytest.mark.parametrize("kernel", FP8)
@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_role_within_threshold_of_float64(kernel, role, dtype):
    lin = loka.Linear(256, 128, dtype=dtype)
    lin.set_config(LinearConfig(**{role.value: kernel}))
    x = torch.randn(64, 256, dtype=dtype, requires_grad=True)
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    ry, rdx, rdw = _f64_reference(x.detach(), lin, g)
    got = {Role.FWD: (y, ry), Role.DGRAD: (x.grad, rdx), Role.WGRAD: (lin.weight.grad, rdw)}
    for r, (val, want) in got.items():
        # FP8 e4m3 on Gaussian data: ~28 dB; the bf16/fp32 roles are far better
        floor = 25.0 if r == role else (40.0 if dtype == torch.bfloat16 else 100.0)
        assert sqnr(val, want) >= floor, (r, sqnr(val, want))


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("bias", [True, False])
def test_under_autocast_a_float32_input_computes_and_returns_the_autocast_dtype(role, bias):
    """As nn.Linear: under bf16 autocast a float32 input is computed in bf16 and the output
    is bf16, with one role on FP8 and the others on the baseline (a float32 input used to
    meet the bf16 output gradient in a baseline gradient GEMM and fail)."""
    torch.manual_seed(0)
    ref, lin = _pair(torch.float32, bias, k=256, n=128)
    lin.set_config(LinearConfig(**{role.value: "emulated-rowwise-e4m3"}))
    x = torch.randn(64, 256)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = ref(x1), lin(x2)
    assert y1.dtype == y2.dtype == torch.bfloat16
    g = torch.randn(64, 128)
    y1.float().backward(g)
    y2.float().backward(g)
    ry, rdx, rdw = _f64_reference(x, lin, g)
    assert x2.grad.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32
    for r, val, want in ((Role.FWD, y2, ry), (Role.DGRAD, x2.grad, rdx),
                         (Role.WGRAD, lin.weight.grad, rdw)):
        # bf16 compute: ~40 dB (see test_fp8_role_within_threshold_of_float64); FP8 ~28 dB
        assert sqnr(val, want) >= (25.0 if r == role else 38.0), (r, sqnr(val, want))
    if bias:
        assert torch.allclose(lin.bias.grad, ref.bias.grad, rtol=0.02, atol=0.05)


def test_under_autocast_float64_and_meta_inputs_are_left_as_autocast_leaves_them():
    """Autocast does not cast float64, and has no state for the meta device: a float64
    input stays float64, and a meta-device Linear runs with or without autocast."""
    lin = loka.Linear(64, 32, dtype=torch.float64)
    lin.set_config(LinearConfig(fwd="emulated-rowwise-e4m3"))
    x = torch.randn(8, 64, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.float64
    assert sqnr(y, x @ lin.weight.detach().t() + lin.bias.detach()) >= 25.0
    meta = loka.Linear(64, 32, device="meta")
    meta.set_config(LinearConfig(fwd="emulated-rowwise-e4m3"))
    assert meta(torch.randn(4, 64, device="meta")).shape == (4, 32)
    # a Linear whose weight was dropped (inference) answers an empty input in the autocast
    # dtype, as a non-empty one is answered
    lin.weight = None
    lin.weight_q = get("emulated-rowwise-e4m3").quantize_b(torch.randn(64, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(torch.randn(0, 64)).dtype == torch.bfloat16
    assert lin(torch.randn(0, 64)).dtype == torch.float32


def _spy(name, calls):
    def fn(a, b, out_dtype):
        calls.append((name, tuple(a.shape), tuple(b.shape)))
        return get("emulated-tensorwise-e4m3")(a, b, out_dtype)
    return Kernel(name, fn, library="custom", scaling="tensorwise", formats=("e4m3", "e4m3"))


def test_each_role_calls_the_kernel_named_for_it():
    calls = []
    for role in Role:
        register(_spy(f"spy-{role.value}", calls))
    try:
        lin = loka.Linear(64, 32, config=LinearConfig("spy-fwd", "spy-dgrad", "spy-wgrad"))
        x = torch.randn(2, 48, 64, requires_grad=True)
        lin(x).sum().backward()
        assert calls == [("spy-fwd", (96, 64), (64, 32)),     # x @ Wᵀ
                         ("spy-dgrad", (96, 32), (32, 64)),   # dy @ W
                         ("spy-wgrad", (32, 96), (96, 64))]   # dyᵀ @ x
    finally:
        for role in Role:
            unregister(f"spy-{role.value}")


def test_wgrad_pads_ragged_token_count_exactly():
    lin = loka.Linear(64, 32, config=LinearConfig(wgrad="emulated-tensorwise-e4m3"))
    x = torch.randn(37, 64, requires_grad=True)  # 37 rows: not a multiple of 16
    lin(x).sum().backward()
    ref = torch.ones(37, 32).t().double() @ x.detach().double()
    assert lin.weight.grad.shape == (32, 64)
    assert sqnr(lin.weight.grad, ref) > 25


def test_from_linear_shares_parameters_and_round_trips():
    base = nn.Linear(32, 16)
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    lin = loka.Linear.from_linear(base, LinearConfig.uniform("emulated-tensorwise-e4m3"))
    assert lin.weight is base.weight and lin.bias is base.bias
    assert list(lin.state_dict()) == list(base.state_dict())
    lin(torch.randn(4, 32)).sum().backward()
    before = base.weight.detach().clone()
    opt.step()  # the optimizer built on the plain Linear updates the wrapped one
    assert not torch.equal(before, lin.weight)
    back = lin.to_linear()
    assert type(back) is nn.Linear and back.weight is base.weight


def test_prequantized_input_is_consumed_without_requantizing():
    calls = []
    k = get("emulated-rowwise-e4m3")
    lin = loka.Linear(64, 32, bias=False, config=LinearConfig(fwd=k.name, wgrad=k.name))
    x = torch.randn(16, 64, requires_grad=True)
    qx = k.quantize_a(x.detach())
    y = lin(x, x_q=qx)
    torch.testing.assert_close(y, lin(x), rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    with pytest.raises(ValueError, match="x_q has shape"):
        lin(torch.randn(8, 64), x_q=qx)


def test_reads_only_x_q_when_nothing_else_needs_the_input():
    from loka.dispatch.linear import SiteMonitor

    lin = loka.Linear(64, 32, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    assert not lin.reads_only_x_q()  # autograd would save x
    with torch.no_grad():
        assert lin.reads_only_x_q()
        x = torch.randn(8, 64)
        q = get("emulated-rowwise-e4m3").quantize_a(x)
        placeholder = x.new_empty(()).expand(x.shape)  # its values are never read
        torch.testing.assert_close(lin(placeholder, x_q=q), lin(x), rtol=0, atol=0)
        lin.monitor = SiteMonitor()
        lin.monitor.arm(torch.device("cpu"))
        assert not lin.reads_only_x_q()  # the guard records x's statistics
        lin.monitor.disarm()
        assert lin.reads_only_x_q()
        assert not loka.Linear(64, 32, config=LinearConfig(dgrad="emulated-rowwise-e4m3")
                               ).reads_only_x_q()  # a bf16 forward reads x


def test_inference_weight_quantized_once():
    lin = loka.Linear(64, 32, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    x = torch.randn(8, 64)
    y0 = lin(x)
    lin.quantize_weight()
    assert lin.weight_q is not None and lin.weight_q.data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(lin(x), y0, rtol=0, atol=0)


# -- bad input -----------------------------------------------------------------------
def test_misaligned_features_are_refused_with_a_hint():
    with pytest.raises(ValueError, match="multiples of 16.*pad"):
        loka.Linear(100, 64, config=LinearConfig(fwd="cublas-tensorwise"))
    with pytest.raises(ValueError, match="multiples of 16"):
        loka.Linear(64, 100, config=LinearConfig(dgrad="emulated-tensorwise-e4m3"))
    loka.Linear(100, 64)  # the baseline takes any shape


def test_unknown_kernel_and_wrong_role():
    with pytest.raises(KeyError, match="no kernel named"):
        loka.Linear(64, 64, config=LinearConfig(fwd="nope"))
    with pytest.raises(ValueError, match="does not serve role fwd"):
        loka.Linear(64, 64, config=LinearConfig(fwd="emulated-tensorwise-e5m2"))
    with pytest.raises(TypeError, match="LinearConfig"):
        loka.Linear(64, 64, config={"fwd": "bf16"})


def test_wrong_input_dtype_and_shape():
    lin = loka.Linear(64, 32, config=LinearConfig.uniform("emulated-tensorwise-e4m3"))
    with pytest.raises(TypeError, match="floating-point"):
        lin(torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\(\*, 64\)"):
        lin(torch.randn(4, 63))


def test_empty_batch_gives_empty_output_and_grads():
    lin = loka.Linear(64, 32, config=LinearConfig.uniform("emulated-tensorwise-e4m3"))
    x = torch.randn(0, 64, requires_grad=True)
    y = lin(x)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert torch.equal(lin.weight.grad, torch.zeros(32, 64))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_propagates(bad):
    lin = loka.Linear(64, 32, config=LinearConfig.uniform("emulated-rowwise-e4m3"))
    x = torch.randn(16, 64)
    x[2, 3] = bad
    y = lin(x)
    assert not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[torch.arange(16) != 2]).all()  # rowwise: other rows unharmed


def _cpu_configs():
    """Every LinearConfig of one CPU kernel per role (uniform where the kernel serves all
    roles; its forward with the baseline gradients otherwise), and the baseline."""
    out = [LinearConfig()]
    for kern in loka.kernels.available("cpu", fp8_only=True):
        if set(Role) <= set(kern.roles):
            out.append(LinearConfig.uniform(kern.name))
        else:
            roles = {r.value: kern.name for r in kern.roles}
            out.append(LinearConfig(**roles))
    return out


@pytest.mark.parametrize("config", _cpu_configs(), ids=lambda c: f"{c.fwd}/{c.dgrad}/{c.wgrad}")
@pytest.mark.parametrize("value", [1e300, -1e300, 3e38])
def test_finite_float64_input_never_gives_nan(config, value):
    # issue 29: 1e300 became inf in float32, its scale inf, and inf / inf NaN everywhere
    torch.manual_seed(0)
    lin = loka.Linear(128, 128, dtype=torch.float64, config=config)
    x = torch.randn(16, 128, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        x[:, :3] = value
    y = lin(x)
    y.backward(torch.randn_like(y))
    assert not x.grad.isnan().any()
    libraries = {get(n).library for n in (config.fwd, config.wgrad) if n not in (None, "bf16")}
    if y.isnan().any() and libraries <= {Library.CUBLAS, Library.TORCHAO} and \
            get(config.fwd).scaling == "tensorwise" and cpu_scaled_mm_scales_operands():
        # the CPU build's GEMM scales the operands before it accumulates here, where cuBLAS
        # scales the accumulator (tests/support.py): its NaN is the library's order of
        # arithmetic; what LoKA hands the forward's and the weight gradient's GEMMs is finite
        assert_finite_operands(get(config.fwd), x.detach(), lin.weight.detach().t())
        assert_finite_operands(get(config.wgrad), torch.randn_like(y).t().contiguous(),
                               x.detach())
        return
    assert not y.isnan().any() and not lin.weight.grad.isnan().any()


# -- tensorwise operands quantized once, shared across roles ---------------------------
@pytest.mark.parametrize("kernel,grad_kernel", [
    ("emulated-tensorwise-e4m3", "emulated-tensorwise-e4m3"),
    ("cublas-tensorwise", "cublas-tensorwise"),
    ("emulated-tensorwise-e4m3", "emulated-tensorwise-e5m2"),  # dy in e5m2: x, W still shared
])
def test_shared_tensorwise_operands_are_bit_identical_and_quantized_once(kernel, grad_kernel,
                                                                         monkeypatch):
    import loka.kernels.recipes as recipes

    calls = []
    real = recipes.quantize
    monkeypatch.setattr(recipes, "quantize", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    lin = loka.Linear(64, 32, config=LinearConfig(kernel, grad_kernel, grad_kernel))
    x = torch.randn(40, 64, requires_grad=True)  # 40 rows: wgrad pads M to 48
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    # x, Wᵀ and dy: three quantizations instead of six
    assert len(calls) == 3, calls
    kf, kg = get(kernel), get(grad_kernel)
    w = lin.weight.detach()
    pad = lambda t: torch.cat([t, t.new_zeros(8, t.shape[1])])  # noqa: E731
    assert torch.equal(y.detach(), kf(x.detach(), w.t(), torch.float32) + lin.bias.detach())
    assert torch.equal(x.grad, kg(g, w, torch.float32))
    assert torch.equal(lin.weight.grad, kg(pad(g).t().contiguous(), pad(x.detach()), torch.float32))


def test_rowwise_roles_quantize_each_operand_for_its_own_gemm(monkeypatch):
    import loka.kernels.recipes as recipes

    calls = []
    real = recipes.quantize
    monkeypatch.setattr(recipes, "quantize", lambda x, *a, **k: calls.append(x.shape) or real(x, *a, **k))
    lin = loka.Linear(64, 32, config=LinearConfig.uniform("emulated-rowwise-e4m3"))
    lin(torch.randn(48, 64, requires_grad=True)).sum().backward()
    assert len(calls) == 6  # rowwise scales run along K, which differs per role
