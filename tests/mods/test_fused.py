"""Fused norm -> activation -> FP8 quantization: the PyTorch path against the unfused
composition (BlockNorm / LayerNorm, Hard Swish, loka.numerics.quantize), its backward
against autograd, the module in front of a loka.Linear, and the Triton kernel (on an FP8
GPU, or under Triton's CPU interpreter in a subprocess)."""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

import loka
import loka.models as M
import loka.mods.fused as fused_mod
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.dispatch import Plan
from loka.kernels import capabilities as caps
from loka.mods.blocknorm import BlockNorm
from loka.mods.fused import (FusedNormActQuant, fused_norm_act_quant, norm_act_backward,
                             reference_norm_act)
from loka.numerics import get_format, quantize, relative_frobenius

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU = not INTERPRETED and caps.triton_available("cuda") and (caps.cuda_capability("cuda") or (0, 0)) >= (8, 9)
DEVICE = "cuda" if GPU else "cpu"
HAS_TRITON = caps.module_available("triton")

def unfused(x, norm, block, act, fmt, granularity, weight=None, bias=None):
    """The composition the fused op replaces, module by module."""
    d = x.shape[-1]
    if norm == "blocknorm":
        n = BlockNorm(block)(x)
    elif norm == "layernorm":
        n = F.layer_norm(x, (d,), weight, bias, 1e-6)
    else:
        n = x
    y = torch.nn.Hardswish()(n) if act == "hardswish" else n
    return y, quantize(y.reshape(-1, d), fmt, granularity, "a")


def assert_q_equal(q, ref):
    assert (q.fmt, q.granularity, q.block) == (ref.fmt, ref.granularity, ref.block)
    assert torch.equal(q.scale.cpu(), ref.scale.cpu())
    assert torch.equal(q.data.float().cpu(), ref.data.float().cpu())


# -- the PyTorch path (CPU reference and fallback) ----------------------------------------

@pytest.mark.parametrize("norm,block,shape", [("blocknorm", 256, (64, 512)),
                                              ("blocknorm", 256, (4, 8, 300)),  # ragged block
                                              ("blocknorm", 64, (32, 64)),
                                              ("layernorm", 256, (32, 96)),
                                              ("none", 256, (16, 48))])
