"""What each ``loka`` subcommand does: one ``cmd_<name>(args) -> exit code`` per command,
over the argparse namespace that :func:`~loka.cli.parser.build_parser` makes; :func:`run`
calls the one the namespace names.

A failure the user can fix raises :class:`~loka.cli.args.CliError`, which ``main`` prints
as one line and a hint; :func:`run` turns an :class:`~loka.assembly.AssemblyError` (a
model or data stream that cannot be built as named) into one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import List, Tuple

import torch

from .. import bench
from ..assembly import (AssemblyError, Optimizers, build_model, criteo_features, device_batches,
                        make_streams, parse_data)
from ..config import ROLES, ProbeConfig
from ..demo.runner import run as run_demo
from ..dispatch import Plan, PlanMismatchError, apply, audit, check, optimize, override
from ..dispatch import plan as make_plan
from ..jsonio import atomic_write_text
from ..kernels import capabilities, registry
from ..probe import probe
from ..probe.report import ProbeReport
from ..reporting import text_plan, text_report, write_html, write_markdown, write_tensorboard
from ..reporting.tables import format_table
from ..train import CHECKPOINT_NAME, loss_fn, make_optimizers, train
from .args import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError, demo_config, parse_budgets,
                   parse_kernels, parse_mods, parse_pairs, probe_config, resolve_device, usage)
from .files import load_any, load_checkpoint, load_curves, load_plan, load_report

__all__ = ["run", "cmd_demo", "cmd_train", "cmd_probe", "cmd_plan", "cmd_optimize",
           "cmd_audit", "cmd_apply",
           "cmd_report", "cmd_bench", "cmd_kernels", "kernel_table", "mismatch_hint"]


def run(args) -> int:
    """Run the subcommand ``args.command`` (its ``cmd_<command>``); a model or data source
    that cannot be built as named (:class:`AssemblyError`) becomes the CliError it is: a
    usage error when the name itself is wrong."""
    try:
        return globals()[f"cmd_{args.command}"](args)
    except AssemblyError as e:
        raise CliError(e.message, e.hint, EXIT_USAGE if e.usage else EXIT_FAILURE) from e


def mismatch_hint(what: str = "the model") -> str:
    return (f"the plan was made for another model: pass the --model/--preset/--mods it was "
            f"probed with, or probe and plan {what} ('loka probe ... && loka plan ...')")


def cmd_demo(args) -> int:
    device = resolve_device(args)
    cfg = demo_config(args)
    build_model(cfg.model, cfg.preset, None)  # an unknown model or preset: a usage error now
    run_demo(cfg, device)
    return EXIT_OK


def cmd_train(args) -> int:
    device = resolve_device(args)
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, args.seed)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    plan = None
    if args.plan:
        plan = load_plan(args.plan)
        model.to(device)
        try:
            apply(model, plan)
        except PlanMismatchError as e:
            raise CliError(f"{args.plan}: {e}", mismatch_hint()) from None
    stream, held = make_streams(data, model, batch_size, args.seed, device)
    ckpt = os.path.join(args.out, CHECKPOINT_NAME)
    if args.resume and not os.path.exists(ckpt):
        print(f"note: no checkpoint at {ckpt}; starting a fresh run", file=sys.stderr)
    print(f"training {desc} on {args.data} for {args.steps} steps (batch {batch_size}, "
          f"{device}{', plan ' + args.plan if plan else ''})")
    try:
        result = train(
            model, stream, args.steps, lr=args.lr, device=device, eval_iter=held,
            eval_every=args.eval_every, eval_steps=args.eval_steps, checkpoint_dir=args.out,
            checkpoint_every=args.checkpoint_every, resume=args.resume, seed=args.seed)
    except RuntimeError as e:
        if args.resume and "state_dict" in str(e):
            raise CliError(f"{ckpt} holds another model's weights "
                           f"({str(e).splitlines()[0].strip()})",
                           "resume with the --model/--preset/--mods of that run, or pick "
                           "another --out") from None
        raise
    metrics = {"model": desc, "data": args.data, "steps": result.steps, "final": result.final,
               "eval_history": result.eval_history, "samples_per_s": result.samples_per_s,
               "resumed_from": result.resumed_from, "plan": args.plan}
    atomic_write_text(os.path.join(args.out, "metrics.json"), json.dumps(metrics, indent=1))
    f = result.final
    if "ne" in f:
        print(f"step {result.steps}: held-out NE {f['ne']:.5f}, AUC {f['auc']:.4f}, "
              f"log loss {f['logloss']:.5f} ({result.samples_per_s:,.0f} samples/s)")
    print(f"wrote {ckpt} and {os.path.join(args.out, 'metrics.json')}")
    return EXIT_OK


def _autocast(device: torch.device):
    """bf16 autocast on GPUs, as training and serving run there; nothing on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _autocast_loss(device: torch.device):
    def loss(m, batch):
        with _autocast(device):
            return loss_fn(m, batch)
    return loss


