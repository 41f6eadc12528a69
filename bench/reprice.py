#!/usr/bin/env python3
"""Price a Probe report's recorded timings again with the producers the Probe reads now,
and compare the savings each pricing predicts with those an evaluation-set run measured.

The step-aware prices (``step_us``, ``serve_us``; :mod:`loka.probe.pricing`) depend on
where each site's operands come from (:mod:`loka.probe.producers`). When that reading
changes, a report made on a GPU earlier need not be made again to see what the change
does: the producers are read again on this machine (one training step of the model at
``--batch-size`` rows, on the CPU), the report's own timings are priced with them, and for
each evaluation-set row of ``--eval`` (bf16 and LoKA, same model, mode and graph setting)
this prints the GPU time the row's plan saved as measured (bf16's GPU time less LoKA's)
beside the saving each pricing predicts for that plan. It also plans again from the
repriced report and lists the site-roles whose kernel changes.

    python bench/reprice.py --model wukong \\
        --report bench/results/2026-12-05-h100-evalset-defaults/eval_set.wukong.b4096.report.json \\
        --eval bench/results/2026-12-05-h100-evalset-defaults/eval_set.json --out reprice.json

Nothing runs on a GPU: the timings are the report's. The comparison is against GPU time,
not wall time: pricing says what the GPU saves; whether a step's wall time follows
depends on its host (``host_ms`` in newer eval rows).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
from typing import Dict, Iterator
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import loka  # noqa: E402
from loka.config import ProbeConfig  # noqa: E402
from loka.bench.evalset import eval_set_with  # noqa: E402
from loka.dispatch import Plan, predict_step  # noqa: E402
from loka.jsonio import ReportError, atomic_write_text, json_safe  # noqa: E402
from loka.kernels import registry  # noqa: E402
from loka.probe.pricing import price  # noqa: E402
from loka.probe.report import ProbeReport  # noqa: E402


@contextlib.contextmanager
def planning_off_device() -> Iterator[None]:
    """Plans made here as on the GPU the report was made on: a kernel counts as available
    on every device type it runs on (this machine need not have that GPU)."""
    real = registry.Kernel.device_ok

    def device_ok(self, device):
        return registry.YES if torch.device(device).type in self.devices else real(self, device)
    with mock.patch.object(registry.Kernel, "device_ok", device_ok):
        yield


def read_producers(model: torch.nn.Module, batch, loss_fn) -> Dict[str, Dict[str, str]]:
    """Each site's operand producers, read by the Probe over one training step."""
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        loss_fn(model, batch).backward()
    return {name: dict(site.producers) for name, site in probe.sites.items()}


def reprice(report: ProbeReport, producers: Dict[str, Dict[str, str]]) -> ProbeReport:
    """A copy of ``report`` with ``producers`` and its step-aware prices computed again
    from its own timings (a kernel the registry does not know keeps its prices)."""
    out = copy.deepcopy(report)
    for name, site in out.sites.items():
        site.producers = dict(producers.get(name, site.producers))
        for role, rr in site.roles.items():
            for kname, kr in rr.kernels.items():
                try:
                    kern = registry.get(kname)
                except KeyError:
                    continue
                if not kern.is_fp8:
                    continue
                price(kr, kern, role, rr.shape, site.producers, rr.baseline_us)
    return out


def changed_kinds(before: ProbeReport, after: ProbeReport) -> Dict[str, Dict[str, str]]:
    """``{site: {operand: 'old -> new'}}`` where the producer kind changed."""
    out: Dict[str, Dict[str, str]] = {}
    for name, site in after.sites.items():
        old = before.sites[name].producers
        diff = {k: f"{old.get(k)} -> {v}" for k, v in site.producers.items() if old.get(k) != v}
        if diff:
            out[name] = diff
    return out


def plan_changes(a: Plan, b: Plan) -> Dict[str, str]:
    """``{'site:role': 'kernel a -> kernel b'}`` where two plans differ."""
    out = {}
    for name in sorted(set(a.sites) | set(b.sites)):
        ra = a.sites[name].roles if name in a.sites else {}
        rb = b.sites[name].roles if name in b.sites else {}
        for role in sorted(set(ra) | set(rb), key=lambda r: r.value):
            ka = ra[role].kernel if role in ra else a.baseline
            kb = rb[role].kernel if role in rb else b.baseline
            if ka != kb:
                out[f"{name}:{role.value}"] = f"{ka} -> {kb}"
    return out


