"""LoKA's Triton kernels as ``torch.compile`` sees them (issue 27, compiler-native FP8).

The ops whose bodies launch LoKA's Triton kernels are ``torch.library.triton_op`` ops
(:func:`loka.kernels.ops.triton_kernel_op`): AOT autograd traces into them, so the graph
Inductor receives holds the Triton kernels themselves (``triton_kernel_wrapper_functional``
nodes, which Inductor launches from its own code) and no ``loka::`` op, which would be a
Python-level dispatch per call. The graphs are traced on the CPU with fake tensors and
never run (the CPU has no Triton driver); under Triton's interpreter the kernels are
Python and untraceable, and the ops fall back to custom ops (tested by the interpreter
runs of the kernel tests).
"""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from loka.kernels import registry
from loka.kernels.triton import common

pytestmark = pytest.mark.skipif(common.interpreted(),
                                reason="interpreted Triton kernels cannot be traced")


class _Traced(Exception):
    """Raised instead of running a compiled graph: the graphs are all the test needs."""


def _graphs(fn, *args):
    """(forward graph, backward graph or None) AOT autograd makes of ``fn(*args)``."""
    graphs = {}

    def record(kind):
        def compiler(gm, inputs):
            graphs[kind] = gm

            def run(*a):
                raise _Traced()
            run._boxed_call = True  # noqa: SLF001 (AOT's calling convention)
            return run
        return compiler

    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record("fw"),
                                                      bw_compiler=record("bw")),
                             fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    # the backward graph is made with the forward's, not at the first backward
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
            pytest.raises(_Traced):
        compiled(*args)
    return graphs["fw"], graphs.get("bw")


LOWERED_OPS = ("loka.scaled_mm",)
"""``loka::`` ops that Inductor lowers to the ATen call they wrap (no Python dispatch in the
code it generates; tests/dispatch/test_compiler_native.py reads that code)"""


def _calls(gm):
    """(Triton kernel launches, ``loka::`` op calls that stay Python calls) in a graph."""
    kernels = loka_ops = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        kernels += "triton_kernel_wrapper" in name
        loka_ops += name.startswith("loka.") and not name.startswith(LOWERED_OPS)
    return kernels, loka_ops


@pytest.mark.parametrize("name, launches", [
    # rowwise: a (K contiguous) in one pass; b is read K-major through its transpose, which
    # takes the two-stage (amax, cast) path; then the Triton GEMM
    ("triton-rowwise", 4),
    # the same three quantization launches; the GEMM is aten._scaled_mm, no Triton launch
    ("triton-rowwise-cublas", 3),
    # tensorwise: two stages (amax, cast) per operand, then the GEMM
    ("triton-tensorwise", 5),
    # blockwise: one kernel per operand, then the blockwise GEMM
    ("triton-blockwise", 3),
    # inline: one amax pass per operand; the GEMM casts in its loads
    ("triton-rowwise-inline", 3),
])
def test_a_triton_kernel_traces_to_its_kernel_launches_and_no_op_dispatch(name, launches):
    kern = registry.get(name)
    a = torch.randn(256, 512, dtype=torch.bfloat16)
    b = torch.randn(512, 384, dtype=torch.bfloat16)
    fw, _ = _graphs(lambda x, y: kern.fn(x, y, torch.bfloat16), a, b)
    kernels, loka_ops = _calls(fw)
    assert loka_ops == 0, fw.code
    assert kernels == launches, fw.code


@pytest.mark.parametrize("name", ["triton-rowwise", "triton-tensorwise-cublas"])
def test_a_planned_linear_training_step_launches_kernels_and_dispatches_no_op(name):
    """Forward and backward of a ``loka.Linear`` on Triton kernels for all three roles."""
    from torch import nn

    import loka

    lin = loka.Linear.from_linear(nn.Linear(256, 384, bias=False).bfloat16(),
                                  loka.LinearConfig(fwd=name, dgrad=name, wgrad=name))
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    fw, bw = _graphs(lambda t: lin(t).float().sum(), x)
    assert bw is not None
    (fw_kernels, fw_ops), (bw_kernels, bw_ops) = _calls(fw), _calls(bw)
    assert fw_ops == bw_ops == 0, (fw.code, bw.code)
    assert fw_kernels >= 2 and bw_kernels >= 2  # at least the quantization launches


