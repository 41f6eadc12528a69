"""loka.Linear's short dynamic serving path: a call without gradients on a Linear that
serves from its FP8 weight with dynamic scales hands x and the FP8 weight to its forward
kernel, which quantizes x and runs the GEMM, without the autograd Function. It must give
the general path's bits, step aside wherever the general path does more (a producer's FP8
input, a monitor, autocast, float64, empty input, gradients, a static scale), and leave a
compiled step fewer guards per Linear than the general path. (Which calls it leaves to the
general path: tests/dispatch/test_static_path.py, for both short paths.)"""

import copy

import pytest
import torch

import loka
from loka.config import LinearConfig
from tests.support import LinearChain, guard_leaves

TW, RW, EMU = "cublas-tensorwise", "cublas-rowwise", "emulated-rowwise-e4m3"


def _linear(kernel, bias=True, dtype=torch.bfloat16, n_in=64, n_out=48, uniform=False):
    """``uniform``: the gradient roles on ``kernel`` too (a tensorwise forward then shares
    its FP8 x with the weight gradient, and the general path quantizes x before the GEMM
    instead of inside it)."""
    torch.manual_seed(0)
    config = (LinearConfig(fwd=kernel, dgrad=kernel, wgrad=kernel) if uniform
              else LinearConfig(fwd=kernel))
    lin = loka.Linear(n_in, n_out, bias=bias, config=config).to(dtype)
    lin.quantize_weight()
    return lin


def _general(lin, x):
    """The general path's output without gradients: the same call with the key cleared."""
    key = lin.__dict__["_serve_key"]
    lin.__dict__["_serve_key"] = None
    try:
        with torch.no_grad():
            return lin(x)
    finally:
        lin.__dict__["_serve_key"] = key


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("kernel", [TW, RW, EMU, "emulated-tensorwise-e4m3"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 64), (2, 5, 64), (3, 64)])
@pytest.mark.parametrize("uniform", [False, True])
def test_the_short_dynamic_path_gives_the_general_paths_bits(kernel, bias, dtype, shape,
                                                             uniform):
    lin = _linear(kernel, bias=bias, dtype=dtype, uniform=uniform)
    assert lin._serve_key == lin._kernel_keys[0] and lin._static_key is None
    x = torch.randn(*shape, dtype=dtype) * 2
    x[..., 0] = 50.0  # an outlier: dynamic scales follow it
    with torch.no_grad():
        y = lin(x)
    ref = _general(lin, x)
    assert y.shape == (*shape[:-1], 48) and y.dtype == dtype
    assert torch.equal(_bits(y), _bits(ref))


def test_the_short_dynamic_path_against_float64():
    """Tensorwise: x cast with the scale of its own amax, then an exact GEMM."""
    lin = _linear(TW, dtype=torch.float32)
    x = torch.randn(16, 64) * 3
    with torch.no_grad():
        y = lin(x)
    q = lin.weight_q
    s = float(x.abs().max()) / 448.0
    xq = (x.double() / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s
    exact = xq @ (q.data.double() * q.scale.double().reshape(1, -1)) + lin.bias.double()
    exact = exact.detach()
    err = (y.double() - exact).abs().max() / exact.abs().max()
    assert float(err) < 1e-5
    # and within FP8's error of the float64 layer itself
    full = (x.double() @ lin.weight.double().t() + lin.bias.double()).detach()
    assert float((y.double() - full).abs().max() / full.abs().max()) < 0.1


def test_the_serve_key_follows_the_state():
    lin = _linear(TW)
    assert lin._serve_key == TW
    lin.set_input_amax(3.0, rows=16)  # a static scale: the static path's key instead
    assert lin._serve_key is None and lin._static_key == TW
    lin.set_input_amax(None)
    assert lin._serve_key == TW and lin._static_key is None
    lin.weight_q = None  # no FP8 weight: the general path quantizes W per call
    assert lin._serve_key is None
    lin.quantize_weight()
    assert lin._serve_key == TW
    twin = copy.deepcopy(lin)
    assert twin._serve_key == TW
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_bits(twin(x)), _bits(lin(x)))
    lin.set_config(LinearConfig(fwd=RW))  # new kernels clear the FP8 weight
    assert lin._serve_key is None
    assert "_serve_key" not in _linear(TW).to_linear().__dict__
    base = loka.Linear(64, 48, config=LinearConfig(dgrad=TW))  # a bf16 forward
    assert base._serve_key is None
    with pytest.raises(ValueError, match="has no weight quantizer"):
        base.quantize_weight()
    assert base._serve_key is None


def test_a_weight_of_another_format_is_refused_as_on_the_general_path():
    from loka.numerics import quantize
    lin = _linear(TW, bias=False)
    lin.weight_q = quantize(lin.weight.detach().t().float(), "e5m2", "tensorwise", "b")
    assert lin._serve_key == TW  # the kernel checks its operands itself
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad(), pytest.raises(ValueError, match="quantized as"):
        lin(x)
    with torch.no_grad(), pytest.raises(ValueError, match="quantized as"):
        _general(lin, x)


def test_a_compiled_dynamic_serving_step_guards_fewer_leaves_than_the_general_path():
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    per_site = {}
    for path in ("short", "general"):
        counts = []
        for n in (2, 4):
            torch.manual_seed(0)
            model = LinearChain(n).to(torch.bfloat16).eval()
            loka.apply(model, loka.Plan.uniform(model, TW), inference=True)
            lins = [m for m in model.modules() if isinstance(m, loka.Linear)]
            assert all(m._serve_key == TW for m in lins)
            if path == "general":
                for m in lins:
                    m.__dict__["_serve_key"] = None
            counts.append(guard_leaves(model, x)[0])
        per_site[path] = (counts[1] - counts[0]) / 2
    assert 0 < per_site["short"] < per_site["general"], per_site
