#!/usr/bin/env python3
"""Where the host's time goes in one compiled serving step: bf16 against a LoKA plan, on an
evaluation-set model, without CUDA graphs.

A serving step of a few hundred microseconds of GPU time is bound by the host (its wall
time is the host's time to issue it), so a plan's FP8 GEMMs pay off in wall time only if
the compiled step issues as fast as bf16's. Per variant (``bf16``, then the plan given with
``--plan`` applied with ``loka.apply(..., inference=True)``, its static scales included):

* ``wall_ms``: median wall time of synchronized steps;
* ``issue_ms``: median time the host takes to return from one step without waiting for the
  GPU (the host's own cost, what a host-bound step's wall time follows);

both taken in ``--rounds`` alternating rounds of the variants (bf16, plan, plan, bf16,
...; with more variants each round rotates their order, :func:`rotated_order`), as a host
whose speed drifts between variants would bias them otherwise (``paired``: bf16's median
over each variant's, < 1: the variant is slower). ``--prefix-sites 1,3`` adds the
variants ``plan@1``, ``plan@3``: the plan with its FP8 roles kept on its first 1 or 3 FP8
sites only (the rest on the baseline), so that the host cost a plan adds can be read per
site. ``--skip-guards`` times the same rounds again under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (``wall_noguard_ms``,
``issue_noguard_ms``): the issue time without Dynamo's guards, a diagnostic only.
``--compare-general`` adds ``plan-general``: the plan with every Linear's short serving
paths switched off (``loka.Linear``'s general path, the autograd Function), to
time what the short path saves. Then, one variant after the other:
* ``gpu_ms``: the GPU time of one step (CUDA graphs, :func:`loka.timing.time_fn`);
* ``guard_us``: Dynamo's cache lookup (its guards) per step, from ``torch.profiler``;
* ``guard_check_us``: the guard check alone, timed directly (no profiler);
* ``guard_lines``, ``tensor_guards``: the size of the guard tree, and the tensors it
  matches (each one a graph input);
* ``profile_top``: the profiler's ops by self CPU time per step;
* ``python_top``: ``cProfile``'s Python functions by own time per step.

    PYTHONPATH=. python bench/step_host.py --model dcnv2 --batch-size 4096 \\
        --plan bench/results/<run>/eval_set.dcnv2.b4096.plan.static.json --out host.json
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import inspect
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import loka  # noqa: E402
from evalset import EVAL_MODELS  # noqa: E402
from loka.bench.evalset import round_order, time_steps  # noqa: E402
from loka.jsonio import atomic_write_text  # noqa: E402
from loka.timing import time_fn  # noqa: E402


def host_profile(step, steps: int, top: int):
    """The profiler's ops by self CPU us per step, and the guards' us per step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    rows = [[e.key[:90], e.self_cpu_time_total / steps, e.count / steps] for e in events[:top]]
    guard = next((e.cpu_time_total / steps for e in events
                  if e.key == "TorchDynamo Cache Lookup"), None)
    return rows, guard


def python_profile(step, steps: int, top: int):
    """cProfile's functions by own time, us per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append([f"{Path(file).name}:{line}:{fn}"[:90], tt / steps * 1e6, ct / steps * 1e6,
                     nc / steps])
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def make_step(model, batch, mode_per_step: bool = False):
    """The compiled forward; ``mode_per_step``: each call enters ``torch.inference_mode()``
    itself, as ``loka.bench.evalset``'s serving step does (the rounds run inside one too)."""
    compiled = torch.compile(model)
    inputs = batch[0]

    def step():
        return compiled(*inputs)

    def step_in_mode():
        with torch.inference_mode():
            return compiled(*inputs)
    return step_in_mode if mode_per_step else step


def rotated_order(names: List[str], rounds: int) -> List[str]:
    """Each round runs every variant once; round r starts at variant r (mod n), and odd
    rounds run backwards, so each variant is first, last and beside each other in turn.
    Two variants: A B, B A, ... (:func:`loka.bench.evalset.round_order`)."""
    if len(names) == 2:
        return [names[0] if v == "A" else names[1] for v in round_order(rounds)]
    out = []
    for r in range(rounds):
        k = r % len(names)
        turn = names[k:] + names[:k]
        out += turn[::-1] if r % 2 else turn
    return out


def paired(steps, device, args, suffix: str = "") -> Dict[str, dict]:
    """Alternating rounds of each variant's synchronized and issue-time medians (each
    round: :func:`loka.bench.evalset.time_steps` after one untimed step)."""
    got = {name: {"wall": [], "issue": []} for name in steps}
    with torch.inference_mode():
        for name in rotated_order(list(steps), args.rounds):
            timed = time_steps(steps[name], device, 1, args.steps)
            got[name]["wall"].append(timed["step_ms"])
            got[name]["issue"].append(timed["host_ms"])
    return {name: {f"wall{suffix}_ms": statistics.median(v["wall"]),
                   f"issue{suffix}_ms": statistics.median(v["issue"]),
                   f"wall{suffix}_rounds_ms": v["wall"], f"issue{suffix}_rounds_ms": v["issue"]}
            for name, v in got.items()}