def compare_rows(rows, model: str, plans: Dict[str, Plan], before: ProbeReport,
                 after: ProbeReport) -> list:
    """For each (mode, graphs) of ``model`` with a bf16 and a LoKA row, both measured on a
    GPU: the GPU time saved as measured, and as each pricing predicts for the plan the
    row ran (``plans[mode]``)."""
    out = []
    ok = [r for r in rows if r.get("status") == "ok" and r.get("model") == model
          and r.get("gpu_ms")]
    for lk in (r for r in ok if r["variant"] == "loka"):
        base = next((r for r in ok if r["variant"] == "bf16" and r["mode"] == lk["mode"]
                     and r["graphs"] == lk["graphs"]
                     and r.get("batch_size") == lk.get("batch_size")), None)
        plan = plans.get(lk["mode"])
        if base is None or plan is None:
            continue
        inference = lk["mode"] == "serve"
        row = {"mode": lk["mode"], "graphs": lk["graphs"], "batch_size": lk.get("batch_size"),
               "bf16_gpu_ms": base["gpu_ms"], "loka_gpu_ms": lk["gpu_ms"],
               "measured_saved_ms": base["gpu_ms"] - lk["gpu_ms"]}
        for tag, rep in (("recorded", before), ("repriced", after)):
            pred = predict_step(plan, rep, base["gpu_ms"], inference=inference)
            row[f"{tag}_saved_ms"] = pred.saved_ms
            row[f"{tag}_gpu_error"] = lk["gpu_ms"] / pred.predicted_step_ms - 1
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="evaluation-set model (bench/evalset)")
    ap.add_argument("--scale", default="paper", choices=("paper", "tiny"))
    ap.add_argument("--report", required=True, help="the Probe report (JSON) to price again")
    ap.add_argument("--eval", help="an eval_set.py JSON with this model's bf16 and LoKA rows")
    ap.add_argument("--plan-train", help="the training plan the LoKA rows ran (default: the "
                    "plan made from the recorded report, as the evaluation set makes it)")
    ap.add_argument("--plan-serve", help="the serving plan the LoKA rows ran (default: as "
                    "--plan-train)")
    ap.add_argument("--batch-size", type=int, default=64,
                    help="rows of the one CPU training step that reads the producers")
    ap.add_argument("--eval-set", default=os.path.join(ROOT, "bench", "evalset"),
                    help="the evaluation set's package (its EVAL_MODELS and loss_fn)")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error("--batch-size must be positive")
    try:
        es = eval_set_with(args.eval_set, args.model)
        before = ProbeReport.load(args.report)
        with planning_off_device():
            plans = {"train": (Plan.load(args.plan_train) if args.plan_train
                               else loka.plan(before)),
                     "serve": (Plan.load(args.plan_serve) if args.plan_serve
                               else loka.plan(before, inference=True))}
        rows = json.load(open(args.eval))["rows"] if args.eval else []
    except (OSError, ValueError, ReportError, KeyError) as e:
        print(f"reprice: {e}".splitlines()[0], file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = es.EVAL_MODELS[args.model](args.scale)
    batch = model.make_batch(args.batch_size, dtype=torch.float32, seed=0)
    producers = read_producers(model, batch, es.loss_fn)
    missing = sorted(set(before.sites) - set(producers))
    if missing:
        print(f"reprice: the report's sites {missing[:3]} are not Linears of {args.model} "
              f"({args.scale})", file=sys.stderr)
        return 2
    after = reprice(before, producers)
    with planning_off_device():
        again = {mode: loka.plan(after, inference=mode == "serve") for mode in plans}
    doc: Dict[str, object] = {
        "schema": "loka.reprice", "version": 1, "argv": list(sys.argv[1:] if argv is None
                                                            else argv),
        "model": args.model, "report": args.report,
        "changed_producers": changed_kinds(before, after),
        "plan_changes": {mode: plan_changes(plans[mode], again[mode]) for mode in plans},
        "rows": compare_rows(rows, args.model, plans, before, after)}
    print(json.dumps(json_safe(doc), indent=1))
    if args.out:
        atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
