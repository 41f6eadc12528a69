#!/usr/bin/env python3
"""How much does a plan perturb the gradients? One batch, before any training.

Builds the benchmark model (``loka.bench.build_model``), applies each plan to a copy, and
compares every parameter's gradient of the loss on one batch against a float64 copy of the
same model: relative Frobenius error per parameter, for the model in its own dtype and for
each plan. The model's own dtype sets the floor (bf16 on a GPU, float32 on the CPU); a
plan's FP8 roles add their rounding on top. This is the model-level view of the Probe's
per-GEMM errors, and it costs one forward and backward per plan. It does not say what the
added noise does to training: `bench/quality_at_scale.py` does.

    PYTHONPATH=. python bench/grad_noise.py --preset paper --merge --batch-size 512 \\
        --plans et=bench/plans/wukong-paper-tuned-exacttop-emulated.merge.plan.json \\
        --out bench/results/grad_noise_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys

import torch

from loka import bench
from loka.config import ModsConfig
from loka.dispatch import Plan, apply
from loka.numerics import relative_frobenius
from loka.train import loss_fn


def gradients(model, batch) -> dict:
    """{name: float64 gradient} of the benchmark loss on ``batch``."""
    model.zero_grad(set_to_none=True)
    loss_fn(model, bench.cast_batch(batch, next(model.parameters()).dtype)).backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def relative_errors(grads: dict, exact: dict) -> dict:
    return {n: relative_frobenius(g, exact[n]) for n, g in grads.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--table-rows", type=int, default=100)
    p.add_argument("--merge", action="store_true", help="merged siblings (for .merge plans)")
    p.add_argument("--plans", required=True, help="name=path[,name=path]")
    p.add_argument("--dtype", choices=("model", "bfloat16"), default="model",
                   help="the model's dtype: as built (float32 on the CPU, bf16 on a GPU), or "
                        "bf16 (the GPU's floor, on the CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    cfg = bench.BenchConfig(model=args.model, preset=args.preset, device=str(device),
                            batch_size=args.batch_size, table_rows=args.table_rows, seed=args.seed)
    mods = dataclasses.replace(ModsConfig.paper(), merge_siblings=args.merge)
    model = bench.build_model(cfg, mods, device)
    if args.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    batch = bench.make_batch(model, cfg, device)
    exact = gradients(copy.deepcopy(model).double(), batch)
    rows = {"model": relative_errors(gradients(model, batch), exact)}
    for name, path in bench.named_plans(args.plans).items():
        planned = copy.deepcopy(model)
        apply(planned, Plan.load(path))
        rows[name] = relative_errors(gradients(planned, batch), exact)
    summary = {name: {"median": statistics.median(errs.values()), "max": max(errs.values())}
               for name, errs in rows.items()}
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    print(f"relative gradient error against float64 ({args.model} {args.preset}, "
          f"batch {batch.labels.shape[0]}, model in {dtype}):")
    for name, s in summary.items():
        print(f"  {name:12s} median {s['median']:.4f}  max {s['max']:.4f}")
    if args.out:
        env = bench.environment(device)
        with open(args.out, "w") as f:
            json.dump({"schema": "loka.grad_noise", "version": 1, "env": env,
                       "config": vars(args), "dtype": dtype, "summary": summary,
                       "per_parameter": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
