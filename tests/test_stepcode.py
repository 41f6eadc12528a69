"""Inductor's CUDA code for a compiled step, generated on a machine without a GPU
(loka.bench.stepcode), and the kernel inventory read from it: launches, bytes, FLOPs."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import loka
from loka.bench.stepcode import Launch, cuda_step_code, inventory, summarize
from loka.dispatch import Plan, RoleChoice
from loka.kernels.registry import get
from tests.support import need_kernel

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Inductor's CUDA code generation needs triton")

WRAPPER = '''
def triton_poi_fused_relu_0(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
def triton_red_fused_abs_amax_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    pass
rowwise_quant_kernel_2 = async_compile.triton('rowwise_quant_kernel', """
def rowwise_quant_kernel(x_ptr, q_ptr, scale_ptr, M, N, stride_m, stride_n):
    pass
""")
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        assert_size_stride(primals_1, (64, 32), (32, 1), 'input')
        assert_size_stride(primals_2, (128, 32), (32, 1), 'input')
        buf0 = empty_strided_cuda((128, 64), (64, 1), torch.bfloat16)
        extern_kernels.mm(primals_2, reinterpret_tensor(primals_1, (32, 64), (1, 32), 0), out=buf0)
        raw_stream0 = get_raw_stream(0)
        triton_poi_fused_relu_0.run(buf0, 8192, stream=raw_stream0)
        buf1 = empty_strided_cuda((128, 1), (1, 1), torch.float32)
        triton_red_fused_abs_amax_1.run(buf0, buf1, 128, 64, stream=raw_stream0)
        buf2 = buf0; del buf0  # reuse
        buf3 = empty_strided_cuda((128, 64), (64, 1), torch.float8_e4m3fn)
        buf4 = empty_strided_cuda((64, 64), (64, 1), torch.bfloat16)
        extern_kernels._scaled_mm(reinterpret_tensor(buf3, (64, 64), (64, 1), 0), reinterpret_tensor(buf3, (64, 64), (1, 64), 0), buf1, buf1, out_dtype=torch.bfloat16, use_fast_accum=True, out=buf4)
        rowwise_quant_kernel_2.run(buf2, buf3, buf1, 128, 64, 64, 1, stream=raw_stream0)
        return (buf2, )
def get_args():
    primals_1 = rand_strided((64, 32), (32, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_2 = rand_strided((128, 32), (32, 1), device='cuda:0', dtype=torch.bfloat16)
'''


def test_inventory_counts_bytes_and_flops_of_each_launch():
    launches = inventory(WRAPPER)
    assert [(l.kind, l.name) for l in launches] == [
        ("gemm_bf16", "mm"), ("inductor", "triton_poi_fused_relu_0"),
        ("inductor", "triton_red_fused_abs_amax_1"), ("gemm_fp8", "_scaled_mm"),
        ("quantize", "rowwise_quant_kernel")]  # a user kernel: its own name, not the variable
    mm, relu, amax, fp8, quant = launches
    assert mm.flops == 2 * 128 * 32 * 64
    assert (mm.bytes_read, mm.bytes_written) == ((128 * 32 + 32 * 64) * 2, 128 * 64 * 2)
    # in_out_ptr: read and written
    assert (relu.bytes_read, relu.bytes_written) == (128 * 64 * 2, 128 * 64 * 2)
    assert (amax.bytes_read, amax.bytes_written) == (128 * 64 * 2, 128 * 4)
    assert fp8.flops == 2 * 64 * 64 * 64
    # FP8 operands are one byte each, the float32 scales four, the bf16 output two
    assert fp8.bytes_read == 2 * 64 * 64 + 2 * 128 * 4 and fp8.bytes_written == 64 * 64 * 2
    # a reused buffer keeps its size under its new name
    assert quant.bytes == 128 * 64 * 2 + 128 * 64 + 128 * 4
    s = summarize(launches)
    assert s["launches"] == {"gemm_bf16": 1, "inductor": 2, "gemm_fp8": 1, "quantize": 1}
    assert s["total_launches"] == 5
    assert s["non_gemm_mbytes"] == pytest.approx((relu.bytes + amax.bytes + quant.bytes) / 1e6,
                                                 abs=0.05)
    assert s["gemm_gflops"]["gemm_fp8"] == pytest.approx(2 * 64 ** 3 / 1e9, abs=1e-3)


def test_an_inductor_kernel_moves_no_more_than_its_iteration_size_per_argument():
    """A slice of a buffer spans nearly all of it: the kernel reads the slice only."""
    code = WRAPPER.replace(
        "        return (buf2, )",
        "        buf5 = empty_strided_cuda((128, 64), (64, 1), torch.bfloat16)\n"
        "        buf6 = empty_strided_cuda((128, 32), (32, 1), torch.bfloat16)\n"
        "        triton_poi_fused_slice_3.run(reinterpret_tensor(buf5, (128, 32), (64, 1), 0), "
        "buf6, 4096, stream=raw_stream0)\n"
        "        return (buf2, )").replace(
        "class Runner:", "def triton_poi_fused_slice_3(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n"
        "    pass\nclass Runner:")
    sliced = inventory(code)[-1]
    assert sliced.name == "triton_poi_fused_slice_3"
    assert (sliced.bytes_read, sliced.bytes_written) == (128 * 32 * 2, 128 * 32 * 2)


def test_kernels_without_iteration_sizes_and_unresolved_operands_are_counted_safely():
    """A GEMM template (max-autotune) names no *numel: its arguments count whole, and it
    is a GEMM. A library GEMM with an operand the parser cannot size gets no FLOPs
    rather than a product of the wrong tensors."""
    code = WRAPPER.replace(
        "        return (buf2, )",
        "        buf7 = empty_strided_cuda((64, 64), (64, 1), torch.bfloat16)\n"
        "        triton_tem_fused_mm_5.run(buf4, buf4, buf7, stream=raw_stream0)\n"
        "        extern_kernels.mm(unknown_0, buf4, out=buf7)\n"
        "        return (buf2, )").replace(
        "class Runner:", "def triton_tem_fused_mm_5(arg_A, arg_B, out_ptr0):\n    pass\nclass Runner:")
    template, mm = inventory(code)[-2:]
    assert template.kind == "gemm_bf16" and template.bytes == 3 * 64 * 64 * 2
    assert mm.name == "mm" and mm.flops == 0.0 and mm.bytes == 2 * 64 * 64 * 2


def test_code_without_a_call_function_is_refused():
    with pytest.raises(ValueError, match="no call"):
        inventory("def triton_poi_fused_0(in_ptr0):\n    pass\n")
    assert inventory("def call(args):\n    return ()\n") == []


def _model():
    """A plain tower (four Linears, an activation between two of them)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128, bias=False), nn.Hardswish(),
                         nn.Linear(128, 128, bias=False), nn.Linear(128, 128, bias=False),
                         nn.ReLU(), nn.Linear(128, 128, bias=False)).to(torch.bfloat16)