def prefix_plan(plan: "loka.Plan", k: int) -> "loka.Plan":
    """``plan`` with its FP8 roles on its first ``k`` FP8 sites only (in the plan's order):
    every role of a later site on the baseline; static scales of the kept sites only."""
    out = plan.copy()
    fp8 = [name for name, site in out.sites.items()
           if any(c.kernel != out.baseline for c in site.roles.values())]
    if not 1 <= k <= len(fp8):
        raise ValueError(f"--prefix-sites {k}: the plan has {len(fp8)} FP8 sites")
    for name in fp8[k:]:
        for choice in out.sites[name].roles.values():
            choice.kernel = out.baseline
    out.static_scales = {n: a for n, a in out.static_scales.items() if n in fp8[:k]}
    return out


def general_path(model) -> int:
    """Switch off the short serving paths (static and dynamic) of every ``loka.Linear`` of
    ``model`` (their keys cleared, so each call takes the general path); the number
    switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, loka.Linear) and (m.__dict__.get("_static_key") is not None
                                           or m.__dict__.get("_serve_key") is not None):
            m.__dict__["_static_key"] = m.__dict__["_serve_key"] = None
            n += 1
    return n


def guard_size(model) -> Dict[str, Optional[int]]:
    """Lines of the compiled forward's guard tree and its tensor guards (None: unreadable)."""
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    if not entries:
        return {"guard_lines": None, "tensor_guards": None}
    text = str(entries[0].guard_manager)
    return {"guard_lines": text.count("\n"), "tensor_guards": text.count("TENSOR_MATCH:")}


def guard_check_us(model, inputs, calls: int = 2000) -> Optional[float]:
    """Dynamo's guard check of the compiled forward alone (its first cache entry, timed
    directly), us per call; None where the entry cannot be read."""
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    if not entries:
        return None
    names = list(inspect.signature(type(model).forward).parameters)[1:]
    frame = {"self": model, **dict(zip(names, inputs))}
    check = entries[0].guard_manager.check
    if not check(frame):
        return None
    t = time.perf_counter()
    for _ in range(calls):
        check(frame)
    return (time.perf_counter() - t) / calls * 1e6


def profiles(step, device, args) -> dict:
    row = {}
    with torch.inference_mode():
        if device.type == "cuda":
            row["gpu_ms"] = time_fn(step, device, warmup=2, iters=10).median_us / 1e3
        row["profile_top"], row["guard_us"] = host_profile(step, args.profile_steps, args.top)
        row["python_top"] = python_profile(step, args.profile_steps, args.top)
    return row


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dcnv2", choices=sorted(EVAL_MODELS))
    ap.add_argument("--scale", default="paper", choices=("paper", "tiny"))
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--plan", required=True, help="a serving plan JSON (static scales kept)")
    ap.add_argument("--steps", type=int, default=30, help="steps per round and variant")
    ap.add_argument("--rounds", type=int, default=6, help="alternating rounds (even)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--prefix-sites", default="",
                    help="comma-separated k: variants with the plan's first k FP8 sites only")
    ap.add_argument("--compare-general", action="store_true",
                    help="add the plan on loka.Linear's general path (no short serving path)")
    ap.add_argument("--mode-per-step", action="store_true",
                    help="each step enters inference_mode itself (as the eval set's does)")
    ap.add_argument("--skip-guards", action="store_true",
                    help="time the rounds again with Dynamo's guards skipped (diagnostic)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        plan = loka.Plan.load(args.plan)
        plans = {"plan": plan}
        for k in [p for p in args.prefix_sites.split(",") if p.strip()]:
            if not k.strip().isdigit():
                raise ValueError(f"--prefix-sites takes whole numbers, got {k!r}")
            plans[f"plan@{int(k)}"] = prefix_plan(plan, int(k))
        if args.compare_general:
            plans["plan-general"] = plan
    except (OSError, ValueError) as e:
        print(f"error: --plan {args.plan}: {e}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    base = EVAL_MODELS[args.model](args.scale).to(device=device, dtype=dtype).eval()
    batch = base.make_batch(args.batch_size, device=device, dtype=dtype)
    doc = {"argv": sys.argv[1:], "torch": torch.__version__, "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "variants": {}}
    torch._dynamo.reset()
    steps, models = {}, {}
    for name in ["bf16", *plans]:
        model = models[name] = copy.deepcopy(base)
        if name != "bf16":
            loka.apply(model, plans[name], inference=True)
        if name == "plan-general":
            general_path(model)
        steps[name] = make_step(model, batch, args.mode_per_step)
        with torch.inference_mode():
            for _ in range(args.warmup):
                steps[name]()
    doc["variants"] = paired(steps, device, args)
    keys = ["wall_ms", "issue_ms"]
    if args.skip_guards:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            for name, row in paired(steps, device, args, "_noguard").items():
                doc["variants"][name].update(row)
        keys += ["wall_noguard_ms", "issue_noguard_ms"]
    bf = doc["variants"]["bf16"]
    doc["paired_by_variant"] = {name: {k: bf[k] / v[k] for k in keys}
                                for name, v in doc["variants"].items() if name != "bf16"}
    doc["paired"] = doc["paired_by_variant"]["plan"]
    for name, step in steps.items():
        doc["variants"][name].update(profiles(step, device, args))
        with torch.inference_mode():
            doc["variants"][name]["guard_check_us"] = guard_check_us(models[name], batch[0])
        doc["variants"][name].update(guard_size(models[name]))
        atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")
        v = doc["variants"][name]
        print(name, {k: round(v[k], 4) for k in [*keys, "gpu_ms", "guard_us", "guard_check_us"]
                     if v.get(k) is not None}, flush=True)
    print("bf16 over plan (paired):", {k: round(v, 3) for k, v in doc["paired"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
