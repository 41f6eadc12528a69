"""What each ``loka`` subcommand does: one ``cmd_<name>(args) -> exit code`` per command,
over the argparse namespace that :func:`~loka.cli.parser.build_parser` makes; :func:`run`
calls the one the namespace names.

A failure the user can fix raises :class:`~loka.cli.args.CliError`, which ``main`` prints
as one line and a hint; :func:`run` turns an :class:`~loka.assembly.AssemblyError` (a
model or data stream that cannot be built as named) and a malformed line of a Criteo file
into one.

Length: one ``cmd_<name>`` per subcommand and the few helpers they share (notes, the
evaluation line, strict JSON files); split by command, the modules would import each
other's helpers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import List, Optional, Tuple

import torch

from .. import bench
from ..assembly import (AssemblyError, Optimizers, build_model, criteo_features, device_batches,
                        make_streams, parse_data)
from ..bench.stepcode import inductor_options
from ..config import ROLES, ProbeConfig, Role
from ..data import CriteoFormatError
from ..demo.runner import run as run_demo
from ..dispatch import Plan, PlanMismatchError, apply, audit, check, optimize, override
from ..dispatch import plan as make_plan
from ..dispatch.static import static_scales_for
from ..dispatch.steptimer import check_capture
from ..jsonio import atomic_write_text, json_safe
from ..kernels import capabilities, registry
from ..numerics.delayed import DEFAULT_DECAY
from ..probe import probe
from ..probe.report import ProbeReport
from ..quality import (BaselineNotLearnedError, fp8_forwards, ne_budget, paired_check,
                       serve_ne_budget)
from ..reporting import text_plan, text_report, write_html, write_markdown, write_tensorboard
from ..reporting.tables import format_table
from ..train import (CHECKPOINT_NAME, CheckpointError, EmptyEvaluationError, PlanChangedError,
                     RunExistsError, RunInUseError, RunLock, check_optimizer_states,
                     checkpoint_plan, evaluate, loss_fn, make_optimizers, train)
from .args import (EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CliError, demo_config, kernel_hint,
                   parse_budgets, parse_kernels, parse_mods, parse_pairs, probe_config,
                   probe_kernels, resolve_device, unknown_kernels, usage)
from .files import (DAMAGED_HINT, check_plan_kernels, load_any, load_checkpoint, load_curves,
                    load_plan, load_report, load_weights, read_checkpoint_file)

__all__ = ["run", "cmd_demo", "cmd_train", "cmd_evaluate", "cmd_quality", "cmd_probe", "cmd_plan", "cmd_optimize",
           "cmd_audit", "cmd_apply",
           "cmd_report", "cmd_bench", "cmd_kernels", "kernel_table", "mismatch_hint",
           "BAD_LINE_HINT", "SYNTHETIC_EVAL_STEPS", "write_json"]

BAD_LINE_HINT = ("that line of the data file is not in the Criteo TSV layout (label, 13 counts, "
                 "26 hex ids, tab-separated): fix or remove it, or pass --skip-bad-lines")
SYNTHETIC_EVAL_STEPS = 20
"""batches of the synthetic held-out stream per evaluation when --eval-steps is left out
(the stream never ends; an evaluation file is read whole instead)"""
QUALITY_EVAL_STEPS = 64
"""the same for ``loka quality``, whose intervals narrow with the examples scored"""


def run(args) -> int:
    """Run the subcommand ``args.command`` (its ``cmd_<command>``); a model or data source
    that cannot be built as named (:class:`AssemblyError`) becomes the CliError it is: a
    usage error when the name itself is wrong; a malformed line of a Criteo file, a
    failure naming the file and the line."""
    try:
        return globals()[f"cmd_{args.command}"](args)
    except AssemblyError as e:
        raise CliError(e.message, e.hint, EXIT_USAGE if e.usage else EXIT_FAILURE) from e
    except CriteoFormatError as e:
        raise CliError(str(e), BAD_LINE_HINT) from e
    except EmptyEvaluationError as e:
        raise CliError(str(e), "give --data an evaluation file with at least one example"
                       ) from e


def write_json(path: str, obj) -> None:
    """``obj`` as strict JSON (inf and NaN as loka.jsonio writes them), atomically."""
    atomic_write_text(path, json.dumps(json_safe(obj), indent=1, allow_nan=False))


def _eval_steps(args, data) -> "int | None":
    """``--eval-steps``, or its default: the whole evaluation file, or
    :data:`SYNTHETIC_EVAL_STEPS` batches of the synthetic stream."""
    if args.eval_steps is not None or data.kind != "synthetic":
        return args.eval_steps
    return SYNTHETIC_EVAL_STEPS


def _eval_data(data, held, steps, count: int) -> dict:
    """What an evaluation read: its source, whether it is held out, how much of it."""
    whole = held.at_end() if hasattr(held, "at_end") else None
    return {"source": data.eval_source, "held_out": data.held_out, "examples": int(count),
            "batches": steps, "whole_file": whole}


def _eval_line(metrics: dict, eval_data: dict) -> str:
    """One line: the NE, AUC and log loss, what they were measured on, how many examples."""
    name = "held-out NE" if eval_data["held_out"] else "NE on the training file"
    n = eval_data["examples"]
    if eval_data["whole_file"] is None:
        where = f"over {n:,} examples ({eval_data['batches']} batches of the {eval_data['source']})"
    elif eval_data["whole_file"]:
        where = f"over {n:,} examples of {eval_data['source']} (the whole file)"
    else:
        where = (f"over {n:,} examples, part of {eval_data['source']} (--eval-steps "
                 f"{eval_data['batches']}; leave it out to read the whole file)")
    line = (f"{name} {metrics['ne']:.5f}, AUC {metrics['auc']:.4f}, log loss "
            f"{metrics['logloss']:.5f} {where}")
    if not eval_data["held_out"]:
        line += "; not held out: no evaluation file was given (criteo:TRAIN,EVAL names one)"
    return line


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def _skipped_lines(stream) -> None:
    skipped = getattr(stream, "num_skipped", 0)
    if skipped:
        _note(f"skipped {skipped} malformed line(s) of {stream.path} (--skip-bad-lines)")


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
    model, desc, mods, data = _named_model(args, args.seed)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    plan = None
    if args.plan:
        plan = load_plan(args.plan)
        check_plan_kernels(plan, args.plan)
        model.to(device)
        try:
            check(model, plan)  # a plan for another model fails before anything is written
        except PlanMismatchError as e:
            raise CliError(f"{args.plan}: {e}", mismatch_hint()) from None
    stream, held = make_streams(data, model, batch_size, args.seed, device,
                                skip_malformed=args.skip_bad_lines)
    ckpt = os.path.join(args.out, CHECKPOINT_NAME)
    try:
        with RunLock(args.out) as lock:
            if lock.takeover_note:
                _note(lock.takeover_note)
            return _train_locked(args, data, model, desc, stream, held, plan, batch_size,
                                 device, ckpt)
    except RunInUseError as e:
        raise CliError(str(e), "wait for that run to end, or train into another --out") from None


def _train_locked(args, data, model, desc, stream, held, plan, batch_size, device, ckpt) -> int:
    """``loka train`` holding the lock of ``--out``."""
    if args.resume and not os.path.exists(ckpt):
        _note(f"no checkpoint at {ckpt}; starting a fresh run")
    print(f"training {desc} on {args.data} for {args.steps} steps (batch {batch_size}, "
          f"{device}{', plan ' + args.plan + ', Guard on' if plan else ''})")

    def log(event) -> None:
        if event["event"] == "note":
            _note(event["message"])

    try:
        result = train(
            model, stream, args.steps, lr=args.lr, device=device, eval_iter=held,
            eval_every=args.eval_every, eval_steps=_eval_steps(args, data), checkpoint_dir=args.out,
            checkpoint_every=args.checkpoint_every, resume=args.resume, seed=args.seed,
            plan=plan, log_fn=log, warmup_steps=args.warmup_steps)
    except RunExistsError:
        raise usage(f"{args.out} already holds a run ({ckpt}); not overwriting it",
                    "continue it with --resume, or train into another --out") from None
    except CheckpointError as e:
        raise CliError(str(e), DAMAGED_HINT) from None
    except PlanChangedError:
        raise CliError(f"{ckpt} trained with another plan than {args.plan}",
                       "resume without --plan to continue with the plan the run trained "
                       "with, or train this plan into another --out") from None
    except PlanMismatchError as e:
        raise CliError(f"{ckpt}: the plan it recorded does not fit {desc} "
                       f"({str(e).split(': ', 1)[-1]})",
                       "resume with the --model/--preset/--mods of that run, or pick "
                       "another --out") from None
    except RuntimeError as e:
        if args.resume and "state_dict" in str(e):
            raise CliError(f"{ckpt} holds another model's weights "
                           f"({str(e).splitlines()[0].strip()})",
                           "resume with the --model/--preset/--mods of that run, or pick "
                           "another --out") from None
        raise
    _skipped_lines(stream)
    run_plan = result.plan
    f = result.final
    eval_data = _eval_data(data, held, _eval_steps(args, data), f["count"])
    metrics_path = os.path.join(args.out, "metrics.json")
    speed = f" ({result.samples_per_s:,.0f} samples/s)" if result.samples_per_s else ""
    print(f"step {result.steps}{speed}: {_eval_line(f, eval_data)}")
    if result.resumed_from == result.steps and os.path.exists(metrics_path):
        _note(f"the run is already at step {result.steps}: nothing left to train; "
              f"{metrics_path} is kept as the run wrote it")
        print(f"kept {metrics_path}")
        return EXIT_OK
    metrics = {"model": desc, "data": args.data, "steps": result.steps, "final": result.final,
               "eval_data": eval_data,
               "eval_history": result.eval_history, "samples_per_s": result.samples_per_s,
               "resumed_from": result.resumed_from, "plan": args.plan,
               "fp8_sites": [] if run_plan is None else run_plan.fp8_sites(),
               "fallbacks": [] if run_plan is None else [f.to_dict() for f in run_plan.fallbacks],
               "skipped_steps": result.skipped_steps}
    write_json(metrics_path, metrics)
    if run_plan is not None:
        print(f"plan: {len(run_plan.fp8_sites())} site(s) on FP8; the Guard switched "
              f"{len(result.guard_events)} to {run_plan.baseline} and skipped "
              f"{len(result.skipped_steps)} update(s) in this run")
    print(f"wrote {ckpt} and {os.path.join(args.out, 'metrics.json')}")
    return EXIT_OK


def cmd_evaluate(args) -> int:
    device = resolve_device(args)
    model, desc, mods, data = _named_model(args, args.seed)
    weights, state = read_checkpoint_file(args.checkpoint)
    plan, plan_name = None, None
    if args.plan:
        plan, plan_name = load_plan(args.plan), args.plan
        check_plan_kernels(plan, args.plan)
    elif state is not None:
        try:
            plan = checkpoint_plan(args.checkpoint, state)
        except CheckpointError as e:
            raise CliError(str(e), DAMAGED_HINT) from None
        if plan is not None:
            plan_name = "the checkpoint's"
            _note(f"evaluating with the plan {args.checkpoint} trained with "
                  f"({len(plan.fp8_sites())} FP8 site(s)); --plan names another")
    model.to(device)
    if plan is not None:
        try:
            check(model, plan)
        except PlanMismatchError as e:
            raise CliError(f"{args.plan or args.checkpoint}: the plan does not fit {desc} "
                           f"({str(e).split(': ', 1)[-1]})", mismatch_hint()) from None
        apply(model, plan)
    load_weights(model, weights, args.checkpoint)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    _, held = make_streams(data, model, batch_size, args.seed, device,
                           skip_malformed=args.skip_bad_lines)
    steps = _eval_steps(args, data)
    metrics = evaluate(model, held, steps, device=device, autocast_bf16=device.type == "cuda")
    _skipped_lines(held)
    eval_data = _eval_data(data, held, steps, metrics["count"])
    print(f"{args.checkpoint} ({desc}{', plan ' + plan_name if plan_name else ''}): "
          f"{_eval_line(metrics, eval_data)}")
    if args.out:
        write_json(args.out, {"schema": "loka.evaluation", "version": 1,
                              "checkpoint": args.checkpoint, "model": desc, "data": args.data,
                              "plan": plan_name, "metrics": metrics, "eval_data": eval_data})
        print(f"wrote {args.out}")
    return EXIT_OK


def _seeds(text: str) -> List[int]:
    try:
        seeds = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise usage(f"--seeds {text!r}: expected a comma list of distinct integers", "e.g. 0,1,2")
    return seeds


def cmd_quality(args) -> int:
    device = resolve_device(args)
    if args.plan is None and not args.control:
        raise usage("loka quality needs the plan arm's --plan (or --control for a control "
                    "run)", "make a plan with 'loka plan report.json -o plan.json'")
    if not 0.0 < args.confidence < 1.0:
        raise usage(f"--confidence {args.confidence}: expected a number in (0, 1)", "e.g. 0.95")
    if not (math.isfinite(args.logit_scale) and args.logit_scale > 0):
        raise usage(f"--logit-scale {args.logit_scale}: expected a positive number", "1: none")
    seeds = _seeds(args.seeds)
    model, desc, mods, data = _named_model(args, seeds[0])
    plan = None
    if args.plan:
        plan = load_plan(args.plan)
        check_plan_kernels(plan, args.plan)
        try:
            check(model.to(device), plan)
        except PlanMismatchError as e:
            raise CliError(f"{args.plan}: {e}", mismatch_hint()) from None
    weights, optimizer_state = None, None
    if args.checkpoint:
        weights, full = read_checkpoint_file(args.checkpoint)
        load_weights(model, weights, args.checkpoint)  # another model's weights: fail now
        # a `loka train` checkpoint: both arms continue its Adam moments, not fresh ones
        optimizer_state = None if full is None else full.get("optimizers")
        if optimizer_state is not None:
            try:  # another model's optimizer states: fail now too
                check_optimizer_states(make_optimizers(model, args.lr, device),
                                       optimizer_state)
            except ValueError as e:
                raise CliError(f"{args.checkpoint}: {e}", "give a checkpoint of this model "
                               "(--model, --preset, --mods), or its weights alone") from None
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    streams = {s: make_streams(data, model, batch_size, s, device,
                               skip_malformed=args.skip_bad_lines) for s in seeds}
    starts = {s: streams[s][0].state_dict() for s in seeds}
    held = streams[seeds[0]][1]
    eval_steps = args.eval_steps
    if eval_steps is None and data.kind == "synthetic":
        eval_steps = QUALITY_EVAL_STEPS

    def train_data(seed):
        stream = streams[seed][0]
        stream.load_state_dict(starts[seed])  # both arms: the same batches from the start
        return stream

    def eval_data():
        if data.kind == "synthetic":
            return (held.batch(i) for i in range(eval_steps))
        return make_streams(data, model, batch_size, seeds[0], device,
                            skip_malformed=args.skip_bad_lines)[1]

    def build(seed):
        return _named_model(args, seed)[0]

    scale = args.logit_scale
    if args.max_ne_change is not None:
        if args.control or scale != 1.0:
            raise usage("--max-ne-change holds a plan to an NE budget: it takes neither "
                        "--control nor --logit-scale")
        if not (math.isfinite(args.max_ne_change) and args.max_ne_change > 0):
            raise usage(f"--max-ne-change {args.max_ne_change}: expected a finite number > 0",
                        "2e-4 is 0.02% relative NE")
        return _quality_budget(args, plan, build, train_data, eval_data, seeds, device, weights,
                               None if data.kind == "synthetic" else eval_steps, desc,
                               optimizer_state)
    arm = "control" if args.control else "paired"
    print(f"quality check ({arm}) of {desc} on {args.data}: {args.steps} steps per arm, "
          f"seeds {','.join(map(str, seeds))}, plan {args.plan or 'none'}, {device}")
    result = paired_check(
        build, train_data, eval_data, plan, steps=args.steps, seeds=seeds, lr=args.lr,
        device=device, initial_state=weights, eval_steps=None if data.kind == "synthetic"
        else eval_steps, control=args.control, confidence=args.confidence,
        bootstrap=args.bootstrap, plan_logits=None if scale == 1.0 else (lambda z: z * scale),
        warmup_steps=args.warmup_steps, initial_optimizer_state=optimizer_state,
        meta={"model": desc, "data": args.data, "plan": args.plan, "mods": args.mods,
              "checkpoint": args.checkpoint, "checkpoint_optimizer_state":
              optimizer_state is not None, "lr": args.lr, "batch_size": batch_size,
              "device": str(device), "eval_source": data.eval_source,
              "eval_held_out": data.held_out,
              "perturbation": None if scale == 1.0 else f"logits x {scale!r}"})
    print(result.summary())
    if not data.held_out:
        _note("no evaluation file was given: both arms were scored on the training file "
              "(criteo:TRAIN,EVAL names a held-out one)")
    result.save(args.out)
    print(f"wrote {args.out}")
    return EXIT_OK


def _quality_budget(args, plan, build, train_data, eval_data, seeds, device, weights,
                    eval_steps, desc, optimizer_state=None) -> int:
    """``loka quality --max-ne-change``: the plan's costliest FP8 site-roles back to the
    baseline until the paired check holds (:func:`loka.quality.ne_budget`)."""
    print(f"NE budget of {args.plan} on {desc}: relative NE change <= {args.max_ne_change:.4%} "
          f"({args.steps} steps per arm, seeds {','.join(map(str, seeds))}, {device})")
    try:
        result = ne_budget(plan, build, train_data, eval_data,
                           max_ne_change=args.max_ne_change, steps=args.steps, seeds=seeds,
                           lr=args.lr, device=device, initial_state=weights,
                           eval_steps=eval_steps, confidence=args.confidence,
                           cost_steps=args.cost_steps, warmup_steps=args.warmup_steps,
                           max_baseline_ne=args.max_baseline_ne or None,
                           initial_optimizer_state=optimizer_state,
                           progress=lambda line: print(f"  {line}"))
    except BaselineNotLearnedError as e:
        raise CliError(str(e), "more --steps, a lower --lr, --warmup-steps, or a trained "
                       "--checkpoint; --max-baseline-ne sets the bound (0: no check)") from None
    for c in result.costs:
        back = " (moved back)" if f"{c.site}:{c.role}" in result.moved_back else ""
        print(f"  {c.site} {c.role}: {c.kernel}, NE cost {c.cost:.3e}{back}")
    print(result.plan.notes[-1])
    result.plan.save(args.plan_out)
    if result.quality is not None:
        result.quality.meta.update(model=desc, data=args.data, plan=args.plan_out,
                                   max_ne_change=args.max_ne_change)
        print(result.quality.summary())
        result.quality.save(args.out)
        print(f"wrote {args.plan_out} and {args.out}")
    else:
        print(f"wrote {args.plan_out} (every site-role on the baseline: no check to write)")
    return EXIT_OK


def _autocast(device: torch.device):
    """bf16 autocast on GPUs, as training and serving run there; nothing on the CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _autocast_loss(device: torch.device):
    def loss(m, batch):
        with _autocast(device):
            return loss_fn(m, batch)
    return loss


