"""torch.compile(fullgraph=True) of planned models on the CPU: no graph breaks, the same
outputs and gradients as eager, no recompilation per call."""

import numpy as np
import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import loka
import loka.models
from loka.config import LinearConfig
from loka.dispatch import Plan
from loka.kernels import Kernel, get, ops, register, unregister


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with torch._inductor.config.patch(compile_threads=1):  # 2-core CI: no worker pool
        yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self, dims=(64, 128, 64, 32), dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.norm = nn.LayerNorm(dims[1])
        self.to(dtype)

    def forward(self, x):
        x = self.layers[0](x)
        x = torch.relu(self.norm(x))  # norm -> FP8 quantize: what Inductor fuses
        for layer in self.layers[1:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


def _run(model, x):
    """Outputs and every gradient of one forward/backward."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return [y.detach()] + grads


def _assert_same(eager, compiled, rtol, atol):
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=rtol, atol=atol)


MIXED = LinearConfig("cublas-rowwise", "emulated-tensorwise-e4m3", "cublas-tensorwise")


@pytest.mark.parametrize("config, backend", [
    (MIXED, "inductor"),  # Inductor lowers _scaled_mm and fuses the quantization
    (LinearConfig.uniform("emulated-blockwise-e4m3"), "aot_eager"),
    (LinearConfig("emulated-rowwise-e4m3", "emulated-rowwise-e5m2", "bf16"), "aot_eager"),
])
def test_planned_mlp_compiles_fullgraph_and_matches_eager(config, backend):
    model = MLP(dims=(128, 256, 128, 128))
    loka.apply(model, Plan.uniform(model, config))
    assert all(isinstance(m, loka.Linear) for m in model.layers)
    x = torch.randn(48, 128)
    eager = _run(model, x)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    first = _run(compiled, x)
    second = _run(compiled, torch.randn(48, 128))  # a new batch of the same shape
    assert counter.frame_count == 1  # one graph, no recompilation per call
    # fp32 model: Inductor's fused quantization gives the same FP8 codes; only the order
    # of fp32 reductions (bias grad, norm) may differ in the last bits
    _assert_same(eager, first, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(second[0]).all()


def test_apply_and_unapply_after_compile_recompile_and_take_effect():
    model = MLP()
    x = torch.randn(16, 64)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        base = compiled(x)
        report = loka.apply(compiled, Plan.uniform(model, "emulated-tensorwise-e4m3"))
        assert any("recompiles" in n for n in report.notes) and report.compiled
        assert isinstance(model.layers[0], loka.Linear)  # changed on the original module
        planned = compiled(x)
        torch.testing.assert_close(planned, model(x), rtol=0, atol=0)
        assert not torch.equal(planned, base)  # the FP8 kernels run in the compiled model
        loka.unapply(compiled)
        torch.testing.assert_close(compiled(x), base, rtol=0, atol=0)


def _numpy_gemm_kernel(name):
    """A kernel Dynamo does not trace (like a hand-written launcher or a C++ library)."""
    base = get("emulated-rowwise-e4m3")

    @torch.compiler.disable
    def fn(a, b, out_dtype):
        qa, qb = (base.quantize_a(a) if isinstance(a, torch.Tensor) else a,
                  base.quantize_b(b) if isinstance(b, torch.Tensor) else b)
        acc = np.matmul(qa.data.float().numpy(), qb.data.float().numpy())
        # the emulated kernel's numerics: scales applied in float64, one rounding
        scales = qa.scale.double() * qb.scale.double()
        return (torch.from_numpy(acc).double() * scales).to(out_dtype)

    return Kernel(name, fn, library="custom", scaling="rowwise", formats=("e4m3", "e4m3"), align=16,
                  quantize_a=base.quantize_a, quantize_b=base.quantize_b)


@pytest.fixture
def opaque_kernel():
    register(_numpy_gemm_kernel("t-numpy"))
    yield "t-numpy"
    ops.unmark_opaque("t-numpy")
    unregister("t-numpy")


def test_opaque_kernel_runs_as_one_custom_op(opaque_kernel):
    model = MLP()
    x = torch.randn(16, 64)
    config = LinearConfig.uniform(opaque_kernel)
    loka.apply(model, Plan.uniform(model, config))
    with pytest.raises(torch._dynamo.exc.Unsupported):  # inline, it breaks the graph
        torch.compile(model, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    ops.mark_opaque(opaque_kernel)
    loka.apply(model, Plan.uniform(model, config))  # kernels are resolved at apply time
    assert ops.is_opaque(model.layers[0].kernels[0])
    eager = _run(model, x)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _run(torch.compile(model, fullgraph=True, backend=counter), x)
    assert counter.frame_count == 1
    _assert_same(eager, compiled, rtol=0, atol=0)
    # the op matches the kernel it wraps, including pre-quantized operands
    a, w = torch.randn(32, 64), torch.randn(64, 48)
    k = get("emulated-rowwise-e4m3")
    want = k(a, k.quantize_b(w), torch.float32)
    got = ops.runnable(get(opaque_kernel))(a, k.quantize_b(w), torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_custom_op_fake_checks_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.empty(8, 64), torch.empty(64, 16)
        out = torch.ops.loka.gemm(a, None, b, None, "emulated-rowwise-e4m3", torch.bfloat16)
        assert out.shape == (8, 16) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="shapes do not match"):
            torch.ops.loka.gemm(a, None, torch.empty(32, 16), None, "x", torch.float32)


def test_wukong_tiny_compiles_fullgraph_and_matches_eager():
    models = pytest.importorskip("loka.models")
    data = pytest.importorskip("loka.data")
    torch.manual_seed(0)
    model = models.build("wukong", "tiny")
    batch = next(iter(data.SyntheticCTR(model.config.features, batch_size=64)))
    plan = Plan.uniform(model, "emulated-rowwise-e4m3")
    assert len(plan.fp8_sites()) >= 4
    loka.apply(model, plan)

    @torch.no_grad()
    def step(m):  # forward and loss; the MLP tests above cover the compiled backward
        out = m(batch)
        loss = nn.functional.binary_cross_entropy_with_logits(out, batch.labels.to(out.dtype))
        return [out, loss]

    eager = step(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = step(torch.compile(model, fullgraph=True, backend=counter))
    assert counter.frame_count == 1
    _assert_same(eager, compiled, rtol=1e-5, atol=1e-6)


UNTRACEABLE = ("cuda_capability", "has_scaled_mm", "module_available", "triton_available",
               "torchao_available", "fbgemm_genai_available", "summary")


@pytest.mark.parametrize("name", loka.models.list_models())
def test_no_capability_query_is_traced_in_a_forward(name, monkeypatch):
    """Every "can this machine do X?" question is answered outside the traced forward and
    backward: on a GPU those queries (imports, device properties) break the graph, which
    the CPU, where they return early, would not show. Here each one breaks the graph
    whenever it is traced, and every reference model, with every Mod that keeps its
    function and an FP8 plan, must still compile to one graph."""
    import dataclasses

    import loka.models as M
    from loka.config import ModsConfig
    from loka.data import SyntheticCTR
    from loka.kernels import capabilities as caps

    torch.manual_seed(0)
    mods = dataclasses.replace(ModsConfig.paper(), blocknorm=8, fuse_norm_quant=True,
                               merge_siblings=True, token_major=True)
    model = M.build(name, "tiny", mods=mods)
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"), strict=False)
    batch = next(SyntheticCTR(model.feature_spec, 16, seed=3))
    eager = model(batch)
    for fn in UNTRACEABLE:
        original = getattr(caps, fn)

        def breaking(*args, _original=original, **kwargs):
            torch._dynamo.graph_break()
            return _original(*args, **kwargs)

        monkeypatch.setattr(caps, fn, breaking)
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(model, fullgraph=True, backend=counter)(batch)
    out.sum().backward()
    assert counter.frame_count == 1
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
