#!/usr/bin/env python3
"""Predict the steps an evaluation-set run measured again, from its recorded Probe report
and plan, with the prediction as it is now (``loka.dispatch.predict_step``), beside the
prediction the run recorded.

For each pair of rows of ``--eval`` (bf16 and one LoKA variant, same model, batch, mode and
graph setting) it predicts the LoKA row's wall and GPU time from the bf16 row's as the
evaluation set does, and prints ``measured / predicted - 1`` for the recorded prediction
and for today's. Nothing runs on a
GPU: the timings are the report's and the rows'.

    R=bench/results/2026-12-06-h100-shared-copy/call5-public-path
    python bench/repredict.py --report $R/w4096.wukong.b4096.report.json \\
        --plan $R/w4096.wukong.b4096.plan.static.json --eval $R/w4096.json \\
        --variant loka-optimize-static --out repredict.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from loka.bench.evalset import add_prediction  # noqa: E402
from loka.dispatch import Plan  # noqa: E402
from loka.probe.report import ProbeReport  # noqa: E402


def repredict(report: ProbeReport, plan: Plan, rows: List[dict], variant: str) -> List[dict]:
    """One entry per ``variant`` row of ``rows`` (one run's) with a bf16 row of its model,
    batch, mode and graph setting: the row predicted again as the evaluation set predicts
    it (:func:`loka.bench.evalset.add_prediction`), beside what it recorded."""
    out = []
    for row in rows:
        if row.get("status") != "ok" or row["variant"] != variant:
            continue
        again = {**row, "_plan": plan}
        add_prediction(rows, again, report)
        now, rec = again["prediction"], row.get("prediction") or {}
        if not now or "prediction_error" not in now:
            continue
        out.append({"model": row["model"], "batch_size": row["batch_size"],
                    "mode": row["mode"], "graphs": row["graphs"], "variant": variant,
                    "copies_us": now["copies_us"],
                    "recorded_error": rec.get("prediction_error"),
                    "recorded_gpu_error": rec.get("gpu_prediction_error"),
                    "error": now["prediction_error"],
                    "gpu_error": now.get("gpu_prediction_error")})
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", required=True, help="the run's Probe report (JSON)")
    p.add_argument("--plan", required=True, help="the plan the LoKA rows ran (JSON)")
    p.add_argument("--eval", action="append", required=True,
                   help="an evaluation-set JSON (repeatable)")
    p.add_argument("--variant", default="loka-optimize-static", help="the LoKA rows' variant")
    p.add_argument("--out", default=None, help="JSON file for the entries")
    args = p.parse_args(argv)
    try:
        report, plan = ProbeReport.load(args.report), Plan.load(args.plan)
        runs = {path: json.load(open(path))["rows"] for path in args.eval}
    except (OSError, ValueError, KeyError) as e:
        p.error(f"cannot read the inputs: {e}")
    entries = [{"eval": path, **e} for path, rows in runs.items()
               for e in repredict(report, plan, rows, args.variant)]
    if not entries:
        p.error(f"no bf16 row with a {args.variant!r} twin in --eval")
    for e in entries:
        print(f"{os.path.basename(e['eval'])}: {e['model']} {e['batch_size']} {e['mode']} "
              f"graphs={e['graphs']}: wall "
              f"{e['recorded_error']:+.3f} -> {e['error']:+.3f}, GPU "
              f"{e['recorded_gpu_error']:+.3f} -> {e['gpu_error']:+.3f} "
              f"(copies {e['copies_us']:.1f} us)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"schema": "loka.bench.repredict", "version": 1, "report": args.report,
                       "plan": args.plan, "eval": args.eval, "entries": entries}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
