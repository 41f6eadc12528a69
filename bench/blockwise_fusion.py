#!/usr/bin/env python3
"""Does an FP8 input quantization fuse into a block norm when its scale block is the norm's?

At the evaluation-set Wukong's FP8 sites (``fm.mlp.0``, ``fm.mlp.3``, ``top.0.0``,
``top.1.0``), x comes from a norm over 256-feature blocks of the row (the model's own
``RowBlockNorm``, as a user would write it), optionally followed by Hard Swish. Each
variant is one ``torch.compile`` region, producer -> quantization -> GEMM, the weight
quantized ahead (serving), timed as a CUDA graph (``triton.testing.do_bench_cudagraph``,
median) beside its GEMM alone:

* ``bf16``: the producer, then ``x @ w.t()``;
* ``rowwise-fastacc``: a row's amax (``loka.numerics.quantize``), ``torch._scaled_mm``
  rowwise with fast accumulation (``cublas-rowwise-fastacc``);
* ``tensorwise-fastacc``: the same, one scale for x;
* ``tensorwise-static-fastacc``: one static scale for x, its amax taken once ahead (as a
  serving plan's static scale): a cast with no amax pass;
* ``g{G}-triton``: x's scales over 1xG blocks (``quantize(..., block=(1, G))``), repeated
  to 1x128, weight 128x128 blocks, LoKA's Triton blockwise GEMM (``loka::triton_gemm``);
* ``g{G}-cublas``: the same operands through cuBLAS blockwise (``F.scaled_mm``
  1x128 x 128x128), where this torch build has it; ``g{G}-cublasT`` passes the weight's
  scales K-major; ``g{G}-emul`` multiplies the dequantized operands (the CPU smoke test).

G is 128 and the norm's block (256): with G equal to the norm's block, Inductor can make
the statistics, the normalisation, the block amax and the cast one kernel. The number of
Inductor kernels of each compiled region is recorded (from its generated code). Each
variant's output is compared with the float64 product of the same producer output and
weight (relative Frobenius error).

    PYTHONPATH=. python bench/blockwise_fusion.py --out blockwise_fusion.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evalset.common import HSwish, RowBlockNorm  # noqa: E402
from loka.numerics import quantize  # noqa: E402

SITES = {  # name: (K, N, activation after the norm)
    "fm.mlp.0": (2048, 2048, False),
    "fm.mlp.3": (2048, 8192, True),
    "top.0.0": (16384, 2048, False),
    "top.1.0": (2048, 1024, True),
}


def expand_scales(scale: torch.Tensor, group: int) -> torch.Tensor:
    """(M, K/G) scales as the (M, K/128) that 1x128 kernels read (each repeated G/128x)."""
    return scale.repeat_interleave(group // 128, dim=1) if group > 128 else scale


VARIANT = re.compile(r"bf16|(rowwise|tensorwise)-fastacc|tensorwise-static-fastacc"
                     r"|g(128|256|512)-(triton|cublas|cublasT|emul)")


def make_variant(name: str, block: int, act: bool, w: torch.Tensor,
                 x: "torch.Tensor | None" = None):
    """(producer, quantization + GEMM) of one variant: functions of x and of y = producer(x).
    ``tensorwise-static-fastacc`` takes its scale from ``producer(x)``'s amax, computed here
    once (a serving plan's static scale): its cast needs no amax pass."""
    if not VARIANT.fullmatch(name):
        raise ValueError(f"unknown variant {name!r}")
    norm, hs = RowBlockNorm(w.shape[1], block), HSwish()
    wt = w.t()
    if name.startswith("g"):
        group, gemm = int(name[1:].split("-")[0]), name.split("-")[1]
        qb = quantize(wt.float(), "e4m3", "blockwise", "b")
        bdata, bscale = qb.data.t().contiguous().t(), qb.scale
    elif name != "bf16":
        gran = name.split("-")[0]
        qb = quantize(wt.float(), "e4m3", gran, "b")
        bdata, bscale = qb.data.t().contiguous().t(), qb.scale

    def producer(x):
        y = norm(x)
        return hs(y) if act else y

    if name == "bf16":
        return producer, lambda y: y @ wt
    if name == "tensorwise-static-fastacc":
        with torch.no_grad():
            scale = producer(x).float().abs().amax().clamp(min=1e-12) / 448.0

        def static_gemm(y):
            qa = quantize(y, "e4m3", "tensorwise", "a", scale=scale, check_scale=False)
            return torch._scaled_mm(qa.data, bdata, scale_a=qa.scale.reshape(()),
                                    scale_b=bscale.reshape(()), out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
        return producer, static_gemm
    if name in ("rowwise-fastacc", "tensorwise-fastacc"):
        gran = name.split("-")[0]

        def gemm_only(y):
            qa = quantize(y, "e4m3", gran, "a")
            sa, sb = qa.scale, bscale
            if gran == "tensorwise":
                sa, sb = sa.reshape(()), sb.reshape(())
            return torch._scaled_mm(qa.data, bdata, scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16, use_fast_accum=True)
        return producer, gemm_only

    def blockwise(y):
        qa = quantize(y, "e4m3", "blockwise", "a", block=(1, group))
        sa = expand_scales(qa.scale, group)
        if gemm == "emul":  # the CPU smoke test: the same operands, dequantized
            a = qa.data.float() * sa.repeat_interleave(128, 1)
            b = bdata.float() * bscale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            return (a @ b).to(torch.bfloat16)
        if gemm == "triton":
            from loka.kernels.adapters.triton_kernels import triton_gemm
            return triton_gemm(qa.data, bdata, sa, bscale, "blockwise", torch.bfloat16)
        import torch.nn.functional as F
        sb = bscale if gemm == "cublas" else bscale.t().contiguous().t()  # cublasT: K-major
        return F.scaled_mm(qa.data, bdata, sa.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                           sb, F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    return producer, blockwise


def kernels_of(fn, *args) -> int:
    """Inductor kernels (``triton_*`` launches) in the compiled code of ``fn``."""
    from torch._inductor.utils import run_and_get_code
    _, codes = run_and_get_code(fn, *args)
    return sum(len(set(re.findall(r"\b(triton_(?:per|red|poi)_\w+)\.run\(", c))) for c in codes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test, untimed")
    ap.add_argument("--sites", default=",".join(SITES))
    ap.add_argument("--variants", default="bf16,rowwise-fastacc,tensorwise-fastacc,g128-triton,"
                                          "g256-triton,g128-cublas,g256-cublas")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = args.device
    if dev == "cuda":
        import triton.testing as tt
        bench = lambda f: tt.do_bench_cudagraph(f, rep=50)  # noqa: E731
    else:
        bench = lambda f: float("nan")  # noqa: E731
    from loka.kernels import capabilities as caps
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "capabilities": caps.summary(dev),
           "batch": args.batch, "block": args.block, "argv": sys.argv, "sites": {}}
    for site in args.sites.split(","):
        k, n, act = SITES[site]
        x = (torch.randn(args.batch, k, device=dev) * 2 + 0.5).to(torch.bfloat16)
        w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
        rows = {}
        for name in args.variants.split(","):
            t0 = time.perf_counter()
            try:
                producer, gemm = make_variant(name, args.block, act, w, x)
                torch._dynamo.reset()
                whole = torch.compile(lambda x: gemm(producer(x)))
                gemm_c = torch.compile(gemm)
                with torch.no_grad():
                    y = producer(x)
                    ref = y.double() @ w.double().t()
                    got = whole(x)
                    err = ((got.double() - ref).norm() / ref.norm()).item()
                    nk = kernels_of(whole, x)
                    ms = bench(lambda: whole(x))
                    ms_gemm = bench(lambda: gemm_c(y))
                rows[name] = {"ms": ms, "gemm_ms": ms_gemm, "rel_err": err,
                              "inductor_kernels": nk, "wall_s": time.perf_counter() - t0}
            except Exception as e:  # noqa: BLE001 - record and go on
                rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(site, name, rows[name], flush=True)
        base = rows.get("bf16", {}).get("ms")
        for r in rows.values():
            if base and "ms" in r:
                r["vs_bf16"] = base / r["ms"]
        out["sites"][site] = {"K": k, "N": n, "hswish": act, "variants": rows}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
