#!/usr/bin/env python3
"""Where does a plan's NE go? And does the NE budget's cost rank site-roles the way the
paired check does?

``--mode sources`` (item 3 of the NE work): on the synthetic stream, a reference model
(``loka.assembly.build_reference``) trains in a baseline arm and in one arm per uniform
FP8 configuration, every arm paired with the same baseline (``loka.quality.PairedArms``:
same weights, batches, RNG, evaluation examples). The arms split the NE by its sources:
forward only, input gradient (dgrad) only, weight gradient (wgrad) only; e4m3 against e5m2
for the gradients; rowwise against tensorwise against blockwise scaling; dynamic against
delayed tensorwise scales (``Plan.delayed_scaling``); every Linear
against all but the last Linear (and all but the last block). Each arm gives the paired
relative NE change (mean over seeds, its interval over examples and over seeds) and its
second-order NE cost (``loka.quality.second_order_cost``), the lower-noise view. Fast
accumulation is a cuBLAS/Triton flag of CUDA tensor cores: with ``--device cuda`` the
script adds the ``*-fastacc`` arms, on the CPU it records them as not measurable.

``--mode budget``: the calibration of the NE budget's cost. Per FP8 site-role of a plan
made by the Probe and ``loka.plan`` (``--assume-fast``, emulated rowwise E4M3 on the
CPU), the cost measured alone (``loka.quality.site_role_costs``); then per group of
site-roles (each site, each role kind) the paired check, and the Spearman rank
correlation between the groups' summed costs and, from the paired check's own arms, their
second-order cost and their paired change; then ``loka.quality.ne_budget`` on the plan at
``--max-ne-change`` (``--interval``: the interval whose upper end is held to it).

``--mode plan``: the default plan (the Probe with ``--plan-kernel`` and ``loka.plan``: on a
GPU the kernel is timed, so its roofline bound and speed decide as in any timed report;
on the CPU, or with ``--untimed-plan``, ``assume_fast=True`` puts every role it fits on it;
or ``--plan-in``), its site-roles' costs, the NE budget's paired
checks and, on a GPU with ``--speed-steps``, the compiled step speed of the baseline, the
plan and the plan within the budget; every cost and check is kept as it is made and
``--resume`` continues a run cut short. ``--start-steps S``: every arm starts from the
baseline trained S steps (a checkpoint), not from scratch.

``--mode horizon``: the paired check's intervals from scratch (``--steps``) against from a
checkpoint (``--start-steps``, default 300) for each of ``--horizons`` steps: from scratch
the arms' trajectories drift apart and the interval over seeds widens with them.

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/ne_sources.py --mode sources \\
        --out bench/results/ne_sources_cpu.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/ne_sources.py --mode budget \\
        --models wukong:tiny --steps 300 --eval-batches 128 \\
        --out bench/results/ne_budget_cpu.json
    # on a GPU (the fast-accumulation arms run there; paper scale); --arm (repeatable)
    # runs only the arms named, e.g. the tensorwise ones with and without delayed scales:
    PYTHONPATH=. python bench/ne_sources.py --mode sources --device cuda \\
        --models wukong:paper --batch-size 4096 --steps 2000 --out ne_sources_h200.json
    PYTHONPATH=. python bench/ne_sources.py --mode budget --device cuda \\
        --models wukong:paper --batch-size 4096 --steps 2000 --plan-kernel cublas-rowwise \\
        --out ne_budget_h200.json
    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/ne_sources.py --mode horizon \\
        --models wukong:small --steps 300 --start-steps 300 --horizons 30,100 \\
        --out bench/results/ne_horizon_cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from typing import Optional

import numpy as np
import torch

from loka.assembly import build_reference
from loka.config import BASELINE, ROLES, LinearConfig, ProbeConfig, Role
from loka.data import SyntheticCTR
from loka.dispatch import Plan, plan as make_plan
from loka.jsonio import atomic_write_text, json_safe
from loka.numerics.delayed import DEFAULT_DECAY
from loka.probe import probe
from loka.quality import (BaselineNotLearnedError, PairedArms, QualityResult, SiteRoleCost,
                          deterministic, fp8_site_roles, ne_budget, site_role_costs, without)
from loka.train import loss_fn, train
from loka.train.checkpoint import CHECKPOINT_NAME, read_checkpoint
from loka.train.loop import plan_digest

RW, RW5 = "emulated-rowwise-e4m3", "emulated-rowwise-e5m2"
TW, TW5 = "emulated-tensorwise-e4m3", "emulated-tensorwise-e5m2"
BW = "emulated-blockwise-e4m3"
B = BASELINE

ARMS = {  # name -> (fwd, dgrad, wgrad) on every Linear that fits
    "rowwise e4m3, every role": (RW, RW, RW),
    "rowwise e4m3, fwd only": (RW, B, B),
    "rowwise e4m3, dgrad only": (B, RW, B),
    "rowwise e4m3, wgrad only": (B, B, RW),
    "rowwise, e5m2 gradients": (RW, RW5, RW5),
    "tensorwise e4m3, every role": (TW, TW, TW),
    "tensorwise, e5m2 gradients": (TW, TW5, TW5),
    "blockwise e4m3, every role": (BW, BW, BW),
    "tensorwise e4m3, every role, delayed": (TW, TW, TW),
    "tensorwise, e5m2 gradients, delayed": (TW, TW5, TW5),
}
EXCEPT = {  # name -> which Linears stay on the baseline, with rowwise e4m3 elsewhere
    "rowwise e4m3, all but the last Linear": "last",
    "rowwise e4m3, all but the last block": "block",
}
GPU_ARMS = {
    "cublas rowwise, every role": ("cublas-rowwise",) * 3,
    "cublas rowwise fastacc, every role": ("cublas-rowwise-fastacc",) * 3,
    "cublas rowwise fastacc fwd, exact accumulation gradients":
        ("cublas-rowwise-fastacc", "cublas-rowwise", "cublas-rowwise"),
    "cublas tensorwise fastacc, every role": ("cublas-tensorwise-fastacc",) * 3,
    "cublas tensorwise fastacc, every role, delayed": ("cublas-tensorwise-fastacc",) * 3,
}


def linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def summarize(result, cost) -> dict:
    """The paired check's figures and the second-order cost of one arm."""
    seeds_iv = result.rel_ne_seeds
    return {"rel_ne_change": result.rel_ne_change,
            "rel_ne_examples": list(result.rel_ne_examples),
            "rel_ne_seeds": None if seeds_iv is None else list(seeds_iv),
            "per_seed": [s.rel_ne_change for s in result.seeds],
            "auc_change": result.auc_change, "second_order_cost": cost,
            "fallbacks": sum(s.fallbacks for s in result.seeds)}