def _named_model(args, seed: int):
    """The model ``--model/--preset/--mods`` name, built with ``seed`` for ``--data`` (a
    Criteo file's features hashed into the preset's tables).

    Returns:
        ``(model, description, mods, data)``.
    """
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, seed,
                              tables=getattr(args, "tables", "torch"))
    return model, desc, mods, data


def _model_and_stream(args, device: torch.device):
    """The model the options name (Mods, checkpoint), on ``device``, and its training stream.

    Returns:
        ``(model, description, mods, batch_size, stream)``.
    """
    model, desc, mods, data = _named_model(args, args.seed)
    if args.checkpoint:
        load_checkpoint(model, args.checkpoint)
    model.to(device)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    stream, _ = make_streams(data, model, batch_size, args.seed, device,
                             skip_malformed=args.skip_bad_lines)
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
    except CriteoFormatError:
        raise  # the data file's line: run() says so
    except ValueError as e:  # e.g. no Linear matches --module-filter
        raise CliError(str(e), "check --module-filter against the model's Linear names") from None
    _skipped_lines(stream)
    report.meta.update(model=desc, data=args.data, mods=dataclasses.asdict(mods),
                       batch_size=batch_size)
    report.save(args.out)
    print(report.summary_table())
    head = report.meta.get("head_forwards_only") or []
    if head:
        print(f"forwards only at the {len(head)} site(s) nearest the loss, which a training "
              f"plan keeps on bf16: {', '.join(head)} (--head-sites 0 measures every role)")
    if device.type == "cuda":
        print(f"wrote {args.out}; next: loka plan {args.out} -o plan.json")
    else:
        print(f"wrote {args.out}; next: loka plan {args.out} -o plan.json --assume-fast "
              f"(CPU timings do not decide FP8 speed: choose on error alone)")
    return EXIT_OK


