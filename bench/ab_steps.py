"""Two compiled steps of one evaluation-set model timed in alternation: bf16 against LoKA's plan.

Steps whose wall time is mostly host time (the evaluation-set DCNv2 and DLRM at batch 4096:
about 3x their GPU time without CUDA graphs) move by a third from one run of the same rows
to the next (bench/results/2026-12-05-h100-evalset-more/NOTE.md). Timing one variant's
steps, then the other's, mixes that drift into the ratio. Here both compiled models stay
alive and are timed in rounds, in the order A B B A A B ..., so that each variant sees the
same conditions; each round's median of ``--steps`` synchronized steps is kept, and the
spread of A's own rounds says how large a difference must be to be more than noise.

    PYTHONPATH=. python bench/ab_steps.py --model dlrm --mode serve \
        --report runs_carry/eval_set.dlrm.b4096.report.json --out ab.json [--graphs]

A is the model as written (bf16 on a GPU); B is ``loka.apply(model, loka.plan(report))``
(``inference=True`` for ``--mode serve``). ``--plan-a`` / ``--plan-b`` apply saved plans
instead (two plans of one model compared side by side: ``--plan-a old.json --plan-b
new.json``); ``--static-b`` serves B with static activation scales, each site's input amax
as the report observed it (:func:`loka.bench.evalset.static_scales`: the sites whose
forward kernel takes one), so that B's casts need no amax pass. After the rounds, each
variant's host time per step (:func:`loka.bench.evalset.profile_host`) and, on a GPU, its
GPU time (:func:`loka.bench.evalset.profile_gpu`). On the CPU it runs the same way
(float32, its times mean nothing; the tests use it so).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import loka  # noqa: E402
from loka.bench.evalset import (eval_set_with, make_step, profile_gpu, profile_host,  # noqa: E402
                                round_order, static_scales, time_steps)
from loka.bench.evalset import paired_summary as summarize  # noqa: E402
from loka.timing import synchronize  # noqa: E402


def time_round(step: Callable[[], object], device: torch.device, steps: int) -> float:
    """Median wall time (ms) of ``steps`` synchronized steps, after one untimed step (the
    first after the other variant's round)."""
    return time_steps(step, device, 1, steps)["step_ms"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval-set", default=str(ROOT / "bench" / "evalset"))
    p.add_argument("--model", required=True)
    p.add_argument("--scale", default="paper", choices=("paper", "tiny"))
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--mode", default="train", choices=("train", "serve"))
    p.add_argument("--report", required=True, help="the model's Probe report (JSON)")
    p.add_argument("--plan-a",
                   help="a plan JSON applied to A (default: none, the model as written)")
    p.add_argument("--plan-b", help="a plan JSON applied to B (default: loka.plan(report))")
    p.add_argument("--static-b", action="store_true",
                   help="serve B with static activation scales from the report's amax")
    p.add_argument("--graphs", action="store_true", help="compile with CUDA graphs")
    p.add_argument("--assume-fast", action="store_true",
                   help="plan as loka.plan(..., assume_fast=True) (a report without GPU timings)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile's backend (aot_eager: Dynamo and AOTAutograd without "
                        "Inductor's code, for a CPU smoke run)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.graphs and args.backend != "inductor":
        p.error("--graphs compiles with Inductor's CUDA graphs: drop --backend")
    if args.rounds < 2 or args.steps < 1 or args.warmup < 1 or args.batch_size < 1:
        p.error("--rounds must be >= 2, --steps, --warmup and --batch-size >= 1")
    if args.static_b and args.mode != "serve":
        p.error("--static-b is for --mode serve (training takes dynamic scales)")
    try:
        es = eval_set_with(args.eval_set, args.model)
        report = loka.ProbeReport.load(args.report)
        plans = {v: loka.Plan.load(path) for v, path in (("A", args.plan_a), ("B", args.plan_b))
                 if path}
    except (ValueError, OSError) as e:
        p.error(str(e).splitlines()[0])
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = es.EVAL_MODELS[args.model](args.scale).to(device=device, dtype=dtype)
    batch = base.make_batch(args.batch_size, device, dtype, seed=0)
    serve = args.mode == "serve"
    plans.setdefault("B", loka.plan(report, inference=serve, device=device,
                                    assume_fast=args.assume_fast))
    models = {"A": copy.deepcopy(base), "B": copy.deepcopy(base)}
    for v, plan in plans.items():
        scales = static_scales(report, plan) if args.static_b and v == "B" else None
        loka.apply(models[v], plan, inference=serve, static_scales=scales or None)
    mode = "reduce-overhead" if args.graphs else None
    steps = {}
    for name, m in models.items():
        m.train(not serve)
        compiled = torch.compile(m, mode=mode, backend=args.backend)
        steps[name] = make_step(compiled, m, args.mode, batch, args.graphs, device, es.loss_fn)
        for _ in range(args.warmup):
            steps[name]()
        synchronize(device)
    medians: Dict[str, List[float]] = {"A": [], "B": []}
    for v in round_order(args.rounds):
        medians[v].append(time_round(steps[v], device, args.steps))
    doc = {"schema": "loka.bench.ab_steps", "version": 1,
           "command": " ".join(["bench/ab_steps.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "model": args.model, "scale": args.scale, "batch_size": args.batch_size,
           "mode": args.mode, "graphs": args.graphs, "static_b": args.static_b,
           "backend": args.backend,
           "fp8_site_roles": {v: sum(c.kernel != plan.baseline for sp in plan.sites.values()
                                     for c in sp.roles.values()) for v, plan in plans.items()},
           "order": round_order(args.rounds), "round_ms": medians, **summarize(medians),
           "host": {v: profile_host(steps[v], device, 3) for v in ("A", "B")}}
    if device.type == "cuda":
        doc["gpu_ms"] = {v: profile_gpu(steps[v], 3)["gpu_ms_per_step"] for v in ("A", "B")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.model} {args.mode} graphs={args.graphs}: A {doc['a_ms']:.3f} ms, B "
          f"{doc['b_ms']:.3f} ms, A/B {doc['ratio_a_over_b']:.3f} "
          f"[{doc['ratio_min']:.3f}, {doc['ratio_max']:.3f}], A's own spread "
          f"{doc['a_spread']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