def terms(name, preset, args, device):
    """The paired check's terms: ``(build, train_data, eval_data)``. With ``--cache-batches``
    every seed's training batches and the held-out batches are made once, on ``device``,
    and replayed (the same batches the stream gives; generating a paper-scale batch on the
    host costs about as much as a GPU step)."""
    def build(seed):
        return build_reference(name, preset, None, device, seed=seed, table_rows=args.table_rows)

    spec = build(0).feature_spec
    held = SyntheticCTR(spec, args.eval_batch, seed=10_000)
    if not getattr(args, "cache_batches", False):
        def train_data(seed):
            return SyntheticCTR(spec, args.batch_size, seed=seed)

        def eval_data():
            return (held.batch(i) for i in range(args.eval_batches))
        return build, train_data, eval_data
    cache = {}

    def train_data(seed):
        if seed not in cache:
            stream = SyntheticCTR(spec, args.batch_size, seed=seed)
            n = max(args.steps, getattr(args, "cost_steps", 0),  # every arm's steps
                    *(getattr(args, "horizons", ()) if getattr(args, "mode", "") == "horizon"
                      else ()))
            cache[seed] = [stream.batch(i).to(device) for i in range(n)]
        return iter(cache[seed])

    held_batches = [held.batch(i).to(device) for i in range(args.eval_batches)]

    def eval_data():
        return iter(held_batches)
    return build, train_data, eval_data


START_SEED = 99
"""the stream the checkpoint start trains on (no arm trains on it)"""


def start_state(build, args, device, steps: int) -> dict:
    """The baseline model of seed 0 trained ``steps`` steps on a stream of its own
    (:data:`START_SEED`, with ``--warmup-steps``): the checkpoint every arm starts from with
    ``--start-steps``, as ``{"model": weights, "optimizers": optimizer states}``. The arms
    continue its Adam moments: restarting them on a trained wide model throws it off in a
    few steps (a fresh AdamW's first updates are ``lr`` on every weight). From a trained
    model a short horizon measures what FP8 does to it before the arms' trajectories drift
    apart, which is what widens the interval over seeds from scratch."""
    with deterministic(), tempfile.TemporaryDirectory() as run:
        torch.manual_seed(0)
        model = build(0)
        stream = SyntheticCTR(model.feature_spec, args.batch_size, seed=START_SEED)
        train(model, (stream.batch(i).to(device) for i in range(steps)), steps, lr=args.lr,
              device=device, progress=False, warmup_steps=args.warmup_steps,
              checkpoint_dir=run)
        saved = read_checkpoint(os.path.join(run, CHECKPOINT_NAME), map_location=device)
    return {"model": saved["model"], "optimizers": saved["optimizers"]}


def arm_terms(args, device, state: Optional[dict] = None) -> dict:
    """The arms' training terms: from scratch with ``--warmup-steps``, or continuing the
    start ``state`` (:func:`start_state`: its weights and its optimizer states)."""
    if state is None:
        return {"lr": args.lr, "device": device, "warmup_steps": args.warmup_steps}
    return {"lr": args.lr, "device": device, "initial_state": state["model"],
            "initial_optimizer_state": state["optimizers"]}


