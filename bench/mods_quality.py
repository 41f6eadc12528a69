"""Quality check of the paper's Mods (No Bias + BlockNorm(256) + Hard Swish): train each
reference model with and without them on the synthetic teacher, over several seeds, and
compare held-out NE.

    python bench/mods_quality.py                       # tiny preset, 3 seeds, CPU
    python bench/mods_quality.py --preset small --steps 600 --device cuda

Each seed fixes the model init and the training stream; both variants of a seed see the
same data and the same held-out set (one teacher for all), so the per-seed difference is
paired. Writes bench/results/mods_quality_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

import loka.models as M
from loka.config import ModsConfig
from loka.data import SyntheticConfig, SyntheticCTR
from loka.train import train


def _summary(values):
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "values": values}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    data_cfg = SyntheticConfig(base_ctr=args.base_ctr)
    results = {}
    for name in args.models:
        per_variant = {}
        for variant, mods in (("baseline", None), ("mods", ModsConfig.paper())):
            nes, aucs, secs = [], [], []
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                model = M.build(name, args.preset, mods)
                batch = args.batch_size or model.default_batch_size
                data = SyntheticCTR(model.feature_spec, batch, seed=1000 + seed,
                                    config=data_cfg, device=args.device)
                held = SyntheticCTR(model.feature_spec, batch, seed=99, config=data_cfg,
                                    device=args.device, _teacher=data.teacher)
                tic = time.perf_counter()
                r = train(model, data, args.steps, lr=args.lr, device=args.device,
                          eval_iter=held, eval_steps=args.eval_steps, seed=seed, progress=False)
                secs.append(time.perf_counter() - tic)
                nes.append(r.final["ne"])
                aucs.append(r.final["auc"])
                print(f"{name:12s} {variant:8s} seed {seed}: NE {nes[-1]:.4f}  AUC {aucs[-1]:.4f}"
                      f"  ({secs[-1]:.1f}s)", flush=True)
            per_variant[variant] = {"ne": _summary(nes), "auc": _summary(aucs),
                                    "seconds": sum(secs)}
        base, mods_ne = per_variant["baseline"]["ne"]["values"], per_variant["mods"]["ne"]["values"]
        rel = [100.0 * (m - b) / b for b, m in zip(base, mods_ne)]
        rel_s = _summary(rel)
        # a 95% interval of the mean paired change (t quantile for the seed count)
        t95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 8: 2.36, 10: 2.26}.get(len(rel), 2.0)
        half = t95 * rel_s["std"] / math.sqrt(len(rel)) if len(rel) > 1 else float("nan")
        results[name] = dict(per_variant, ne_change_pct={
            **rel_s, "ci95": [rel_s["mean"] - half, rel_s["mean"] + half]})
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["wukong", "dcnv2", "interformer", "dlrm"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512, help="0: the preset's default")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-steps", type=int, default=40)
    p.add_argument("--base-ctr", type=float, default=0.03)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tic = time.perf_counter()
    results = run(args)
    out = {
        "what": "held-out NE with and without ModsConfig.paper() (No Bias, BlockNorm(256), "
                "Hard Swish); ne_change_pct = 100 (NE_mods - NE_baseline) / NE_baseline, paired "
                "per seed",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "wall_s": time.perf_counter() - tic,
        "results": results,
    }
    print(f"\n{'model':12s} {'NE baseline':>20s} {'NE mods':>20s} {'change %':>18s}")
    for name, r in results.items():
        b, m, c = r["baseline"]["ne"], r["mods"]["ne"], r["ne_change_pct"]
        print(f"{name:12s} {b['mean']:>12.4f} ± {b['std']:.4f} {m['mean']:>12.4f} ± {m['std']:.4f}"
              f" {c['mean']:>+10.2f} [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}]")
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"mods_quality_{torch.device(args.device).type}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path} ({out['wall_s']:.0f}s)")


if __name__ == "__main__":
    main()
