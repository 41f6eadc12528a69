#!/usr/bin/env python3
"""Where a planned reference model's compiled training step spends its GPU time, plan by
plan: the step of ``loka.assembly.build_reference`` compiled as ``bench/ne_sources.py``
times it (``torch.compile``, fused AdamW, bf16), with each plan applied through
``loka.apply``; for each, the median wall time, the profiled GPU time by kernel class, the
top kernels and the operators (and LoKA or Inductor frames) that launched them.

Plans: ``--plan LABEL=PATH`` (repeatable). Derived rows: ``--family KERNEL`` moves every
FP8 role of the first plan onto KERNEL; ``--drop REGEX`` puts the first plan's sites whose
name matches back on the baseline (one row per REGEX).

    python bench/profile_plan.py --model wukong:paper --batch-size 4096 \\
        --plan default=bench/results/<run>/plan.default.json --family cublas-tensorwise \\
        --drop 'lcb' --out /tmp/profile_plan.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import loka.kernels.adapters  # noqa: E402,F401 - registers the torchao and FBGEMM kernels
from loka.dispatch import Plan  # noqa: E402
from loka.dispatch.select import override  # noqa: E402
from loka.jsonio import atomic_write_text, json_safe  # noqa: E402
from loka.kernels import registry  # noqa: E402
from ne_sources import compiled_step  # noqa: E402 - the step ne_sources.py times


def plans_from(args) -> list:
    """[(label, Plan or None)]: the baseline first, then the named and derived plans."""
    rows = [("baseline", None)]
    first = None
    for spec in args.plan:
        label, _, path = spec.partition("=")
        if not path:
            sys.exit(f"--plan {spec!r}: give LABEL=PATH")
        p = Plan.load(path)
        first = first or p
        rows.append((label, p))
    if (args.family or args.drop) and first is None:
        sys.exit("--family and --drop derive from the first --plan: give one")
    for k in args.family:
        old = {c.kernel for sp in first.sites.values() for c in sp.roles.values()
               if c.kernel != k and registry.get(c.kernel).is_fp8}
        rows.append((f"family {k}", override(first, replace={o: k for o in old})))
    for rx in args.drop:
        names = [n for n in first.sites if re.search(rx, n)]
        if not names:
            sys.exit(f"--drop {rx!r} matches no site of the first plan")
        rows.append((f"drop /{rx}/ ({len(names)} sites)",
                     override(first, assign={f"{n}:*": first.baseline for n in names})))
    return rows


def profile_row(label, plan, args, device, graphs: bool) -> dict:
    from loka.bench.evalset import time_steps
    from loka.bench.profiling import profile_breakdown

    name, _, preset = args.model.partition(":")
    torch._dynamo.reset()
    model = step = None
    try:
        step, model = compiled_step(name, preset or "paper", args, device, plan, graphs)
        row = {"label": label, "graphs": graphs,
               "fp8_sites": 0 if plan is None else len(plan.fp8_sites())}
        row.update(time_steps(step, device, warmup=3, steps=args.steps))
        row.update(profile_breakdown(step, args.profile_steps, top=args.top, ops=True))
        return row
    finally:  # a row that fails frees its model too
        del model, step
        gc.collect()
        torch.cuda.empty_cache()


def _graphs(text: str) -> list:
    """An argparse ``type``: '0', '1' or '0,1' -> [False], [True], [False, True]."""
    parts = text.split(",")
    if not parts or any(x not in ("0", "1") for x in parts) or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"expected 0, 1 or 0,1, got {text!r}")
    return [x == "1" for x in parts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wukong:paper", help="name:preset")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--table-rows", type=int, default=100)
    p.add_argument("--plan", action="append", default=[], help="LABEL=PATH (repeatable)")
    p.add_argument("--family", action="append", default=[], help="KERNEL (repeatable)")
    p.add_argument("--drop", action="append", default=[], help="REGEX (repeatable)")
    p.add_argument("--graphs", default="0", type=_graphs,
                   help="0, 1 or 0,1: compile without and/or with CUDA graphs (reduce-overhead)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("profile_plan.py needs a CUDA device")
    device = torch.device("cuda")
    rows = plans_from(args)
    out = {"schema": "loka.bench.profile_plan", "version": 1, "command": " ".join(sys.argv),
           "torch": torch.__version__, "device_name": torch.cuda.get_device_name(),
           "rows": []}
    t0 = time.time()
    for label, plan, graphs in [(lb, pl, g) for g in args.graphs for lb, pl in rows]:
        try:
            r = profile_row(label, plan, args, device, graphs)
        except Exception as e:  # noqa: BLE001 - keep the other rows
            r = {"label": label, "graphs": graphs, "error": f"{type(e).__name__}: {e}"[:2000]}
        out["rows"].append(r)
        name = f"{label}{' (graphs)' if graphs else ''}"
        print(f"{name}: {r.get('step_ms', float('nan')):.3f} ms wall, "
              f"{r.get('gpu_us_per_step', float('nan')) / 1e3:.3f} ms GPU, "
              f"{ {k: round(v / 1e3, 3) for k, v in (r.get('by_class_us') or {}).items()} }"
              f"{' ' + r['error'] if 'error' in r else ''}", flush=True)
        for k, v, c in (r.get("top_kernels_us") or [])[:12]:
            print(f"   {v:9.1f} us  {c:9s} {k[:110]}", flush=True)
        for op, frame, us in (r.get("by_op_us") or [])[:12]:
            print(f"   op {us:9.1f} us  {op[:40]}  {str(frame)[:90]}", flush=True)
        atomic_write_text(args.out, json.dumps(json_safe(out), indent=1))
    print(f"wrote {args.out} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