def delayed_option(args) -> Optional[float]:
    """``--delayed-scaling`` / ``--delayed-decay`` as a plan's ``delayed_scaling``."""
    if args.delayed_decay is not None and not args.delayed_scaling:
        raise usage("--delayed-decay needs --delayed-scaling")
    if not args.delayed_scaling:
        return None
    if getattr(args, "inference", False):
        raise usage("--delayed-scaling is for training; it does not go with --inference")
    return DEFAULT_DECAY if args.delayed_decay is None else args.delayed_decay


def cmd_optimize(args) -> int:
    delayed_option(args)  # refuse bad combinations before any work
    static_option(args)
    if args.max_ne_change is not None and not args.inference:
        raise usage("--max-ne-change holds a serving plan to a bound: add --inference",
                    "for training plans: loka quality --max-ne-change")
    if args.budget_batches is not None and args.max_ne_change is None:
        raise usage("--budget-batches needs --max-ne-change")
    try:
        compile_options = inductor_options(args.inductor_config)
    except ValueError as e:
        raise usage(f"--inductor-config {e}") from None
    if compile_options and args.no_compile:
        raise usage("--inductor-config sets options of compiled steps: drop --no-compile")
    device = resolve_device(args)
    if args.synchronized_steps and device.type != "cuda":
        raise usage(f"--synchronized-steps is how a GPU's steps are timed: on {device.type} "
                    f"optimize times no step", "drop --synchronized-steps")
    try:
        check_capture(args.capture_steps, not args.no_compile, args.compile_mode,
                      compile_options)
    except ValueError:
        raise usage("--capture-steps captures each whole step itself: --compile-mode "
                    f"{args.compile_mode} or --inductor-config triton.cudagraphs adds "
                    "Inductor's CUDA graphs inside it",
                    "drop them, or use --compile-mode max-autotune-no-cudagraphs") from None
    if args.capture_steps and device.type != "cuda":
        raise usage(f"--capture-steps captures steps in CUDA graphs: on {device.type} "
                    f"optimize times no step", "drop --capture-steps")
    kernels, all_kernels = probe_kernels(args.kernels)
    model, desc, mods, batch_size, stream = _model_and_stream(args, device)
    batches = [b for _, b in zip(range(args.steps), device_batches(stream, device))]

    def forward(m, batch):
        with _autocast(device):
            return m(batch)
    refine = None
    if args.max_ne_change is not None:
        _, held = make_streams(parse_data(args.data), model, batch_size, args.seed, device,
                               skip_malformed=args.skip_bad_lines)
        held_batches = [b for _, b in zip(range(args.budget_batches or 16),
                                          device_batches(held, device))]

        def budgeted(plan, say=lambda line: print(f"  {line}")):
            try:
                return serve_ne_budget(plan, model, held_batches, forward=forward,
                                       max_ne_change=args.max_ne_change, progress=say)
            except BaselineNotLearnedError as e:
                raise CliError(str(e), "give a trained --checkpoint (loka train)") from None

        def served_as(plan):  # what a serving step runs: each FP8 forward, its scale
            return ({s: plan.sites[s].kernel(Role.FWD) for s in fp8_forwards(plan)},
                    static_scales_for(plan, plan.static_scales or {}))
        checked = []  # what the budget held, as refine returned it

        def refine(plan):
            res = budgeted(plan)
            print(f"  {res.plan.notes[-1]}")
            res.plan.budget["serve_ne_budget"] = res.to_dict()
            checked.append(served_as(res.plan))
            return res.plan
        budgeted(Plan.uniform(model, "bf16"), say=lambda line: None)  # learned? before probing
    config = ProbeConfig(num_samples=args.num_samples, kernels=kernels,
                         all_kernels=all_kernels, seed=args.seed,
                         every_n_steps=1, max_error=args.max_error, min_speedup=args.min_speedup,
                         # serving runs forwards only: nothing else is measured
                         roles=(Role.FWD,) if args.inference else ROLES,
                         head_sites=args.head_sites)
    print(f"optimizing {desc} for {'serving' if args.inference else 'training'} on {device}")

    result = optimize(model, batches, _autocast_loss(device), inference=args.inference,
                      forward=forward, config=config,
                      max_error=args.max_error, min_speedup=args.min_speedup,
                      head_sites=args.head_sites, compile=not args.no_compile,
                      compile_mode=args.compile_mode, compile_options=compile_options,
                      synchronized_steps=args.synchronized_steps,
                      capture_steps=args.capture_steps,
                      paired_trials=args.paired_trials, rounds=args.rounds,
                      **({} if args.host_slowdown is None
                         else {"host_slowdown": args.host_slowdown}),
                      max_trials=args.max_trials,
                      progress=lambda line: print(f"  {line}"),
                      delayed_scaling=delayed_option(args), refine=refine,
                      **static_option(args))
    if refine is not None and result.timed and served_as(result.plan) not in checked:
        # the whole-step tuning moved the plan's sites or changed their kernels: the plan
        # written is held to the budget as it is
        final = budgeted(result.plan)
        if final.moved_back:
            print(f"  after timing: {final.plan.notes[-1]} (the timed plan had them in FP8)")
        final.plan.budget["serve_ne_budget"] = final.to_dict()
        result.plan = final.plan
    result.plan.save(args.out)
    if args.report:
        result.report.meta.update(model=desc, data=args.data, mods=dataclasses.asdict(mods),
                                  batch_size=batch_size)
        result.report.save(args.report)
    print(result.plan.summary())
    line = whole_step_line(result)
    if line:
        print(line)
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    return EXIT_OK


