#!/usr/bin/env python3
"""Pool the runs of several quality JSONs (``bench/quality_at_scale.py``) arm by arm.

One GPU call holds a few seeds of a few arms, and a training run is not reproducible
across code versions or machines to the last bit: a rounding-level change (an Inductor
kernel choice, a new op in the graph) moves one Wukong ``paper`` run's final NE by as much
as the seed-to-seed spread (bench/BENCHMARKS.md). So the per-seed pairing of one call says
little, and the arms are compared as samples: the mean NE per arm over every run of every
file, and the change of each arm's mean against the bf16 + Mods mean with a permutation
p-value (how often a random relabelling of the pooled runs gives a gap at least as large).

A run that appears in several files with the same arm and seed and a final NE within
``SAME_RUN`` of it counts once: two runs that end that close took the same path (a rerun
of the same code, apart by bit-level nondeterminism only), and counting both would
overstate the evidence. Arms that ran the same plan (equal plan JSON) pool under the
name the first file gave that plan, whatever later files call it (``loka+mods`` with
``--plan X`` in one call, ``loka@tuned+mods`` with ``--plans tuned=X`` in another), and
arms of one name that ran different plans are kept apart (``name~<digest>``); the
renamings are listed under ``aliases``. Only files whose training configuration matches the first file's
(steps, learning rates, schedule, tables, model) are pooled; others are refused.

Pooling by arm mixes in whatever differs between calls (the code version, hence each run's
path), so the paired view is reported beside it: each run's NE change against the bf16 +
Mods run of the same seed in the same file, pooled over files, with a sign-flip
permutation p-value (how often flipping the signs of the changes at random gives a mean
at least as far from zero). A control arm with no FP8 (``bf16+mods+jitter``) shows how
large such a change is without FP8.

    python bench/quality_pool.py bench/results/*/quality.json --out pooled.json
"""

import argparse
import hashlib
import itertools
import json
import math
import random
import statistics
import sys

BASE = "bf16+mods"
CONFIG_KEYS = ("model", "preset", "steps", "eval_steps", "batch_size", "table_rows", "lr",
               "emb_lr", "weight_decay", "warmup", "schedule", "min_lr_ratio", "merge")
SAME_RUN = 1e-4
"""final NEs of one arm and seed closer than this are one run"""
FP8_ARMS = "fp8"
"""the pseudo-arm of every run with FP8 sites (all plans together)"""


def _plan_arms(d) -> dict:
    """arm name -> digest of the plan that arm ran, for the LoKA arms of one quality JSON."""
    def digest(plan):
        return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()

    out = {}
    if isinstance(d.get("plan"), dict):
        out["loka+mods"] = digest(d["plan"])
    for arm, plan in (d.get("plans") or {}).items():  # keyed by arm name
        if isinstance(plan, dict):
            out[arm] = digest(plan)
    return out


def load(paths, aliases=None):
    """(config of the first file, runs with ``file`` added, pairs), duplicates dropped;
    arms that ran an equal plan take one name (each renaming recorded in ``aliases``). A
    pair is a run of another arm with the bf16 + Mods run of the same seed in the same
    file (``change_pct``: its relative NE change)."""
    ref, runs, pairs = None, [], []
    names = {}  # plan digest -> the arm name it pools under
    aliases = {} if aliases is None else aliases
    for path in paths:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable quality JSON ({e})") from None
        if d.get("schema") != "loka.quality" or not isinstance(d.get("runs"), list):
            raise ValueError(f"{path}: not a quality JSON (schema {d.get('schema')!r})")
        cfg = {k: d.get("config", {}).get(k) for k in CONFIG_KEYS}
        if ref is None:
            ref = cfg
        elif cfg != ref:
            diff = {k: (ref[k], cfg[k]) for k in CONFIG_KEYS if ref[k] != cfg[k]}
            raise ValueError(f"{path}: a different training configuration {diff}")
        rename, in_file = {}, {}
        for arm, dig in _plan_arms(d).items():
            if dig not in names:  # a new plan; under a name of its own
                taken = arm in names.values()
                names[dig] = f"{arm}~{dig[:8]}" if taken else arm
            rename[arm] = names[dig]
            if rename[arm] != arm:
                aliases[f"{path}:{arm}"] = rename[arm]
        for r in d["runs"]:
            ne = r.get("final", {}).get("ne")
            if not isinstance(ne, (int, float)) or ne != ne:
                continue
            arm = rename.get(r["arm"], r["arm"])
            run = {"arm": arm, "seed": r["seed"], "ne": float(ne),
                   "fp8_sites": r.get("fp8_sites", 0), "file": path,
                   "commit": d.get("env", {}).get("commit")}
            in_file[(arm, r["seed"])] = run
            if not _seen(runs, run):
                runs.append(run)
        for (arm, seed), run in in_file.items():
            base = in_file.get((BASE, seed))
            if arm == BASE or base is None or _seen(pairs, run):
                continue
            pairs.append({**run, "base_ne": base["ne"],
                          "change_pct": 100.0 * (run["ne"] / base["ne"] - 1.0)})
    return ref, runs, pairs


