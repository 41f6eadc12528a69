import io

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn

import loka
from loka.config import LinearConfig
from loka.dispatch import Plan
from loka.dispatch.static import amax_from_report
from loka.kernels import registry
from loka.numerics import (as_granularity, get_format, operand_block, quantize,
                           round_scale_to_power_of_two, sqnr)
from loka.probe.report import ProbeReport, SiteReport
from tests.support import need_kernel

KERNELS = ["emulated-rowwise-e4m3", "emulated-tensorwise-e4m3", "cublas-rowwise",
           "cublas-tensorwise", "emulated-blockwise-e4m3"]


class MLP(nn.Module):
    def __init__(self, dims=(128, 256, 128, 128), dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.to(dtype)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _reference(model, x):
    """The unquantized model in float64."""
    layers = [(l.weight.detach().double(), l.bias.detach().double()) for l in model.layers]
    x = x.double()
    for i, (w, b) in enumerate(layers):
        x = x @ w.t() + b
        if i < len(layers) - 1:
            x = torch.relu(x)
    return x


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_inference_matches_training_forward_exactly(kernel, dtype, grad_mode):
    need_kernel(kernel)
    model = MLP(dtype=dtype)
    x = torch.randn(4, 16, 128, dtype=dtype)
    ref = _reference(model, x)
    plan = Plan.uniform(model, kernel)
    loka.apply(model, plan)
    train_out = model(x).detach()  # training mode: the weight quantized per call
    report = loka.apply(model, plan, inference=True)
    assert report.inference and all(m.weight_q is not None for m in model.layers)
    assert all(m.config == LinearConfig(fwd=kernel) for m in model.layers)
    with getattr(torch, grad_mode)():
        out = model(x)
    # same kernels, same (dynamic) scales, weights quantized once instead of per call
    torch.testing.assert_close(out, train_out, rtol=0, atol=0)
    assert 18 < sqnr(out, ref) < 45  # and that is FP8 error against float64


def test_weights_are_quantized_once():
    need_kernel("cublas-rowwise")
    model = MLP()
    x = torch.randn(32, 128)
    loka.apply(model, Plan.uniform(model, "cublas-rowwise"), inference=True)
    with torch.no_grad():
        before = model(x)
        for layer in model.layers:
            layer.weight.zero_()  # the FP8 copy is what the forward reads
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)
        loka.apply(model, Plan.uniform(model, "cublas-rowwise"), inference=True)  # requantize
        assert torch.equal(model(x), model.layers[-1].bias.expand(32, -1))


def test_gradient_only_sites_are_not_swapped_for_inference():
    model = MLP()
    plan = Plan.uniform(model, LinearConfig(wgrad="emulated-rowwise-e4m3"))
    assert plan.fp8_sites() == ["layers.0", "layers.1", "layers.2"]
    report = loka.apply(model, plan, inference=True)
    assert report.changed == [] and all(type(m) is nn.Linear for m in model.layers)


def test_drop_weights_changes_the_state_dict_and_round_trips():
    torch.manual_seed(3)
    model = MLP()
    x = torch.randn(32, 128)
    plan = Plan.uniform(model, "emulated-rowwise-e4m3")
    loka.apply(model, plan, inference=True)
    with torch.no_grad():
        kept = model(x)
    report = loka.apply(model, plan, inference=True, drop_weights=True)
    assert any("state_dict keys changed" in n for n in report.notes)
    keys = list(model.state_dict())
    assert "layers.0.weight" not in keys and "layers.0.weight_fp8" in keys
    assert model.state_dict()["layers.0.weight_fp8"].dtype == torch.float8_e4m3fn
    assert all(m.weight is None for m in model.layers)
    with torch.no_grad():
        torch.testing.assert_close(model(x), kept, rtol=0, atol=0)
        assert model(torch.randn(0, 128)).shape == (0, 128)
    # save the FP8 model and load it into another dropped model of other weights
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    other = MLP()
    loka.apply(other, plan, inference=True, drop_weights=True)
    buf.seek(0)
    other.load_state_dict(torch.load(buf))
    with torch.no_grad():
        torch.testing.assert_close(other(x), kept, rtol=0, atol=0)
    with pytest.raises(ValueError, match="weights of layers.0, layers.1, layers.2 were dropped"):
        loka.unapply(model)
    with pytest.raises(ValueError, match="dropped"):
        model.layers[0].set_config(LinearConfig())
    bad = dict(model.state_dict())
    bad["layers.0.weight_scale"] = bad["layers.0.weight_scale"].double()
    with pytest.raises(RuntimeError, match="layers.0.weight_scale: expected torch.float32"):
        other.load_state_dict(bad)
    missing = {k: v for k, v in model.state_dict().items() if k != "layers.1.weight_fp8"}
    with pytest.raises(RuntimeError, match="Missing key.*layers.1.weight_fp8"):
        other.load_state_dict(missing)


