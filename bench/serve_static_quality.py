#!/usr/bin/env python3
"""What static serving scales cost in quality: a model trained in float32, served on
held-out data by a dynamic FP8 serving plan and by static-scale plans (``loka.plan(...,
inference=True, static_scales=True, static_margin=X)``), every arm scored on the same
examples against the float32 model (paired), and how much of each site's input saturates.

Per model and seed: the model trains ``--steps`` steps on the synthetic stream of that
seed; ``loka.probe`` observes ``--probe-steps`` more training steps (its amax is what a
static scale takes); the arms serve ``--eval-batches`` held-out batches (a stream no arm
trained or probed on). Each arm: the paired relative NE change against float32 with its
interval over examples (``loka.quality.stats.ratio_interval`` of per-example log losses)
and the largest fraction of a site's input elements beyond its static amax (the guard's
``saturation`` statistic). The kernels are the CPU's emulated tensorwise E4M3 (the same
numerics as ``cublas-tensorwise``): no GPU is needed and none is timed.

A seed whose float32 model did not learn (held-out NE at least ``--max-baseline-ne``) is
kept in the file but left out of the summary: an FP8 arm's change against a model that
predicts worse than the base rate says nothing about FP8. ``--models`` takes
``name:preset[:lr]``.

    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/serve_static_quality.py \\
        --models wukong:small:3e-3,dcnv2:small:1e-3 --seeds 0,1,2,3,4 \\
        --out bench/results/serve_static_quality_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time

import numpy as np
import torch

from loka.assembly import build_reference
from loka.config import ProbeConfig
from loka.data import SyntheticCTR
from loka.data.metrics import normalized_entropy
from loka.dispatch import apply, plan as make_plan
from loka.dispatch.static import static_saturation
from loka.jsonio import atomic_write_text, json_safe
from loka.probe import probe
from loka.quality.stats import example_log_losses, ratio_interval
from loka.train import loss_fn, predict, train

KERNEL = "emulated-tensorwise-e4m3"
HELD_OUT_SEED = 10_000
PROBE_SEED = 5_000


def one_seed(name: str, preset: str, seed: int, args, lr: float) -> dict:
    torch.manual_seed(seed)
    model = build_reference(name, preset, None, torch.device("cpu"), seed=seed,
                            table_rows=args.table_rows)
    spec = model.feature_spec
    stream = SyntheticCTR(spec, args.batch_size, seed=seed)
    train(model, (stream.batch(i) for i in range(args.steps)), args.steps, lr=lr,
          progress=False, guard=False)
    probe_stream = SyntheticCTR(spec, args.batch_size, seed=PROBE_SEED + seed)
    cfg = ProbeConfig(kernels=("bf16", KERNEL), num_samples=4, timing=False, every_n_steps=1,
                      bootstrap=100, progress=False)
    report = probe(model, [probe_stream.batch(i) for i in range(args.probe_steps)],
                   lambda m, b: loss_fn(m, b), config=cfg)
    held = SyntheticCTR(spec, args.eval_batch, seed=HELD_OUT_SEED + seed)
    eval_batches = [held.batch(i) for i in range(args.eval_batches)]
    model.eval()
    base_logits, labels = predict(model, eval_batches, device="cpu")
    base_logits, labels = np.asarray(base_logits, np.float64), np.asarray(labels, np.float64)
    base_ll = example_log_losses(base_logits, labels)
    arms = {"dynamic": dict(static_scales=False)}
    for margin in args.margins:
        arms[f"static x{margin:g}"] = dict(static_scales=True, static_margin=margin)
    out = {"seed": seed, "ne_fp32": normalized_entropy(base_logits, labels, from_logits=True),
           "fp8_sites": None, "arms": {}}
    for arm, kw in arms.items():
        plan = make_plan(report, inference=True, assume_fast=True, allowed_kernels=[KERNEL],
                         **kw)
        served = copy.deepcopy(model)
        apply(served, plan, inference=True)
        served.eval()
        logits, _ = predict(served, eval_batches, device="cpu")
        logits = np.asarray(logits, np.float64)
        change, lo, hi = ratio_interval(base_ll, example_log_losses(logits, labels))
        sat = (static_saturation(served, lambda: [served(b) for b in eval_batches])
               if plan.static_scales else {})
        out["fp8_sites"] = len(plan.fp8_sites())
        out["arms"][arm] = {"rel_ne_change": change, "interval": [lo, hi],
                            "static_sites": len(plan.static_scales),
                            "saturation_max": max(sat.values()) if sat else 0.0,
                            "saturation_mean": float(np.mean(list(sat.values()))) if sat else 0.0,
                            "sites_saturating": sum(1 for v in sat.values() if v > 0)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wukong:small:3e-3,dcnv2:small:1e-3",
                   help="comma list of name:preset[:lr] (default lr: --lr)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--probe-steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batch", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--table-rows", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--margins", default="1,2")
    p.add_argument("--max-baseline-ne", type=float, default=1.0,
                   help="seeds whose float32 NE is at least this are left out of the summary")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.margins = [float(m) for m in args.margins.split(",")]
    t0 = time.perf_counter()
    doc = {"schema": "loka.serve-static-quality", "version": 1, "kernel": KERNEL,
           "args": {k: v for k, v in vars(args).items() if k != "out"},
           "env": {"torch": torch.__version__, "python": platform.python_version()},
           "models": {}}
    for spec in args.models.split(","):
        parts = spec.split(":")
        name, preset = parts[0], parts[1]
        lr = float(parts[2]) if len(parts) > 2 else args.lr
        runs = [one_seed(name, preset, int(s), args, lr) for s in args.seeds.split(",")]
        learned = [r for r in runs if r["ne_fp32"] < args.max_baseline_ne]
        summary = {"lr": lr, "seeds_learned": [r["seed"] for r in learned],
                   "seeds_not_learned": [r["seed"] for r in runs if r not in learned]}
        for arm in runs[0]["arms"]:
            if not learned:
                break
            changes = [r["arms"][arm]["rel_ne_change"] for r in learned]
            summary[arm] = {"rel_ne_change_mean": float(np.mean(changes)),
                            "rel_ne_change_seeds": changes,
                            "saturation_max": max(r["arms"][arm]["saturation_max"]
                                                  for r in learned)}
        doc["models"][spec] = {"seeds": runs, "summary": summary}
        print(spec, json.dumps(summary, indent=1), flush=True)
    doc["wall_s"] = time.perf_counter() - t0
    atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
