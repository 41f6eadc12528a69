"""Kernel-library adapters: the Triton kernels' registration, predicates, custom ops and
numerics; torchao and FBGEMM when installed."""

import os

import pytest
import torch

from loka.config import Role
from loka.kernels import all_kernels, available, capabilities as caps, get, unavailable
from loka.numerics import Granularity, QTensor, quantize, relative_frobenius

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GPU = not INTERPRETED and caps.triton_available("cuda") and (caps.cuda_capability("cuda") or (0, 0)) >= (8, 9)
DEVICE = "cuda" if GPU else "cpu"
HAS_TRITON = caps.module_available("triton")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
TRITON_NAMES = ["triton-rowwise", "triton-rowwise-fastacc", "triton-rowwise-cublas",
                "triton-rowwise-cublas-fastacc", "triton-rowwise-e5m2", "triton-rowwise-inline",
                "triton-tensorwise",
                "triton-tensorwise-cublas", "triton-tensorwise-cublas-fastacc",
                "triton-blockwise", "triton-blockwise-cublas"]
TWINS = {"triton-rowwise": "emulated-rowwise-e4m3", "triton-rowwise-fastacc": "emulated-rowwise-e4m3",
         "triton-rowwise-cublas": "emulated-rowwise-e4m3",
         "triton-rowwise-cublas-fastacc": "emulated-rowwise-e4m3", "triton-rowwise-e5m2": "emulated-rowwise-e5m2",
         "triton-rowwise-inline": "emulated-rowwise-e4m3",
         "triton-tensorwise": "emulated-tensorwise-e4m3",
         "triton-tensorwise-cublas": "emulated-tensorwise-e4m3",
         "triton-tensorwise-cublas-fastacc": "emulated-tensorwise-e4m3",
         "triton-blockwise": "emulated-blockwise-e4m3",
         "triton-blockwise-cublas": "emulated-blockwise-e4m3"}


def kernels_run_here():
    if not (GPU or INTERPRETED):
        pytest.skip("needs an FP8 GPU, or Triton's interpreter (see test_under_interpreter)")


# -- registration and predicates (any machine with triton) -------------------------------

@needs_triton
def test_triton_adapter_imports_and_registers_without_a_gpu():
    from loka.kernels.adapters import FAILED

    assert "triton_kernels" not in FAILED
    names = {k.name for k in all_kernels() if k.library == "triton"}
    assert names == set(TRITON_NAMES)


@needs_triton
@pytest.mark.parametrize("name", TRITON_NAMES)
def test_triton_kernel_metadata_and_cpu_predicate(name):
    kern, twin = get(name), get(TWINS[name])
    assert kern.library == "triton" and kern.devices == ("cuda",)
    assert kern.min_capability == (8, 9) and kern.vendor == "nvidia"
    assert (kern.formats, kern.scaling, kern.align) == (twin.formats, twin.scaling, twin.align)
    assert kern.roles == twin.roles
    assert kern.quantize_a is not None and kern.quantize_b is not None
    assert kern.fast_accum == name.endswith("fastacc")
    if not GPU:
        assert name in unavailable("cpu") and "cuda" in unavailable("cpu")[name]
        assert kern not in available("cpu")
        # the library's own check, for a CUDA device this machine lacks
        assert not kern.requires(torch.device("cpu"))
        assert "CUDA" in kern.requires(torch.device("cpu")).reason
        assert not kern.supports("cuda", 64, 64, 64)


@needs_triton
def test_gradient_only_kernels_refuse_the_forward():
    kern = get("triton-rowwise-e5m2")
    assert kern.roles == frozenset({Role.DGRAD, Role.WGRAD})
    assert not kern.supports("cuda", 64, 64, 64, role="fwd")
    assert "role fwd" in kern.supports("cuda", 64, 64, 64, role="fwd").reason