def state_digest(state: dict) -> str:
    """``"sha256:<hex>"`` of a start state's weights and optimizer states (names, dtypes,
    shapes and values): a resumed run must start its arms from the very state the run it
    continues started from."""
    h = hashlib.sha256()
    flat = dict(state["model"])
    for i, opt in enumerate(state["optimizers"]):
        for pid, values in opt["state"].items():
            for k, v in values.items():
                flat[f"optimizer{i}.{pid}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    for k in sorted(flat):
        t = flat[k].detach().cpu().contiguous()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def stop(error: BaselineNotLearnedError, out=None, write=None):
    """Exit on a baseline that did not learn, after recording ``error`` in ``out`` (and
    writing it) where the mode keeps a row as it goes."""
    if out is not None:
        out["error"] = str(error)
        write()
    sys.exit(f"stopped: {error}")


def require_learned(arms, args, out=None, write=None) -> None:
    """:func:`stop` unless every seed's baseline arm of ``arms`` reaches an NE below
    ``--max-baseline-ne`` (0: no check): against a diverged baseline no NE change means
    anything. With ``out``, the baselines' NE is recorded (and written) either way."""
    if out is not None:
        out.setdefault("baseline_ne", {}).update(
            {f"{arms.steps} steps, seed {s}": arms.baseline_ne(s) for s in arms.seeds})
    if args.max_baseline_ne > 0:
        try:
            arms.require_learned(args.max_baseline_ne)
        except BaselineNotLearnedError as e:
            stop(e, out, write)
    if write is not None:
        write()


def horizon(name, preset, args, device) -> dict:
    """``--mode horizon``: how the paired check's intervals depend on where the arms start.
    One plan (every Linear on rowwise e4m3, emulated on the CPU, ``--plan-kernel`` on a
    GPU), checked from scratch for ``--steps`` steps, then from a baseline trained
    ``--start-steps`` steps for each of ``--horizons`` steps."""
    build, train_data, eval_data = terms(name, preset, args, device)
    kernel = RW if device.type == "cpu" else args.plan_kernel
    plan = Plan.uniform(build(0), LinearConfig(kernel, kernel, kernel), device=device)
    if not fp8_site_roles(plan):
        sys.exit(f"--mode horizon: no Linear of {name} ({preset}) takes {kernel} on {device}")
    out = {"kernel": kernel, "fp8_site_roles": len(fp8_site_roles(plan)),
           "site_roles_total": 3 * len(plan.sites), "rows": {}}
    t0 = time.time()
    result = PairedArms(build, train_data, eval_data, steps=args.steps, seeds=args.seeds,
                        **arm_terms(args, device)).check(plan)
    out["rows"][f"from scratch, {args.steps} steps"] = dict(summarize(result, None),
                                                           seconds=round(time.time() - t0, 1))
    state = start_state(build, args, device, args.start_steps)
    out["start"] = {"steps": args.start_steps, "seed": START_SEED, "digest": state_digest(state)}
    for h in args.horizons:
        t0 = time.time()
        result = PairedArms(build, train_data, eval_data, steps=h, seeds=args.seeds,
                            **arm_terms(args, device, state)).check(plan)
        out["rows"][f"from {args.start_steps} steps, {h} more"] = dict(
            summarize(result, None), seconds=round(time.time() - t0, 1))
    for row, v in out["rows"].items():
        lo, hi = v["rel_ne_seeds"] or (math.nan, math.nan)
        print(f"  {row:32s} {v['rel_ne_change']:+.4%} over seeds [{lo:+.4%}, {hi:+.4%}]",
              flush=True)
    return out


def source_plans(model, device, only=()) -> tuple:
    """``({arm: plan}, {what could not be measured: why})`` of the sources study."""
    names = linears(model)
    last = names[-1]
    block = last.rsplit(".", 1)[0] + "." if "." in last else last
    todo, missing = dict(ARMS), {}
    if device.type == "cuda":
        todo.update(GPU_ARMS)
    else:
        missing["fast accumulation"] = (
            "cuBLAS/Triton fast accumulation exists on CUDA tensor cores only; run with "
            "--device cuda for the *-fastacc arms")
    plans = {arm: Plan.uniform(model, LinearConfig(*cfg), device=device)
             for arm, cfg in todo.items()}
    for arm, p in plans.items():
        if arm.endswith(", delayed"):
            p.delayed_scaling = DEFAULT_DECAY
    for arm, which in EXCEPT.items():
        keep = (lambda s: s != last) if which == "last" else (lambda s: not s.startswith(block))
        p = Plan.uniform(model, LinearConfig(RW, RW, RW), device=device)
        plans[arm] = without(p, [(s, r) for s, r in fp8_site_roles(p) if not keep(s)],
                             f"{arm}: on the baseline")
    for arm in list(plans):
        if only and arm not in only:
            del plans[arm]
        elif not fp8_site_roles(plans[arm]):
            missing[arm] = "no Linear of this model fits the kernel's alignment"
            del plans[arm]
    return plans, missing


def low_noise(name, preset, args, device, out) -> None:
    """Add to each arm of ``out`` the views with less training noise: the second-order cost
    after ``--cost-steps`` steps (the NE budget's cost), and the serving change: each seed's
    trained baseline served with the arm's forward kernels (``steps=0`` from its weights)."""
    build, train_data, eval_data = terms(name, preset, args, device)
    plans, _ = source_plans(build(0), device, args.arms)
    short = PairedArms(build, train_data, eval_data, steps=args.cost_steps, seeds=args.seeds,
                       **arm_terms(args, device))
    full = PairedArms(build, train_data, eval_data, steps=args.steps, seeds=args.seeds,
                      **arm_terms(args, device), keep_states=True)
    served = {seed: None for seed in args.seeds}
    for seed in args.seeds:
        full.scored(None, seed)
        served[seed] = PairedArms(build, train_data, eval_data, steps=0, seeds=(seed,),
                                  lr=args.lr, device=device,
                                  initial_state=full.baseline_states[seed])
    for arm, p in plans.items():
        row = out["arms"].setdefault(arm, {})
        row["short_cost"], row["short_change"] = short.cost(p)
        if any(r is Role.FWD for _, r in fp8_site_roles(p)):
            per_seed = [served[s].check(p).seeds[0] for s in args.seeds]
            result = QualityResult(seeds=per_seed, steps=0, confidence=0.95, control=False)
            row["served"] = summarize(result, math.fsum(served[s].cost(p)[0] for s in
                                                        args.seeds) / len(args.seeds))
        lo, hi = row.get("served", {}).get("rel_ne_examples", (math.nan, math.nan))
        print(f"  {arm:45s} short cost {row['short_cost']:.2e}  served "
              f"{row.get('served', {}).get('rel_ne_change', math.nan):+.4%} "
              f"[{lo:+.4%}, {hi:+.4%}]", flush=True)


def sources(name, preset, args, device) -> dict:
    build, train_data, eval_data = terms(name, preset, args, device)
    model = build(0)
    arms = PairedArms(build, train_data, eval_data, steps=args.steps, seeds=args.seeds,
                      **arm_terms(args, device))
    names = linears(model)
    plans, missing = source_plans(model, device, args.arms)
    out = {"linears": names, "arms": {}, "not_measured": missing,
           "site_roles_total": 3 * len(names)}
    for arm, p in plans.items():
        t0 = time.time()
        result = arms.check(p)
        cost, _ = arms.cost(p)
        row = summarize(result, cost)
        row["fp8_site_roles"] = len(fp8_site_roles(p))
        row["fp8_sites"] = len(p.fp8_sites())
        row["seconds"] = round(time.time() - t0, 1)
        out["arms"][arm] = row
        lo, hi = row["rel_ne_examples"]
        print(f"  {arm:45s} {row['fp8_site_roles']:3d} roles  {row['rel_ne_change']:+.4%} "
              f"[{lo:+.4%}, {hi:+.4%}]  cost {cost:.2e}  ({row['seconds']} s)", flush=True)
    return out


def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        v = np.asarray(v, np.float64)
        order = np.argsort(v, kind="mergesort")
        r = np.empty(v.size)
        r[order] = np.arange(1, v.size + 1)
        for val in np.unique(v):
            r[v == val] = r[v == val].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


def budget(name, preset, args, device) -> dict:
    build, train_data, eval_data = terms(name, preset, args, device)
    model = build(0)
    stream = train_data(0)
    batches = [stream.batch(i) for i in range(8)]
    report = probe(model, batches, loss_fn,
                   config=ProbeConfig(every_n_steps=1, num_samples=16, timing=False,
                                      kernels=("bf16", args.plan_kernel)))
    plan = make_plan(report, max_error=args.max_error, assume_fast=True)
    pairs = fp8_site_roles(plan)
    print(f"  plan: {len(plan.fp8_sites())} FP8 sites, {len(pairs)} FP8 site-roles", flush=True)
    cost_arms = PairedArms(build, train_data, eval_data, steps=args.cost_steps,
                           seeds=args.cost_seeds, **arm_terms(args, device))
    t0 = time.time()
    costs = site_role_costs(plan, cost_arms)
    cost_s = time.time() - t0
    known = {(c.site, c.role): c.cost for c in costs}
    for c in costs:
        print(f"    {c.site:28s} {c.role:5s} cost {c.cost:.3e}  change {c.rel_ne_change:+.4%}",
              flush=True)
    # groups: each FP8 site (its FP8 roles), each role kind (every site)
    groups = {}
    for site in plan.fp8_sites():
        groups[f"site {site}"] = [(s, r) for s, r in pairs if s == site]
    for role in ROLES:
        groups[f"role {role.value}"] = [(s, r) for s, r in pairs if r is role]
    arms = PairedArms(build, train_data, eval_data, steps=args.steps, seeds=args.seeds,
                      **arm_terms(args, device))
    require_learned(arms, args)  # before any group's plan arms
    rows = {}
    for g, members in groups.items():
        if not members:
            continue
        keep = set(members)
        p = without(plan, [x for x in pairs if x not in keep], f"{g} only")
        result = arms.check(p)
        cost, _ = arms.cost(p)
        row = summarize(result, cost)
        row["proxy"] = math.fsum(known[(s, r.value)] for s, r in members)
        row["site_roles"] = [f"{s}:{r.value}" for s, r in members]
        rows[g] = row
        print(f"  {g:34s} proxy {row['proxy']:.2e}  cost {cost:.2e}  change "
              f"{row['rel_ne_change']:+.4%}", flush=True)
    names = list(rows)
    proxy = [rows[g]["proxy"] for g in names]
    calib = {"groups": len(names),
             "spearman_proxy_vs_cost": spearman(proxy, [rows[g]["second_order_cost"]
                                                        for g in names]),
             "spearman_proxy_vs_change": spearman(proxy, [rows[g]["rel_ne_change"]
                                                          for g in names]),
             "spearman_proxy_vs_abs_change": spearman(proxy, [abs(rows[g]["rel_ne_change"])
                                                              for g in names])}
    print(f"  calibration: {calib}", flush=True)
    t0 = time.time()
    try:
        result = ne_budget(plan, build, train_data, eval_data,
                           max_ne_change=args.max_ne_change, steps=args.steps,
                           seeds=args.seeds, **arm_terms(args, device), costs=costs,
                           interval=args.interval, max_baseline_ne=args.max_baseline_ne or None,
                           progress=lambda line: print(f"    {line}", flush=True))
    except BaselineNotLearnedError as e:
        stop(e)
    budget_s = time.time() - t0
    kept = len(fp8_site_roles(result.plan))
    print(f"  NE budget {args.max_ne_change:.4%}: kept {kept} of {len(pairs)}; change "
          f"{result.rel_ne_change:+.4%}, upper {result.upper:+.4%}", flush=True)
    return {"plan_fp8_sites": len(plan.fp8_sites()), "plan_fp8_site_roles": len(pairs),
            "costs": [c.__dict__ for c in costs], "cost_seconds": round(cost_s, 1),
            "groups": rows, "calibration": calib,
            "budget": {"max_ne_change": args.max_ne_change, "interval": args.interval,
                       "kept_site_roles": kept, "moved_back": result.moved_back,
                       "checks": result.checks, "rel_ne_change": result.rel_ne_change,
                       "upper": result.upper, "seconds": round(budget_s, 1),
                       "quality": None if result.quality is None
                       else summarize(result.quality, None)}}


RESUME_TERMS = ("device", "steps", "seeds", "lr", "batch_size", "eval_batch", "eval_batches",
                "table_rows", "cost_steps", "cost_seeds", "max_ne_change", "interval",
                "cache_batches", "start_steps", "warmup_steps")
"""the configuration a resumed ``--mode plan`` run must share with the run it resumes"""


def _site_roles(plan) -> list:
    return [f"{s}:{r.value}:{plan.sites[s].kernel(r)}" for s, r in fp8_site_roles(plan)]


def read_resume(args) -> Optional[dict]:
    """The ``--resume`` document, read once before anything is written (``--out`` may be
    the same file), checked against this run's terms and torch; None without it. A
    mismatch exits with one line."""
    if not args.resume:
        return None
    try:
        with open(args.resume) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"--resume {args.resume}: cannot read it ({e})")
    if doc.get("config", {}).get("mode") != "plan":
        sys.exit(f"--resume {args.resume}: not a --mode plan run")
    old = doc["config"]
    differ = [k for k in RESUME_TERMS if json.dumps(old.get(k)) != json.dumps(
        list(getattr(args, k)) if isinstance(getattr(args, k), tuple) else getattr(args, k))]
    if differ:
        sys.exit(f"--resume {args.resume}: its run had other terms ({', '.join(differ)})")
    if doc.get("env", {}).get("torch") != torch.__version__:
        sys.exit(f"--resume {args.resume}: made with torch {doc.get('env', {}).get('torch')}, "
                 f"this is {torch.__version__}")
    return doc


