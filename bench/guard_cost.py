"""What Dynamo checks before every call of a compiled model: its guards, with and without a plan.

A compiled model's every call first runs the guards of its cached frame (the
``TorchDynamo Cache Lookup`` event of a host profile). ``loka.apply`` adds the guards of
the traced LoKA path: the Linear's kernels and their closures, and the globals of the loka
modules the trace read. This compiles an evaluation-set model for serving (as written, then
with a plan applied for inference), and reports per variant the number of guard lines
Dynamo prints, the time of one check of the cached frame's guards (the median of
``--repeats`` batches of 200 checks), and what a host profile of 10 calls puts under
Dynamo's ``TorchDynamo Cache Lookup`` event per call (``profiled_lookup_us``: the event a
GPU run's host profile shows; the profiler's own cost is in it). ``--train`` does the
same for a training step (the plan applied for training, the model compiled and called
with gradients, one backward). Guards are host work, the same on any device: it runs on
the CPU (the plan's kernels must run there: cuBLAS names without ``-fastacc``).

    PYTHONPATH=. python bench/guard_cost.py --model dcnv2 --plan plan.serve.json --out g.json
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import loka  # noqa: E402
from loka.bench.evalset import eval_set_with  # noqa: E402


PROFILED_CALLS = 10
"""calls of the compiled model under torch.profiler, for its cache-lookup event"""


def measure(model: torch.nn.Module, inputs, repeats: int, train: bool = False,
            no_grad: bool = False, backend: str = "inductor") -> dict:
    """Compile ``model``, call it once (with a backward for ``train``), and time its
    cached frame's guard check; a serving forward runs under ``inference_mode`` (as the
    evaluation set's rows run it), or under ``no_grad`` (as ``loka.optimize``'s timer
    does by default). The guards are Dynamo's: ``backend`` changes what runs between
    them, not them."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    mode = (contextlib.nullcontext() if train else
            torch.no_grad() if no_grad else torch.inference_mode())
    with mode:
        out = compiled(*inputs)
        if train:
            out.float().mean().backward()
        entries = _debug_get_cache_entry_list(type(model).forward.__code__)
        if len(entries) != 1:
            raise RuntimeError(f"expected one compiled frame, found {len(entries)}")
        guards = entries[0].guard_manager
        names = list(inspect.signature(type(model).forward).parameters)
        f_locals = dict(zip(names, (model,) + tuple(inputs)))
        if not guards.check(f_locals):
            raise RuntimeError("the compiled frame's guards fail on the inputs it was made for")
        per_call = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(200):
                guards.check(f_locals)
            per_call.append((time.perf_counter() - t) / 200 * 1e6)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_CALLS):
                compiled(*inputs)
    lookup = sum(e.self_cpu_time_total for e in prof.key_averages()
                 if e.key == "TorchDynamo Cache Lookup") / PROFILED_CALLS
    text = str(guards)
    return {"guard_lines": len(text.splitlines()),
            "lambda_guards": text.count("LAMBDA_GUARD"),
            "check_us": statistics.median(per_call), "profiled_lookup_us": lookup}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--eval-set", default=str(ROOT / "bench" / "evalset"))
    p.add_argument("--model", required=True)
    p.add_argument("--scale", default="paper", choices=("paper", "tiny"))
    p.add_argument("--plan", required=True, help="a plan for the model (JSON)")
    p.add_argument("--train", action="store_true",
                   help="a training step's guards (default: a serving forward's)")
    p.add_argument("--no-grad", action="store_true",
                   help="serve under torch.no_grad instead of torch.inference_mode")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--backend", default="inductor",
                   help="torch.compile's backend (the guards are Dynamo's whatever it is; "
                        "aot_eager skips Inductor's code generation)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.repeats < 1:
        p.error("--batch-size and --repeats must be >= 1")
    if args.no_grad and args.train:
        p.error("--no-grad is for a serving forward; --train steps keep their gradients")
    try:
        es = eval_set_with(args.eval_set, args.model)
        plan = loka.Plan.load(args.plan)
    except (ValueError, OSError) as e:
        p.error(str(e).splitlines()[0])
    torch.manual_seed(0)
    model = es.EVAL_MODELS[args.model](args.scale).train(args.train)
    inputs = model.make_batch(args.batch_size, "cpu", torch.float32, seed=0)[0]
    rows = {"as written": measure(model, inputs, args.repeats, args.train, args.no_grad,
                                  args.backend)}
    loka.apply(model, plan, inference=not args.train)
    rows["plan"] = measure(model, inputs, args.repeats, args.train, args.no_grad, args.backend)
    rows["plan"]["fp8_site_roles"] = sum(c.kernel != plan.baseline for sp in plan.sites.values()
                                         for c in sp.roles.values())
    doc = {"schema": "loka.bench.guard_cost", "version": 1,
           "command": " ".join(["bench/guard_cost.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "torch": torch.__version__, "model": args.model, "scale": args.scale,
           "backend": args.backend,
           "mode": "train" if args.train else "serve",
           "grad_mode": "grad" if args.train else "no_grad" if args.no_grad else "inference_mode",
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{args.model} {name}: {r['guard_lines']} guard lines ({r['lambda_guards']} "
              f"in Python), one check {r['check_us']:.1f} us, profiled cache lookup "
              f"{r['profiled_lookup_us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