def whole_step_line(result) -> Optional[str]:
    """``loka optimize``'s line on the A/B rounds: the plan's step against the step without
    FP8, and, where no FP8 site was kept (rounds lost, or the host check), that the ratio
    is the plan's that was timed, not the one written; None without rounds."""
    if result.speedup is None:
        return None
    how = (result.plan.budget.get("optimize") or {}).get("ab_timing") or {}
    rounds = (f"median of {len(result.rounds)} A/B rounds"
              + (", the model and its planned copy timed in turn"
                 if how.get("timing") == "paired" else ""))
    if result.plan.fp8_sites():
        return f"whole step: {result.speedup:.3f}x of the step without FP8 ({rounds})"
    return (f"whole step: the plan timed ran at {result.speedup:.3f}x of the step without FP8 "
            f"({rounds}); no FP8 site kept, see the plan's notes")


def static_option(args) -> dict:
    """``--static-scales`` / ``--static-margin`` as ``loka.plan``'s keyword arguments."""
    if args.static_margin is not None and not args.static_scales:
        raise usage("--static-margin needs --static-scales")
    if args.static_scales and not args.inference:
        raise usage("--static-scales is for serving: add --inference")
    return {"static_scales": bool(args.static_scales),
            "static_margin": 1.0 if args.static_margin is None else args.static_margin}


