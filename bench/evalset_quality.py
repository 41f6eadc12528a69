#!/usr/bin/env python3
"""What LoKA's serving plans cost in quality on the evaluation-set models (models LoKA never
saw), paired against bf16 serving of the same trained model.

Per model and seed: the model (``bench/evalset``, plain PyTorch with its own norm and
activation classes) trains ``--steps`` steps in float32 with AdamW on its own batches
(``make_batch``: per-channel log-normal features, labels from a fixed logistic teacher);
the trained model is then served in bf16, as the evaluation set serves it. ``loka.probe``
observes ``--probe-batches`` batches of another stream (its input amax is what a static
scale takes), and each arm serves ``--eval-batches`` held-out batches of a third stream:

* ``bf16``: the model as trained, cast to bf16 (the baseline every ratio is against);
* ``dynamic``: ``loka.plan(report, inference=True)``, every site's forward in FP8 with
  per-call scales (``--kernel``: ``cublas-tensorwise`` on a GPU; on the CPU its emulated
  twin, the same numerics);
* ``static xM``: ``loka.plan(report, inference=True, static_scales=True,
  static_margin=M)``, each input scaled by the amax the Probe observed times ``M``;
* ``static x1 budget`` (with ``--ne-budget B``): the ``static x1`` plan held to a relative
  NE change of at most ``B`` by :func:`loka.quality.serve_ne_budget` on a validation
  stream of ``--eval-batches`` batches (neither trained, probed nor reported on), then
  reported on the held-out stream like every arm.

Every site is planned in FP8 (``assume_fast``: no GPU times anything here), so the change is
that of the largest plan. Each FP8 arm: the paired relative NE change against the bf16 arm
on the same examples, with its 95% interval over examples
(``loka.quality.stats.ratio_interval`` of per-example log losses), and the largest share of
any site's input beyond its static amax. A seed whose bf16 model did not learn (held-out NE
at least ``--max-baseline-ne``) is kept in the file, left out of the summary.

    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/evalset_quality.py \\
        --models wukong:tiny,dcnv2:tiny,dlrm:tiny --seeds 0,1,2,3,4 \\
        --out bench/results/evalset_quality_cpu/evalset_quality.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from evalset import EVAL_MODELS, loss_fn  # noqa: E402
from loka.config import ProbeConfig  # noqa: E402
from loka.data.metrics import normalized_entropy  # noqa: E402
from loka.dispatch import apply, plan as make_plan  # noqa: E402
from loka.dispatch.static import static_saturation, static_scales_for  # noqa: E402
from loka.jsonio import atomic_write_text, json_safe  # noqa: E402
from loka.probe import probe  # noqa: E402
from loka.quality.serving import fp8_forwards, serve_ne_budget  # noqa: E402
from loka.quality.stats import example_log_losses, ratio_interval  # noqa: E402

EMULATED = "emulated-tensorwise-e4m3"
PROBE_SEED, HELD_OUT_SEED, VALIDATION_SEED = 5_000, 10_000, 20_000


def train(model: torch.nn.Module, batch_size: int, steps: int, lr: float, seed: int,
          device: torch.device) -> None:
    """``steps`` AdamW steps in float32 on the model's own batches (stream ``seed``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for i in range(steps):
        batch = model.make_batch(batch_size, device=device, seed=seed * 100_003 + i)
        loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


def serve(model: torch.nn.Module, batches) -> np.ndarray:
    """Logits of every held-out example, float64."""
    with torch.no_grad():
        return np.concatenate([model(*inputs).float().reshape(-1).double().cpu().numpy()
                               for inputs, _ in batches])


