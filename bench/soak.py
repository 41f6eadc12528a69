"""Soak: train a reference model with an FP8 plan and the Guard on while faults are
injected, and report what was caught. Not part of CI (a short CPU run is: tests/test_soak.py).

    python bench/soak.py                                   # Wukong tiny, CPU, 200 steps
    python bench/soak.py --preset small --steps 2000 --device cuda --plan plan.json
    python bench/soak.py --inf-steps 40,90 --fp8-fault-step 60 --drift-from 120 --out soak.json

Three faults, each at chosen steps:

``grad-inf``
    Inf in the gradient of the model's output (a bad batch, a broken loss: not an FP8
    kernel). No site is to blame; the step's update must be skipped.
``fp8-grad``
    One FP8 site's weight-gradient GEMM returns Inf (an FP8 overflow) from that step on.
    The Guard must switch that site to the baseline (and skip that step's update).
``drift``
    One FP8 site's activations drift beyond the static FP8 input scale it was given (4x
    its amax before training): they grow from that step, up to ``--drift-max`` x. The
    Guard must switch that site (saturation beyond its threshold).

It trains with ``loka.train.train`` (the loop of ``loka train``) on the plan (default: every
Linear on ``--kernel``, ``Plan.uniform``) with the Guard checking every ``--guard-every``
steps, then prints and writes JSON: the faults injected and whether each was caught, the
sites switched, the skipped updates, the final training loss (finite or not) and the
held-out NE. Exit status 1 when a fault went uncaught or the final loss is not finite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
from typing import Dict, Iterator, List, Optional

import torch

import loka
from loka.config import ROLES, Role
from loka.data import Batch, SyntheticCTR
from loka.dispatch import Plan
from loka.kernels import get, register, unregister
from loka.train import train

FAULTY = "soak-wgrad-inf"
"""the kernel that wraps the fp8-grad site's weight-gradient kernel and injects the Inf"""
AMAX_MARGIN = 4.0
"""the drift site's static input scale: this many times its input amax before training"""


class Faults:
    """Which faults are on at the current step (the data stream advances it)."""

    def __init__(self, inf_steps: List[int], fp8_fault_step: int, drift_from: int,
                 drift_steps: int, drift_max: float) -> None:
        self.inf_steps, self.fp8_fault_step = set(inf_steps), fp8_fault_step
        self.drift_from, self.drift_steps, self.drift_max = drift_from, drift_steps, drift_max
        self.step = 0

    @property
    def grad_inf(self) -> bool:
        return self.step in self.inf_steps

    @property
    def fp8_grad(self) -> bool:
        return self.step >= self.fp8_fault_step

    @property
    def drift(self) -> float:
        """The factor the drift site's input is multiplied by at this step."""
        if self.step < self.drift_from:
            return 1.0
        ramp = min(1.0, (self.step - self.drift_from + 1) / max(self.drift_steps, 1))
        return 1.0 + ramp * (self.drift_max - 1.0)

    def stream(self, data: SyntheticCTR) -> Iterator[Batch]:
        for step, batch in enumerate(data, start=1):
            self.step = step
            yield batch


def _faulty_kernel(base_name: str, faults: Faults):
    base = get(base_name)

    def inf_wgrad(a, b, out_dtype):
        y = base(a, b, out_dtype)
        if faults.fp8_grad:
            y = y.clone()
            y[0, 0] = float("inf")
        return y

    return dataclasses.replace(base, name=FAULTY, fn=inf_wgrad, emulates=None,
                               description=f"{base_name} whose output turns Inf (soak)")


def _pick_sites(model: torch.nn.Module, plan: Plan) -> Dict[str, str]:
    """An FP8 site for each FP8 fault: one whose weight gradient is FP8 (fp8-grad) and
    another whose forward kernel takes a static input scale (drift)."""
    fp8 = set(plan.fp8_sites())
    picked: Dict[str, str] = {}
    for site in plan.sites:
        if site not in fp8:
            continue
        kernels = {r: get(plan.sites[site].kernel(r, plan.baseline)) for r in ROLES}
        if "fp8-grad" not in picked and kernels[Role.WGRAD].is_fp8:
            picked["fp8-grad"] = site
        elif "drift" not in picked and kernels[Role.FWD].is_fp8 and \
                kernels[Role.FWD].quantize_a is not None and kernels[Role.FWD].scaling in (
                    "tensorwise", "rowwise"):
            picked["drift"] = site
    missing = {"fp8-grad", "drift"} - set(picked)
    if missing:
        raise SystemExit(f"soak: the plan has no FP8 site for {sorted(missing)}: give a plan "
                         "or --kernel with FP8 on several sites")
    return picked