@needs_triton
@pytest.mark.parametrize("granularity,scale_shape", [("rowwise", (48, 1)), ("tensorwise", (1, 1)),
                                                     ("blockwise_1x128", (48, 2)),
                                                     ("blockwise_128x128", (1, 2))])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_custom_op_fake_shapes(granularity, scale_shape, layout):
    if granularity == "rowwise" and layout == "col":  # one scale per column of x (K, N)
        scale_shape = (1, 200)
    """torch.compile traces the ops through their fake implementations: shapes, dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loka.kernels.ops import ensure_triton_ops

    ensure_triton_ops()  # the ops register on first need

    with FakeTensorMode():
        x = torch.empty(48, 200, dtype=torch.bfloat16)
        q, s = torch.ops.loka.triton_quantize(x, "e5m2", granularity, layout)
        assert q.dtype == torch.float8_e5m2 and s.dtype == torch.float32
        assert q.shape == ((48, 200) if layout == "row" else (200, 48))
        assert s.shape == scale_shape
        a = torch.empty(48, 64, dtype=torch.float8_e4m3fn)
        b = torch.empty(64, 32, dtype=torch.float8_e4m3fn)
        y = torch.ops.loka.triton_gemm(a, b, torch.empty(48, 1), torch.empty(1, 32), "rowwise",
                                       torch.bfloat16, False)
        assert y.shape == (48, 32) and y.dtype == torch.bfloat16
        y = torch.ops.loka.triton_gemm_inline(x[:, :64], b, None, torch.empty(1, 32), "e4m3",
                                              "e4m3", torch.float32, True)
        assert y.shape == (48, 32) and y.dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise", "blockwise_1x128",
                                         "blockwise_128x128"])
@pytest.mark.parametrize("layout", ["row", "col"])
def test_custom_op_fake_matches_the_real_op(granularity, layout):
    """Inductor asserts the real outputs' sizes and strides against the fake's."""
    kernels_run_here()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from loka.kernels.ops import ensure_triton_ops

    ensure_triton_ops()  # the ops register on first need

    x = torch.randn(48, 256, device=DEVICE).to(torch.bfloat16)
    real = torch.ops.loka.triton_quantize(x, "e4m3", granularity, layout)
    with FakeTensorMode() as mode:
        fake = torch.ops.loka.triton_quantize(mode.from_tensor(x), "e4m3", granularity, layout)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)
        assert [st for st, n in zip(r.stride(), r.shape) if n > 1] == \
            [st for st, n in zip(f.stride(), f.shape) if n > 1]


# -- numerics (FP8 GPU, or the interpreter) -----------------------------------------------

def test_under_interpreter(run_under_interpreter):
    """Without an FP8 GPU the kernels run under Triton's CPU interpreter, which Triton
    picks when it is first imported: the tests of this file run in a fresh process."""
    if GPU or INTERPRETED or not HAS_TRITON:
        pytest.skip("the kernels run in this process" if HAS_TRITON else "no Triton")
    run_under_interpreter(__file__, "not test_under_interpreter", min_passed=13)


def role_operands(role, m=48, k=160, n=64, seed=0):
    """(a, b) as loka.Linear passes them for ``role`` of a Linear k -> n on m rows."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16().to(DEVICE)
    w = torch.randn(n, k, generator=g).bfloat16().to(DEVICE)
    dy = (torch.randn(m, n, generator=g) * 1e-3).bfloat16().to(DEVICE)
    if role == "fwd":
        return x, w.t()
    if role == "dgrad":
        return dy, w
    return dy.t().contiguous(), x


def runnable_names(role):
    out = []
    for name in TRITON_NAMES:
        kern = get(name)
        if Role.parse(role) not in kern.roles:
            continue
        if "-cublas" in name and not caps.has_scaled_mm(DEVICE, kern.scaling):
            continue  # F.scaled_mm blockwise: not in the CPU build
        out.append(name)
    return out