def test_a_rowwise_linear_quantizes_each_tensor_once_per_layout():
    """x, W and dy are each quantized for both of their layouts by the two-layout quantizer
    (the one-pass rowwise kernel for the tensor, the two-stage amax and cast for its
    transpose), and dy needs no transposed copy: the forward launches two such triples and
    the GEMM, the backward one triple and two GEMMs."""
    from torch import nn
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    import loka

    lin = loka.Linear.from_linear(nn.Linear(256, 384, bias=False).bfloat16(),
                                  loka.LinearConfig.uniform("triton-rowwise"))
    x = torch.randn(512, 256, dtype=torch.bfloat16, requires_grad=True)
    fw, bw = _graphs(lambda t: lin(t).float().sum(), x)

    def names(gm):
        return [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
                for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]

    pair = ["rowwise_quant_kernel", "rowwise_amax_split_kernel", "rowwise_cast_split_kernel"]
    assert names(fw) == pair + pair + ["rowwise_gemm_kernel"]
    assert names(bw) == pair + ["rowwise_gemm_kernel"] * 2
    assert not any(str(n.target) == "aten.clone.default" for n in bw.graph.nodes
                   if n.op == "call_function"), bw.code


def test_the_triton_op_is_still_one_op_outside_compilation():
    """Eager calls go to the kernels directly (no HOP); the op stays registered for the
    cases that call it by name (``torch.ops.loka.triton_quantize``)."""
    assert hasattr(torch.ops.loka, "triton_quantize")
    assert hasattr(torch.ops.loka, "triton_gemm")
    assert common.launch(registry.get) is registry.get  # outside an op body: the callable itself
    with common.op_body():
        wrapped = common.launch(_a_jit_kernel())
    assert type(wrapped.traceable).__name__ == "TraceableTritonKernelWrapper"


def _a_jit_kernel():
    from loka.kernels.triton import quantize
    return quantize.rowwise_quant_kernel


def test_the_fused_norm_activation_quantization_traces_to_its_kernel():
    from loka.mods.fused import _norm_act_quant_op  # the op itself: no GPU to route to it

    x = torch.randn(64, 256)
    fw, _ = _graphs(lambda t: _norm_act_quant_op(t, None, None, "blocknorm", 64, "hardswish",
                                                 "e4m3", "rowwise", 1e-5, True)[1].float(), x)
    kernels, loka_ops = _calls(fw)
    assert (kernels, loka_ops) == (1, 0), fw.code


def test_launches_grow_with_sites_but_op_dispatches_stay_zero():
    """A chain of FP8 GEMMs: every one adds its kernel launches to the graph, none adds a
    Python-level op call."""
    kern = registry.get("triton-rowwise")
    ws = [torch.randn(128, 128, dtype=torch.bfloat16) for _ in range(4)]

    def chain(x, *w):
        for wi in w:
            x = kern.fn(x, wi, torch.bfloat16)
        return x

    counts = []
    for depth in (1, 4):
        fw, _ = _graphs(chain, torch.randn(64, 128, dtype=torch.bfloat16), *ws[:depth])
        counts.append(_calls(fw))
    (one, ops_one), (four, ops_four) = counts
    assert one >= 3 and four == 4 * one
    assert ops_one == ops_four == 0


def test_import_registers_no_op_and_a_first_trace_does(tmp_path):
    """``import loka`` declares the Triton ops without registering them (registering
    imports Triton and torch.compile's machinery); a model compiled before any Triton
    kernel ran registers them while Dynamo traces it, outside the graph."""
    import subprocess
    import sys

    code = """
import sys, torch
import loka
from loka.kernels.adapters.triton_kernels import triton_quantize
assert 'torch._dynamo' not in sys.modules and 'triton' not in sys.modules, 'import loaded them'
assert not hasattr(torch.ops.loka, 'triton_quantize')
from torch._dynamo.backends.common import aot_autograd
graphs = []
class Traced(Exception):
    pass
def record(gm, inputs):
    graphs.append(gm)
    def run(*a):
        raise Traced()
    run._boxed_call = True
    return run
f = torch.compile(lambda x: triton_quantize(x, 'e4m3', 'rowwise')[0],
                  backend=aot_autograd(fw_compiler=record), fullgraph=True)
try:
    f(torch.randn(64, 128, dtype=torch.bfloat16))
except Traced:
    pass
names = [str(n.target) for n in graphs[0].graph.nodes if n.op == 'call_function']
assert hasattr(torch.ops.loka, 'triton_quantize')
print(sum('triton_kernel_wrapper' in n for n in names), sum(n.startswith('loka.') for n in names))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["1", "0"]