def _seen(runs, run) -> bool:
    """Whether ``runs`` holds ``run`` already (same arm and seed, NE within SAME_RUN)."""
    return any(x["arm"] == run["arm"] and x["seed"] == run["seed"]
               and abs(x["ne"] - run["ne"]) < SAME_RUN for x in runs)


def permutation_p(a, b, trials: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of the gap of means between samples ``a`` and ``b`` (exact when
    the relabellings are few)."""
    pooled, na = a + b, len(a)
    gap = abs(statistics.fmean(a) - statistics.fmean(b))
    total = sum(pooled)
    if math.comb(len(pooled), na) <= trials:
        combos = itertools.combinations(range(len(pooled)), na)
    else:
        rng = random.Random(seed)
        combos = (rng.sample(range(len(pooled)), na) for _ in range(trials))
    return _share_at_least((abs(sa / na - (total - sa) / (len(pooled) - na))
                            for sa in (sum(pooled[i] for i in idx) for idx in combos)), gap)


def _share_at_least(gaps, gap: float) -> float:
    """The share of the relabelled ``gaps`` at least as large as the observed ``gap``."""
    hits = count = 0
    for g in gaps:
        hits += g >= gap - 1e-12
        count += 1
    return hits / count


def sign_flip_p(diffs, trials: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value that paired changes ``diffs`` are centred on zero: the share of
    sign assignments whose mean is at least as far from zero (exact when there are few)."""
    n, gap = len(diffs), abs(statistics.fmean(diffs))
    if 2 ** n <= trials:
        signs = itertools.product((1, -1), repeat=n)
    else:
        rng = random.Random(seed)
        signs = ([rng.choice((1, -1)) for _ in range(n)] for _ in range(trials))
    return _share_at_least((abs(sum(a * b for a, b in zip(sg, diffs))) / n for sg in signs), gap)


def summarize_pairs(pairs) -> dict:
    """Per arm (and ``fp8`` for every run with FP8 sites): the paired NE changes' mean,
    spread, standard error and sign-flip p-value."""
    arms = {}
    for p in pairs:
        arms.setdefault(p["arm"], []).append(p["change_pct"])
        if p["fp8_sites"]:
            arms.setdefault(FP8_ARMS, []).append(p["change_pct"])
    out = {}
    for arm, ch in arms.items():
        sd = statistics.stdev(ch) if len(ch) > 1 else 0.0
        out[arm] = {"n": len(ch), "changes_pct": ch, "mean_pct": statistics.fmean(ch),
                    "std_pct": sd, "sem_pct": sd / math.sqrt(len(ch)),
                    "p_sign_flip": sign_flip_p(ch)}
    return out


def summarize(runs, pairs=()) -> dict:
    arms = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(r["ne"])
        if r["arm"] != BASE and r["fp8_sites"]:
            arms.setdefault(FP8_ARMS, []).append(r["ne"])
    if BASE not in arms:
        raise ValueError(f"no {BASE} runs to compare with")
    base = arms[BASE]
    out = {"n_runs": len(runs), "arms": {}}
    for arm, nes in arms.items():
        s = {"n": len(nes), "ne_mean": statistics.fmean(nes),
             "ne_std": statistics.stdev(nes) if len(nes) > 1 else 0.0,
             "ne_min": min(nes), "ne_max": max(nes)}
        if arm != BASE:
            s["change_pct"] = 100.0 * (s["ne_mean"] / statistics.fmean(base) - 1.0)
            if len(nes) > 1 and len(base) > 1:
                s["p_value"] = permutation_p(nes, base)
        out["arms"][arm] = s
    b = out["arms"][BASE]
    out["seed_noise_pct"] = 100.0 * b["ne_std"] / b["ne_mean"]
    out["paired"] = summarize_pairs(pairs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="quality JSONs of one training configuration")
    p.add_argument("--out", default=None, help="write the pooled summary here (JSON)")
    args = p.parse_args(argv)
    aliases = {}
    try:
        cfg, runs, pairs = load(args.files, aliases)
        summary = summarize(runs, pairs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"schema": "loka.quality-pool", "version": 1, "files": args.files,
              "config": cfg, "aliases": aliases, "runs": runs, "pairs": pairs,
              "summary": summary}
    for where, arm in aliases.items():
        print(f"{where} ran the plan of {arm}: pooled with it")
    for arm, s in summary["arms"].items():
        extra = (f"  change {s['change_pct']:+.2f}%" + (f"  p={s['p_value']:.3f}"
                                                      if "p_value" in s else "")
                 if "change_pct" in s else "")
        print(f"{arm:22s} n={s['n']:2d}  NE {s['ne_mean']:.5f} ± {s['ne_std']:.5f}"
              f"  [{s['ne_min']:.5f}, {s['ne_max']:.5f}]{extra}")
    print(f"seed noise of {BASE}: {summary['seed_noise_pct']:.2f}%")
    print(f"paired with the {BASE} run of the same seed and file:")
    for arm, s in summary["paired"].items():
        print(f"{arm:22s} n={s['n']:2d}  change {s['mean_pct']:+.2f}% ± {s['sem_pct']:.2f}% (s.e.)"
              f"  std {s['std_pct']:.2f}%  p={s['p_sign_flip']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