@needs_triton
@pytest.mark.parametrize("role", ["fwd", "dgrad", "wgrad"])
def test_quantizers_match_the_recipe_bit_for_bit(role):
    kernels_run_here()
    a, b = role_operands(role)
    seen = set()
    for name in runnable_names(role):
        kern, twin = get(name), get(TWINS[name])
        if (kern.scaling, kern.formats) in seen:
            continue  # kernels of one recipe share their quantizers
        seen.add((kern.scaling, kern.formats))
        for mine, ref in ((kern.quantize_a(a), twin.quantize_a(a)),
                          (kern.quantize_b(b), twin.quantize_b(b))):
            assert isinstance(mine, QTensor)
            assert (mine.fmt, mine.granularity, mine.block) == (ref.fmt, ref.granularity, ref.block)
            assert torch.equal(mine.scale.cpu(), ref.scale.cpu()), name
            assert torch.equal(mine.data.float().cpu(), ref.data.float().cpu()), name
        # b is K-major (column-major), the layout FP8 tensor cores read
        assert kern.quantize_b(b).data.stride(0) == 1


@needs_triton
@pytest.mark.parametrize("role,out_dtype", [("fwd", torch.float32), ("dgrad", torch.float32),
                                            ("wgrad", torch.float32), ("fwd", torch.bfloat16)])
def test_kernels_agree_with_their_emulated_twins(role, out_dtype):
    kernels_run_here()
    for name in runnable_names(role):
        kern, twin = get(name), get(TWINS[name])
        # blockwise kernels take whole 128-blocks along K and N; K is each of m, k, n in one
        # of the roles (other K: the test below)
        a, b = role_operands(role, *((512, 512, 512) if kern.align == 128 else (48, 160, 64)))
        assert kern.fits(a.shape[0], a.shape[1], b.shape[1]), name
        ref = a.double() @ b.double()
        y = kern(a, b, out_dtype)
        assert y.shape == ref.shape and y.dtype == out_dtype
        e = twin(a, b, torch.float32)
        tol = (2e-2 if kern.fast_accum else 4e-3) if GPU else 1e-5
        if not GPU and kern.fast_accum and "-cublas" in name:
            tol = 4e-3  # the CPU build's _scaled_mm accumulates fast-accum calls in bf16
        if out_dtype == torch.bfloat16 or kern.scaling != "tensorwise" and name.endswith("cublas"):
            tol = max(tol, 4e-3)  # a bf16 output (rowwise/blockwise libraries write bf16)
        assert relative_frobenius(y, e) < tol, name
        assert relative_frobenius(y, ref) < 0.08, name  # and it is a GEMM of these operands


@needs_triton
@pytest.mark.parametrize("k", [128, 256, 384, 640])
def test_blockwise_kernels_take_k_that_is_not_whole_fours_of_blocks(k):
    """The weight's 128x128 scales are padded to K-blocks in fours for ``F.scaled_mm``
    (``loka.kernels.cublas._k_blocks_in_fours``); here at K = 1, 2, 3 and 5 blocks, in every
    role (K is m, k or n of the role's operands), against the emulated twin."""
    kernels_run_here()
    names = [k_ for k_ in ("cublas-blockwise", "triton-blockwise-cublas", "triton-blockwise")
             if get(k_).device_ok(DEVICE)]
    if not names:
        pytest.skip(f"no blockwise kernel runs on {DEVICE}")
    for role in ("fwd", "dgrad", "wgrad"):
        a, b = role_operands(role, 256, k, 384)
        ref = a.double() @ b.double()
        twin = get("emulated-blockwise-e4m3")(a, b, torch.float32)
        for name in names:
            y = get(name)(a, b, torch.float32)
            assert y.shape == ref.shape, (name, role)
            assert relative_frobenius(y, twin) < 4e-3, (name, role, k)
            assert relative_frobenius(y, ref) < 0.08, (name, role, k)