def cmd_plan(args) -> int:
    static = static_option(args)
    report = load_report(args.report)
    allowed = parse_kernels(args.kernels)
    device = resolve_device(args) if args.device else None
    try:
        plan = make_plan(report, max_error=args.max_error, min_speedup=args.min_speedup,
                         metric=args.metric,
                         role_budgets=parse_budgets(args.role_budget, "role-budget",
                                                    [r.value for r in ROLES]) or None,
                         site_budgets=parse_budgets(args.site_budget, "site-budget") or None,
                         allowed_kernels=allowed, device=device, assume_fast=args.assume_fast,
                         head_sites=args.head_sites, inference=args.inference, **static)
    except KeyError as e:
        raise usage(f"--kernels: {e.args[0]}", "list them with 'loka kernels'") from None
    except ValueError as e:
        raise usage(str(e)) from None
    if args.replace or args.assign:
        replace = parse_pairs(args.replace, "replace", "triton-rowwise-cublas=cublas-rowwise")
        assign = parse_pairs(args.assign, "assign", "'over_arch.*:fwd=cublas-rowwise'")
        unknown = unknown_kernels(list(replace.values()) + list(assign.values()))
        if unknown:
            raise usage(f"--replace/--assign: unknown kernel(s) {unknown}", kernel_hint(unknown))
        try:
            plan = override(plan, replace=replace, assign=assign, report=report)
        except ValueError as e:
            raise usage(str(e)) from None
    plan.delayed_scaling = delayed_option(args)
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
    check_plan_kernels(plan, args.plan)
    model, desc, mods, data = _named_model(args, 0)
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
