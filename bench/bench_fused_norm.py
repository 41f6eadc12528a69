"""Fused norm -> activation -> FP8 quantization against the unfused ops, at Wukong's shapes.

Every producer of an FP8 GEMM input in the Wukong ``paper`` model with Mods:

* ``fmb_norm``: the FMB's BlockNorm over n*k = 2048 features, feeding ``fmb.mlp.0``;
* ``fmb_act``: the Hard Swish between ``fmb.mlp.0`` and ``fmb.mlp.2`` (2048 features);
* ``top_norm``: the last layer's norm over d = 256, flattened to 16384 features (a
  BlockNorm of block 256), feeding ``over_arch`` Linear 0;
* ``top_act``: the Hard Swish after ``over_arch`` Linear 0 (2048) and Linear 1 (1024);
* ``norm_act``: BlockNorm then Hard Swish over 2048 (the composition the kernel is for).

Each at batch 4096 in bf16, rowwise and tensorwise e4m3, timed with CUDA graphs
(``loka.timing.time_fn``, median) as:

* ``fused``: ``loka.mods.fused.fused_norm_act_quant`` (one Triton kernel; tensorwise adds a
  second pass for the global amax);
* ``fused_fp8_only``: the same without writing the high-precision output
  (``return_hp=False``): what serving needs, and training where the consumer keeps only
  the FP8 copy (tensorwise: a second launch recomputes the activation from ``x`` and casts
  it with the global scale, instead of storing it and reading it back);
* ``eager``: the PyTorch composition, then ``loka.numerics.quantize`` (the eager ops);
* ``norm_compiled+quant_triton``: Inductor's norm (one kernel), then LoKA's Triton quantizer:
  the best "separate quantization" pass;
* ``inductor_fused``: the composition and the quantization in one ``torch.compile``
  region, Inductor free to fuse them (the strongest baseline);
* ``norm_compiled_only`` and ``quant_triton_only``: the two parts of the separate path
  alone (the quantizer on a precomputed activation: the same bytes as ``fused_fp8_only``).

``--configs`` also times the fused kernel with each of its tile configs forced.

``--with-linear KERNEL`` also times each producer with the Linear it feeds in the model
(``CONSUMERS``: its width N), as the model runs them: ``unfused`` is the compiled
norm/activation, then a ``loka.Linear`` whose forward kernel is KERNEL and quantizes its
own input; ``fused`` is :func:`loka.mods.fused.norm_act_linear` (one fused pass, the
Linear takes the FP8 tensor). In training mode (the forward of a step, autograd
recording) and in serving mode (``no_grad``: the fused pass writes the FP8 tensor alone).

The target (the fused kernel at least 2x faster than norm + separate quantization) is read
against ``norm_compiled+quant_triton``; the other rows are for context. The fused output is
checked against the reference first (FP8 bytes of ``quantize`` of its own high-precision
output, bit for bit; high-precision output within bf16 rounding of the float32
composition).

    PYTHONPATH=. python bench/bench_fused_norm.py [--out bench/results/fused_norm_h200.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

from loka.mods.fused import fused_norm_act_quant, reference_norm_act
from loka.numerics import quantize
from loka.jsonio import atomic_write_text
from loka.timing import time_fn

CASES = (  # name, M, D, norm, act
    ("fmb_norm", 4096, 2048, "blocknorm", "identity"),
    ("fmb_act", 4096, 2048, "none", "hardswish"),
    ("top_norm", 4096, 16384, "blocknorm", "identity"),
    ("top_act_2048", 4096, 2048, "none", "hardswish"),
    ("top_act_1024", 4096, 1024, "none", "hardswish"),
    ("norm_act", 4096, 2048, "blocknorm", "hardswish"),
)


CONSUMERS = {"fmb_norm": 2048, "fmb_act": 8192, "top_norm": 2048, "top_act_2048": 1024,
             "norm_act": 2048}
"""output width N of the Linear each producer feeds (``top_act_1024`` feeds the logit
Linear, N = 1, which runs on no FP8 kernel)"""


def bench_with_linear(name, m, d, norm, act, kernel, device, budget_ms) -> dict:
    """The producer and the Linear it feeds, unfused and fused, in training and serving
    mode (see the module docstring): times, speedup, and whether the outputs agree."""
    import loka
    from loka.mods import BlockNorm
    from loka.mods.fused import norm_act_linear

    g = torch.Generator(device=device).manual_seed(1)
    x = (torch.randn(m, d, device=device, generator=g) * 3 + 0.5).to(torch.bfloat16)
    lin = loka.Linear(d, CONSUMERS[name], bias=False, device=device, dtype=torch.bfloat16,
                      config=loka.LinearConfig(fwd=kernel))
    norm_m = BlockNorm(256) if norm == "blocknorm" else None
    act_m = torch.nn.Hardswish() if act == "hardswish" else None
    norm_c = torch.compile(lambda t: reference_norm_act(t, norm, 256, act), dynamic=False)
    fns = {"unfused": lambda t: lin(norm_c(t)),
           "fused": lambda t: norm_act_linear(t, norm_m, act_m, lin)}
    out = {"kernel": kernel, "N": CONSUMERS[name]}
    for mode in ("train", "serve"):
        xin = x.detach().requires_grad_(mode == "train")
        row = {}
        with torch.set_grad_enabled(mode == "train"):
            # against the eager composition (Inductor's norm may round its intermediate
            # activation differently, so the compiled route is not the reference)
            ref = lin(reference_norm_act(xin, norm, 256, act))
            got = fns["fused"](xin)
            row["max_abs_diff_vs_eager"] = float((ref.float() - got.float()).abs().max())
            for k, fn in fns.items():
                try:
                    row[f"{k}_us"] = time_fn(lambda: fn(xin), device, warmup=5, iters=50,
                                             budget_ms=budget_ms).median_us
                except Exception as e:  # noqa: BLE001 - report, keep the other rows
                    row[f"{k}_error"] = f"{type(e).__name__}: {e}"[:300]
        if "unfused_us" in row and "fused_us" in row and row["fused_us"] > 0:
            row["speedup"] = row["unfused_us"] / row["fused_us"]
        out[mode] = row
    return out


def _triton_quant(y: torch.Tensor, gran: str):
    from loka.kernels.triton import quantize as tq
    if gran == "rowwise":
        return tq.quantize_rowwise(y, "e4m3")
    return tq.quantize_tensorwise(y, "e4m3")


def check(x, norm, act, gran) -> dict:
    """Numerics of the fused kernel against its reference, as numbers."""
    y, q = fused_norm_act_quant(x, norm, 256, act, "e4m3", gran, backend="triton")
    ref = reference_norm_act(x.float(), norm, 256, act)
    q_ref = quantize(y, "e4m3", gran)
    same_bytes = bool(torch.equal(q.data.view(torch.uint8), q_ref.data.view(torch.uint8)))
    same_scale = bool(torch.equal(q.scale.float().reshape(-1), q_ref.scale.float().reshape(-1)))
    hp_err = ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return {"fp8_bytes_equal_quantize_of_output": same_bytes, "scales_equal": same_scale,
            "hp_max_rel_error_vs_fp32": hp_err}


def time_configs(x, norm, act, gran, device, budget_ms) -> dict:
    """The fused kernel with each of its tile configs forced, with and without the
    high-precision output: which tile the autotuner should find."""
    from bench_inline import forced
    from loka.kernels.triton import norm_act_quant as nq

    _, ng, gp, nchunk = nq._tile_shape(x.shape[1], norm, 256)
    kern = nq.norm_act_quant_kernel
    out = {}
    for cfg in nq._prune(kern.configs, {"M": x.shape[0]}, NG=ng, GP=gp, NCHUNK=nchunk):
        name = f"BLOCK_M={cfg.kwargs['BLOCK_M']},w={cfg.num_warps}" + (
            f",maxnreg={cfg.maxnreg}" if cfg.maxnreg else "") + (
            f",split={nq._split(cfg)}" if nq._split(cfg) > 1 else "")
        for hp in (True, False):
            with forced(kern, configs=[cfg]):
                try:
                    us = time_fn(lambda: fused_norm_act_quant(x, norm, 256, act, "e4m3", gran,
                                                              return_hp=hp, backend="triton"),
                                 device, warmup=3, iters=50, budget_ms=budget_ms).median_us
                except Exception as e:  # noqa: BLE001 - a config that fails is reported
                    us = f"{type(e).__name__}: {str(e)[:120]}"
            out[f"{name}{'' if hp else ',fp8_only'}"] = us
    return out


def bench_case(name, m, d, norm, act, gran, device, budget_ms, configs=False,
               with_linear=None) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(m, d, device=device, generator=g) * 3 + 0.5).to(torch.bfloat16)
    row = {"case": name, "M": m, "D": d, "norm": norm, "act": act, "granularity": gran}
    row.update(check(x, norm, act, gran))
    torch._dynamo.reset()  # each case compiles its own baselines, none hits a recompile limit

    y_pre = reference_norm_act(x, norm, 256, act)
    norm_c = torch.compile(lambda t: reference_norm_act(t, norm, 256, act), dynamic=False)
    both_c = torch.compile(lambda t: quantize(reference_norm_act(t, norm, 256, act), "e4m3", gran),
                           dynamic=False)
    fns = {
        "fused": lambda: fused_norm_act_quant(x, norm, 256, act, "e4m3", gran, backend="triton"),
        "fused_fp8_only": lambda: fused_norm_act_quant(x, norm, 256, act, "e4m3", gran,
                                                       return_hp=False, backend="triton"),
        "eager": lambda: quantize(reference_norm_act(x, norm, 256, act), "e4m3", gran),
        "norm_compiled+quant_triton": lambda: _triton_quant(norm_c(x), gran),
        "inductor_fused": lambda: both_c(x),
        "norm_compiled_only": lambda: norm_c(x),
        "quant_triton_only": lambda: _triton_quant(y_pre, gran),
    }
    times = {}
    for k, fn in fns.items():
        try:
            r = time_fn(fn, device, warmup=5, iters=100, budget_ms=budget_ms)
            times[k] = {"us": r.median_us, "method": r.method}
        except Exception as e:  # noqa: BLE001 - one failing baseline must not lose the rest
            times[k] = {"error": f"{type(e).__name__}: {e}"[:300]}
    row["times"] = times
    if configs and gran == "rowwise":
        row["fused_configs"] = time_configs(x, norm, act, gran, device, budget_ms)
    if with_linear and gran == "rowwise" and name in CONSUMERS:
        row["with_linear"] = bench_with_linear(name, m, d, norm, act, with_linear, device,
                                               budget_ms)
    # bytes that must move: read x (bf16), write y (bf16) and q (fp8)
    moved = m * d * (2 + 2 + 1)
    if "us" in times["fused"]:
        row["fused_gb_per_s"] = moved / times["fused"]["us"] / 1e3
        for k in ("eager", "norm_compiled+quant_triton", "inductor_fused"):
            if "us" in times[k]:
                row[f"speedup_vs_{k}"] = times[k]["us"] / times["fused"]["us"]
                if "us" in times["fused_fp8_only"]:
                    row[f"fp8_only_speedup_vs_{k}"] = times[k]["us"] / times["fused_fp8_only"]["us"]
    return row


def diagnose(device, budget_ms) -> dict:
    """Where a 4096 x 2048 fused call's time goes: the device time of every kernel it
    launches (torch.profiler), beside the quantizer alone, and the time at 1, 4 and 16
    times the rows (a fixed cost stays, a bandwidth-bound one grows)."""
    from torch.profiler import ProfilerActivity, profile

    out = {"kernels_us": {}, "by_rows": []}
    for m in (4096, 16384, 65536):
        x = (torch.randn(m, 2048, device=device) * 3 + 0.5).to(torch.bfloat16)
        y = reference_norm_act(x, "blocknorm", 256, "identity")
        fns = {"fused_fp8_only": lambda: fused_norm_act_quant(
                   x, "blocknorm", 256, "identity", "e4m3", "rowwise", return_hp=False,
                   backend="triton"),
               "fused": lambda: fused_norm_act_quant(x, "blocknorm", 256, "identity", "e4m3",
                                                     "rowwise", backend="triton"),
               "quant_triton_only": lambda: _triton_quant(y, "rowwise")}
        row = {"M": m}
        for k, fn in fns.items():
            row[k] = time_fn(fn, device, warmup=5, iters=50, budget_ms=budget_ms).median_us
            if m == 4096:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        fn()
                    torch.cuda.synchronize()
                out["kernels_us"][k] = {
                    e.key: round(e.device_time_total / max(1, e.count), 2)
                    for e in prof.key_averages() if e.device_time_total > 0}
        out["by_rows"].append(row)
        print("diag", row, flush=True)
    print("diag kernels", out["kernels_us"], flush=True)
    return out


def result(rows, gpu: str) -> dict:
    """The JSON of a run: its rows and what they say against the separate-quantization path."""
    sp = [r["speedup_vs_norm_compiled+quant_triton"] for r in rows
          if "speedup_vs_norm_compiled+quant_triton" in r]
    sp8 = [r["fp8_only_speedup_vs_norm_compiled+quant_triton"] for r in rows
           if r["granularity"] == "rowwise"
           and "fp8_only_speedup_vs_norm_compiled+quant_triton" in r]
    return {
        "schema": "loka.bench.fused-norm", "version": 1,
        "env": {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "commit": os.environ.get("LOKA_COMMIT", "")},
        "rows": rows,
        "summary": {"min_speedup_vs_separate_quant": min(sp) if sp else None,
                    "geomean_speedup_vs_separate_quant":
                        (float(torch.tensor(sp).log().mean().exp()) if sp else None),
                    "fp8_only_rowwise_speedups_vs_separate_quant": sp8,
                    "all_numerics_exact": all(r["fp8_bytes_equal_quantize_of_output"]
                                              and r["scales_equal"] for r in rows)},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--budget-ms", type=float, default=20.0, help="timing budget per call")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--configs", action="store_true",
                   help="also time the fused kernel with each tile config forced (rowwise)")
    p.add_argument("--with-linear", default=None, metavar="KERNEL",
                   help="also time each producer with the Linear it feeds, whose forward "
                        "runs on KERNEL (e.g. triton-rowwise-cublas-fastacc), unfused and fused")
    p.add_argument("--diagnose", action="store_true",
                   help="only the kernel-by-kernel profile and the row scaling (diagnose())")
    args = p.parse_args(argv)
    wanted = set(filter(None, args.cases.split(",")))
    unknown = wanted - {c[0] for c in CASES}
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {[c[0] for c in CASES]}")
    if not torch.cuda.is_available():
        print("bench_fused_norm needs a CUDA GPU (the fused kernel is Triton)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    path = Path(args.out or f"bench/results/fused_norm_{gpu.split()[-1].lower()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.diagnose:
        atomic_write_text(path, json.dumps({"env": {"gpu": gpu, "torch": torch.__version__},
                                            "diagnose": diagnose(device, args.budget_ms)},
                                           indent=1))
        return 0
    rows = []
    for name, m, d, norm, act in CASES:
        if wanted and name not in wanted:
            continue
        for gran in ("rowwise", "tensorwise"):
            row = bench_case(name, m, d, norm, act, gran, device, args.budget_ms, args.configs,
                             args.with_linear)
            rows.append(row)
            t = row["times"]
            print(f"{name:14s} {gran:10s} " + " ".join(
                f"{k}={v['us']:.1f}us" if "us" in v else f"{k}=ERR" for k, v in t.items())
                + f"  x{row.get('speedup_vs_norm_compiled+quant_triton', float('nan')):.2f}"
                + "".join(f"  {mode}+linear x{row['with_linear'][mode].get('speedup', float('nan')):.2f}"
                          for mode in ("train", "serve") if "with_linear" in row),
                flush=True)
            out = result(rows, gpu)
            atomic_write_text(path, json.dumps(out, indent=1))  # a run cut short keeps its rows
    print(f"wrote {path}: {out['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