@needs_triton
def test_prequantized_operands_are_used_as_is_and_checked():
    kernels_run_here()
    a, b = role_operands("fwd")
    kern = get("triton-rowwise")
    qa, qb = kern.quantize_a(a), kern.quantize_b(b)
    torch.testing.assert_close(kern(qa, qb, torch.float32), kern(a, b, torch.float32), rtol=0, atol=0)
    # a QTensor from the torch recipe of the same format and granularity is accepted
    torch.testing.assert_close(kern(quantize(a, "e4m3", "rowwise", "a"), qb, torch.float32),
                               kern(a, b, torch.float32), rtol=0, atol=0)
    with pytest.raises(ValueError, match="tensorwise"):
        kern(quantize(a, "e4m3", "tensorwise", "a"), qb, torch.float32)
    with pytest.raises(ValueError, match="e5m2"):
        kern(quantize(a, "e5m2", "rowwise", "a"), qb, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        kern(a[:, :128], b, torch.float32)


@needs_triton
@pytest.mark.parametrize("names", [("triton-rowwise",) * 3,
                                   ("triton-rowwise-cublas", "triton-rowwise-e5m2",
                                    "triton-rowwise-e5m2")])
def test_a_linear_quantizes_x_and_dy_once_for_both_layouts(names, monkeypatch):
    """Rowwise kernels need x and xᵀ (forward, weight gradient), W and Wᵀ (forward, input
    gradient) and dy and dyᵀ (input and weight gradients): the two-layout quantizer makes each
    pair in one call, with the same bits as two separate quantizations, so the step is
    bit-identical."""
    kernels_run_here()
    import loka
    from loka.dispatch import linear as linear_mod
    from loka.kernels.triton import quantize as Q

    fwd, dgrad, wgrad = names
    if any("-cublas" in n and not caps.has_scaled_mm(DEVICE, "rowwise") for n in names):
        pytest.skip("no rowwise _scaled_mm in this build")
    calls = []
    real = Q.quantize_rowwise_dual
    monkeypatch.setattr(Q, "quantize_rowwise_dual",
                        lambda x, fmt="e4m3": calls.append((tuple(x.shape), fmt)) or real(x, fmt))

    def step(fused):
        torch.manual_seed(0)
        lin = loka.Linear(160, 64, bias=False).to(DEVICE).bfloat16()
        lin.set_config(loka.LinearConfig(fwd=fwd, dgrad=dgrad, wgrad=wgrad))
        x = (torch.randn(48, 160, device=DEVICE) * 2).bfloat16().requires_grad_()
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(linear_mod, "_dual", lambda *a: None)
            y = lin(x)
            (y.float() * torch.linspace(-1, 1, 64, device=DEVICE)).sum().backward()
        return y, x.grad, lin.weight.grad

    fused, calls_fused = step(True), list(calls)
    calls.clear()
    separate = step(False)
    assert not calls
    with torch.no_grad():  # no gradient layouts without grad mode
        lin = loka.Linear(160, 64, bias=False).to(DEVICE).bfloat16()
        lin.set_config(loka.LinearConfig(fwd=fwd, dgrad=dgrad, wgrad=wgrad))
        lin(torch.randn(48, 160, device=DEVICE).bfloat16())
    assert not calls
    # each pair whose two layouts share a format: x (the forward's a, the weight
    # gradient's b), W (the forward's and the input gradient's b), dy (both gradients' a)
    kf, kd, kw = get(fwd).formats, get(dgrad).formats, get(wgrad).formats
    want = ([((48, 160), kf[0])] if kf[0] == kw[1] else []) + \
           ([((64, 160), kf[0])] if kf[0] == kf[1] == kd[1] else []) + \
           ([((48, 64), kd[0])] if kd[0] == kw[0] else [])
    assert calls_fused == want and len(want) == 3
    for a, b in zip(fused, separate):
        assert torch.equal(a.float().cpu(), b.float().cpu())


@needs_triton
def test_compiled_call_has_no_graph_break():
    kernels_run_here()
    from loka.kernels.adapters.triton_kernels import triton_gemm, triton_gemm_inline, triton_quantize

    def f(x, w):
        qa, sa = triton_quantize(x, "e4m3", "rowwise")
        qb, sb = triton_quantize(w.t(), "e4m3", "rowwise", layout="col")
        return triton_gemm(qa, qb, sa, sb, "rowwise", torch.float32)

    def g(x, w):
        return triton_gemm_inline(x, w.t(), "e4m3", "e4m3", torch.float32)

    x, w = role_operands("fwd")[0], role_operands("fwd")[1].t()
    for fn in (f, g):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=0, atol=0)