def _resumed(doc: Optional[dict], spec: str, plan) -> tuple:
    """``(costs, {k: QualityResult}, start digest or None)`` of ``doc``'s row for ``spec``
    (an earlier ``--mode plan`` run of the same terms and plan); ``([], {}, None)`` without
    it. A mismatch exits."""
    if doc is None:
        return [], {}, None
    row = doc.get("models", {}).get(spec)
    if row is None:
        sys.exit(f"--resume: no row for {spec}")
    if "digest" not in row.get("plan", {}):
        sys.exit(f"--resume: its {spec} row predates resumable runs (no plan digest, costs "
                 "or checks kept): run afresh")
    if row["plan"]["digest"] != plan_digest(plan):
        sys.exit(f"--resume: its {spec} plan differs from this one (give its plan with "
                 "--plan-in)")
    costs = [SiteRoleCost(**c) for c in row.get("costs", [])]
    checks = {int(k): QualityResult.from_dict(v)
              for k, v in row.get("check_results", {}).items()}
    return costs, checks, row.get("start", {}).get("digest")


def default_plan(name, preset, args, device, out, write, spec, resume=None) -> None:
    """``--mode plan``: the plan a user gets by default (the Probe on ``--plan-kernel`` and
    ``loka.plan(report)``: timed on a GPU, ``assume_fast`` on the CPU or with
    ``--untimed-plan``; or ``--plan-in``), its
    paired NE change (the budget's first check), the NE budget at ``--max-ne-change``, and,
    with ``--speed-steps`` on a GPU, the compiled training step of the baseline, the plan
    and the plan within the budget, side by side. ``out`` is filled and ``write()`` called
    after every stage and every paired check, so a run cut short keeps what it measured,
    and ``--resume`` continues it."""
    t_start = time.time()
    build, train_data, eval_data = terms(name, preset, args, device)
    t0 = time.time()
    if args.plan_in:
        plan = Plan.load(args.plan_in)
    else:
        model = build(0)
        stream = SyntheticCTR(model.feature_spec, args.batch_size, seed=0)
        batches = [stream.batch(i).to(device) for i in range(8)]
        timed = device.type == "cuda" and not args.untimed_plan
        report = probe(model, batches, loss_fn,
                       config=ProbeConfig(every_n_steps=1, num_samples=16, timing=timed,
                                          kernels=("bf16", args.plan_kernel)))
        plan = make_plan(report, max_error=args.max_error, assume_fast=not timed,
                         head_sites=args.head_sites)
        del model, report
    pairs = fp8_site_roles(plan)
    out["plan"] = {"fp8_sites": len(plan.fp8_sites()), "fp8_site_roles": len(pairs),
                   "site_roles_total": 3 * len(plan.sites),
                   "kernel": None if args.plan_in else args.plan_kernel,
                   "timed": None if args.plan_in else plan.budget.get("assume_fast") is False,
                   "head_sites": None if args.plan_in else plan.budget.get("head_sites"),
                   "max_error": None if args.plan_in else args.max_error,
                   "from": args.plan_in or "probe",
                   "probe_seconds": None if args.plan_in else round(time.time() - t0, 1),
                   "site_roles": _site_roles(plan), "digest": plan_digest(plan)}
    if args.plan_out:
        plan.save(args.plan_out)
    print(f"  plan: {len(plan.fp8_sites())} FP8 sites, {len(pairs)} FP8 site-roles", flush=True)
    if not pairs:  # e.g. a timed Probe found --plan-kernel fast nowhere: nothing to check
        out["stopped"] = "the default plan has no FP8 site-role: no NE to check"
        print(f"  {out['stopped']}", flush=True)
        write()
        return
    # what a resumed run keeps is checked, and put back into out, before anything is written
    # (--out may be the file it resumes)
    known, prior, start_then = _resumed(resume, spec, plan)
    out["resumed"] = {"from": args.resume, "costs": len(known),
                      "checks": sorted(prior)} if args.resume else None
    out["costs"] = [c.__dict__ for c in known]
    out["check_results"] = {str(k): r.to_dict() for k, r in prior.items()}
    state = None
    if args.start_steps:
        t0 = time.time()
        state = start_state(build, args, device, args.start_steps)
        out["start"] = {"steps": args.start_steps, "seed": START_SEED,
                        "digest": state_digest(state), "seconds": round(time.time() - t0, 1)}
        if start_then is not None and start_then != out["start"]["digest"]:
            sys.exit(f"--resume {args.resume}: its arms started from another start (other "
                     "weights or optimizer states: it did not train to the same values here, or "
                     "predates starts that keep optimizer states): run afresh")
    write()
    lines = out.setdefault("progress", [])

    def progress(line):
        lines.append(f"{round(time.time() - t_start)} s: {line}")
        print(f"    {line}", flush=True)
        write()

    kept = out["costs"]

    def on_cost(c):
        kept.append(c.__dict__)
        write()

    cost_arms = PairedArms(build, train_data, eval_data, steps=args.cost_steps,
                           seeds=args.cost_seeds, **arm_terms(args, device, state))
    if state is not None and len(known) < len(pairs):  # arms from a trained checkpoint
        require_learned(cost_arms, args, out, write)
    progress(f"measuring {len(pairs) - len(known)} of {len(pairs)} FP8 site-role(s) alone, "
             f"{args.cost_steps} steps each")
    costs = site_role_costs(plan, cost_arms, progress, known=known, on_cost=on_cost)
    out["costs"] = [c.__dict__ for c in costs]
    checks = out["check_results"]
    write()

    def on_check(k, result):
        checks[str(k)] = result.to_dict()
        write()

    t0 = time.time()
    try:  # the budget's arms check their baselines before any plan arm trains
        result = ne_budget(plan, build, train_data, eval_data,
                           max_ne_change=args.max_ne_change, steps=args.steps,
                           seeds=args.seeds, **arm_terms(args, device, state), costs=costs,
                           interval=args.interval, progress=progress, on_check=on_check,
                           prior_checks=prior, max_baseline_ne=args.max_baseline_ne or None)
    except BaselineNotLearnedError as e:
        stop(e, out, write)
    first = result.checks[0] if result.checks else None
    out["default_plan"] = first
    n_kept = len(fp8_site_roles(result.plan))
    out["budget"] = {"max_ne_change": args.max_ne_change, "interval": args.interval,
                     "kept_site_roles": n_kept, "kept_sites": len(result.plan.fp8_sites()),
                     "moved_back": result.moved_back, "checks": result.checks,
                     "rel_ne_change": result.rel_ne_change, "upper": result.upper,
                     "quality": None if result.quality is None
                     else summarize(result.quality, None),
                     "seconds": round(time.time() - t0, 1)}
    if args.budget_plan_out:
        result.plan.save(args.budget_plan_out)
    print(f"  NE budget {args.max_ne_change:.4%}: kept {n_kept} of {len(pairs)}; change "
          f"{result.rel_ne_change:+.4%}, upper {result.upper:+.4%}", flush=True)
    write()
    if args.speed_steps and device.type == "cuda":
        out["speed"] = {}
        for row, p in (("baseline", None), ("default plan", plan), ("within budget", result.plan)):
            out["speed"][row] = step_speed(name, preset, args, device, p)
            print(f"  speed {row}: {out['speed'][row]}", flush=True)
            write()
        base = out["speed"]["baseline"]["step_ms"]
        for row in out["speed"].values():
            row["speedup"] = base / row["step_ms"]
        write()


