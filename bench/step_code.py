#!/usr/bin/env python3
"""What Inductor makes of a plan on a GPU: kernels, bytes and GEMM FLOPs of one compiled
training step (or serving forward) of an evaluation-set model, from the CUDA code
Inductor generates (``loka.bench.stepcode``). Runs on a machine without a GPU (the code
is generated for a simulated H200 and nothing runs) or with one (the real compilation, and
each variant's compiled step timed: median wall time of ``--steps`` steps, GPU time from
the profiler, bytes over time kernel by kernel).

Variants: ``bf16`` (no plan), the plan given with ``--plan``, and one variant per kernel
of ``--families``: the plan's FP8 site-roles all moved to that kernel, so that the same
sites and roles compare by how their operands are quantized. ``--delayed`` adds, for the
plan and each family, a twin with delayed tensorwise scaling (``loka.apply(...,
delayed_scaling=True)``; only roles that scale tensorwise change). ``--static-report
REPORT`` adds, for serving, a twin with static activation scales: each site's input amax
as the Probe report observed it (``loka.apply(..., static_scales=amax_from_report(...))``;
the cast then needs no amax pass). ``--inductor-config
KEY=VALUE`` (repeatable) sets ``torch._inductor.config`` options for every variant (how
Inductor's own choices move the bytes, bf16's included). A variant that fails is
recorded with its error and the others go on. Without a GPU, serving plans whose weights
a Triton kernel quantizes cannot be applied (the weight is quantized when the plan is
applied, by a kernel that needs the GPU).

    python bench/step_code.py --model wukong --scale paper --batch-size 4096 \\
        --plan bench/results/2026-12-05-h200-evalset/wukong.b4096.plan.train.json \\
        --families cublas-rowwise-fastacc,cublas-tensorwise-fastacc,triton-rowwise-cublas-fastacc \\
        --out step_code.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402

import loka  # noqa: E402
from loka.bench import evalset as lev  # noqa: E402
from loka.bench.stepcode import (cuda_step_code, inductor_options, inventory, output_code,  # noqa: E402
                                 summarize)
from loka.dispatch import Plan, RoleChoice, amax_from_report  # noqa: E402
from loka.jsonio import atomic_write_text  # noqa: E402
import json  # noqa: E402


def variant_plan(plan: Plan, kernel: str) -> Plan:
    """``plan`` with every FP8 site-role on ``kernel`` (baseline roles stay)."""
    out = copy.deepcopy(plan)
    for site in out.sites.values():
        for role, choice in site.roles.items():
            if choice.kernel != plan.baseline:
                site.roles[role] = RoleChoice(kernel)
    return out


def measure(model_cls, scale: str, batch_size: int, plan, mode: str, on_cuda: bool,
            save_dir: str | None, tag: str, delayed: bool = False, steps: int = 0,
            static_report=None) -> dict:
    """One variant's kernels and bytes (and, on a GPU with ``steps``, its times);
    ``static_report``: a Probe report whose observed input amax serves as static scales."""
    import bench.evalset as es
    torch.manual_seed(0)
    model = model_cls(scale).to(torch.bfloat16)
    device = "cuda" if on_cuda else "cpu"
    model = model.to(device)
    if plan is not None and mode == "serve" and not on_cuda:
        triton = sorted({c.kernel for sp in plan.sites.values() for c in sp.roles.values()
                         if c.kernel.startswith("triton-")})
        if triton:
            raise RuntimeError(f"serving plans quantize weights when applied; {', '.join(triton)} "
                               "quantize with Triton, which needs the GPU")
    if plan is not None:
        # a CPU model takes CUDA kernels here: the code is generated for a CUDA device
        with mock.patch("loka.dispatch.swap._device_problem", lambda *a: None):
            scales = lev.static_scales(static_report, plan) if static_report else None
            loka.apply(model, plan, inference=(mode == "serve"), delayed_scaling=delayed,
                       static_scales=scales or None)
    if mode == "serve":
        model.eval()
    inputs, labels = model.make_batch(batch_size, device=device, dtype=torch.bfloat16, seed=0)
    if delayed and mode == "train":
        # the first training call seeds the estimates (dynamic scaling); the step measured
        # is the one after it, with the estimates' scales. On a GPU that first call is an
        # eager step, as a user's would be; without one, nothing can run: fixed seeds
        if on_cuda:
            es.loss_fn(model, (inputs, labels)).backward()
            model.zero_grad(set_to_none=True)
        else:
            for mod in model.modules():
                if getattr(mod, "delayed_decay", None) is not None:
                    mod.seed_delayed(1.0, 1.0, 1.0)
    timing = {}
    t0 = time.perf_counter()
    if on_cuda and steps > 0:
        codes, timing = time_variant(model, inputs, labels, mode, steps)
    else:
        codes = cuda_step_code(model, (inputs, labels) if mode == "train" else inputs,
                               es.loss_fn if mode == "train" else None, train=(mode == "train"))
    wall = time.perf_counter() - t0  # code generation, and on a GPU the timing too
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
        for i, code in enumerate(codes):
            with open(os.path.join(save_dir, f"{tag}.graph{i}.py"), "w") as f:
                f.write(code)
    launches = [launch for code in codes for launch in inventory(code)]
    row = dict(summarize(launches), graphs=len(codes), wall_s=round(wall, 1))
    if len(codes) > (2 if mode == "train" else 1):  # a recompilation: its code is summed too
        print(f"[step_code] {tag}: {len(codes)} graphs compiled (a recompilation); their "
              "kernels are all counted", file=sys.stderr)
    if timing:
        kernels_ms = timing.pop("kernels_ms")
        row.update(timing, kernel_rates=lev.kernel_rates(kernels_ms, launches))
    return row


def time_variant(model, inputs, labels, mode: str, steps: int):
    """On a GPU: compile ``model`` as the evaluation set does (training: BCE loss, backward,
    fused AdamW), keep Inductor's code of every graph it compiles (the first step's, unless
    a guard fails later), then the median wall time of
    ``steps`` steps after 5 warm-up steps and the profiled GPU time of 3 more."""
    import bench.evalset as es
    device = next(model.parameters()).device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the previous variant's memory, as the evaluation set does
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model)
        step = lev.make_step(compiled, model, mode, (inputs, labels), False, device, es.loss_fn)
        with output_code() as codes:  # every graph compiled while timing (one, normally)
            t = lev.time_steps(step, device, warmup=5, steps=steps)
        prof = lev.profile_gpu(step, 3)
    finally:
        torch._dynamo.reset()
    timing = {"step_ms": t["step_ms"], "step_ms_min": t["step_ms_min"],
              "step_ms_max": t["step_ms_max"], "first_step_s": t["first_step_s"],
              "gpu_ms": prof["gpu_ms_per_step"], "profile_ms": prof["by_class_ms"],
              "top_kernels_ms": prof["top_kernels_ms"], "kernels_ms": prof["kernels_ms"],
              "wall_over_gpu": t["step_ms"] / max(prof["gpu_ms_per_step"], 1e-9)}
    return list(codes), timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="wukong", help="evaluation-set model (bench/evalset)")
    ap.add_argument("--scale", default="paper", choices=("paper", "tiny"))
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--mode", default="train", choices=("train", "serve"))
    ap.add_argument("--plan", help="plan JSON (its FP8 sites and roles); none: bf16 only")
    ap.add_argument("--uniform", metavar="KERNEL",
                    help="instead of --plan: Plan.uniform of the model on KERNEL (every Linear "
                         "it fits, each role where it can serve it on this machine)")
    ap.add_argument("--families", default="",
                    help="comma-separated kernels: one variant each, the plan's FP8 roles on it")
    ap.add_argument("--delayed", action="store_true",
                    help="add a delayed-scaling twin of the plan and of each family")
    ap.add_argument("--static-report", metavar="REPORT",
                    help="serving: add a twin of the plan and of each family with static "
                         "activation scales from this Probe report's observed input amax")
    ap.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config option for every variant (repeatable; "
                         "VALUE is read as JSON, e.g. realize_reads_threshold=3)")
    ap.add_argument("--steps", type=int, default=20,
                    help="on a GPU: time each variant's compiled step (median of STEPS after 5 "
                         "warm-up steps, GPU time profiled over 3); 0: code only")
    ap.add_argument("--save-code", help="directory for the generated code of every variant")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args(argv)
    import bench.evalset as es
    if args.model not in es.EVAL_MODELS:
        ap.error(f"unknown model {args.model!r}; choose from {sorted(es.EVAL_MODELS)}")
    if args.batch_size < 1:
        ap.error("--batch-size must be positive")
    if args.steps < 0:
        ap.error("--steps must be >= 0")
    families = [k for k in args.families.split(",") if k]
    try:
        inductor = inductor_options(args.inductor_config)
    except ValueError as e:
        ap.error(f"--inductor-config {e}")
    if args.plan and args.uniform:
        ap.error("give --plan or --uniform, not both")
    if families and not (args.plan or args.uniform):
        ap.error("--families needs --plan or --uniform (its FP8 site-roles)")
    if args.uniform:
        try:
            kern = loka.kernels.registry.get(args.uniform)
        except KeyError as e:
            ap.error(f"--uniform: {e.args[0]}")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # without a GPU, a CUDA-only kernel (fast accumulation) takes the roles its twin
        # takes here: the same shapes qualify, and the code is generated for a GPU anyway
        base = (kern.quantizes_as if device == "cpu" and not kern.device_ok(device)
                and kern.quantizes_as else args.uniform)
        plan = Plan.uniform(es.EVAL_MODELS[args.model](args.scale), base, device=device)
        if base != args.uniform:
            plan = variant_plan(plan, args.uniform)
        if all(c.kernel == plan.baseline for sp in plan.sites.values() for c in sp.roles.values()):
            ap.error(f"--uniform: {args.uniform} serves no role of {args.model} "
                     f"({args.scale}) on this machine: {plan.notes[0] if plan.notes else ''}")
    else:
        plan = Plan.load(args.plan) if args.plan else None
    for k in families:
        loka.kernels.registry.get(k)  # an unknown kernel fails here, in one line
    if args.delayed and args.mode != "train":
        ap.error("--delayed is for training (serving takes static scales)")
    static = None
    if args.static_report:
        if args.mode != "serve" or plan is None:
            ap.error("--static-report is for --mode serve with --plan or --uniform")
        try:
            static = loka.ProbeReport.load(args.static_report)
            amax_from_report(static)  # one line here where no site has an observed amax
        except (ValueError, OSError, KeyError) as e:
            ap.error(f"--static-report: {str(e).splitlines()[0]}")
    variants = [("bf16", None, False, None)]
    if plan is not None:
        planned = [("plan", plan)] + [(k, variant_plan(plan, k)) for k in families]
        for tag, p in planned:
            variants.append((tag, p, False, None))
            if args.delayed:
                variants.append((tag + "+delayed", p, True, None))
            if static:
                variants.append((tag + "+static", p, False, static))
    on_cuda = torch.cuda.is_available()
    rows = {}

    def save():  # after every variant: a run cut short keeps what it measured
        if args.out:
            meta = {"schema": "loka.step_code", "version": 2, "torch": torch.__version__,
                    "generated_for": "cuda" if on_cuda else "simulated H200 (no GPU)",
                    "device": torch.cuda.get_device_name() if on_cuda else None,
                    "argv": sys.argv[1:] if argv is None else list(argv), "model": args.model,
                    "scale": args.scale, "batch_size": args.batch_size, "mode": args.mode,
                    "plan": args.plan or (f"uniform:{args.uniform}" if args.uniform else None),
                    "inductor_config": inductor, "variants": rows}
            atomic_write_text(args.out, json.dumps(meta, indent=1) + "\n")
    for tag, p, delayed, static_report in variants:
        print(f"[step_code] {tag} ...", file=sys.stderr, flush=True)
        try:
            with inductor_config.patch(inductor):
                rows[tag] = measure(es.EVAL_MODELS[args.model], args.scale, args.batch_size,
                                    p, args.mode, on_cuda, args.save_code, tag, delayed,
                                    args.steps, static_report)
        except Exception as e:  # noqa: BLE001 - one variant's failure keeps the others
            rows[tag] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            print(f"[step_code] {tag} failed: {rows[tag]['error']}", file=sys.stderr)
        save()
    base = rows["bf16"]
    timed = any("step_ms" in r for r in rows.values())
    head = "| variant | launches | non-GEMM MB | vs bf16 | GEMM MB | FP8 GFLOP | bf16 GFLOP |"
    print(head + (" wall ms | GPU ms | bf16 wall / wall |" if timed else ""))
    print("|---" * (7 + 3 * timed) + "|")
    for tag, r in rows.items():
        if "error" in r or "error" in base:
            print(f"| {tag} | failed: {r.get('error', 'the bf16 row failed')} |" + " |" * (5 + 3 * timed))
            continue
        gemm_mb = sum(v for k, v in r["mbytes"].items() if k.startswith("gemm"))
        line = (f"| {tag} | {r['total_launches']} | {r['non_gemm_mbytes']:.0f} | "
                f"{r['non_gemm_mbytes'] - base['non_gemm_mbytes']:+.0f} | {gemm_mb:.0f} | "
                f"{r['gemm_gflops'].get('gemm_fp8', 0):.0f} | {r['gemm_gflops'].get('gemm_bf16', 0):.0f} |")
        if timed and "step_ms" in r and "step_ms" in base:
            line += f" {r['step_ms']:.3f} | {r['gpu_ms']:.3f} | {base['step_ms'] / r['step_ms']:.3f} |"
        elif timed:
            line += " | | |"
        print(line)
    for tag, r in rows.items():
        if r.get("serial_mbytes"):
            print(f"warning: {tag}: {r['serial_mbytes']:.0f} MB go through reductions that one "
                  "program does alone (few bytes, slow kernels)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
