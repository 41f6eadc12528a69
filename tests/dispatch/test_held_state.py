"""loka.Linear's own tensors and kernels as compiled steps read them: the FP8 weight, its
scale and the static scale table held as gradient-free Parameters outside ``_parameters``
(no optimizer, state_dict entry or dtype cast), and kernels reached through one global
table by key."""

import copy

import torch
from torch import nn

import loka
from loka.config import LinearConfig
from loka.dispatch import linear as L
from loka.kernels import registry

K = "cublas-tensorwise"


def _serving_linear():
    torch.manual_seed(0)
    lin = loka.Linear(64, 32, bias=False, config=LinearConfig(fwd=K)).to(torch.bfloat16)
    lin.quantize_weight()
    lin.set_input_amax(4.0, rows=16)
    return lin


def test_the_fp8_weight_and_scales_are_held_outside_the_parameters():
    lin = _serving_linear()
    q = lin.weight_q
    assert q.data.dtype == torch.float8_e4m3fn and q.granularity.value == "tensorwise"
    held = (q.data, q.scale, lin.__dict__["_xs_table"])
    assert all(type(t) is nn.Parameter and not t.requires_grad for t in held)
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    assert set(lin.state_dict()) == {"weight"}
    # a dtype cast of the module leaves the FP8 weight and the float32 scales as they are
    before = q.data.clone()
    lin.to(torch.float32)
    assert lin.weight_q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.weight_q.data.view(torch.uint8), before.view(torch.uint8))
    assert lin._input_scales.dtype == torch.float32
    # the same values come back through the property, and None clears them
    again = lin.weight_q
    assert again.fmt.name == "e4m3" and again.block == q.block
    lin.weight_q = None
    assert lin.weight_q is None and lin.__dict__["_wq"] is None


def test_serving_output_is_the_one_of_a_plain_tensor_state():
    """The held Parameters change nothing in what the forward computes: against the same
    GEMM on the same FP8 operands made by hand, in float64."""
    lin = _serving_linear()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    q = lin.weight_q
    scale_x = lin._input_scales.reshape(()).double()
    xq = (x.double() / scale_x).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale_x
    ref = xq @ (q.data.double() * q.scale.double())
    assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2)


def test_serving_from_the_fp8_weight_passes_no_high_precision_weight(monkeypatch):
    lin = _serving_linear()
    lin.set_input_amax(None)  # dynamic scales
    seen = []
    real = L._LinearFunction.apply

    def spy(*args):
        seen.append(args[2])
        return real(*args)
    monkeypatch.setattr(L._LinearFunction, "apply", spy)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        lin(x)
    assert seen == []  # the short dynamic path: no autograd Function
    lin.monitor = L.SiteMonitor()  # (unarmed) a monitor takes the general path
    with torch.no_grad():
        lin(x)
    assert seen[-1] is None
    lin.monitor = None
    lin(x)  # with autograd on, the weight is passed (a backward may need it)
    assert seen[-1] is lin.weight
    # a static scale: the short path, which runs no autograd Function at all
    lin.set_input_amax(4.0, rows=16)
    seen.clear()
    with torch.no_grad():
        lin(x)
    assert seen == []


def test_kernels_are_reached_by_key_and_a_lost_key_is_interned_again():
    lin = loka.Linear(32, 32, config=LinearConfig(fwd=K))
    assert lin._kernel_keys[0] == K and L._INTERNED[K] is lin.kernels[0]
    assert lin._live_kernels() == lin.kernels
    # another object under the same name takes a key of its own
    other = copy.copy(registry.get(K))
    key = L._intern(other)
    assert key != K and L._INTERNED[key] is other and L._INTERNED[K] is lin.kernels[0]
    # a table that lost the key (a module restored elsewhere): interned again
    saved = L._INTERNED.pop(K)
    try:
        assert lin._live_kernels() == lin.kernels
        assert L._INTERNED[lin._kernel_keys[0]] is lin.kernels[0]
    finally:
        L._INTERNED[K] = saved


def test_a_compiled_forward_follows_a_new_fp8_weight_without_recompiling():
    """FSDP2's FP8 gather sets ``weight_q`` anew every step: the compiled forward must read
    the new held Parameter, not one baked in at compile time, and not compile again."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    lin = loka.Linear(64, 32, bias=False, config=LinearConfig(fwd=K)).to(torch.bfloat16)
    lin.quantize_weight()
    compiled = torch.compile(lin)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y1 = compiled(x).float()
        graphs = counters["stats"]["unique_graphs"]
        lin.weight.mul_(2)
        lin.quantize_weight()  # a new object: (2 W) in FP8, its scale doubled
        y2 = compiled(x).float()
    assert counters["stats"]["unique_graphs"] == graphs == 1
    assert torch.allclose(y2, 2 * y1, rtol=1e-2, atol=1e-2)


def test_a_compiled_serving_forward_guards_no_property_of_the_held_state():
    """The hot path reads the held state from the instance's ``__dict__`` (``_wq``,
    ``_xs_table``), not through the ``weight_q`` and ``_input_scales`` properties, whose
    code a compiled step would otherwise guard at every site; the guards still see the
    held tensors themselves."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    lin = _serving_linear()
    compiled = torch.compile(lin)
    with torch.no_grad():
        compiled(torch.randn(16, 64, dtype=torch.bfloat16))
    entries = _debug_get_cache_entry_list(type(lin).forward.__code__)
    assert len(entries) == 1
    guards = str(entries[0].guard_manager)
    assert "['weight_q']" not in guards and "['_input_scales']" not in guards
    assert "._wq" in guards and "._xs_table" in guards