def compiled_step(name, preset, args, device, plan, graphs: bool = False):
    """``(step, model)``: one compiled training step (``torch.compile``, with CUDA graphs
    when ``graphs``; fused AdamW) of the reference model in bf16, with ``plan`` applied
    (None: the baseline), on one batch of ``--batch-size`` (also bench/profile_plan.py's)."""
    import loka
    from loka.bench import cast_batch
    from loka.bench.evalset import make_step

    model = build_reference(name, preset, None, device, seed=0, table_rows=args.table_rows)
    if plan is not None:
        loka.apply(model, plan)
    batch = cast_batch(SyntheticCTR(model.feature_spec, args.batch_size, seed=0).batch(0)
                       .to(device), torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead" if graphs else None)
    return make_step(compiled, model, "train", batch, graphs, device, loss_fn), model


def step_speed(name, preset, args, device, plan) -> dict:
    """Median wall time and profiled GPU time of :func:`compiled_step` (no CUDA graphs)."""
    from loka.bench.evalset import profile_gpu, time_steps

    step, model = compiled_step(name, preset, args, device, plan)
    row = time_steps(step, device, warmup=3, steps=args.speed_steps)
    row["gpu_ms"] = profile_gpu(step, 5)["gpu_ms_per_step"]
    row["fp8_sites"] = 0 if plan is None else len(plan.fp8_sites())
    del model, step
    torch.cuda.empty_cache()
    return row


def _count(text: str) -> int:
    """An argparse ``type``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("sources", "budget", "plan", "horizon"), default="sources")
    p.add_argument("--low-noise", action="store_true",
                   help="--mode sources: add to --out (an earlier sources run) each arm's "
                        "short-horizon cost and its serving change")
    p.add_argument("--models", default="wukong:small,dcnv2:small",
                   help="name:preset[,name:preset]")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-batch", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=64)
    p.add_argument("--table-rows", type=int, default=100)
    p.add_argument("--cost-steps", type=int, default=20)
    p.add_argument("--cost-seeds", default="0")
    p.add_argument("--max-error", type=float, default=0.2)
    p.add_argument("--max-ne-change", type=float, default=2e-4)
    p.add_argument("--interval", default="auto", choices=("auto", "seeds", "examples"))
    p.add_argument("--plan-kernel", default=RW,
                   help="--mode budget: the FP8 kernel the Probe measures and the plan uses "
                        "(cublas-rowwise on a GPU)")
    p.add_argument("--arm", action="append", default=[], dest="arms",
                   help="--mode sources: only this arm (repeatable; default all)")
    p.add_argument("--cache-batches", action="store_true",
                   help="make every seed's training batches and the held-out batches once, "
                        "on --device, and replay them")
    p.add_argument("--plan-out", default=None, help="--mode plan: write the default plan here")
    p.add_argument("--plan-in", default=None,
                   help="--mode plan: this plan instead of the Probe's default one")
    p.add_argument("--untimed-plan", action="store_true",
                   help="--mode plan on a GPU: do not time --plan-kernel; put every role it "
                        "fits on it (assume_fast), as the CPU does")
    p.add_argument("--head-sites", type=_count, default=None,
                   help="--mode plan: loka.plan's head_sites (default: DispatchConfig's)")
    p.add_argument("--resume", default=None,
                   help="--mode plan: an earlier run's JSON (same terms and plan): its costs "
                        "and paired checks are reused")
    p.add_argument("--budget-plan-out", default=None,
                   help="--mode plan: write the plan within the NE budget here")
    p.add_argument("--speed-steps", type=int, default=0,
                   help="--mode plan, on a GPU: time this many compiled training steps of the "
                        "baseline, the default plan and the plan within the budget")
    p.add_argument("--start-steps", type=int, default=None,
                   help="--mode plan: every arm starts from the baseline trained this many "
                        "steps on a stream of its own (0: from scratch); --mode horizon: the "
                        "checkpoint's steps (default there 300)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="linear learning-rate warm-up, in steps, of the checkpoint start "
                        "(--start-steps) and of every arm trained from scratch (arms from the "
                        "checkpoint continue its optimizer states)")
    p.add_argument("--max-baseline-ne", type=float, default=1.0,
                   help="--mode plan and budget: stop unless every baseline arm of the checks "
                        "(and, from a --start-steps checkpoint, of the costs) reaches an NE "
                        "below this (1: the base rate's; 0: no check)")
    p.add_argument("--horizons", default="30,100",
                   help="--mode horizon: steps after the checkpoint, a comma list")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        args.horizons = tuple(int(h) for h in args.horizons.split(","))
    except ValueError:
        p.error(f"--horizons: expected a comma list of integers, got {args.horizons!r}")
    if args.start_steps is None:
        args.start_steps = 300 if args.mode == "horizon" else 0
    if args.warmup_steps < 0 or not 0 <= args.max_baseline_ne < math.inf:
        p.error("--warmup-steps must be >= 0 and --max-baseline-ne a finite number >= 0")
    if args.start_steps < 0 or min(args.horizons) < 1:
        p.error("--start-steps must be >= 0 and every --horizons entry >= 1")
    if args.mode == "horizon" and args.start_steps == 0:
        p.error("--mode horizon compares from scratch with from a checkpoint: "
                "--start-steps must be >= 1")
    known = set(ARMS) | set(EXCEPT) | set(GPU_ARMS)
    args.arms = tuple(args.arms)
    unknown = [a for a in args.arms if a not in known]
    if unknown:
        p.error(f"--arm: unknown arm(s) {unknown}; choose from {sorted(known)}")
    args.seeds = tuple(int(s) for s in args.seeds.split(","))
    args.cost_seeds = tuple(int(s) for s in args.cost_seeds.split(","))
    if START_SEED in args.seeds + args.cost_seeds:
        p.error(f"--seeds, --cost-seeds: {START_SEED} is the checkpoint start's own stream")
    device = torch.device(args.device)
    if (args.plan_in or args.resume) and args.mode != "plan":
        p.error("--plan-in and --resume are for --mode plan")
    if args.plan_in and len(args.models.split(",")) > 1:
        p.error("--plan-in names one model's plan: give one --models entry")
    resume = read_resume(args) if args.mode == "plan" else None
    t0 = time.time()
    out = {"schema": f"loka.bench.ne_{args.mode}", "version": 1,
           "env": {"torch": torch.__version__, "python": platform.python_version(),
                   "device": str(device), "threads": torch.get_num_threads()},
           "config": {k: v for k, v in vars(args).items() if k != "out"},
           "command": "python bench/ne_sources.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv),
           "models": {}}
    if args.low_noise:
        with open(args.out) as f:
            out = json.load(f)
        out["low_noise_command"] = ("python bench/ne_sources.py "
                                    + " ".join(sys.argv[1:] if argv is None else argv))
    for spec in args.models.split(","):
        name, preset = spec.split(":")
        print(f"{name} {preset}", flush=True)
        if args.low_noise:
            low_noise(name, preset, args, device, out["models"][spec])
        elif args.mode == "plan":
            row = out["models"].setdefault(spec, {})

            def write():
                atomic_write_text(args.out, json.dumps(json_safe(out), indent=1,
                                                       allow_nan=False))
            default_plan(name, preset, args, device, row, write, spec, resume)
        else:
            run = {"sources": sources, "budget": budget, "horizon": horizon}[args.mode]
            out["models"][spec] = run(name, preset, args, device)
        atomic_write_text(args.out, json.dumps(json_safe(out), indent=1, allow_nan=False))
    out["seconds" if not args.low_noise else "low_noise_seconds"] = round(time.time() - t0, 1)
    atomic_write_text(args.out, json.dumps(json_safe(out), indent=1, allow_nan=False))
    print(f"wrote {args.out} ({round(time.time() - t0, 1)} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