def test_static_scales_equal_dynamic_ones_at_the_observed_amax():
    model = MLP()
    x = torch.randn(64, 128)
    plan = Plan.uniform(model, "emulated-tensorwise-e4m3")
    loka.apply(model, plan, inference=True)
    with torch.no_grad():
        dynamic = model(x)
        h0 = torch.relu(model.layers[0](x))
        h1 = torch.relu(model.layers[1](h0))
    amax = {"layers.0": x.abs().max(), "layers.1": h0.abs().max(), "layers.2": h1.abs().max()}
    loka.apply(model, plan, inference=True, static_scales=amax)
    assert float(model.layers[1].input_amax) == float(h0.abs().max())
    with torch.no_grad():
        torch.testing.assert_close(model(x), dynamic, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", ["emulated-rowwise-e4m3", "cublas-tensorwise",
                                    "cublas-rowwise", "emulated-blockwise-e4m3",
                                    "emulated-mx-e4m3"])
def test_static_scales_saturate_beyond_the_amax(kernel):
    """Also on a real rowwise GEMM, whose library wants contiguous row scales (a static
    scale is one value broadcast over the rows)."""
    need_kernel(kernel)
    amax = 448 * 2.0 ** -8  # 1.75: its scale is a power of two, so MX does not round it
    model = MLP()
    loka.apply(model, Plan.uniform(model, kernel, module_filter="layers.0"), inference=True,
               static_scales={"layers.0": amax})
    lin = model.layers[0]
    x = torch.randn(64, 128) * 2
    with torch.no_grad():
        clipped = lin(x.clamp(-amax, amax))
        torch.testing.assert_close(lin(x), clipped, rtol=0, atol=0)  # beyond amax: saturated
        assert not torch.equal(lin(x), lin(x.clamp(-amax / 2, amax / 2)))
        ref = (x.clamp(-amax, amax).double() @ lin.weight.double().t() + lin.bias.double())
    assert sqnr(clipped, ref) > 18  # and within the range, ordinary FP8 error