def _input_amax(model: torch.nn.Module, site: str, batch: Batch) -> float:
    seen: List[float] = []
    handle = model.get_submodule(site).register_forward_pre_hook(
        lambda m, args: seen.append(float(args[0].detach().abs().max())))
    try:
        with torch.no_grad():
            model(batch)
    finally:
        handle.remove()
    return max(seen)


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    model = loka.models.build(args.model, args.preset).to(device)
    batch_size = args.batch_size or model.default_batch_size
    data = SyntheticCTR(model.feature_spec, batch_size, seed=args.seed, device=device)
    held = data.held_out()
    rng = random.Random(args.seed)
    inf_steps = (sorted(int(s) for s in args.inf_steps.split(",") if s.strip())
                 if args.inf_steps else sorted(rng.sample(range(2, args.steps), 3)))
    faults = Faults(inf_steps, args.fp8_fault_step or max(2, args.steps // 3),
                    args.drift_from or max(3, args.steps // 2), args.drift_steps, args.drift_max)

    kernel = args.kernel or ("cublas-rowwise" if device.type == "cuda" else "emulated-rowwise-e4m3")
    plan = Plan.load(args.plan) if args.plan else Plan.uniform(model, kernel, device=device)
    sites = _pick_sites(model, plan)
    wgrad_kernel = plan.sites[sites["fp8-grad"]].kernel(Role.WGRAD, plan.baseline)
    register(_faulty_kernel(wgrad_kernel, faults), override=True)
    try:
        plan.sites[sites["fp8-grad"]].roles[Role.WGRAD].kernel = FAULTY
        amax = _input_amax(model, sites["drift"], next(iter(held)))
        loka.apply(model, plan)
        drift_mod = model.get_submodule(sites["drift"])
        drift_mod.set_input_amax(AMAX_MARGIN * amax)
        drift_mod.register_forward_pre_hook(lambda m, a: (a[0] * faults.drift,) + tuple(a[1:]))

        def poison_output_grad(module, inputs, out):
            if faults.grad_inf and out.requires_grad:
                out.register_hook(lambda g: g + float("inf"))

        model.register_forward_hook(poison_output_grad)
        result = train(model, faults.stream(data), args.steps, lr=args.lr, device=device,
                       eval_iter=held, eval_steps=args.eval_steps, guard_every=args.guard_every,
                       progress=False, seed=args.seed)
    finally:
        unregister(FAULTY)

    switched = {e.site: e for e in result.guard_events}
    injected = [
        {"fault": "grad-inf", "steps": inf_steps,
         "caught": all(s in result.skipped_steps for s in inf_steps if s <= result.steps),
         "how": "update skipped, no site blamed"},
        {"fault": "fp8-grad", "site": sites["fp8-grad"], "from_step": faults.fp8_fault_step,
         "caught": sites["fp8-grad"] in switched,
         "switched_at": getattr(switched.get(sites["fp8-grad"]), "step", None)},
        {"fault": "drift", "site": sites["drift"], "from_step": faults.drift_from,
         "caught": sites["drift"] in switched and "saturation" in switched[sites["drift"]].reason,
         "switched_at": getattr(switched.get(sites["drift"]), "step", None)},
    ]
    final_loss = result.losses[-1] if result.losses else math.nan
    out = {
        "model": f"{args.model}/{args.preset}", "device": str(device), "steps": result.steps,
        "batch_size": batch_size, "kernel": None if args.plan else kernel, "plan": args.plan,
        "guard_every": args.guard_every, "fp8_sites": len(plan.fp8_sites()),
        "faults": injected,
        "faults_injected": len(injected), "faults_caught": sum(f["caught"] for f in injected),
        "sites_switched": [{"site": e.site, "step": e.step, "reason": e.reason}
                           for e in result.guard_events],
        "skipped_steps": result.skipped_steps,
        "final_loss": final_loss if math.isfinite(final_loss) else str(final_loss),
        "final_loss_finite": math.isfinite(final_loss),
        "held_out_ne": result.final.get("ne"),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }
    out["ok"] = (out["faults_caught"] == out["faults_injected"] and out["final_loss_finite"]
                 and out["params_finite"])
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", default=None, help="a plan.json (default: every Linear on --kernel)")
    p.add_argument("--kernel", default=None,
                   help="the uniform plan's kernel (default: cublas-rowwise on CUDA, "
                        "emulated-rowwise-e4m3 on the CPU)")
    p.add_argument("--guard-every", type=int, default=10, help="the Guard's check_every")
    p.add_argument("--inf-steps", default=None,
                   help="steps with Inf in the output gradient, e.g. 40,90 (default: 3 random)")
    p.add_argument("--fp8-fault-step", type=int, default=None,
                   help="from this step the fp8-grad site's wgrad returns Inf (default: steps/3)")
    p.add_argument("--drift-from", type=int, default=None,
                   help="the drift site's input grows from this step (default: steps/2)")
    p.add_argument("--drift-steps", type=int, default=10, help="steps to reach --drift-max")
    p.add_argument("--drift-max", type=float, default=16.0,
                   help="the drift's largest factor (the static scale is 4x the amax)")
    p.add_argument("--eval-steps", type=int, default=4)
    p.add_argument("--out", default="soak.json", help="the JSON to write")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    out = run(args)
    for f in out["faults"]:
        where = f" at {f['site']}" if "site" in f else f" at steps {f['steps']}"
        print(f"{f['fault']:9s}{where}: {'caught' if f['caught'] else 'NOT CAUGHT'}"
              + (f" (switched at step {f['switched_at']})" if f.get("switched_at") else ""))
    print(f"{out['faults_caught']}/{out['faults_injected']} faults caught; "
          f"{len(out['sites_switched'])} site(s) switched; updates skipped at "
          f"{out['skipped_steps']}; final loss {out['final_loss']}; held-out NE "
          f"{out['held_out_ne']}")
    directory = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(directory, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