def _planned(kernel):
    model = _model()
    if kernel is not None:
        loka.apply(model, Plan.uniform(model, kernel))
    return model


def _launches(codes):
    return [launch for code in codes for launch in inventory(code)]


@needs_triton
def test_a_training_step_has_a_forward_and_a_backward_with_every_gemm_flop():
    model = _planned(None)
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    codes = cuda_step_code(model, (x,))
    assert len(codes) == 2 and all("empty_strided_cuda" in c for c in codes)
    fwd, bwd = (_launches([c]) for c in codes)
    gemm = 2 * 256 * 128 * 128
    assert sum(l.flops for l in fwd) == 4 * gemm
    # backward: four weight gradients, three input gradients (x needs none)
    assert sum(l.flops for l in bwd) == 7 * gemm
    assert model[0].weight.grad is None  # the model was copied: nothing ran on it


@needs_triton
def test_a_plan_moves_gemm_flops_to_fp8_and_adds_quantization_bytes():
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    base = summarize(_launches(cuda_step_code(_planned(None), (x,))))
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: the tensorwise one)
    kernel = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "cublas-tensorwise"
    fp8 = summarize(_launches(cuda_step_code(_planned(kernel), (x,))))
    total = lambda s: sum(s["gemm_gflops"].values())  # noqa: E731
    assert total(fp8) == pytest.approx(total(base))
    assert fp8["gemm_gflops"]["gemm_fp8"] == pytest.approx(total(base))
    assert fp8["launches"]["gemm_fp8"] == 11  # four forwards, four wgrads, three dgrads
    assert fp8["non_gemm_mbytes"] > base["non_gemm_mbytes"]  # the quantization passes


