#!/usr/bin/env python3
"""Where a training step's GPU time goes: torch.profiler over a few steps of each variant,
kernels grouped by ``loka.bench.kernel_class`` (GEMM / FP8 GEMM / quantize / Triton
(Inductor) / embedding / optimizer / other). Writes JSON (and prints a table) so
BENCHMARKS.md can show the split. ``loka bench --profile VARIANTS`` does the same inside a
benchmark run, on the very steps it timed.

    python bench/profile_step.py --variants bf16+mods+graphs,loka+mods+graphs \\
        --plan bench/results/<run>.plan.json --out bench/results/profile.json
"""

import argparse
import json

import torch

from loka import bench


def profile(variant, cfg, device, steps=5):
    step, row, _ = bench.prepare_train(variant, cfg, device, {})
    for _ in range(cfg.warmup):
        step()
    out = bench.profile_breakdown(step, steps)
    return {"variant": variant.name, "fp8_sites": row.get("fp8_sites"), **out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="bf16+mods+graphs")
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plan", default=None, help="plan JSON for the LoKA variants (else: probe)")
    ap.add_argument("--out", default="bench/results/profile.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    cfg = bench.BenchConfig(model=args.model, preset=args.preset, device="cuda", warmup=3,
                            plan=args.plan)
    results = []
    for variant in [bench.Variant.parse(n) for n in args.variants.split(",")]:
        try:
            r = profile(variant, cfg, device, args.steps)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            r = {"variant": variant.name, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        torch._dynamo.reset()
        print(json.dumps({k: v for k, v in r.items() if k != "top_kernels_us"}, indent=None))
        for k, v, c in r.get("top_kernels_us", [])[:12]:
            print(f"   {v:9.1f} us  {c:9s} {k[:100]}")
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
