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
        --steps 2500 --seeds 3 --table-rows 100 --lr 1e-3 --emb-lr 1e-2 --warmup 200 \\
        --schedule cosine --cache-batches --out bench/results/<date>-quality.json

Without ``--plan`` the Probe runs once (on the first seed's model) and its plan serves all
seeds. ``--plans name=path,...`` adds one arm ``loka@<name>+mods`` per named plan (ablations:
which FP8 sites cost NE), each paired with the same bf16 + Mods arm. The JSON holds every
run's final metrics, loss curve and held-out NE curve
(``ne_curve``, every ``--eval-every`` steps), the mean and spread per arm, and the paired
per-seed NE change.

``--jitter X`` adds a control arm, ``bf16+mods+jitter``: the bf16 + Mods model with each
initial weight multiplied by ``1 + X * N(0, 1)``, trained on the same batches. Its NE
change against bf16 + Mods (``jitter_ne_change_pct``) is what a rounding-size difference
alone does to a run; an FP8 arm's change is only attributable to FP8 beyond that.

``--serve-plans name=path,...`` asks the serving question: after each seed's bf16 + Mods
arm has trained, its model is served with each named plan (``loka.apply(...,
inference=True)``: FP8 weights quantized once, the plan's forward kernels) and evaluated on
the same held-out batches. The NE change against the same model served in bf16 is the
plan's own effect on a trained model (``served`` per run, ``served_ne_change_pct`` in the
summary).

Learning on this stream is limited by examples per embedding row: with large tables a run
of a few thousand steps stays near NE 1. The tables are not what FP8 changes (the plan is
over the Linears), so ``--table-rows 100`` is the setting for such a run. A cosine decay
to a tenth makes the final NE of a run stable step to step, which a comparison at the
0.02% level needs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

import loka
from loka import bench, models
from loka.assembly import capped_features
from loka.config import ModsConfig
from loka.data.metrics import Metrics
from loka.data.synthetic import SyntheticCTR
from loka.dispatch import Plan, apply
from loka.models.arch import EmbeddingArch
from loka.models.fused_embedding import FusedEmbeddingArch
from loka.timing import synchronize
from loka.train import loss_fn

BASE = "bf16+mods"
JITTER_ARM = "bf16+mods+jitter"
"""the control arm of ``--jitter``: bf16 + Mods from rounding-size perturbed weights"""
ARMS = (BASE, "loka+mods")
"""the arms of a run without named plans"""


def evaluate(model, stream: SyntheticCTR, steps: int, dtype) -> dict:
    metrics, teacher = Metrics(from_logits=True), Metrics(from_logits=True)
    with torch.no_grad():
        for i in range(steps):
            batch = stream.batch(i)
            logits = model(bench.cast_batch(batch, dtype)).float()
            metrics.update(logits, batch.labels)
            teacher.update(stream.teacher_logits(batch).float(), batch.labels)
    out = metrics.compute()
    out["teacher_ne"] = teacher.compute()["ne"]
    return out


def _mods(args) -> ModsConfig:
    return dataclasses.replace(ModsConfig.paper(), merge_siblings=bool(getattr(args, "merge", False)))


def _is_embedding(module) -> bool:
    return isinstance(module, (EmbeddingArch, FusedEmbeddingArch, torch.nn.Embedding,
                               torch.nn.EmbeddingBag))


def make_optimizer(model, args, device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA, as in the benchmark) with two groups: the embedding tables at
    ``--emb-lr`` (default ``--lr``) and every other parameter at ``--lr``. Each group keeps
    its peak rate in ``base_lr`` for :func:`lr_factor`."""
    emb = {id(p) for m in model.modules() if _is_embedding(m) for p in m.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    emb_lr = args.emb_lr if args.emb_lr is not None else args.lr
    groups = [{"params": [p for p in params if id(p) not in emb], "lr": args.lr,
               "base_lr": args.lr},
              {"params": [p for p in params if id(p) in emb], "lr": emb_lr, "base_lr": emb_lr}]
    groups = [g for g in groups if g["params"]]
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, **kw)


def lr_factor(step: int, args) -> float:
    """Multiplier of the peak learning rate at 0-based ``step``: linear warm-up over
    ``--warmup`` steps, then constant or a cosine decay to ``--min-lr-ratio`` at the end."""
    if args.warmup and step < args.warmup:
        return (step + 1) / args.warmup
    if args.schedule == "cosine":
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.min_lr_ratio + (1.0 - args.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))
    return 1.0


def _held_out_ne(step_model, model, batches, dtype) -> dict:
    """NE and AUC of the model on pre-generated held-out ``batches`` (a curve point)."""
    metrics = Metrics(from_logits=True)
    model.eval()
    with torch.no_grad():
        for batch in batches:
            metrics.update(step_model(bench.cast_batch(batch, dtype)).float(), batch.labels)
    model.train()
    out = metrics.compute()
    return {"ne": out["ne"], "auc": out["auc"]}


def _spec_holder(args):
    """What :func:`train_batches` reads of a model (``feature_spec``, ``default_batch_size``),
    without building one: the preset's features with tables capped as ``bench.build_model``
    caps them."""
    base = models.presets(args.model)[args.preset]
    return SimpleNamespace(feature_spec=capped_features(base.features, args.table_rows),
                           default_batch_size=base.batch_size)


def train_batches(model, args, seed: int, device):
    """The training stream of ``seed``, or (``--cache-batches``) all its batches generated
    up front: then the arms of a seed share them and the step loop never waits on the
    generator's host sync."""
    bs = args.batch_size or model.default_batch_size
    train = SyntheticCTR(model.feature_spec, bs, seed=seed, device=device)
    if not args.cache_batches:
        return train, None
    return train, [train.batch(i) for i in range(args.steps)]


def serve(model, plan, held_out: SyntheticCTR, args, dtype) -> dict:
    """Held-out metrics of a trained ``model`` served with ``plan`` (a copy of it, applied
    with ``inference=True``; compiled as the training arms are), on the batches the
    training arms are evaluated on."""
    served = copy.deepcopy(model).eval()
    apply(served, plan, inference=True)
    run = torch.compile(served) if args.compile else served
    with torch.inference_mode():
        out = evaluate(run, held_out, args.eval_steps, dtype)
    out["fp8_sites"] = bench.count_fp8(served)
    del served, run
    return out


def jitter_(model, scale: float, seed: int) -> None:
    """Multiplies every floating parameter of ``model`` by ``1 + scale * N(0, 1)`` in place
    (noise drawn on the CPU from ``seed``, so every device perturbs alike). With ``scale``
    = 2^-9 about half the weights of a bf16 model move by one rounding step: a change of
    the size FP8 arms are suspected of, without FP8."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"--jitter must be a positive finite scale, got {scale}")
    gen = torch.Generator().manual_seed(1_000_003 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                p.mul_((1.0 + scale * noise).to(p.device, p.dtype))


def run_arm(arm: str, seed: int, plan, args, device, cached=None, serve_plans=None) -> dict:
    """One training run of ``arm`` (``plan``: the plan its LoKA arm applies;
    ``serve_plans``: {name: plan} the trained bf16 + Mods model is also served with)."""
    cfg = bench.BenchConfig(model=args.model, preset=args.preset, device=str(device),
                            batch_size=args.batch_size, seed=seed, table_rows=args.table_rows)
    model = bench.build_model(cfg, _mods(args), device)
    dtype = next(model.parameters()).dtype
    if cached is None:
        train, batches = train_batches(model, args, seed, device)
    else:
        train, batches = cached
    held_out = train.held_out(seed=10_000_019)
    curve_every = args.eval_every if args.eval_every >= 0 else max(1, args.steps // 10)
    curve_set = [held_out.batch(i) for i in range(args.curve_eval_steps)] if curve_every else []
    if arm == JITTER_ARM:
        jitter_(model, args.jitter, seed)
    if arm.startswith("loka"):
        apply(model, plan)
    step_model = torch.compile(model) if args.compile else model
    opt = make_optimizer(model, args, device)
    losses, curve = [], []
    t0 = time.perf_counter()
    eval_s = 0.0
    for i in range(args.steps):
        factor = lr_factor(i, args)
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        opt.zero_grad(set_to_none=True)
        batch = batches[i] if batches is not None else train.batch(i)
        loss = loss_fn(step_model, bench.cast_batch(batch, dtype))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if i + 1 == min(10, args.steps):  # compilation is behind: time the steady steps
            synchronize(device)
            t_steady, eval_at_steady = time.perf_counter(), eval_s
        if curve_every and (i + 1) % curve_every == 0 and i + 1 < args.steps:
            te = time.perf_counter()
            point = _held_out_ne(step_model, model, curve_set, dtype)
            curve.append({"step": i + 1, "lr_factor": factor, **point})
            eval_s += time.perf_counter() - te
            print(f"  seed {seed} {arm} step {i + 1}: held-out NE {point['ne']:.5f} "
                  f"AUC {point['auc']:.4f}", flush=True)
    losses = torch.stack(losses).tolist()
    t_end = time.perf_counter()
    train_s = t_end - t0 - eval_s
    steady_ms = (1e3 * (t_end - t_steady - (eval_s - eval_at_steady)) / (args.steps - 10)
                 if args.steps > 10 else 1e3 * train_s / max(1, args.steps))
    model.eval()
    final = evaluate(step_model, held_out, args.eval_steps, dtype)
    if curve_every:
        point = _held_out_ne(step_model, model, curve_set, dtype)
        curve.append({"step": args.steps, "lr_factor": lr_factor(args.steps - 1, args), **point})
    served = {}
    if arm == BASE:
        for name, serve_plan in (serve_plans or {}).items():
            served[name] = serve(model, serve_plan, held_out, args, dtype)
    every = max(1, args.steps // 100)
    extra = {"served": served} if served else {}
    return {"arm": arm, "seed": seed, "final": final, **extra, "train_s": train_s,
            "ms_per_step": 1e3 * train_s / max(1, args.steps), "steady_ms_per_step": steady_ms,
            "curve_eval_s": eval_s,
            "fp8_sites": bench.count_fp8(model), "finite": all(math.isfinite(x) for x in losses),
            "loss_curve": [[i + 1, losses[i]] for i in range(0, len(losses), every)],
            "ne_curve": curve}


def _per_seed(changes) -> dict:
    """Per-seed NE changes (%) with their mean and spread."""
    return {"per_seed": changes, "mean": statistics.fmean(changes),
            "std": statistics.stdev(changes) if len(changes) > 1 else 0.0}


def summarize(runs, arms=ARMS) -> dict:
    """Mean and spread of NE per arm, and each LoKA arm's per-seed NE change against the
    bf16 + Mods arm of the same seed (``paired_ne_change_pct`` for the first LoKA arm,
    ``paired_by_arm`` for all)."""
    out = {}
    for arm in arms:
        nes = [r["final"]["ne"] for r in runs if r["arm"] == arm]
        aucs = [r["final"]["auc"] for r in runs if r["arm"] == arm]
        if nes:
            out[arm] = {"ne_mean": statistics.fmean(nes),
                        "ne_std": statistics.stdev(nes) if len(nes) > 1 else 0.0,
                        "auc_mean": statistics.fmean(aucs), "seeds": len(nes)}
    by = {(r["arm"], r["seed"]): r["final"]["ne"] for r in runs}
    for arm in arms:
        if arm == BASE:
            continue
        paired = [100.0 * (by[(arm, s)] / by[(BASE, s)] - 1.0)
                  for a, s in by if a == BASE and (arm, s) in by]
        if not paired:
            continue
        stats = _per_seed(paired)
        out.setdefault("paired_by_arm", {})[arm] = stats
        if arm == JITTER_ARM:  # the yardstick: what a rounding-size change alone does
            out["jitter_ne_change_pct"] = stats
        else:
            out.setdefault("paired_ne_change_pct", stats)
    served = {}
    for r in runs:
        for name, m in r.get("served", {}).items():
            served.setdefault(name, []).append(100.0 * (m["ne"] / r["final"]["ne"] - 1.0))
    for name, changes in served.items():
        out.setdefault("served_ne_change_pct", {})[name] = _per_seed(changes)
    if "paired_ne_change_pct" in out or served:
        base = out.get(BASE, {})
        if base.get("ne_mean"):
            out["seed_noise_pct"] = 100.0 * base["ne_std"] / base["ne_mean"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default=None, help="default: paper on CUDA, tiny on the CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plan", default=None, help="plan JSON (default: probe once)")
    p.add_argument("--plans", default="",
                   help="named plans, name=path[,name=path]: one arm loka@<name>+mods each "
                        "(with them, no Probe runs and loka+mods only with --plan)")
    p.add_argument("--serve-plans", default="",
                   help="name=path[,name=path]: serve each seed's trained bf16 + Mods model "
                        "with these plans (inference=True) and report the NE change")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="also train the control arm bf16+mods+jitter: the bf16 + Mods model "
                        "with each weight times (1 + X*N(0,1)) (2^-9 ~ 0.00195: one bf16 "
                        "rounding step for about half the weights), the NE change a "
                        "rounding-size difference alone makes (default: off)")
    p.add_argument("--steps", type=int, default=3000,
                   help="training steps per run (250 left Wukong paper at NE ~1.0 on an H200)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds --first-seed .. --first-seed + --seeds - 1 (a later run adds "
                        "seeds to an earlier one's; pool the runs' 'runs' lists)")
    p.add_argument("--eval-steps", type=int, default=50, help="held-out batches")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--table-rows", type=int, default=100_000,
                   help="cap on embedding-table rows (the preset's tables below it)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--emb-lr", type=float, default=None,
                   help="peak learning rate of the embedding tables (default: --lr)")
    p.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW weight decay (0.01: torch's default, what earlier runs used)")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="after warm-up: constant, or cosine decay to --min-lr-ratio at the end "
                        "(a decayed end cuts the final weights' step-to-step NE jitter)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="final learning rate / peak under --schedule cosine")
    p.add_argument("--eval-every", type=int, default=-1,
                   help="held-out NE every this many steps (the learning curve, 'ne_curve'); "
                        "-1: steps // 10; 0: off")
    p.add_argument("--curve-eval-steps", type=int, default=8,
                   help="held-out batches per curve point (the final evaluation uses --eval-steps)")
    p.add_argument("--cache-batches", action="store_true",
                   help="generate each seed's training batches once, up front, on the device, "
                        "and feed both arms from them (~9 MB per Wukong paper batch of 4096: "
                        "steps x 9 MB of device memory); the step loop then never waits on the "
                        "generator")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="start no further seed when the elapsed time plus the last seed's "
                        "time would pass this (0: no limit); a stage timeout then never cuts "
                        "a pair of arms in half")
    p.add_argument("--merge", action="store_true",
                   help="also merge sibling Linears (the Mods of the benchmark's merged rows; "
                        "a --plan must then be a merged model's plan)")
    p.add_argument("--assume-fast", action="store_true",
                   help="plan FP8 wherever the Probe's error bound fits the budget, without "
                        "a decisive timing (on the CPU: torch._scaled_mm or emulated FP8; a quality "
                        "check, not a speed one)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default="bench/results/quality.json")
    args = p.parse_args(argv)
    start = time.perf_counter()  # --budget-s counts from here (the probe included)
    device = torch.device(args.device)
    args.preset = args.preset or ("paper" if device.type == "cuda" else "tiny")
    if not (math.isfinite(args.jitter) and args.jitter >= 0):
        p.error(f"--jitter must be a finite scale >= 0, got {args.jitter}")
    args.compile = not args.no_compile and device.type == "cuda"
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    named = bench.named_plans(args.plans)
    plan, plan_src = None, args.plan
    if args.plan or named or args.serve_plans:  # serving alone: no Probe, no LoKA arm
        plan = Plan.load(args.plan) if args.plan else None
    else:
        cfg = bench.BenchConfig(model=args.model, preset=args.preset, device=str(device),
                                batch_size=args.batch_size, table_rows=args.table_rows)
        model = bench.build_model(cfg, _mods(args), device)
        batch = bench.cast_batch(bench.make_batch(model, cfg, device),
                                 next(model.parameters()).dtype)
        report, plan = bench.probe_and_plan(model, batch, cfg, device, {})
        plan_src = "probed in this run"
        if args.assume_fast:  # CPU timings decide nothing: FP8 where the error fits
            plan = loka.plan(report, max_error=cfg.max_error, min_speedup=cfg.min_speedup,
                             assume_fast=True)
            plan_src += " (assume_fast: the lowest-error kernel within the budget)"
        del model
    plans = {"loka+mods": plan} if plan is not None else {}
    for name, path in named.items():
        plans[f"loka@{name}+mods"] = Plan.load(path)
    serve_plans = {name: Plan.load(path)
                   for name, path in bench.named_plans(args.serve_plans).items()}
    arms = (BASE,) + ((JITTER_ARM,) if args.jitter else ()) + tuple(plans)
    result = {"schema": "loka.quality", "version": 1, "env": bench.environment(device),
              "config": {k: v for k, v in vars(args).items()}, "plan_source": plan_src,
              "plan": plan.to_dict() if plan is not None else None, "arms": list(arms),
              "plans": {arm: p.to_dict() for arm, p in plans.items()},
              "serve_plans": {name: p.to_dict() for name, p in serve_plans.items()},
              "runs": []}
    next_seed_s = 0.0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        elapsed = time.perf_counter() - start
        if args.budget_s and seed > args.first_seed and elapsed + next_seed_s > args.budget_s:
            result["stopped"] = (f"--budget-s {args.budget_s:.0f}: seed {seed} not started "
                                 f"after {elapsed:.0f} s (a seed needs ~{next_seed_s:.0f} s)")
            print(result["stopped"], flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            break
        t_seed = time.perf_counter()
        cached = None
        if args.cache_batches:
            cached = train_batches(_spec_holder(args), args, seed, device)
        gen_s = time.perf_counter() - t_seed
        for arm in arms:
            t0 = time.perf_counter()
            run = run_arm(arm, seed, plans.get(arm), args, device, cached, serve_plans)
            run["wall_s"] = time.perf_counter() - t0
            result["runs"].append(run)
            result["summary"] = summarize(result["runs"], arms)
            print(f"seed {seed} {arm:10s} NE {run['final']['ne']:.5f} AUC {run['final']['auc']:.4f} "
                  f"teacher NE {run['final']['teacher_ne']:.4f} fp8={run['fp8_sites']} "
                  f"({run['wall_s']:.0f} s)", flush=True)
            for name, m in run.get("served", {}).items():
                print(f"seed {seed} {arm} served with {name}: NE {m['ne']:.5f} "
                      f"fp8={m['fp8_sites']}", flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del cached
        # the next seed without this one's compilation: batch generation, the arms' steady
        # steps, and their evaluations (with a margin)
        mine = [r for r in result["runs"] if r["seed"] == seed]
        next_seed_s = gen_s + sum(1.1 * r["steady_ms_per_step"] * args.steps / 1e3 + 5.0
                                  for r in mine)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