def test_static_scale_input_is_validated():
    lin = loka.Linear(64, 32, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    for bad in (0.0, -1.0, float("nan"), float("inf"), [1.0, 2.0]):
        with pytest.raises(ValueError, match="finite positive"):
            lin.set_input_amax(bad)
    with pytest.raises(ValueError, match="does not take a static input scale"):
        loka.Linear(64, 32).set_input_amax(1.0)


def test_static_scale_rows_are_validated():
    lin = loka.Linear(64, 32, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="rows must be a non-negative int"):
            lin.set_input_amax(1.0, rows=bad)


@pytest.mark.parametrize("kernel", ["emulated-rowwise-e4m3", "emulated-tensorwise-e4m3",
                                    "emulated-blockwise-e4m3", "emulated-mx-e4m3",
                                    "cublas-rowwise"])
@pytest.mark.parametrize("rows", [0, 48, 64, 200])
def test_the_static_scale_table_gives_the_same_bits_for_any_row_count(kernel, rows):
    """The scale is made once, as a table of up to ``rows`` rows of blocks; an input with
    more rows than the table expands its first row. Every way gives the bits of the forward
    kernel on a static quantization with ``amax / fmt.max`` per block, and the float64
    reference GEMM of the saturated input to FP8 accuracy."""
    need_kernel(kernel)
    torch.manual_seed(0)
    lin = loka.Linear(256, 128, bias=False, config=LinearConfig(fwd=kernel))
    amax = 2.5
    lin.set_input_amax(amax, rows=rows)
    kf = registry.get(kernel)
    fmt = get_format(kf.formats[0])
    x = torch.randn(64, 256) * 2
    with torch.no_grad():
        y = lin(x)
        br, bc = operand_block(as_granularity(kf.scaling), "a")
        grid = (1 if br == -1 else -(-64 // br), 1 if bc == -1 else -(-256 // bc))
        scale = torch.full(grid, amax / fmt.max)
        if kf.scaling == "mx":  # MX scales are powers of two, rounded up
            scale = round_scale_to_power_of_two(scale)
        q = quantize(x, fmt, kf.scaling, "a", scale=scale)
        assert torch.equal(lin._quantize_input(x).data, q.data)
        assert torch.equal(lin._quantize_input(x).scale.reshape(grid), scale)
        want = lin(x, x_q=q)  # the forward kernel on that quantization, handed in
        # saturated at the scale's range (MX rounds the scale up to a power of two)
        top = float(scale[0, 0]) * fmt.max
        ref = x.clamp(-top, top).double() @ lin.weight.double().t()
    # the table: one row of blocks per row of input it covers (at least one)
    expect_rows = 1 if br == -1 else max(1, -(-rows // br))
    assert tuple(lin._input_scales.shape) == (expect_rows, grid[1])
    assert torch.all(lin._input_scales == scale[0, 0])
    assert torch.equal(y, want)
    assert sqnr(y, ref) > 18


def test_a_static_scale_table_too_large_keeps_one_row_and_the_same_bits(monkeypatch):
    from loka.dispatch import linear as linear_mod
    monkeypatch.setattr(linear_mod, "STATIC_TABLE_MAX_SCALES", 100)
    lin = loka.Linear(256, 128, bias=False, config=LinearConfig(fwd="emulated-blockwise-e4m3"))
    lin.set_input_amax(2.5, rows=64)  # 64 x 2 blocks would be 128 scales
    assert tuple(lin._input_scales.shape) == (1, 2)
    small = loka.Linear(256, 128, bias=False, config=LinearConfig(fwd="emulated-blockwise-e4m3"))
    small.load_state_dict(lin.state_dict())
    small.set_input_amax(2.5, rows=32)  # 64 scales: kept whole
    assert tuple(small._input_scales.shape) == (32, 2)
    x = torch.randn(64, 256)
    with torch.no_grad():
        assert torch.equal(lin(x), small(x))


@pytest.mark.parametrize("kernel", ["emulated-tensorwise-e4m3", "emulated-rowwise-e4m3"])
def test_static_scales_set_under_inference_mode_serve_a_forward_with_grad_mode_on(kernel):
    """The table made under torch.inference_mode (a serving setup) is an ordinary tensor:
    a later forward with autograd on (weights that require grad) can save it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    with torch.inference_mode():
        loka.apply(model, Plan.uniform(model, kernel), inference=True,
                   static_scales={"0": 3.0, "2": 3.0})
    x = torch.randn(16, 64)
    y = model(x)
    with torch.no_grad():
        assert torch.equal(y, model(x))
    assert not model[0]._input_scales.is_inference()


def test_a_moved_static_scale_table_is_made_again_on_the_new_device():
    """After .to(...), the table is the one set_input_amax makes there from the same amax
    (a GPU divides by a host scalar as a multiplication by its reciprocal, so a moved copy
    of the CPU's quotient could differ in the last bit), with the same rows."""
    lin = loka.Linear(256, 128, bias=False, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    lin.set_input_amax(74.62663269042969, rows=48)
    lin.to(torch.float64)  # a move through _apply (same device here)
    assert lin._input_scales.dtype == torch.float32
    fresh = loka.Linear(256, 128, bias=False, config=LinearConfig(fwd="emulated-rowwise-e4m3"))
    fresh.set_input_amax(74.62663269042969, rows=48)
    assert torch.equal(lin._input_scales, fresh._input_scales)
    # equal scales on one device: one table (tests/dispatch/test_shared_input.py)
    assert lin._input_scales is fresh._input_scales
    assert tuple(lin._input_scales.shape) == (48, 1)


def test_amax_from_report():
    report = ProbeReport(sites={
        "a": SiteReport("a", 64, 64, 8, stats={"act": {"amax": 3.0}, "grad": {"amax": 9.0}}),
        "b": SiteReport("b", 64, 64, 8, stats={"act": {"amax": float("inf")}}),
        "c": SiteReport("c", 64, 64, 8, stats={"act": {"updates": 0}}),
        "d": SiteReport("d", 64, 64, 8, stats={}),
    })
    assert amax_from_report(report, margin=1.5) == {"a": 4.5}
    assert amax_from_report(report, key="grad.amax") == {"a": 9.0}
    with pytest.raises(KeyError, match="at 'x_amax'"):
        amax_from_report(report, key="x_amax")
    with pytest.raises(ValueError, match="margin"):
        amax_from_report(report, margin=0)


def test_fp8_weight_follows_device_moves_but_not_dtype_casts():
    model = MLP()
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"), inference=True,
               static_scales={"layers.0": 3.0})
    model.double()
    q = model.layers[0].weight_q
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert model.layers[0].input_amax.dtype == torch.float32
    model.to("meta")
    assert model.layers[0].weight_q.data.device.type == "meta"
    assert model.layers[0].input_amax.device.type == "meta"


def test_compiled_bf16_inference_within_fp8_error():
    torch._dynamo.reset()
    model = MLP(dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    ref = _reference(model, x)
    loka.apply(model, Plan.uniform(model, "cublas-rowwise"), inference=True)
    with torch.inference_mode():
        eager = model(x)
        with torch._inductor.config.patch(compile_threads=1):
            compiled = torch.compile(model, fullgraph=True)(x)
    torch._dynamo.reset()
    # Inductor rounds bf16 differently inside fused kernels, which may move an FP8 code:
    # both are FP8 error away from float64, and equally far
    err_e = float((eager.double() - ref).norm() / ref.norm())
    err_c = float((compiled.double() - ref).norm() / ref.norm())
    assert err_e < 0.1 and err_c < 0.1 and abs(err_c - err_e) < 0.25 * err_e