def one_seed(name: str, scale: str, seed: int, args, lr: float) -> dict:
    torch.manual_seed(seed)
    dev = torch.device(args.device)
    model = EVAL_MODELS[name](scale).to(dev)
    train(model, args.batch_size, args.steps, lr, seed, dev)
    served = copy.deepcopy(model).to(torch.bfloat16).eval()
    probe_batches = [served.make_batch(args.batch_size, device=dev, dtype=torch.bfloat16,
                                       seed=PROBE_SEED + seed * 1000 + i)
                     for i in range(args.probe_batches)]
    cfg = ProbeConfig(kernels=("bf16", args.kernel), num_samples=4, timing=False,
                      every_n_steps=1, bootstrap=100, progress=False, precompile_workers=0)
    report = probe(served, probe_batches, loss_fn, config=cfg)
    held = [served.make_batch(args.eval_batch, device=dev, dtype=torch.bfloat16,
                              seed=HELD_OUT_SEED + seed * 1000 + i)
            for i in range(args.eval_batches)]
    labels = np.concatenate([b[1].double().cpu().numpy() for b in held])
    base = serve(served, held)
    base_ll = example_log_losses(base, labels)
    out = {"seed": seed, "ne_bf16": normalized_entropy(base, labels, from_logits=True),
           "linears": sum(1 for m in served.modules() if isinstance(m, torch.nn.Linear)),
           "arms": {}}
    arms = {"dynamic": dict(static_scales=False)}
    for margin in args.margins:
        arms[f"static x{margin:g}"] = dict(static_scales=True, static_margin=margin)
    if args.ne_budget is not None:
        arms["static x1 budget"] = dict(static_scales=True, static_margin=1.0)
    for arm, kw in arms.items():
        plan = make_plan(report, inference=True, assume_fast=True, allowed_kernels=[args.kernel],
                         max_error=args.max_error, **kw)
        budget = None
        if arm.endswith("budget"):
            val = [served.make_batch(args.eval_batch, device=dev, dtype=torch.bfloat16,
                                     seed=VALIDATION_SEED + seed * 1000 + i)
                   for i in range(args.eval_batches)]
            # the seed's own NE decides whether it learned (the summary), not the budget
            budget = serve_ne_budget(plan, served, val, max_ne_change=args.ne_budget,
                                     max_baseline_ne=None)
            plan = budget.plan
        fp8 = copy.deepcopy(served)
        apply(fp8, plan, inference=True)
        fp8.eval()
        logits = serve(fp8, held)
        change, lo, hi = ratio_interval(base_ll, example_log_losses(logits, labels))
        sat = static_saturation(fp8, lambda: serve(fp8, held)) if plan.static_scales else {}
        out["arms"][arm] = {"rel_ne_change": change, "interval": [lo, hi],
                            "fp8_sites": len(fp8_forwards(plan)),
                            "static_sites": len(static_scales_for(plan,
                                                                  plan.static_scales or {})),
                            "saturation_max": max(sat.values()) if sat else 0.0,
                            "sites_saturating": sum(1 for v in sat.values() if v > 0)}
        if budget is not None:
            out["arms"][arm]["budget"] = budget.to_dict()
    return out


def summarize(runs, max_baseline_ne: float) -> dict:
    learned = [r for r in runs if r["ne_bf16"] < max_baseline_ne]
    summary = {"seeds_learned": [r["seed"] for r in learned],
               "seeds_not_learned": [r["seed"] for r in runs if r not in learned]}
    for arm in (runs[0]["arms"] if learned else {}):
        changes = [r["arms"][arm]["rel_ne_change"] for r in learned]
        summary[arm] = {"rel_ne_change_mean": float(np.mean(changes)),
                        "rel_ne_change_seeds": changes,
                        "intervals": [r["arms"][arm]["interval"] for r in learned],
                        "fp8_sites": learned[0]["arms"][arm]["fp8_sites"],
                        "saturation_max": max(r["arms"][arm]["saturation_max"] for r in learned)}
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wukong:tiny,dcnv2:tiny,dlrm:tiny",
                   help="comma list of name:scale[:lr]")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--probe-batches", type=int, default=4)
    p.add_argument("--eval-batch", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--margins", default="1,2")
    p.add_argument("--max-error", type=float, default=1.0,
                   help="the plans' error budget (default: every site in FP8)")
    p.add_argument("--max-baseline-ne", type=float, default=0.95)
    p.add_argument("--ne-budget", type=float, default=None,
                   help="also the static x1 plan held to this relative NE change on a "
                        "validation stream (loka.quality.serve_ne_budget; 2e-4 is 0.02%%)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernel", default=None,
                   help="the FP8 kernel of every site (default: cublas-tensorwise on CUDA, "
                        f"{EMULATED}, its numerics, on the CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.kernel is None:
        args.kernel = "cublas-tensorwise" if args.device.startswith("cuda") else EMULATED
    try:
        args.margins = [float(m) for m in args.margins.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
        specs = []
        for spec in args.models.split(","):
            parts = spec.split(":")
            if parts[0] not in EVAL_MODELS or len(parts) < 2:
                raise ValueError(f"--models: {spec!r} is not name:scale[:lr] with name in "
                                 f"{sorted(EVAL_MODELS)}")
            specs.append((spec, parts[0], parts[1],
                          float(parts[2]) if len(parts) > 2 else args.lr))
        if not 0 < args.steps <= PROBE_SEED:
            # training batches' seeds would reach the probe, held-out and validation streams
            raise ValueError(f"--steps must be in [1, {PROBE_SEED}], got {args.steps}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    doc = {"schema": "loka.evalset-quality", "version": 1, "kernel": args.kernel,
           "args": {k: v for k, v in vars(args).items() if k != "out"},
           "env": {"torch": torch.__version__, "python": platform.python_version(),
                   "device": (torch.cuda.get_device_name(args.device)
                              if args.device.startswith("cuda") else "cpu")},
           "models": {}}
    for spec, name, scale, lr in specs:
        runs = []
        for seed in seeds:
            runs.append(one_seed(name, scale, seed, args, lr))
            doc["models"][spec] = {"lr": lr, "seeds": runs,
                                   "summary": summarize(runs, args.max_baseline_ne)}
            atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1) + "\n")
            print(spec, f"seed {seed}:", json.dumps(runs[-1]), flush=True)
    doc["wall_s"] = time.perf_counter() - t0
    atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1) + "\n")
    for spec, m in doc["models"].items():
        print(spec, json.dumps(m["summary"], indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
