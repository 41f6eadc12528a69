"""Every Triton kernel of LoKA compiles for Hopper (sm_90) at the Wukong shapes, on the CPU.

``bench/triton_aot.py`` runs the kernels' wrappers on CPU tensors with Triton's launches
turned into compilations (every autotune config, down to a cubin, with Triton's own
``ptxas``). The interpreter tests check the numerics; this checks that the compiler takes
the code. It needs Triton, and no GPU.
"""

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed")


def _aot():
    spec = importlib.util.spec_from_file_location("triton_aot", ROOT / "bench" / "triton_aot.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernels_of_the_package():
    """Names of the launchable kernels in loka/kernels/triton (``*_kernel``)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import loka.kernels.triton as pkg

    names = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        mod = importlib.import_module(f"loka.kernels.triton.{path.stem}")
        for name, obj in inspect.getmembers(mod):
            if name.endswith("_kernel") and isinstance(obj, (JITFunction, Autotuner)):
                names.add(name)
    return names


def test_every_kernel_compiles_for_hopper(tmp_path):
    out = tmp_path / "aot.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "LOKA_TRITON_AUTOTUNE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_aot.py"), "--arch", "90",
                        "--quick", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == []
    # every launchable kernel of the package was compiled, each to an sm_90 cubin
    assert set(res["kernels"]) == _kernels_of_the_package()
    assert all(c["cubin"] and c["arch"] == 90 for c in res["compiled"])
    # every config the autotuner keeps was compiled, not one per kernel
    per_case = {}
    for c in res["compiled"]:
        per_case.setdefault(c["case"], set()).add(c["config"])
    assert len(per_case["gemm_rowwise bias+hardswish fastacc"]) >= 4
    assert len(per_case["norm_act_quant blocknorm tensorwise fp8-only"]) >= 4


def test_a_kernel_that_does_not_compile_is_reported(tmp_path, monkeypatch):
    """The check can fail: a kernel whose dot has mismatched inner dimensions compiles under
    no target, and the launch that would compile it raises inside compile_only (which
    then leaves Triton's launch machinery as it found it)."""
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    aot = _aot()

    @triton.jit
    def broken_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        a = tl.load(a_ptr + r[:, None] * BLOCK + r[None, :])
        b = tl.load(a_ptr + tl.arange(0, 2 * BLOCK)[:, None] * BLOCK + r[None, :])
        tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], tl.dot(a, b))

    run, tuner_run, active = JITFunction.run, Autotuner.run, driver._active
    log = []
    x = torch.zeros(64, 32)
    from triton.compiler.errors import CompilationError

    with pytest.raises(CompilationError, match="equal reduction dimensions"):
        with aot.compile_only(90, log):
            broken_kernel[(1,)](x, x, BLOCK=32)
    assert log == []
    assert (JITFunction.run, Autotuner.run, driver._active) == (run, tuner_run, active)

    @triton.jit
    def fine_kernel(a_ptr, c_ptr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        tl.store(c_ptr + r, tl.load(a_ptr + r) * 2)

    with aot.compile_only(90, log):
        fine_kernel[(1,)](x, x, BLOCK=32)
    assert [(e["kernel"], e["cubin"], e["arch"]) for e in log] == [("fine_kernel", True, 90)]


def test_sass_profile_counts_instructions_and_the_division_is_cheaper(tmp_path, monkeypatch):
    """``--sass``'s profile of two compiled kernels that divide 4096 values by one scale:
    the quantizers' reciprocal-and-fma division (``div_by_scale``) has no per-element slow
    path and far fewer instructions than an IEEE division (``div_rn``)."""
    import torch
    import triton
    import triton.language as tl

    from loka.kernels.triton.common import div_by_scale

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    aot = _aot()

    @triton.jit
    def fast_kernel(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        tl.store(y_ptr + r, div_by_scale(tl.load(x_ptr + r), tl.load(s_ptr)))

    @triton.jit
    def ieee_kernel(x_ptr, s_ptr, y_ptr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r)
        tl.store(y_ptr + r, tl.math.div_rn(x, tl.zeros_like(x) + tl.load(s_ptr)))

    x = torch.zeros(4096)
    log = []
    with aot.compile_only(90, log, sass=True):  # 32 values per thread
        fast_kernel[(1,)](x, x, x, BLOCK=4096, num_warps=4)
        ieee_kernel[(1,)](x, x, x, BLOCK=4096, num_warps=4)
    fast, ieee = ({op: n for op, n in e["top_ops"]} | {"n": e["instructions"]} for e in log)
    assert ieee.get("MUFU.RCP", 0) >= 32 and ieee.get("CALL.REL.NOINC", 0) >= 32  # per value
    assert fast.get("MUFU.RCP", 0) <= 1 and fast.get("CALL.REL.NOINC", 0) <= 1  # per scale
    assert fast["FFMA"] >= 4 * 32  # two corrections of two fmas per value
    assert fast["n"] < 0.6 * ieee["n"], (fast["n"], ieee["n"])


def test_every_fp8_store_saturates(tmp_path, monkeypatch):
    """The quantizers leave the clamp to ``±max`` to the float-to-FP8 cast: every FP8
    conversion in the compiled quantizers, fused norm and GEMMs with an FP8 output must be
    ``cvt.rn.satfinite`` (a quotient past the max becomes the max, NaN stays NaN)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    aot = _aot()
    monkeypatch.setenv("LOKA_TRITON_AUTOTUNE", "0")  # one config per kernel: the cast is the same
    assert aot.fp8_casts("cvt.rn.satfinite.e4m3x2.f32 %rs1, %r2, %r3;\n"
                         "cvt.rn.e5m2x2.f32 %rs4, %r5, %r6;\n"
                         "cvt.rn.e4m3x2.f16x2 %rs7, %r8;") == {"saturating": 1, "other": 2}
    cases = aot.cases(quick=False)
    log = []
    with aot.compile_only(90, log, sass=True):
        for name in ("quantize_rowwise row-major", "quantize_rowwise e5m2",
                     "quantize_tensorwise col", "norm_act_quant fmb norm 2048 rowwise fp8-only",
                     "gemm_rowwise fp8 out (N=256)", "gemm_rowwise_inline fm_projection wgrad"):
            cases[name]()()
    casts = [e["fp8_casts"] for e in log]
    assert casts and all(c["other"] == 0 for c in casts), casts
    assert sum(c["saturating"] for c in casts) > 0
