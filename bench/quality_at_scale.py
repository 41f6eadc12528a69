#!/usr/bin/env python3
"""Quality at scale: does LoKA's plan change the model's NE?

Trains the benchmark model (``loka.bench.build_model``: Wukong ``paper`` by default, bf16,
fused tables) on the synthetic CTR stream in two arms, bf16 + Mods and LoKA (bf16 + Mods
with a plan applied), for several seeds. The arms of one seed start from the same weights
and see the same batches in the same order, so their difference is the plan's alone; the
seeds give the run-to-run noise that any claim is measured against. Every run is evaluated
on the same held-out batches (NE, AUC, log loss in float64), and the teacher's own NE (the
Bayes floor of the stream) is reported beside them.

    PYTHONPATH=. python bench/quality_at_scale.py --plan bench/results/<run>.plan.json \\
        --steps 3000 --seeds 3 --out bench/results/<date>-quality.json

Without ``--plan`` the Probe runs once (on the first seed's model) and its plan serves all
seeds. The JSON holds every run's final metrics and loss curve, the mean and spread per
arm, and the paired per-seed NE change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from loka import bench  # noqa: E402
from loka.config import ModsConfig  # noqa: E402
from loka.data.metrics import Metrics  # noqa: E402
from loka.data.synthetic import SyntheticCTR  # noqa: E402

ARMS = ("bf16+mods", "loka+mods")


def _cast(batch, dtype):
    return bench._cast_batch(batch, dtype)


def evaluate(model, stream: SyntheticCTR, steps: int, dtype) -> dict:
    metrics, teacher = Metrics(from_logits=True), Metrics(from_logits=True)
    with torch.no_grad():
        for i in range(steps):
            batch = stream.batch(i)
            logits = model(_cast(batch, dtype)).float()
            metrics.update(logits, batch.labels)
            teacher.update(stream.teacher_logits(batch).float(), batch.labels)
    out = metrics.compute()
    out["teacher_ne"] = teacher.compute()["ne"]
    return out


def _mods(args) -> ModsConfig:
    return dataclasses.replace(ModsConfig.paper(), merge_siblings=bool(getattr(args, "merge", False)))


def run_arm(arm: str, seed: int, plan, args, device) -> dict:
    cfg = bench.BenchConfig(model=args.model, preset=args.preset, device=str(device),
                            batch_size=args.batch_size, seed=seed, table_rows=args.table_rows)
    model = bench.build_model(cfg, _mods(args), device)
    dtype = next(model.parameters()).dtype
    bs = args.batch_size or model.default_batch_size
    train = SyntheticCTR(model.feature_spec, bs, seed=seed, device=device)
    held_out = SyntheticCTR(model.feature_spec, bs, seed=10_000_019, device=device,
                            _teacher=train.teacher)
    if arm.startswith("loka"):
        from loka.dispatch import apply

        apply(model, plan)
    step_model = torch.compile(model) if args.compile else model
    opt = bench._optimizer(model, device, capturable=False)
    opt.param_groups[0]["lr"] = args.lr
    losses = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = bench._loss(step_model, _cast(train.batch(i), dtype))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    losses = torch.stack(losses).tolist()
    train_s = time.perf_counter() - t0
    model.eval()
    final = evaluate(step_model, held_out, args.eval_steps, dtype)
    every = max(1, args.steps // 100)
    return {"arm": arm, "seed": seed, "final": final, "train_s": train_s,
            "fp8_sites": bench._count_fp8(model), "finite": all(math.isfinite(x) for x in losses),
            "loss_curve": [[i + 1, losses[i]] for i in range(0, len(losses), every)]}


def summarize(runs) -> dict:
    out = {}
    for arm in ARMS:
        nes = [r["final"]["ne"] for r in runs if r["arm"] == arm]
        aucs = [r["final"]["auc"] for r in runs if r["arm"] == arm]
        if nes:
            out[arm] = {"ne_mean": statistics.fmean(nes),
                        "ne_std": statistics.stdev(nes) if len(nes) > 1 else 0.0,
                        "auc_mean": statistics.fmean(aucs), "seeds": len(nes)}
    by = {(r["arm"], r["seed"]): r["final"]["ne"] for r in runs}
    paired = [100.0 * (by[("loka+mods", s)] / by[("bf16+mods", s)] - 1.0)
              for a, s in by if a == "bf16+mods" and ("loka+mods", s) in by]
    if paired:
        out["paired_ne_change_pct"] = {
            "per_seed": paired, "mean": statistics.fmean(paired),
            "std": statistics.stdev(paired) if len(paired) > 1 else 0.0}
        base = out.get("bf16+mods", {})
        if base.get("ne_mean"):
            out["seed_noise_pct"] = 100.0 * base["ne_std"] / base["ne_mean"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default=None, help="default: paper on CUDA, tiny on the CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plan", default=None, help="plan JSON (default: probe once)")
    p.add_argument("--steps", type=int, default=3000,
                   help="training steps per run (250 left Wukong paper at NE ~1.0 on an H200)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-steps", type=int, default=50, help="held-out batches")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--table-rows", type=int, default=100_000,
                   help="cap on embedding-table rows (the preset's tables below it)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--merge", action="store_true",
                   help="also merge sibling Linears (the Mods of the benchmark's merged rows; "
                        "a --plan must then be a merged model's plan)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default="bench/results/quality.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.preset = args.preset or ("paper" if device.type == "cuda" else "tiny")
    args.compile = not args.no_compile and device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    plan, plan_src = None, args.plan
    if args.plan:
        from loka.dispatch import Plan

        plan = Plan.load(args.plan)
    else:
        cfg = bench.BenchConfig(model=args.model, preset=args.preset, device=str(device),
                                batch_size=args.batch_size, table_rows=args.table_rows)
        model = bench.build_model(cfg, _mods(args), device)
        batch = bench._cast_batch(bench.make_batch(model, cfg, device),
                                  next(model.parameters()).dtype)
        _, plan = bench._loka_plan(model, batch, cfg, device, {})
        plan_src = "probed in this run"
        del model
    result = {"schema": "loka.quality", "version": 1, "env": bench.environment(device),
              "config": {k: v for k, v in vars(args).items()}, "plan_source": plan_src,
              "plan": plan.to_dict(), "runs": []}
    for seed in range(args.seeds):
        for arm in ARMS:
            t0 = time.perf_counter()
            run = run_arm(arm, seed, plan, args, device)
            run["wall_s"] = time.perf_counter() - t0
            result["runs"].append(run)
            result["summary"] = summarize(result["runs"])
            print(f"seed {seed} {arm:10s} NE {run['final']['ne']:.5f} AUC {run['final']['auc']:.4f} "
                  f"teacher NE {run['final']['teacher_ne']:.4f} fp8={run['fp8_sites']} "
                  f"({run['wall_s']:.0f} s)", flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