def _model_and_stream(args, device: torch.device):
    """The model the options name (Mods, checkpoint), on ``device``, and its training stream.

    Returns:
        ``(model, description, mods, batch_size, stream)``.
    """
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, args.seed)
    if args.checkpoint:
        load_checkpoint(model, args.checkpoint)
    model.to(device)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    stream, _ = make_streams(data, model, batch_size, args.seed, device)
    return model, desc, mods, batch_size, stream


def cmd_probe(args) -> int:
    device = resolve_device(args)
    cfg = probe_config(args)
    model, desc, mods, batch_size, stream = _model_and_stream(args, device)
    optimizer = Optimizers(make_optimizers(model, args.lr, device))

    loss = _autocast_loss(device)
    print(f"probing {desc} on {args.data}: {args.steps} training steps, then measuring "
          f"kernels on {device}")
    try:
        report = probe(model, device_batches(stream, device), loss, config=cfg,
                       optimizer=optimizer, steps=args.steps, device=device)
    except ValueError as e:  # e.g. no Linear matches --module-filter
        raise CliError(str(e), "check --module-filter against the model's Linear names") from None
    report.meta.update(model=desc, data=args.data, mods=dataclasses.asdict(mods),
                       batch_size=batch_size)
    report.save(args.out)
    print(report.summary_table())
    print(f"wrote {args.out}; next: loka plan {args.out} -o plan.json")
    return EXIT_OK


def cmd_optimize(args) -> int:
    device = resolve_device(args)
    kernels = parse_kernels(args.kernels)
    model, desc, mods, batch_size, stream = _model_and_stream(args, device)
    batches = [b for _, b in zip(range(args.steps), device_batches(stream, device))]
    config = ProbeConfig(num_samples=args.num_samples, kernels=kernels, seed=args.seed,
                         every_n_steps=1, max_error=args.max_error, min_speedup=args.min_speedup)
    print(f"optimizing {desc} for {'serving' if args.inference else 'training'} on {device}")

    def forward(m, batch):
        with _autocast(device):
            return m(batch)

    result = optimize(model, batches, _autocast_loss(device), inference=args.inference,
                      forward=forward, config=config,
                      max_error=args.max_error, min_speedup=args.min_speedup,
                      compile=not args.no_compile, compile_mode=args.compile_mode,
                      rounds=args.rounds, max_trials=args.max_trials,
                      progress=lambda line: print(f"  {line}"))
    result.plan.save(args.out)
    if args.report:
        result.report.meta.update(model=desc, data=args.data, mods=dataclasses.asdict(mods),
                                  batch_size=batch_size)
        result.report.save(args.report)
    print(result.plan.summary())
    if result.speedup is not None:
        print(f"whole step: {result.speedup:.3f}x of the step without FP8 (median of "
              f"{len(result.rounds)} A/B rounds)")
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    return EXIT_OK


def cmd_plan(args) -> int:
    report = load_report(args.report)
    allowed = None
    if args.kernels:
        allowed = [k.strip() for k in args.kernels.split(",") if k.strip()]
    device = resolve_device(args) if args.device else None
    try:
        plan = make_plan(report, max_error=args.max_error, min_speedup=args.min_speedup,
                         metric=args.metric,
                         role_budgets=parse_budgets(args.role_budget, "role-budget",
                                                    [r.value for r in ROLES]) or None,
                         site_budgets=parse_budgets(args.site_budget, "site-budget") or None,
                         allowed_kernels=allowed, device=device, assume_fast=args.assume_fast)
    except KeyError as e:
        raise usage(f"--kernels: {e.args[0]}", "list them with 'loka kernels'") from None
    except ValueError as e:
        raise usage(str(e)) from None
    if args.replace or args.assign:
        try:
            plan = override(
                plan, replace=parse_pairs(args.replace, "replace", "triton-rowwise-cublas=cublas-rowwise"),
                assign=parse_pairs(args.assign, "assign", "'over_arch.*:fwd=cublas-rowwise'"),
                report=report)
        except KeyError as e:
            raise usage(f"unknown kernel: {e.args[0]}", "list them with 'loka kernels'") from None
        except ValueError as e:
            raise usage(str(e)) from None
    plan.save(args.out)
    print(plan.summary())
    print(f"wrote {args.out}; check it against the model: loka apply --check {args.out} "
          f"--model MODEL")
    return EXIT_OK