# -- torchao and FBGEMM (optional) --------------------------------------------------------

def test_torchao_kernels_and_converter():
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from loka.kernels.adapters import FAILED
    from loka.kernels.adapters.torchao import RECIPES, convert_torchao

    assert "torchao" not in FAILED
    names = {k.name for k in all_kernels() if k.library == "torchao"}
    assert {"torchao-tensorwise", "torchao-rowwise"} <= names
    x, w = torch.randn(64, 128).bfloat16(), torch.randn(32, 128).bfloat16()
    ref = x.double() @ w.double().t()
    for name in sorted(names):
        kern = get(name)
        if not kern.device_ok(DEVICE):
            assert kern.device_ok(DEVICE).reason
            continue
        a, b = x.to(DEVICE), w.t().to(DEVICE)
        y = kern(a, b, torch.float32)
        assert 0.005 < relative_frobenius(y.cpu(), ref) < 0.08, name  # FP8, and the right product
        qb = kern.quantize_b(b)
        assert qb.data.stride(0) == 1 and torch.equal(kern(a, qb, torch.float32), y)
        if kern.scaling == "rowwise":  # torchao's rowwise recipe rounds scales to powers of two
            s = qb.scale
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)
        else:  # a transposed view is cast as its contiguous transpose: the same FP8 values
            qc = kern.quantize_b(b.contiguous())
            assert torch.equal(qb.scale, qc.scale)
            assert torch.equal(qb.data.float(), qc.data.float())
            qa = kern.quantize_a(w.t().to(DEVICE))  # an a operand given as a transposed view
            assert qa.data.shape == (128, 32) and qa.data.stride() == (1, 128)
            assert torch.equal(qa.data.float(), kern.quantize_a(w.t().contiguous().to(DEVICE)).data.float())
    assert set(RECIPES) == {"tensorwise", "rowwise", "rowwise_with_gw_hp"}
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    assert convert_torchao(model, "rowwise", False, "cpu") == ["0"]  # 64 -> 8 is not 16-aligned
    assert type(model[0]).__name__ == "Float8Linear" and type(model[2]) is torch.nn.Linear
    model(torch.randn(4, 128)).sum().backward()
    assert model[0].weight.grad is not None
    big = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(64, 64))
    assert convert_torchao(big, "tensorwise", True, "cpu") == ["0"]  # its filter drops tiny ones
    with pytest.raises(ValueError, match="recipe"):
        convert_torchao(big, "blockwise", False, "cpu")


def test_fbgemm_kernels():
    pytest.importorskip("fbgemm_gpu.experimental.gen_ai", reason="fbgemm-gpu-genai is not installed")
    if not caps.fbgemm_genai_available() or not GPU:
        pytest.skip("FBGEMM GenAI's FP8 ops need an sm_90 GPU")
    x, w = torch.randn(256, 512, device="cuda").bfloat16(), torch.randn(256, 512, device="cuda").bfloat16()
    ref = x.double() @ w.double().t()
    for name in ("fbgemm-rowwise", "fbgemm-tensorwise"):
        kern = get(name)
        y = kern(x, w.t(), torch.bfloat16)
        assert relative_frobenius(y, ref) < 0.08
        assert torch.equal(kern(x, kern.quantize_b(w.t()), torch.bfloat16), y)