def test_inputs_must_be_a_tuple():
    with pytest.raises(TypeError, match="tuple"):
        cuda_step_code(nn.Linear(4, 4), torch.randn(2, 4))


def test_the_bench_script_refuses_bad_arguments_in_one_line(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib
    script = importlib.import_module("bench.step_code")
    for argv, needle in ((["--model", "nope"], "unknown model"),
                         (["--batch-size", "0"], "--batch-size"),
                         (["--steps", "-1"], "--steps must be >= 0"),
                         (["--families", "cublas-rowwise"], "needs --plan or --uniform"),
                         (["--plan", "p.json", "--uniform", "cublas-tensorwise"], "not both"),
                         (["--uniform", "warp-drive"], "--uniform: no kernel named"),
                         (["--delayed", "--mode", "serve"], "--delayed is for training"),
                         (["--inductor-config", "nope=1"], "KEY an option"),
                         (["--inductor-config", "realize_reads_threshold"], "KEY=VALUE"),
                         (["--inductor-config", "realize_reads_threshold=three"],
                          "VALUE must be JSON")):
        with pytest.raises(SystemExit) as e:
            script.main(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
    if not torch.cuda.is_available():  # a kernel this machine cannot run, and no CPU twin
        with pytest.raises(SystemExit) as e:
            script.main(["--uniform", "triton-rowwise", "--scale", "tiny"])
        assert e.value.code == 2
        assert "serves no role of wukong (tiny)" in capsys.readouterr().err
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    plan = Plan.uniform(_model(), rw)
    plan.sites["0"].roles["dgrad"] = RoleChoice(plan.baseline)
    moved = script.variant_plan(plan, "cublas-tensorwise")
    assert moved.sites["0"].roles["fwd"].kernel == "cublas-tensorwise"
    assert moved.sites["0"].roles["dgrad"].kernel == plan.baseline  # baseline roles stay
    assert plan.sites["0"].roles["fwd"].kernel == rw  # the input is unchanged


def test_the_bench_script_times_a_compiled_step_and_keeps_its_code(monkeypatch):
    """``time_variant`` (the GPU path of bench/step_code.py) on this CPU, the profiler
    stubbed: it trains the compiled model (the weights move), keeps the code of the first
    compilation only, and reports the median of the steps it was asked for."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib
    script = importlib.import_module("bench.step_code")
    es = importlib.import_module("bench.evalset")
    calls = []

    def fake_profile(step, steps):
        calls.append(steps)
        return {"gpu_ms_per_step": 2.0, "by_class_ms": {"gemm": 1.0}, "top_kernels_ms": [],
                "kernels_ms": {"k": 2.0}, "profiled_steps": steps}
    monkeypatch.setattr(script.lev, "profile_gpu", fake_profile)
    torch.manual_seed(0)
    model = es.EVAL_MODELS["wukong"]("tiny")
    inputs, labels = model.make_batch(16, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    codes, timing = script.time_variant(model, inputs, labels, "train", steps=3)
    assert len(codes) == 2  # one forward and one backward graph: compiled once
    assert all("def call(" in c for c in codes)
    assert calls == [3]
    assert timing["step_ms_min"] <= timing["step_ms"] <= timing["step_ms_max"]
    assert timing["gpu_ms"] == 2.0 and timing["wall_over_gpu"] == pytest.approx(timing["step_ms"] / 2.0)
    moved = [not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())]
    assert all(moved)  # 1 + 4 warm-up + 3 timed AdamW steps changed every weight


def test_output_code_collects_what_a_real_compilation_generates():
    from loka.bench.stepcode import output_code
    from torch._inductor.graph import GraphLowering
    torch._dynamo.reset()
    before = GraphLowering.save_output_code
    with output_code() as codes:
        torch.compile(lambda x: torch.relu(x) * 2)(torch.randn(8, 8))
    assert GraphLowering.save_output_code is before  # restored
    assert len(codes) == 1 and "def call(" in codes[0]
    assert inventory(codes[0]) == []  # C++ kernels only: no CUDA launches, no GEMM


def test_rates_join_a_profile_with_the_codes_bytes_by_kernel_name():
    from loka.bench.stepcode import rates
    launches = inventory(WRAPPER)
    relu, amax = launches[1], launches[2]
    profile = {"triton_poi_fused_relu_0": 0.002, "triton_red_fused_abs_amax_1": 0.004,
               "rowwise_quant_kernel": 0.003,  # the profiler's name of a user kernel
               "nvjet_sm90_gemm": 0.010}  # cuBLAS: not in the code by that name
    got = rates(profile, launches)
    assert [r[0] for r in got["kernels"]] == ["triton_red_fused_abs_amax_1",
                                              "rowwise_quant_kernel",
                                              "triton_poi_fused_relu_0"]  # largest time first
    assert got["by_kind"]["quantize"]["ms"] == pytest.approx(0.003)
    name, kind, mb, ms, gbs = got["kernels"][2]
    assert (kind, ms) == ("inductor", 0.002)
    assert mb == pytest.approx(relu.bytes / 1e6, abs=1e-3)
    assert gbs == pytest.approx(relu.bytes / 1e6 / 0.002, abs=0.1)  # MB per ms = GB per s
    assert got["by_kind"]["inductor"]["mbytes"] == pytest.approx((relu.bytes + amax.bytes) / 1e6,
                                                                 abs=0.1)
    assert got["by_kind"]["inductor"]["ms"] == pytest.approx(0.006)
    assert got["unmatched_ms"] == pytest.approx(0.010)
    # a kernel timed at zero has no rate, and nothing is divided by zero
    assert rates({"triton_poi_fused_relu_0": 0.0}, launches)["kernels"][0][4] is None
    assert rates({}, launches) == {"kernels": [], "by_kind": {}, "unmatched_ms": 0.0}


def test_the_bench_script_says_why_a_triton_serving_plan_needs_the_gpu():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import importlib
    script = importlib.import_module("bench.step_code")
    es = importlib.import_module("bench.evalset")
    root = Path(__file__).resolve().parents[1]
    plan = Plan.load(root / "bench/results/2026-12-05-h200-evalset/wukong.b4096.plan.serve.json")
    assert any(c.kernel.startswith("triton-") for sp in plan.sites.values()
               for c in sp.roles.values())
    with pytest.raises(RuntimeError, match="needs the GPU"):
        script.measure(es.EVAL_MODELS["wukong"], "tiny", 64, plan, "serve", False, None, "x")


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="under the interpreter LoKA's Triton ops are opaque custom ops")
@pytest.mark.parametrize("depth", [1, 2])
def test_lokas_triton_kernels_launch_from_the_cuda_code_with_no_python_op(depth):
    """Compiler-native on the GPU path too: a step planned on LoKA's Triton kernels calls
    them from Inductor's CUDA code (no torch.ops.loka call), and its launches grow with
    the sites by kernels, not by Python-level ops."""
    from unittest import mock
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(128, 128, bias=False), nn.ReLU()]
    model = nn.Sequential(*layers).to(torch.bfloat16)
    # a GPU's plan on a CPU model (Plan.uniform drops kernels this machine cannot run;
    # torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    plan = loka.dispatch.override(Plan.uniform(model, rw),
                                  replace={rw: "triton-rowwise-fastacc"})
    with mock.patch("loka.dispatch.swap._device_problem", lambda *a: None):
        loka.apply(model, plan)
    codes = cuda_step_code(model, (torch.randn(256, 128, dtype=torch.bfloat16),))
    code = "\n".join(codes)
    assert "torch.ops.loka" not in code
    launches = _launches(codes)
    gemms = [l for l in launches if l.name == "rowwise_gemm_kernel"]
    assert len(gemms) == 3 * depth - 1  # every role but the first layer's input gradient
    assert all(l.kind == "gemm_fp8" for l in gemms)
    assert any(l.kind == "quantize" for l in launches)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
def test_a_reduction_one_program_does_alone_is_flagged_whatever_its_bytes():
    """With split reductions off, Inductor fuses a whole-tensor amax and the cast that
    needs it into one kernel of one program: fewer bytes, one multiprocessor. The summary
    says so (``serial_mbytes``), so such a variant is not read as faster."""
    from torch._inductor import config as inductor_config

    class Scale(nn.Module):
        def forward(self, x):
            return (x / x.abs().amax()).to(torch.float8_e4m3fn)

    x = torch.randn(2048, 1024, dtype=torch.bfloat16)
    split = summarize(_launches(cuda_step_code(Scale(), (x,), train=False)))
    with inductor_config.patch(split_reductions=False):
        alone = summarize(_launches(cuda_step_code(Scale(), (x,), train=False)))
    assert split["serial_mbytes"] == 0
    assert alone["serial_mbytes"] >= 2048 * 1024 * 2 / 1e6
    assert alone["non_gemm_mbytes"] <= split["non_gemm_mbytes"]  # the trap: fewer bytes


class _UserBlockNorm(nn.Module):
    """A user's RMS norm over blocks of the row (not a class LoKA knows)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        blocks = x.float().unflatten(-1, (-1, self.block))
        return (blocks * torch.rsqrt(blocks.square().mean(-1, keepdim=True) + 1e-6)
                ).flatten(-2).to(x.dtype)


@needs_triton
@pytest.mark.parametrize("block, rowwise", [(256, 3), (128, 2)])
def test_a_tensors_amax_fuses_into_a_block_norm_and_a_rows_may_not(block, rowwise):
    """The premise of pricing a ``blocked`` producer as fused for tensorwise kernels and as
    a pass of its own for rowwise ones (loka/probe/pricing.py): in a compiled serving
    forward, the kernels that read all of x are the norm alone in bf16, two with a
    tensorwise cast (the norm with the amax, the cast recomputing the norm), and with a
    rowwise cast three over 256-feature blocks (the evaluation set's). Over 128-feature
    blocks Inductor reduces the row's amax from per-block partials in the norm's kernel:
    two, where the Probe's price is then a pass too many. Should Inductor change either,
    this fails and the pricing must follow."""
    need_kernel("cublas-rowwise")
    m, k = 4096, 1024
    x = torch.randn(m, k, dtype=torch.bfloat16)
    full_reads = {}
    for kernel in (None, "cublas-tensorwise", "cublas-rowwise"):
        torch.manual_seed(0)
        model = nn.Sequential(_UserBlockNorm(block), nn.Linear(k, 512, bias=False)
                              ).to(torch.bfloat16).eval()
        if kernel is not None:
            loka.apply(model, Plan.uniform(model, kernel), inference=True)
        with torch.no_grad():
            launches = _launches(cuda_step_code(model, (x,), train=False))
        full_reads[kernel] = sum(1 for launch in launches
                                 if launch.kind == "inductor" and launch.bytes >= m * k * 2)
    assert full_reads == {None: 1, "cublas-tensorwise": 2, "cublas-rowwise": rowwise}
