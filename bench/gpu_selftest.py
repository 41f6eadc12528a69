"""GPU self-test of LoKA's Triton kernels against their PyTorch references.

Every check compares a compiled Triton kernel with its reference on the GPU: quantizers
must give the reference's scales and FP8 values bit for bit (``loka.numerics.quantize``),
GEMMs must agree with a float64 product of the same FP8 operands within the error of
their accumulation, the fused norm -> quantize kernel must agree with the unfused
composition, and the registry kernels with their emulated twins. Prints a pass/fail table
and writes it as JSON.

    PYTHONPATH=. python bench/gpu_selftest.py --out bench/results/gpu_selftest.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from loka.kernels import capabilities as caps
from loka.numerics import dequantize, quantize, relative_frobenius

RESULTS = []


def check(name):
    """Decorator: run a check, record pass/fail, its metrics and its time."""
    def wrap(fn):
        def run():
            t0 = time.perf_counter()
            try:
                metrics = fn() or {}
                ok = bool(metrics.pop("ok", True))
                err = ""
            except Exception as e:  # noqa: BLE001 - a failing check is a result, not a crash
                ok, metrics, err = False, {}, f"{type(e).__name__}: {e}"
                traceback.print_exc()
            torch.cuda.synchronize()
            RESULTS.append({"check": name, "passed": ok, "seconds": round(time.perf_counter() - t0, 2),
                            "metrics": metrics, "error": err})
            print(f"{'PASS' if ok else 'FAIL'}  {name:58s} {metrics if ok else err}", flush=True)
        RUNNERS.append((name, run))
        return fn
    return wrap


RUNNERS = []
DEV = "cuda"


def heavy(r, c, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(r, c, device=DEV, generator=g)
    x = x * torch.exp2(torch.randint(-10, 10, (r, 1), device=DEV, generator=g).float())
    x[:, c // 3] *= 50
    x[r // 2] = 0
    return x.to(dtype)


def exact(q, s, ref):
    """Mismatch counts of scales and FP8 values (NaN compared as NaN)."""
    s = s.reshape(ref.scale.shape)
    a, b = q.float(), ref.data.float()
    nan_ok = torch.equal(a.isnan(), b.isnan())
    return {"scale_mismatch": int((s != ref.scale).sum()),
            "value_mismatch": int((a.nan_to_num(0) != b.nan_to_num(0)).sum()) + (0 if nan_ok else 1)}


def register_quantize_checks():
    from loka.kernels.triton import quantize as Q

    cases = [("rowwise bf16 4096x2048", lambda: heavy(4096, 2048), "row"),
             ("rowwise fp32 1000x300 (ragged)", lambda: heavy(1000, 300, torch.float32), "row"),
             ("rowwise long rows 64x40000 (two stages)", lambda: heavy(64, 40000), "row"),
             ("rowwise transposed dy.t() 4096x512 (two stages)", lambda: heavy(4096, 512).t(), "row"),
             ("colwise x 1048576x64 (Wukong wgrad operand)", lambda: heavy(1048576, 64), "col")]
    for fmt in ("e4m3", "e5m2"):
        for label, make, kind in cases:
            @check(f"quantize {label} {fmt}")
            def _(make=make, kind=kind, fmt=fmt):
                x = make()
                if kind == "col":
                    q, s = Q.quantize_colwise(x, fmt)
                    m = exact(q, s, quantize(x.t(), fmt, "rowwise", "a"))
                else:
                    q, s = Q.quantize_rowwise(x, fmt)
                    m = exact(q, s, quantize(x, fmt, "rowwise", "a"))
                m["ok"] = m["scale_mismatch"] == 0 and m["value_mismatch"] == 0
                return m
        for layout in ("row", "col"):
            @check(f"quantize tensorwise 8192x1024 {layout} {fmt}")
            def _(layout=layout, fmt=fmt):
                x = heavy(8192, 1024)
                q, s = Q.quantize_tensorwise(x, fmt, layout)
                m = exact(q, s, quantize(x, fmt, "tensorwise"))
                m["ok"] = m["scale_mismatch"] == 0 and m["value_mismatch"] == 0
                return m
        for block, operand, layout in (((1, 128), "a", "row"), ((128, 128), "b", "col")):
            @check(f"quantize blockwise {block[0]}x{block[1]} 1000x2000 {fmt}")
            def _(block=block, operand=operand, layout=layout, fmt=fmt):
                x = heavy(1000, 2000)
                q, s = Q.quantize_blockwise(x, fmt, block, layout)
                m = exact(q, s, quantize(x, fmt, "blockwise", operand))
                m["ok"] = m["scale_mismatch"] == 0 and m["value_mismatch"] == 0
                return m

    @check("quantize NaN/Inf rows propagate to their scales")
    def _():
        x = torch.randn(64, 256, device=DEV)
        x[3, 4], x[5, 6] = float("nan"), float("inf")
        q, s = Q.quantize_rowwise(x)
        m = exact(q, s, quantize(x, "e4m3", "rowwise"))
        m["ok"] = m["scale_mismatch"] == 1 and bool(s[3].isnan() & s[5].isinf()) and m["value_mismatch"] <= 1
        return m  # NaN != NaN counts the NaN row's scale as a mismatch (inf == inf does not)


def register_gemm_checks():
    from loka.kernels.triton import gemm_blockwise as B, gemm_rowwise as G

    def ops(m, k, n, gran="rowwise", a_fmt="e4m3"):
        a = torch.randn(m, k, device=DEV) * torch.exp2(torch.randint(-4, 4, (m, 1), device=DEV).float())
        w = torch.randn(n, k, device=DEV)
        return quantize(a.bfloat16(), a_fmt, gran, "a"), quantize(w.bfloat16(), "e4m3", gran, "a")

    def ref64(qa, qw):
        return dequantize(qa, torch.float64) @ dequantize(qw, torch.float64).t()

    for (m, k, n) in ((4096, 4096, 4096), (4096, 2048, 8192), (1048576, 64, 32), (1000, 300, 200),
                      (32, 1048576, 64), (1048576, 32, 64)):
        for out_dtype, fast, a_fmt in ((torch.float32, False, "e4m3"), (torch.bfloat16, True, "e4m3"),
                                       (torch.float32, False, "e5m2")):
            @check(f"gemm rowwise {m}x{k}x{n} {str(out_dtype)[6:]} {a_fmt} fast={fast}")
            def _(m=m, k=k, n=n, out_dtype=out_dtype, fast=fast, a_fmt=a_fmt):
                qa, qw = ops(m, k, n, a_fmt=a_fmt)
                y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), out_dtype=out_dtype,
                                   fast_accum=fast)
                err = relative_frobenius(y, ref64(qa, qw))
                tol = 2e-2 if fast else (4e-3 if out_dtype == torch.bfloat16 else 2e-3)
                return {"relfro_vs_fp64": err, "split_k": G.split_k(m, n, k), "ok": err < tol}

    @check("gemm tensorwise scales 2048x1024x512")
    def _():
        qa, qw = ops(2048, 1024, 512, "tensorwise")
        y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale, out_dtype=torch.float32)
        err = relative_frobenius(y, ref64(qa, qw))
        return {"relfro_vs_fp64": err, "ok": err < 2e-3}

    @check("gemm epilogue bias + hardswish 4096x512x256")
    def _():
        qa, qw = ops(4096, 512, 256)
        bias = torch.randn(256, device=DEV).bfloat16()
        y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                           activation="hardswish", out_dtype=torch.float32)
        err = relative_frobenius(y, F.hardswish(ref64(qa, qw) + bias.double()))
        return {"relfro_vs_fp64": err, "ok": err < 2e-3}

    for n in (64, 256, 1024):
        @check(f"gemm fp8 rowwise output 4096x512x{n}")
        def _(n=n):
            qa, qw = ops(4096, 512, n)
            bias = torch.randn(n, device=DEV).bfloat16()
            q, s = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                                  activation="hardswish", fp8_out="e4m3")
            y = G.gemm_rowwise(qa.data, qw.data.t(), qa.scale, qw.scale.t(), bias=bias,
                               activation="hardswish")
            ref = quantize(y, "e4m3", "rowwise", "a")
            differ = float((q.float() != ref.data.float()).float().mean())
            scale_rel = float(((s - ref.scale).abs() / ref.scale).max())
            return {"fp8_mismatch_frac": differ, "scale_max_rel": scale_rel,
                    "ok": differ < 0.01 and scale_rel < 2 ** -7}

    for (m, k, n) in ((4096, 4096, 4096), (1000, 384, 640), (4096, 16384, 2048)):
        @check(f"gemm blockwise {m}x{k}x{n}")
        def _(m=m, k=k, n=n):
            a = torch.randn(m, k, device=DEV).bfloat16()
            w = torch.randn(n, k, device=DEV).bfloat16()
            qa, qb = quantize(a, "e4m3", "blockwise", "a"), quantize(w.t(), "e4m3", "blockwise", "b")
            y = B.gemm_blockwise(qa.data, qb.data, qa.scale, qb.scale, torch.float32)
            err = relative_frobenius(y, dequantize(qa, torch.float64) @ dequantize(qb, torch.float64))
            return {"relfro_vs_fp64": err, "ok": err < 2e-3}


def register_fused_checks():
    from loka.mods.blocknorm import BlockNorm
    from loka.mods.fused import fused_norm_act_quant, reference_norm_act

    for norm, d in (("blocknorm", 2048), ("blocknorm", 300), ("layernorm", 1024), ("none", 512)):
        for gran in ("rowwise", "tensorwise"):
            @check(f"fused {norm} D={d} hardswish {gran}")
            def _(norm=norm, d=d, gran=gran):
                x = (torch.randn(4096, d, device=DEV) * 3 + 0.5).bfloat16()
                y, q = fused_norm_act_quant(x, norm, 256, "hardswish", "e4m3", gran, backend="triton")
                y_ref = reference_norm_act(x, norm, 256, "hardswish")
                self_exact = exact(q.data, q.scale, quantize(y, "e4m3", gran, "a"))
                differ = float((y != y_ref).float().mean())
                err = relative_frobenius(y, y_ref)
                return {"hp_mismatch_frac": differ, "hp_relfro": err, **self_exact,
                        "ok": self_exact["scale_mismatch"] == 0 and self_exact["value_mismatch"] == 0
                        and differ < 0.02 and err < 4e-3}

    @check("fused backward vs autograd of the composition")
    def _():
        x = (torch.randn(4096, 1024, device=DEV) * 2).bfloat16().requires_grad_()
        dy = torch.randn(4096, 1024, device=DEV).bfloat16()
        y, _ = fused_norm_act_quant(x, backend="triton")
        (dx,) = torch.autograd.grad(y, x, dy)
        xr = x.detach().requires_grad_()
        (dxr,) = torch.autograd.grad(F.hardswish(BlockNorm(256)(xr)), xr, dy)
        err = relative_frobenius(dx, dxr)
        return {"relfro": err, "ok": err < 3e-2}


def register_registry_checks():
    import loka
    from loka.config import Role
    from loka.kernels import get

    twins = {"rowwise": "emulated-rowwise-e4m3", "tensorwise": "emulated-tensorwise-e4m3",
             "blockwise": "emulated-blockwise-e4m3"}
    m, k, n = 4096, 1024, 512
    x = torch.randn(m, k, device=DEV).bfloat16()
    w = torch.randn(n, k, device=DEV).bfloat16()
    dy = (torch.randn(m, n, device=DEV) * 1e-3).bfloat16()
    operands = {"fwd": (x, w.t()), "dgrad": (dy, w), "wgrad": (dy.t().contiguous(), x)}
    # LoKA's Triton kernels, and the cuBLAS ones (PyTorch quantization around
    # ``torch._scaled_mm`` / ``F.scaled_mm``, whose scale layouts the library checks)
    for kern in [k_ for k_ in loka.kernels.all_kernels() if k_.library in ("triton", "cublas")]:
        for role, (a, b) in operands.items():
            if Role.parse(role) not in kern.roles:
                continue

            @check(f"registry {kern.name} {role}")
            def _(kern=kern, a=a, b=b):
                ok = kern.supports(DEV, a.shape[0], a.shape[1], b.shape[1])
                if not ok:
                    return {"skipped": ok.reason}
                twin = get(twins[kern.scaling].replace("e4m3", kern.formats[0]))
                y = kern(a, b, torch.float32)
                err = relative_frobenius(y, twin(a, b, torch.float32))
                qa, qra = kern.quantize_a(a), twin.quantize_a(a)
                qb, qrb = kern.quantize_b(b), twin.quantize_b(b)
                same = (torch.equal(qa.scale, qra.scale) and torch.equal(qa.data.float(), qra.data.float())
                        and torch.equal(qb.scale, qrb.scale) and torch.equal(qb.data.float(), qrb.data.float()))
                return {"relfro_vs_twin": err, "quantizers_exact": same,
                        "ok": same and err < (2e-2 if kern.fast_accum else 5e-3)}

    @check("loka.Linear on triton-rowwise, torch.compile (inductor), fwd+bwd")
    def _():
        cfg = loka.LinearConfig.uniform("triton-rowwise")
        lin = loka.Linear(1024, 512, bias=False, device=DEV, dtype=torch.bfloat16, config=cfg)
        ref = torch.nn.Linear(1024, 512, bias=False, device=DEV, dtype=torch.bfloat16)
        ref.weight.data.copy_(lin.weight.data)
        xx = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        f = torch.compile(lin, fullgraph=True)
        y = f(xx)
        y.float().square().mean().backward()
        y_ref = ref(xx.detach())
        err = relative_frobenius(y, y_ref)
        return {"relfro_vs_bf16": err, "ok": err < 0.08 and lin.weight.grad is not None
                and bool(torch.isfinite(lin.weight.grad).all())}


def emulated_twin(kernel) -> str:
    """The emulated kernel with ``kernel``'s FP8 rounding (scaling and format)."""
    return f"emulated-{kernel.scaling}-{kernel.formats[0]}"