@pytest.mark.parametrize("act", ["hardswish", "identity"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_torch_path_is_the_unfused_composition(norm, block, shape, act, fmt, granularity):
    x = (torch.randn(shape) * 3 + 1).bfloat16()
    y, q = fused_norm_act_quant(x, norm, block, act, fmt, granularity, backend="torch")
    y_ref, q_ref = unfused(x, norm, block, act, fmt, granularity)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, y_ref)
    assert_q_equal(q, q_ref)
    assert q.shape == (x.numel() // shape[-1], shape[-1])


def test_auto_backend_falls_back_to_torch_off_gpu():
    x = torch.randn(8, 256).bfloat16()
    y, q = fused_norm_act_quant(x)  # CPU tensor: the PyTorch composition
    y_ref, q_ref = unfused(x, "blocknorm", 256, "hardswish", "e4m3", "rowwise")
    assert torch.equal(y, y_ref)
    assert_q_equal(q, q_ref)
    y2, q2 = fused_norm_act_quant(x, return_hp=False)
    assert y2 is None and torch.equal(q2.data.float(), q.data.float())


@pytest.mark.parametrize("norm,d,affine", [("blocknorm", 512, False), ("blocknorm", 300, False),
                                           ("layernorm", 96, False), ("layernorm", 96, True),
                                           ("none", 32, False)])
@pytest.mark.parametrize("act", ["hardswish", "identity"])
def test_backward_formula_matches_autograd(norm, d, affine, act):
    x = (torch.randn(16, d, dtype=torch.float64) * 2).requires_grad_()
    w = (torch.rand(d, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    b = torch.randn(d, dtype=torch.float64).requires_grad_() if affine else None
    dy = torch.randn(16, d, dtype=torch.float64)
    y = reference_norm_act(x, norm, 128, act, 1e-6, w, b)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy)
    dx, dw, db = norm_act_backward(x.detach(), dy, norm, 128, act, 1e-6,
                                   None if w is None else w.detach(),
                                   None if b is None else b.detach())
    # the formula computes in float32 (as on the GPU); compare at float32 precision
    torch.testing.assert_close(dx.double(), grads[0], rtol=1e-4, atol=1e-5)
    if affine:
        torch.testing.assert_close(dw.double(), grads[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(db.double(), grads[2], rtol=1e-4, atol=1e-4)


def test_module_feeds_a_loka_linear_without_requantizing():
    lin = loka.Linear(256, 64, bias=False,
                      config=loka.LinearConfig(fwd="emulated-rowwise-e4m3", dgrad="bf16", wgrad="bf16"))
    fused = FusedNormActQuant.for_linear(lin)
    assert (fused.fmt, fused.granularity) == ("e4m3", "rowwise")
    x = torch.randn(4, 8, 256, requires_grad=True)
    y, q = fused(x)
    out = lin(y, x_q=q)
    torch.testing.assert_close(out, lin(y), rtol=0, atol=0)  # q is exactly what lin would make
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert lin.weight.grad is not None
    # a high-precision forward kernel gets no FP8 tensor
    plain = FusedNormActQuant.for_linear(loka.Linear(256, 64))
    assert plain(x)[1] is None and plain.granularity is None


def test_handoff_only_where_the_linear_would_make_the_same_fp8_tensor():
    def lin(fwd):
        return loka.Linear(128, 128, config=loka.LinearConfig(fwd=fwd, dgrad="bf16", wgrad="bf16"))
    assert fused_mod.handoff(lin("emulated-rowwise-e4m3")) == ("e4m3", "rowwise")
    assert fused_mod.handoff(lin("emulated-tensorwise-e4m3fnuz")) == ("e4m3fnuz", "tensorwise")
    assert fused_mod.handoff(lin("bf16")) is None
    assert fused_mod.handoff(lin("emulated-blockwise-e4m3")) is None
    assert fused_mod.handoff(lin("emulated-mx-e4m3")) is None
    assert fused_mod.handoff(torch.nn.Linear(128, 128)) is None
    static = lin("emulated-tensorwise-e4m3")
    static.set_input_amax(torch.tensor(3.0))  # a calibrated scale: the Linear quantizes
    assert fused_mod.handoff(static) is None
    ln = torch.nn.LayerNorm(64)
    assert fused_mod.norm_act_spec(ln, torch.nn.Hardswish())["weight"] is ln.weight
    assert fused_mod.norm_act_spec(BlockNorm(32), None) == {
        "norm": "blocknorm", "block": 32, "eps": 1e-6, "act": "identity"}
    assert fused_mod.norm_act_spec(torch.nn.RMSNorm(64), None) is None
    assert fused_mod.norm_act_spec(None, torch.nn.SiLU()) is None


FUSED_MODS = dataclasses.replace(ModsConfig.paper(), fuse_norm_quant=True)


def fused_pair(name, mods, kernel, device="cpu", dtype=torch.float32):
    """Reference model ``name`` (tiny) with ``mods`` but without and with fuse_norm_quant,
    the same weights, ``kernel`` at every Linear that takes it."""
    torch.manual_seed(0)
    plain, fused = (M.build(name, "tiny", mods=dataclasses.replace(mods, fuse_norm_quant=f))
                    .to(device, dtype) for f in (False, True))
    fused.load_state_dict(plain.state_dict())
    for model in (plain, fused):
        loka.apply(model, Plan.uniform(model, kernel), strict=False)
    return plain, fused


@pytest.mark.parametrize("kernel", ["emulated-rowwise-e4m3", "emulated-tensorwise-e4m3"])
@pytest.mark.parametrize("name", M.list_models())
def test_models_route_norms_into_fp8_linears(name, kernel, monkeypatch):
    """A reference model with fuse_norm_quant computes what it computes without (outputs
    and gradients bit for bit: each FP8 Linear gets the tensor it would have made), and
    its norm / activation -> FP8 Linear edges go through the fused op, whose FP8 tensor the
    Linear takes as is."""
    plain, fused = fused_pair(name, FUSED_MODS, kernel)
    calls, handed = [], []
    real = fused_mod.fused_norm_act_quant

    def spy(x, **kw):
        calls.append((kw["norm"], kw["act"], kw["granularity"], x.shape[-1]))
        assert kw["return_hp"] == torch.is_grad_enabled()  # serving writes the FP8 tensor alone
        return real(x, **kw)
    monkeypatch.setattr(fused_mod, "fused_norm_act_quant", spy)
    for m in fused.modules():
        if isinstance(m, loka.Linear):
            m.register_forward_pre_hook(
                lambda mod, args, kwargs: handed.append(kwargs.get("x_q") is not None),
                with_kwargs=True)
    batch = next(SyntheticCTR(plain.feature_spec, 32, seed=5))
    out_p, out_f = plain(batch), fused(batch)
    torch.testing.assert_close(out_f, out_p, rtol=0, atol=0)
    out_p.sum().backward()
    out_f.sum().backward()
    grads_p = dict(plain.named_parameters())
    for n, p in fused.named_parameters():
        if p.grad is not None or grads_p[n].grad is not None:
            torch.testing.assert_close(p.grad, grads_p[n].grad, rtol=0, atol=0, msg=n)
    assert sum(handed) == len(calls)  # every fused output went into its Linear as FP8
    with torch.no_grad():  # serving: no high-precision activation, the same logits
        torch.testing.assert_close(fused(batch), plain(batch), rtol=0, atol=0)
    calls, served = calls[:len(calls) // 2], calls[len(calls) // 2:]
    assert served == calls and sum(handed) == 2 * len(calls)
    assert all(g == kernel.split("-")[1] for _, _, g, _ in calls)
    assert all(n != "none" or a != "identity" for n, a, _, _ in calls)  # no bare quantization
    assert bool(calls) == (name != "logreg")  # logistic regression: one Linear, nothing before
    if name == "wukong":  # per layer: FM norm -> fm_mlp.0, Hard Swish -> fm_mlp.2, and the
        c = fused.config  # top MLP's Hard Swishes; the top norm (blocks of 256 > d) is not
        assert sum(1 for n, a, _, _ in calls if (n, a) == ("blocknorm", "identity")) \
            == c.num_layers
        # the logit Linear (N = 1) runs on no FP8 kernel: its input's Hard Swish stays apart
        assert sum(1 for n, a, _, _ in calls if a == "hardswish") == \
            c.num_layers + len(c.top_hidden) - 1


def test_fused_model_compiles_in_one_graph():
    """The routing is static Python (module types, the Linears' configs): torch.compile
    traces a fused Wukong's forward and backward without a graph break, to the same values."""
    torch.manual_seed(0)
    model = M.build("wukong", "tiny", mods=dataclasses.replace(FUSED_MODS, blocknorm=8))
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"), strict=False)
    batch = next(SyntheticCTR(model.feature_spec, 16, seed=4))
    eager = model(batch)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(batch)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    compiled.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():  # serving: the FP8-only producer and the placeholder trace too
        served = torch.compile(model, fullgraph=True, backend="aot_eager")(batch)
    torch.testing.assert_close(served, eager.detach(), rtol=0, atol=0)


def test_kernel_choice_is_a_constant_of_the_compiled_graph(monkeypatch):
    """Whether the Triton kernel runs is decided once, outside the trace: the capability
    queries behind it (importing triton, the device's properties) are not traceable, and
    traced they split a compiled model at every producer. Here the query itself breaks
    the graph when traced; fullgraph fails unless the answer is taken as a constant."""
    def untraceable(device=None):
        torch._dynamo.graph_break()
        return False

    monkeypatch.setattr(caps, "triton_available", untraceable)
    torch._dynamo.reset()
    x = torch.randn(8, 256)

    def f(t):
        y, q = fused_norm_act_quant(t)
        return y, q.data, q.scale

    y, data, scale = torch.compile(f, fullgraph=True, backend="eager")(x)
    y_ref, q_ref = unfused(x, "blocknorm", 256, "hardswish", "e4m3", "rowwise")
    assert torch.equal(y, y_ref) and torch.equal(scale, q_ref.scale)
    assert torch.equal(data.float(), q_ref.data.float())
    torch._dynamo.reset()


@pytest.mark.skipif(not GPU, reason="needs an FP8 GPU (the fused kernel and a Triton GEMM)")
@pytest.mark.parametrize("train", [True, False])
def test_fused_wukong_on_gpu_compiles_in_one_graph(train):
    """On the GPU the route takes the Triton kernel and a Triton-quantizing Linear: still
    one graph, forward and backward, with the unfused model's outputs."""
    from torch._dynamo.testing import CompileCounterWithBackend

    plain, model = fused_pair("wukong", dataclasses.replace(FUSED_MODS, blocknorm=8),
                              "triton-rowwise-cublas-fastacc", DEVICE, torch.bfloat16)
    batch = next(SyntheticCTR(model.feature_spec, 64, seed=4)).to(DEVICE)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with torch.set_grad_enabled(train):
        out = torch.compile(model, fullgraph=True, backend=counter)(batch)
        ref = plain(batch)
    if counter.frame_count != 1:
        with torch.set_grad_enabled(train):
            reasons = torch._dynamo.explain(model)(batch).break_reasons
        pytest.fail(f"{counter.frame_count} graphs: {[r.reason for r in reasons]}")
    # the fused norm's reductions run in another order: an ulp of bf16 in a few places
    assert relative_frobenius(out.float(), ref.float()) < 2e-2
    if train:
        out.float().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    torch._dynamo.reset()


@pytest.mark.parametrize("block,top_fused", [(8, True), (16, True), (32, False), (12, False)])
def test_wukong_fuses_its_top_norm_where_blocks_divide_d(block, top_fused, monkeypatch):
    """The last layer's BlockNorm runs on the flattened (B, n * d) rows, fused with the top
    MLP's first Linear, where its blocks divide d (16 here) and so never straddle two
    embeddings; else the layer applies it. Same outputs either way."""
    plain, fused = fused_pair("wukong", dataclasses.replace(FUSED_MODS, blocknorm=block),
                              "emulated-rowwise-e4m3")
    widths = []
    real = fused_mod.fused_norm_act_quant
    monkeypatch.setattr(fused_mod, "fused_norm_act_quant",
                        lambda x, **kw: widths.append((kw["norm"], x.shape[-1])) or real(x, **kw))
    batch = next(SyntheticCTR(plain.feature_spec, 16, seed=2))
    torch.testing.assert_close(fused(batch), plain(batch), rtol=0, atol=0)
    c = fused.config
    top = ("blocknorm", (c.num_fm + c.num_lcb) * c.embedding_dim)
    assert (top in widths) == top_fused


def test_layernorm_module_with_affine_parameters():
    mod = FusedNormActQuant("layernorm", act="identity", normalized_dim=32, elementwise_affine=True)
    assert mod.weight.shape == (32,) and mod.bias.shape == (32,)
    with torch.no_grad():
        mod.weight.uniform_(0.5, 1.5)
        mod.bias.normal_()
    x = torch.randn(8, 32)
    y, q = mod(x)
    torch.testing.assert_close(y, F.layer_norm(x, (32,), mod.weight, mod.bias, 1e-6))
    y.sum().backward()
    assert mod.weight.grad is not None and mod.bias.grad is not None


def test_non_finite_rows_stay_in_their_row():
    x = torch.randn(6, 256)
    x[2, 7] = float("nan")
    _, q = fused_norm_act_quant(x, backend="torch")
    assert torch.isnan(q.scale[2]).all() and torch.isfinite(q.scale[[0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("kwargs,error", [
    (dict(norm="rmsnorm"), ValueError), (dict(act="gelu"), ValueError),
    (dict(granularity="blockwise"), ValueError), (dict(backend="cuda"), ValueError),
    (dict(block=0), ValueError), (dict(fmt="e3m4"), ValueError),
    (dict(weight=torch.ones(64)), ValueError)])
def test_bad_arguments_raise(kwargs, error):
    with pytest.raises(error):
        fused_norm_act_quant(torch.randn(4, 64), **kwargs)


def test_bad_inputs_raise():
    with pytest.raises(TypeError):
        fused_norm_act_quant(torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="zero features"):
        fused_norm_act_quant(torch.randn(4, 0))
    with pytest.raises(ValueError):
        FusedNormActQuant(norm="batchnorm")
    with pytest.raises(ValueError, match="elementwise_affine"):
        FusedNormActQuant("blocknorm", elementwise_affine=True, normalized_dim=8)


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loka.kernels.ops import ensure_triton_ops

    ensure_triton_ops()  # the ops register on first need

    with FakeTensorMode():
        x = torch.empty(24, 512, dtype=torch.bfloat16)
        y, q, s = torch.ops.loka.norm_act_quant(x, None, None, "blocknorm", 256, "hardswish",
                                                "e4m3", "rowwise", 1e-6, True)
        assert y.shape == x.shape and q.dtype == torch.float8_e4m3fn and s.shape == (24, 1)
        y, q, s = torch.ops.loka.norm_act_quant(x, None, None, "none", 256, "identity",
                                                "e5m2", "tensorwise", 1e-6, False)
        assert y.numel() == 0 and q.dtype == torch.float8_e5m2 and s.shape == (1, 1)


# -- the Triton kernel ---------------------------------------------------------------------

def test_under_interpreter(run_under_interpreter):
    """Without an FP8 GPU the kernel runs under Triton's CPU interpreter, which Triton
    picks when it is first imported: the tests of this file run in a fresh process."""
    if GPU or INTERPRETED or not HAS_TRITON:
        pytest.skip("the kernels run in this process" if HAS_TRITON else "no Triton")
    run_under_interpreter(__file__, "triton_kernel", min_passed=10)


def kernel_runs_here():
    if not (GPU or INTERPRETED):
        pytest.skip("needs an FP8 GPU, or Triton's interpreter (see test_under_interpreter)")


@pytest.mark.parametrize("norm,d,affine", [("blocknorm", 512, False), ("blocknorm", 300, False),
                                           ("layernorm", 96, True), ("layernorm", 160, False),
                                           ("none", 64, False)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_triton_kernel_matches_the_composition(norm, d, affine, granularity):
    kernel_runs_here()
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(37, d, generator=g) * 3 + 0.5).bfloat16().to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).bfloat16().to(DEVICE) if affine else None
    b = torch.randn(d, generator=g).bfloat16().to(DEVICE) if affine else None
    y, q = fused_norm_act_quant(x, norm, 256, "hardswish", "e4m3", granularity, weight=w,
                                bias=b, backend="triton")
    y_ref, _ = unfused(x, norm, 256, "hardswish", "e4m3", granularity, w, b)
    # the FP8 tensor is exactly the quantization of the kernel's own activation
    assert_q_equal(q, quantize(y, "e4m3", granularity, "a"))
    if GPU:  # rsqrt and the order of the reductions may differ by an ulp
        differ = (y != y_ref).float().mean().item()
        assert differ < 0.02
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=2 ** -7)
    else:
        assert torch.equal(y, y_ref)


@pytest.mark.parametrize("act,fmt", [("hardswish", "e4m3"), ("identity", "e5m2")])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_triton_kernel_without_hp_output(act, fmt, granularity):
    """Without the high-precision output the FP8 tensor is the same, bit for bit; the
    tensorwise path then recomputes the activation in a second launch instead of reading it
    back, and still casts with the amax of the whole tensor."""
    kernel_runs_here()
    x = torch.randn(20, 256).bfloat16()
    x[7] *= 40  # one row sets the tensorwise amax
    x = x.to(DEVICE)
    y, q = fused_norm_act_quant(x, "blocknorm", 128, act, fmt, granularity, backend="triton")
    none, q2 = fused_norm_act_quant(x, "blocknorm", 128, act, fmt, granularity,
                                    return_hp=False, backend="triton")
    assert none is None
    assert_q_equal(q2, q)
    assert_q_equal(q, quantize(y, fmt, granularity, "a"))
    if granularity == "tensorwise":
        assert q2.scale.numel() == 1
        assert q2.scale.item() == pytest.approx(
            y.float().abs().max().item() / get_format(fmt).max, rel=1e-6)


@pytest.mark.parametrize("d,splits", [(16384, [2, 2, 4, 4, 8, 8]),
                                      (8192, [2, 2, 4, 4, 8]),  # 1K lanes on 8 warps: too few
                                      (2048, []), (20000, [])])
def test_capped_and_split_tiles_only_for_long_whole_rows(d, splits):
    """The configs that cap registers (two programs per SM) or split a row into chunks are
    tried only where a whole row of 8-16K values sits in one program; shorter rows, and
    chunked longer ones, keep the plain tiles."""
    if not HAS_TRITON:
        pytest.skip("no Triton")
    import importlib

    nq = importlib.import_module("loka.kernels.triton.norm_act_quant")
    _, ng, gp, nchunk = nq._tile_shape(d, "blocknorm", 256)
    kept = nq._prune(nq.CONFIGS, {"M": 4096}, NG=ng, GP=gp, NCHUNK=nchunk)
    assert kept and any(c.maxnreg is None and nq._split(c) == 1 for c in kept)
    assert any(c.maxnreg for c in kept) == bool(splits)
    assert sorted(nq._split(c) for c in kept if nq._split(c) > 1) == splits
    for c in kept:
        assert c.maxnreg is None or c.maxnreg * 32 * c.num_warps <= 32768  # two per SM
        lanes = c.kwargs["BLOCK_M"] * ng * gp // nq._split(c) / (32 * c.num_warps)
        assert 8 <= lanes <= 64 or nchunk > 1


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("block,m,d", [(256, 3, 1000),   # a shorter last block
                                       (128, 2, 1280)])  # 10 blocks padded to 16
@pytest.mark.parametrize("act,fmt,granularity", [("hardswish", "e4m3", "rowwise"),
                                                 ("identity", "e5m2", "tensorwise")])
def test_triton_kernel_split_rows(split, block, m, d, act, fmt, granularity, monkeypatch):
    """A row the tuner splits into chunks (two passes) gives what the whole-row tile gives,
    forced here at every split (the tuner tries them only at rows of 8-16K values)."""
    kernel_runs_here()
    import importlib

    import triton

    nq = importlib.import_module("loka.kernels.triton.norm_act_quant")
    tuner = nq.norm_act_quant_kernel
    cfg = triton.Config({"BLOCK_M": 1, "SPLIT": split}, num_warps=4)
    monkeypatch.setattr(tuner, "early_config_prune", lambda cfgs, nargs, **kw: [cfg])
    monkeypatch.setattr(tuner, "cache", {})
    g = torch.Generator().manual_seed(d + split)
    x = (torch.randn(m, d, generator=g) * 3 + 0.5).bfloat16()
    x[-1, -7:] *= 50  # the row amax in the last chunk
    x = x.to(DEVICE)
    check_against_composition(x, "blocknorm", block, act, fmt, granularity)
    assert tuner.best_config is cfg  # the split config ran


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_triton_kernel_casts_every_bf16_ratio_exactly(fmt, granularity):
    """Every (value, amax) pair of bf16 through the fused kernel (no norm, identity: the
    activation is x itself): the FP8 bytes are the PyTorch quantization's, with and
    without the high-precision output (the one-correction division for 16-bit values on
    a GPU)."""
    kernel_runs_here()
    mant = 1 + torch.arange(128, dtype=torch.float64) / 128
    ys = (mant[None, :] * torch.exp2(3 - torch.arange(42, dtype=torch.float64))[:, None]).reshape(-1)
    rows = [torch.cat([a.reshape(1), ys[ys < a], torch.zeros(int((ys >= a).sum()))])
            for a in mant * 8]
    x = torch.stack(rows)
    x = (x * torch.where(torch.arange(x.shape[1]) % 2 == 1, -1.0, 1.0)).bfloat16().to(DEVICE)
    for return_hp in (True, False):
        y, q = fused_norm_act_quant(x, "none", 256, "identity", fmt, granularity,
                                    return_hp=return_hp, backend="triton")
        assert y is None or torch.equal(y, x)
        assert_q_equal(q, quantize(x, fmt, granularity, "a"))


def test_triton_kernel_skips_the_op_where_nothing_is_differentiated():
    """Eager calls with nothing to differentiate (serving) launch the kernel without the
    custom op's dispatch (host time at every call); calls that record a
    gradient go through the op, whose backward they need. Both give the same tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    kernel_runs_here()

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    x = (torch.randn(16, 512) * 3).bfloat16().to(DEVICE)
    runs = {}
    for label, grad, needs in (("serve", False, False), ("plain input", True, False),
                               ("train", True, True)):
        xi = x.clone().requires_grad_(needs)
        with torch.set_grad_enabled(grad), Ops() as ops:
            y, q = fused_norm_act_quant(xi, backend="triton")
        runs[label] = (y.detach(), q.data.float(), q.scale)
        assert any("norm_act_quant" in n for n in ops.names) == needs, (label, ops.names[:5])
        assert y.requires_grad == needs
    for label in ("plain input", "train"):
        assert all(torch.equal(a, b) for a, b in zip(runs[label], runs["serve"])), label


def test_triton_kernel_in_an_op_body_passes_no_tensor_twice():
    """What tracing records (the launches inside the op's body) gets distinct tensors for
    every pointer (loka.kernels.triton.common.launch): traced, a tensor passed as two
    arguments was written back with the copy the kernel did not write, which left the
    rowwise scale uninitialised on a GPU. The results equal the launches outside a body."""
    kernel_runs_here()
    from loka.kernels.triton import common
    from loka.kernels.triton import norm_act_quant as kernel
    x = (torch.randn(24, 384) * 2).bfloat16().to(DEVICE)
    for granularity in ("rowwise", "tensorwise"):
        for return_hp in (True, False):
            outside = kernel.norm_act_quant(x, granularity=granularity, return_hp=return_hp)
            with common.op_body():
                inside = kernel.norm_act_quant(x, granularity=granularity, return_hp=return_hp)
            for o, i in zip(outside, inside):
                assert (o is None) == (i is None)
                if o is not None:
                    assert torch.equal(o.float(), i.float()), (granularity, return_hp)


def test_triton_kernel_backward_and_compile():
    kernel_runs_here()
    x = (torch.randn(24, 384) * 2).bfloat16().to(DEVICE).requires_grad_()
    dy = torch.randn(24, 384).bfloat16().to(DEVICE)
    y, q = fused_norm_act_quant(x, backend="triton")
    (dx,) = torch.autograd.grad(y, x, dy)
    x_ref = x.detach().requires_grad_()  # autograd of the unfused composition, same rounding
    (dx_ref,) = torch.autograd.grad(reference_norm_act(x_ref), x_ref, dy)
    assert relative_frobenius(dx, dx_ref) < 3e-2  # the reference's gradients pass through bf16
    dx_formula, _, _ = norm_act_backward(x.detach(), dy, "blocknorm", 256, "hardswish", 1e-6)
    assert torch.equal(dx, dx_formula)  # the op's backward is the PyTorch formula

    def f(t):
        y, q = fused_norm_act_quant(t, backend="triton")
        return y, q.data, q.scale

    y_c, data_c, scale_c = torch.compile(f, fullgraph=True, backend="aot_eager")(x.detach())
    assert torch.equal(y_c, y.detach()) and torch.equal(scale_c, q.scale)
    assert torch.equal(data_c.float(), q.data.float())


def assert_q_same(q, ref):
    """assert_q_equal with NaN == NaN (non-finite inputs)."""
    assert (q.fmt, q.granularity, q.block) == (ref.fmt, ref.granularity, ref.block)
    torch.testing.assert_close(q.scale.cpu(), ref.scale.cpu(), rtol=0, atol=0, equal_nan=True)
    data, data_ref = q.data.float().cpu(), ref.data.float().cpu()
    if INTERPRETED:  # the interpreter's float-to-FP8 cast turns NaN into a number
        keep = ~torch.isnan(data_ref)
        data, data_ref = data[keep], data_ref[keep]
    torch.testing.assert_close(data, data_ref, rtol=0, atol=0, equal_nan=True)


def check_against_composition(x, norm, block, act, fmt, granularity, w=None, b=None):
    y, q = fused_norm_act_quant(x, norm, block, act, fmt, granularity, weight=w, bias=b,
                                backend="triton")
    y_ref, _ = unfused(x, norm, block, act, fmt, granularity, w, b)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_q_same(q, quantize(y, fmt, granularity, "a"))
    if GPU or x.dtype == torch.float32:  # rsqrt, the order of the reductions: an ulp
        tol = 2 ** -7 if x.dtype != torch.float32 else 1e-5
        torch.testing.assert_close(y.float(), y_ref.float(), rtol=tol, atol=tol,
                                   equal_nan=True)
    else:
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
    none, q2 = fused_norm_act_quant(x, norm, block, act, fmt, granularity, False, weight=w,
                                    bias=b, backend="triton")
    assert none is None
    assert_q_same(q2, q)
    return y, q


@pytest.mark.parametrize("norm,block,m,d", [
    ("blocknorm", 256, 1, 64),      # a block longer than the row: RMS norm of the row
    ("blocknorm", 256, 3, 1000),    # a shorter last block (232 features)
    ("blocknorm", 100, 5, 1000),    # blocks of a width that is no power of two
    ("blocknorm", 256, 9, 2048),
    ("blocknorm", 256, 2, 16384),   # the longest row held whole
    ("blocknorm", 256, 2, 16640),   # longer: chunks, two passes
    ("blocknorm", 64, 70, 192),     # many rows of a short tile
    ("none", 256, 1, 2048),
    ("none", 256, 67, 1024),
    ("none", 256, 2, 20000),        # chunks
    ("layernorm", 256, 5, 2048),
])
@pytest.mark.parametrize("act", ["hardswish", "identity"])
@pytest.mark.parametrize("fmt,granularity", [("e4m3", "rowwise"), ("e5m2", "tensorwise")])
def test_triton_kernel_tiles_and_chunks(norm, block, m, d, act, fmt, granularity):
    kernel_runs_here()
    g = torch.Generator().manual_seed(m * d + block)
    x = (torch.randn(m, d, generator=g) * 3 + 0.5).bfloat16().to(DEVICE)
    check_against_composition(x, norm, block, act, fmt, granularity)


@pytest.mark.parametrize("d", [96, 3000, 20000])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_triton_kernel_layernorm_affine(d, granularity):
    kernel_runs_here()
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(3, d, generator=g) * 2 - 0.25).bfloat16().to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).bfloat16().to(DEVICE)
    b = torch.randn(d, generator=g).bfloat16().to(DEVICE)
    y, q = fused_norm_act_quant(x, "layernorm", 256, "hardswish", "e4m3", granularity,
                                weight=w, bias=b, backend="triton")
    assert_q_same(q, quantize(y, "e4m3", granularity, "a"))
    y_ref, _ = unfused(x, "layernorm", 256, "hardswish", "e4m3", granularity, w, b)
    # the mean and variance are summed in another order than torch's: an ulp apart at most
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("norm", ["blocknorm", "none"])
def test_triton_kernel_other_input_dtypes(dtype, norm):
    kernel_runs_here()
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(13, 768, generator=g) * 4).to(dtype).to(DEVICE)
    for granularity in ("rowwise", "tensorwise"):
        check_against_composition(x, norm, 256, "hardswish", "e4m3", granularity)


@pytest.mark.parametrize("norm,d", [("none", 512), ("blocknorm", 512), ("blocknorm", 16640)])
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_triton_kernel_non_finite_inputs(norm, d, granularity):
    kernel_runs_here()
    x = torch.randn(6, d).bfloat16()
    x[1, 5] = float("nan")
    x[3, 300] = float("inf")
    x[4, 7] = -float("inf")
    x = x.to(DEVICE)
    for act in ("hardswish", "identity"):
        _, q = check_against_composition(x, norm, 256, act, "e4m3", granularity)
        if granularity == "rowwise":
            assert torch.isfinite(q.scale[[0, 2, 5]]).all()
            assert torch.isnan(q.scale[1]).all()
        else:
            assert not torch.isfinite(q.scale).all()


def test_triton_kernel_large_values_saturate_and_tiny_rows_use_the_amax_floor():
    kernel_runs_here()
    x = torch.randn(4, 256).bfloat16()
    x[1] = 0  # amax 0: the scale is AMAX_EPS / fmt.max, the FP8 row zero
    x[2] *= 1e30
    x = x.to(DEVICE)
    for granularity in ("rowwise", "tensorwise"):
        for fmt in ("e4m3", "e5m2"):
            check_against_composition(x, "none", 256, "identity", fmt, granularity)
