#!/usr/bin/env python3
"""Where a training step's GPU time goes: torch.profiler over a few steps of each variant,
kernels grouped into GEMM / FP8 GEMM / quantization / Triton (Inductor) / embedding /
optimizer / other. Writes JSON (and prints a table) so BENCHMARKS.md can show the split.

    python bench/profile_step.py --variants bf16+mods+graphs,loka+mods+graphs --out bench/results/profile.json
"""

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from loka import bench  # noqa: E402


def category(name: str) -> str:
    n = name.lower()
    # cuBLAS's Hopper kernels are named nvjet_*: "qq" marks FP8 operands (e.g. _qqtst_)
    if n.startswith("nvjet") and "_qq" in n:
        return "gemm-fp8"
    if any(t in n for t in ("f8f8", "fp8", "e4m3", "scaled_mm")) and "gemm" in n:
        return "gemm-fp8"
    if any(t in n for t in ("radix_sort", "sum_and_scatter", "compute_grad_weight_bags",
                            "embeddingbag", "embedding_bag", "krn_partials_per_segment",
                            "segment_offsets")):
        return "embedding"
    if any(t in n for t in ("gemm", "cutlass", "xmma", "cublas", "nvjet", "sm90_", "matmul")):
        return "gemm-fp8" if "e4m3" in n or "f8" in n else "gemm"
    if "embedding" in n or "index_select" in n or "indexing_backward" in n:
        return "embedding"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if n.startswith("triton_") or "triton" in n:
        return "triton"
    return "other"


def profile(name, cfg, device, steps=5):
    step, row, _ = bench.prepare_train(name, cfg, device, {})
    for _ in range(cfg.warmup):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for evt in p.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if t and evt.key and not evt.key.startswith("ProfilerStep"):
            per_kernel[evt.key] += t / steps
    # drop the CPU-op rows that summarise their kernels (they would count twice)
    kernels = {k: v for k, v in per_kernel.items() if not k.startswith("aten::")
               and not k.startswith("cuda") and not k.startswith("Torch-Compiled")
               and not k.startswith("CompiledFunction") and not k.startswith("## ")}
    cats = defaultdict(float)
    for k, v in kernels.items():
        cats[category(k)] += v
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    total = sum(kernels.values())
    return {"variant": name, "gpu_us_per_step": total, "by_category_us": dict(cats),
            "top_kernels_us": top, "fp8_sites": row.get("fp8_sites")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bf16+mods+graphs")
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/profile.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = bench.BenchConfig(model=args.model, preset=args.preset, device="cuda", warmup=3)
    results = []
    for name in args.variants.split(","):
        try:
            r = profile(name, cfg, device, args.steps)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        torch._dynamo.reset()
        print(json.dumps({k: v for k, v in r.items() if k != "top_kernels_us"}, indent=None))
        for k, v in r.get("top_kernels_us", [])[:12]:
            print(f"   {v:9.1f} us  {k[:110]}")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