def linear_vs_twin(kernel_name: str, roles=("fwd",), device="cuda", m=4096, k=2048, n=8192,
                   dtype=torch.bfloat16, compile=True) -> dict:
    """A training step of a ``loka.Linear`` whose ``roles`` run on ``kernel_name`` (the
    others bf16), compiled as the training harness compiles it, against the same Linear on
    the kernel's emulated twin in eager mode, with the same weights, input and output
    gradient.

    On the FP8 roles the outputs agree within the accumulation error of the two GEMMs. The
    bf16 roles see identical operands (the input and the output gradient), so the
    gradients agree to bf16 rounding. A kernel that is right alone but wrong inside the
    compiled training path (scales, layouts, what autograd saves) fails here."""
    import loka
    from loka.kernels import get

    kern = get(kernel_name)
    twin = emulated_twin(kern)

    def config(name):
        return loka.LinearConfig(*[name if r in roles else "bf16" for r in ("fwd", "dgrad", "wgrad")])

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, device=device, generator=g).to(dtype)
    x[:, k // 7] *= 30  # an outlier channel, as the Probe sees in Wukong's FM inputs
    dy = (torch.randn(m, n, device=device, generator=g) * 1e-3).to(dtype)
    lin = loka.Linear(k, n, bias=False, device=device, dtype=dtype, config=config(kernel_name))
    ref = loka.Linear(k, n, bias=False, device=device, dtype=dtype, config=config(twin))
    ref.weight.data.copy_(lin.weight.data)
    out = {}
    for name, mod, fn in (("kernel", lin, torch.compile(lin, fullgraph=True) if compile else lin),
                          ("twin", ref, ref)):
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.backward(dy)
        out[name] = (y.detach().float(), xx.grad.float(), mod.weight.grad.float())
    (y, dx, dw), (y_r, dx_r, dw_r) = out["kernel"], out["twin"]
    tol = 2e-2 if kern.fast_accum else 5e-3
    errs = {"y": relative_frobenius(y, y_r), "dx": relative_frobenius(dx, dx_r),
            "dw": relative_frobenius(dw, dw_r)}
    bound = {role: tol if role in roles else 1e-2 for role in ("fwd", "dgrad", "wgrad")}
    ok = (errs["y"] < bound["fwd"] and errs["dx"] < bound["dgrad"] and errs["dw"] < bound["wgrad"]
          and all(bool(torch.isfinite(t).all()) for t in (y, dx, dw)))
    return {**{f"relfro_{k_}_vs_twin": v for k_, v in errs.items()}, "twin": twin, "ok": ok}


def register_training_path_checks():
    """The FP8 site-roles of the benchmark's training plans, each through a compiled
    training step against its emulated twin: does the compiled path compute what the
    emulated path (the CPU suite's reference) computes?"""
    for kernel, roles in (("cublas-rowwise-fastacc", ("fwd", "dgrad")),
                          ("triton-rowwise-cublas-fastacc", ("fwd",)),
                          ("triton-rowwise-cublas", ("fwd", "dgrad")),
                          ("cublas-rowwise", ("fwd",)),
                          ("fbgemm-rowwise", ("fwd",))):
        @check(f"training step {kernel} {'+'.join(roles)} vs emulated twin, compiled")
        def _(kernel=kernel, roles=roles):
            from loka.kernels import get

            ok = get(kernel).supports(DEV, 4096, 2048, 8192)
            if not ok:
                return {"skipped": ok.reason}
            return linear_vs_twin(kernel, roles, device=DEV)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu_selftest.json")
    p.add_argument("--only", default="", help="run checks whose name contains this")
    p.add_argument("--autotune", action="store_true",
                   help="autotune every kernel (slow: compiles every config); default: one config")
    args = p.parse_args(argv)
    if not args.autotune:  # numerics do not need the fastest config, only a valid one
        os.environ.setdefault("LOKA_TRITON_AUTOTUNE", "0")
    if not (torch.cuda.is_available() and caps.triton_available("cuda")):
        print("gpu_selftest needs a CUDA GPU and Triton")
        return 2
    torch.manual_seed(0)
    for register in (register_quantize_checks, register_gemm_checks, register_fused_checks,
                     register_registry_checks, register_training_path_checks):
        register()
    t0 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def write(done: bool) -> dict:  # after every check: a run cut short keeps its results
        passed = sum(r["passed"] for r in RESULTS)
        summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "passed": passed,
                   "failed": len(RESULTS) - passed, "complete": done,
                   "seconds": round(time.perf_counter() - t0, 1), "checks": RESULTS}
        Path(args.out).write_text(json.dumps(summary, indent=1, default=float))
        return summary

    for name, run in RUNNERS:
        if args.only in name:
            run()
            write(False)
    summary = write(True)
    passed = summary["passed"]
    print(f"\n{passed} passed, {len(RESULTS) - passed} failed in {summary['seconds']} s -> {args.out}")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