def cmd_audit(args) -> int:
    plan, report = load_plan(args.plan), load_report(args.report)
    result = audit(plan, report)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{args.plan} against {args.report}: {result['site_roles']} site-role(s) checked")
        if result["ok"]:
            print("every choice within its budget; no kernel within the budget measured "
                  "faster than the one chosen")
        for v in result["violations"]:
            extra = (f" ({v['chosen']} x{v['chosen_speedup']:.2f} < {v['best']} "
                     f"x{v['best_speedup']:.2f})" if "best" in v else "")
            print(f"  {v['site']} {v['role']}: {v['why']}{extra}")
    return EXIT_OK if result["ok"] else EXIT_FAILURE


def cmd_apply(args) -> int:
    if not args.check:
        raise usage("'loka apply' only checks a plan (--check): a model changed in memory "
                    "would be lost when the command ends",
                    "apply for real with 'loka train --plan plan.json' or loka.apply(model, plan)")
    plan = load_plan(args.plan)
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, 0)
    device = resolve_device(args) if args.device else None
    if device is not None:
        model.to(device)
    try:
        changes = check(model, plan, inference=args.inference)
    except PlanMismatchError as e:
        raise CliError(f"{args.plan} does not fit {desc}: {str(e).split(': ', 1)[-1]}",
                       mismatch_hint(desc)) from None
    changed = [c for c in changes if c.action != "keep"]
    mode = "inference" if args.inference else "training"
    print(f"{args.plan} fits {desc}: {len(changed)} of {len(plan.sites)} site(s) would change "
          f"({mode}); nothing was modified")
    for c in changed:
        print(f"  {c}")
    return EXIT_OK


def cmd_report(args) -> int:
    report = plan = None
    for path in args.files:
        obj = load_any(path)
        if isinstance(obj, ProbeReport):
            if report is not None:
                raise usage("two reports given", "pass one report.json and/or one plan.json")
            report = obj
        elif isinstance(obj, Plan):
            if plan is not None:
                raise usage("two plans given", "pass one report.json and/or one plan.json")
            plan = obj
    curves = load_curves(args.curves) if args.curves else None
    if report is not None:
        print(text_report(report, plan, args.metric))
    else:
        print(text_plan(plan))
    if args.html:
        write_html(args.html, report, plan, curves, title=args.title)
        print(f"wrote {args.html}")
    if args.markdown:
        write_markdown(args.markdown, report, plan, curves, title=args.title)
        print(f"wrote {args.markdown}")
    if args.tensorboard:
        try:
            n = write_tensorboard(args.tensorboard, report, plan, curves)
        except RuntimeError as e:
            raise CliError(str(e), "or leave out --tensorboard; report.html has the same plots") from None
        print(f"wrote {n} TensorBoard scalars to {args.tensorboard}")
    return EXIT_OK


def cmd_bench(args) -> int:
    if getattr(args, "device", None) is not None:
        resolve_device(args)
    try:
        bench.run_from_args(args)
    except ValueError as e:  # an unknown variant, model or preset
        raise usage(str(e)) from None
    return EXIT_OK


def kernel_table(device) -> Tuple[List[str], List[List[str]]]:
    """Headers and one row per registered kernel: what runs on ``device`` and why not."""
    headers = ["kernel", "library", "formats", "scaling", "roles", "available", "reason"]
    body = []
    for k in registry.all_kernels():
        ok = k.device_ok(device)
        roles = ",".join(r.value for r in ROLES if r in k.roles)
        body.append([k.name, k.library, " x ".join(k.formats), k.scaling, roles,
                     "yes" if ok else "no", "" if ok else ok.reason])
    return headers, body


def cmd_kernels(args) -> int:
    device = resolve_device(args)
    headers, body = kernel_table(device)
    summary = capabilities.summary(device)
    if args.json:
        print(json.dumps({"device": str(device), "capabilities": summary,
                          "kernels": [dict(zip(headers, r)) for r in body]}, indent=1))
        return EXIT_OK
    n_ok = sum(r[5] == "yes" for r in body)
    print(f"{n_ok} of {len(body)} registered kernels run on {device} (torch {summary['torch']}"
          f"{', compute capability ' + '.'.join(map(str, summary['cuda_capability'])) if summary['cuda_capability'] else ''})")
    print()
    print(format_table(headers, body))
    libs = [("triton", capabilities.module_available("triton")),
            ("torchao", summary["torchao"]), ("fbgemm-gpu-genai", summary["fbgemm_genai"])]
    print()
    print("optional libraries: " + ", ".join(f"{n} {'installed' if ok else 'not installed'}"
                                             for n, ok in libs)
          + " (a library that is not installed registers no kernels)")
    scaled = [s for s in ("tensorwise", "rowwise", "blockwise") if summary[f"scaled_mm_{s}"]]
    print(f"torch._scaled_mm on {device}: {', '.join(scaled) if scaled else 'none'}")
    return EXIT_OK
