"""What Inductor makes of a planned model (issue 27's compiler-native FP8), read from the
code it generates on the CPU: the quantization of an operand that a fusible op (an
activation, a norm) produces is fused into that op's kernel, and a planned step calls no
Python-level custom op, however many sites are on FP8. Kernels whose quantization is
plain PyTorch (``cublas-*``, their emulated twins) are the ones checked here; LoKA's Triton
kernels are ``triton_op`` ops that Inductor traces into (tests/kernels/test_triton_traced.py)."""

import importlib.util
import re

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import loka
from loka.config import ROLES
from loka.kernels import ops
from loka.dispatch import Linear, Plan, RoleChoice
from tests.support import need_kernel


class OwnNorm(nn.Module):
    """A user's RMS norm (not a class LoKA knows)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Tower(nn.Module):
    """x -> Linear -> Hard Swish -> Linear -> own norm -> Linear, repeated ``depth`` times."""

    def __init__(self, width=128, depth=1):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width, bias=False), nn.Hardswish(),
                       nn.Linear(width, width, bias=False), OwnNorm(),
                       nn.Linear(width, width, bias=False)]
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return self.body(x)


def _kernels(model, x, grad=False):
    """Names of the kernels Inductor generated for one step (forward; and backward)."""
    compiled = torch.compile(model, fullgraph=True)
    if grad:
        def step():
            compiled(x).float().pow(2).mean().backward()
        _, codes = run_and_get_code(step)
    else:
        with torch.no_grad():
            _, codes = run_and_get_code(compiled, x)
    code = "\n".join(codes)
    return sorted(set(re.findall(r"\bcpp_fused_\w+", code))), code


def _serving(kernel, depth=1):
    need_kernel(kernel)
    torch.manual_seed(0)
    model = Tower(depth=depth)
    plan = Plan.uniform(model, kernel)
    for sp in plan.sites.values():  # serving: FP8 forwards, weights quantized once
        for role in ROLES[1:]:
            sp.roles[role] = RoleChoice(plan.baseline)
    loka.apply(model, plan, inference=True)
    return model.eval()


@pytest.mark.parametrize("kernel", ["cublas-rowwise", "cublas-tensorwise"])
def test_quantization_after_a_fusible_producer_is_fused_into_it(kernel):
    torch._dynamo.reset()
    model = _serving(kernel)
    assert sum(isinstance(m, Linear) for m in model.modules()) == 3
    names, _ = _kernels(model, torch.randn(256, 128))
    quantizing = [n for n in names if "amax" in n]
    # three FP8 operands: the graph input (no producer), Hard Swish's output, the norm's
    assert len(quantizing) == 3, names
    fused_act = [n for n in quantizing if "hardswish" in n]
    fused_norm = [n for n in quantizing if "rsqrt" in n]
    standalone = [n for n in quantizing if n not in fused_act + fused_norm]
    assert len(fused_act) == 1 and len(fused_norm) == 1, names
    assert len(standalone) == 1, names  # only the graph input's quantization stands alone


@pytest.mark.parametrize("depth", [1, 3])
def test_a_compiled_planned_step_calls_no_custom_op_whatever_the_number_of_fp8_sites(depth):
    need_kernel("cublas-rowwise")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Tower(depth=depth)
    loka.apply(model, Plan.uniform(model, "cublas-rowwise"))
    assert sum(isinstance(m, Linear) for m in model.modules()) == 3 * depth
    x = torch.randn(256, 128, requires_grad=True)
    _, code = _kernels(model, x, grad=True)
    assert "_scaled_mm" in code  # the FP8 GEMMs are in the compiled step ...
    # ... as ATen calls from the generated code, with no Python-level op of LoKA's
    assert re.findall(r"torch\.ops\.loka\.\w+", code) == []


def test_the_opaque_route_is_what_the_custom_op_check_would_catch():
    """The check above can fail: a kernel routed through LoKA's opaque custom op shows up as
    one ``torch.ops.loka.gemm`` call per FP8 GEMM in the generated code."""
    need_kernel("cublas-rowwise")
    torch._dynamo.reset()
    ops.mark_opaque("cublas-rowwise")
    try:
        model = _serving("cublas-rowwise")
        _, code = _kernels(model, torch.randn(256, 128))
    finally:
        ops.unmark_opaque("cublas-rowwise")
        torch._dynamo.reset()
    assert len(re.findall(r"torch\.ops\.loka\.gemm", code)) >= 3


class Mixed(nn.Module):
    """Linear a (the graph input) -> Linear b (a GEMM's output) -> Hard Swish -> Linear c
    -> own norm -> Linear d."""

    def __init__(self, width=128):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.norm = OwnNorm()

    def forward(self, x):
        return self.d(self.norm(self.c(nn.functional.hardswish(self.b(self.a(x))))))


def _probed_and_served(kernel, device, dtype):
    """:class:`Mixed`, probed for one training step (its producer kinds checked), then on
    ``kernel`` for serving (FP8 forwards, weights quantized once); and its input."""
    need_kernel(kernel, device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixed().to(device, dtype)
    x = torch.randn(256, 128, device=device, dtype=dtype)
    with loka.Probe(model, loka.ProbeConfig(progress=False)) as probe:
        model(x).float().sum().backward()
    kinds = {name: site.producers["x"] for name, site in probe.sites.items()}
    assert kinds == {"a": "input", "b": "gemm", "c": "pointwise", "d": "pointwise"}
    plan = Plan.uniform(model, kernel)
    for sp in plan.sites.values():
        for role in ROLES[1:]:
            sp.roles[role] = RoleChoice(plan.baseline)
    loka.apply(model, plan, inference=True)
    return model, x


@pytest.mark.parametrize("kernel", ["cublas-rowwise", "cublas-tensorwise"])
def test_the_probes_producer_kinds_say_which_quantizations_inductor_fuses(kernel):
    """What the step-aware Probe prices as fused is what Inductor fuses: the sites whose
    input the Probe saw made by a pointwise op get their quantization inside that op's
    kernel, one kernel per such site."""
    model, x = _probed_and_served(kernel, "cpu", torch.float32)
    names, _ = _kernels(model.eval(), x)
    quantizing = [n for n in names if "amax" in n]
    fused = [n for n in quantizing if "hardswish" in n or "rsqrt" in n]
    assert len(fused) == 2, names  # c's and d's (the Probe's pointwise-fed sites)
    assert any("hardswish" in n for n in fused) and any("rsqrt" in n for n in fused), names
    # (the GEMM case is not checked here: the CPU's Inductor decomposes _scaled_mm into a
    # GEMM and a scaling epilogue, into which it can fuse the next quantization; on a GPU
    # _scaled_mm is one cuBLAS call that scales inside, and the next input needs a pass)


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs an FP8 GPU (bench/gpu_session.sh gputests runs it there)")
@pytest.mark.parametrize("kernel", ["cublas-rowwise", "cublas-tensorwise"])
def test_on_a_gpu_pointwise_fed_sites_fuse_into_their_producers(kernel):
    """The step-aware Probe's premise on CUDA, where _scaled_mm is one cuBLAS call: the
    quantization of an input a pointwise op made is inside that op's Triton kernel, so the
    activation and the norm never run as kernels of their own. (Where the graph input's and
    the GEMM output's quantizations go differs between Inductor versions, which may merge
    them into a kernel that reads the same tensor; the simulated test below pins them down
    for the Inductor of CI.)"""
    model, x = _probed_and_served(kernel, "cuda", torch.bfloat16)
    from torch._inductor import config as inductor_config
    # every op in each kernel's name (some torch versions cut names at a few ops)
    with torch.no_grad(), inductor_config.patch(kernel_name_max_ops=1000):
        _, codes = run_and_get_code(torch.compile(model.eval(), fullgraph=True), x)
    code = "\n".join(codes)
    names = sorted(set(re.findall(r"\btriton_(?:poi|per|red)_\w+", code)))
    quantizing = [n for n in names if "amax" in n]
    assert any("hardswish" in n for n in quantizing), names
    assert any("rsqrt" in n for n in quantizing), names
    producers_alone = [n for n in names if ("hardswish" in n or "rsqrt" in n)
                       and "amax" not in n and "_to_copy" not in n]
    assert producers_alone == [], names
    # the graph input has no producer to fuse into: its quantization stands alone
    assert [n for n in quantizing if "hardswish" not in n and "rsqrt" not in n], names
    from loka.bench.stepcode import inventory
    assert sum(l.kind == "gemm_fp8" for c in codes for l in inventory(c)) == 4, names


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
@pytest.mark.parametrize("kernel", ["cublas-rowwise", "cublas-tensorwise"])
def test_on_a_simulated_gpu_pointwise_fed_sites_fuse_and_gemm_fed_ones_take_a_pass(kernel):
    """The test above without a GPU: Inductor's CUDA code for a simulated H200
    (loka.bench.stepcode), where _scaled_mm is one cuBLAS call as on the GPU (the CPU's
    Inductor decomposes it)."""
    from torch._inductor import config as inductor_config
    from loka.bench.stepcode import cuda_step_code, inventory
    model, x = _probed_and_served(kernel, "cpu", torch.bfloat16)
    with inductor_config.patch(kernel_name_max_ops=1000):
        codes = cuda_step_code(model.eval(), (x,), train=False)
    assert len(codes) == 1
    launches = inventory(codes[0])
    names = [l.name for l in launches]  # one launch each (identical kernels share a name)
    # passes over a whole (256, 128) operand that find its amax (tensorwise: the first of
    # two stages; the second reads a few partial maxima)
    quantizing = [l.name for l in launches if "amax" in l.name and l.bytes >= 256 * 128 * 2]
    fused = [n for n in quantizing if "hardswish" in n or "rsqrt" in n]
    assert len(fused) == 2, names
    assert any("hardswish" in n for n in fused) and any("rsqrt" in n for n in fused), names
    # the activation and the norm are never kernels of their own: their outputs are made
    # inside the quantization (tensorwise: inside both stages of its amax and in the cast)
    producers_alone = [n for n in names if ("hardswish" in n or "rsqrt" in n)
                       and "amax" not in n and "_scaled_mm" not in n and "_to_copy" not in n]
    assert producers_alone == [], names
    # the graph input's and the GEMM output's quantization: passes of their own
    assert len(quantizing) - len(fused) == 2, names
    assert len([l for l in launches if l.kind == "gemm_fp8"]) == 4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
@pytest.mark.parametrize("kernel", ["cublas-rowwise", "cublas-tensorwise"])
def test_on_a_simulated_gpu_static_scales_add_only_the_casts_no_producer_can_take(kernel):
    """Served with static scales whose table covers the input's rows (``loka.apply`` sizes
    it to the plan's tokens), a step launches what bf16 launches plus one cast for each
    FP8 input no fusible op made (the graph input's, the GEMM output's): the scales are
    made once, not per call. A rowwise table too small for the input expands its scale in
    a kernel per site, so the count can fail."""
    from loka.bench.stepcode import cuda_step_code, inventory

    def launches(model, x):
        codes = cuda_step_code(model.eval(), (x,), train=False)
        assert len(codes) == 1
        return inventory(codes[0])

    model, x = _probed_and_served(kernel, "cpu", torch.bfloat16)
    torch.manual_seed(0)
    plain = launches(Mixed().to(torch.bfloat16), x)
    counts = {}
    for rows in (x.shape[0], 0):
        for i, m in enumerate(l for l in model.modules() if isinstance(l, Linear)):
            m.set_input_amax(4.0 + i, rows=rows)  # a scale of its own (equal ones share)
        torch._dynamo.reset()
        found = launches(model, x)
        assert len([l for l in found if l.kind == "gemm_fp8"]) == 4
        counts[rows] = len([l for l in found if l.kind != "gemm_fp8"])
    plain_other = len([l for l in plain if l.kind != "gemm_bf16"])
    assert counts[x.shape[0]] == plain_other + 2, (counts, plain_other)
    if kernel == "cublas-rowwise":  # one (M, 1) scale made per site and call
        assert counts[0] == counts[x.shape[0]] + 4, counts
        # equal scales: the Linears hold one table, and its (M, 1) expansion is made once
        for m in model.modules():
            if isinstance(m, Linear):
                m.set_input_amax(4.0, rows=0)
        torch._dynamo.reset()
        found = launches(model, x)
        assert len([l for l in found if l.kind != "gemm_fp8"]) == counts[x.shape[0]] + 1
