"""The ``loka`` command: demo, train, probe, plan, apply --check, report, bench, kernels.

Every subcommand prints one readable line on failure, with a hint, and exits 2 for a usage
error (bad option or value), 1 for a runtime failure (a missing or corrupt file, a plan
made for another model); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
PROG = "loka"


class CliError(Exception):
    """A failure the user can fix: printed as ``error: ...`` and ``hint: ...``."""

    def __init__(self, message: str, hint: Optional[str] = None, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.message, self.hint, self.code = message, hint, code


def usage(message: str, hint: Optional[str] = None) -> CliError:
    return CliError(message, hint, EXIT_USAGE)


# -- argument values -----------------------------------------------------------------------
def resolve_device(args) -> "Any":
    """The ``--device`` given (checked), else cuda when available, else cpu."""
    import torch

    name = getattr(args, "device", None)
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise usage(f"--device {name!r} is not a device", "use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise usage(f"--device {name}: CUDA is not available on this machine",
                    "use --device cpu (the emulated kernels run there)")
    if device.type not in ("cpu", "cuda"):
        raise usage(f"--device {name}: LoKA runs on cpu or cuda", "use --device cpu")
    return device


def parse_mods(text: Optional[str]):
    """``none`` | ``paper`` | ``no_bias,blocknorm=256,hardswish,pad_to=16,...`` -> ModsConfig."""
    from .config import ModsConfig

    if text is None or text.strip().lower() in ("", "none"):
        return ModsConfig()
    if text.strip().lower() == "paper":
        return ModsConfig.paper()
    fields = {f.name: f for f in dataclasses.fields(ModsConfig)}
    kwargs: Dict[str, Any] = {}
    for item in (t.strip() for t in text.split(",") if t.strip()):
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in fields:
            raise usage(f"--mods: unknown Mod {key!r}",
                        f"choose from paper, none or {', '.join(fields)}")
        if fields[key].type in ("bool", bool):
            if value and value.lower() not in ("1", "true", "yes", "on"):
                raise usage(f"--mods: {key} is a switch, got {key}={value}", f"write just {key}")
            kwargs[key] = True
        elif not value and key == "blocknorm":
            kwargs[key] = 256  # the paper's block size
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise usage(f"--mods: {key} needs an integer, got {value!r}",
                            f"e.g. --mods {key}=16") from None
    try:
        return ModsConfig(**kwargs)
    except ValueError as e:
        raise usage(f"--mods: {e}") from None


def parse_pairs(items: Optional[Sequence[str]], what: str, example: str) -> Dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}``, split at the last ``=`` (a key may contain
    ``=``, as a regular expression may); ``example`` goes into the error's hint."""
    out: Dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.rpartition("=")
        if not sep or not key or not value:
            raise usage(f"--{what} {item!r}: expected KEY=VALUE", f"e.g. --{what} {example}")
        out[key] = value
    return out


def parse_budgets(items: Optional[Sequence[str]], what: str, keys: Optional[Sequence[str]] = None
                  ) -> Dict[str, float]:
    """``["wgrad=0.1", ...]`` -> ``{"wgrad": 0.1}``; the key may contain ``=`` (a regex)."""
    out: Dict[str, float] = {}
    example = f"{'wgrad' if keys else 'over_arch'}=0.1"
    for key, value in parse_pairs(items, what, example).items():
        item = f"{key}={value}"
        try:
            budget = float(value)
        except ValueError:
            raise usage(f"--{what} {item!r}: {value!r} is not a number") from None
        if not budget >= 0 or budget == float("inf"):
            raise usage(f"--{what} {item!r}: the budget must be a finite number >= 0")
        if keys is not None and key not in keys:
            raise usage(f"--{what} {item!r}: unknown role {key!r}", f"roles: {', '.join(keys)}")
        if keys is None:
            try:
                re.compile(key)
            except re.error as e:
                raise usage(f"--{what} {item!r}: {key!r} is not a regular expression ({e})") from None
        out[key] = budget
    return out


def _positive(kind: Callable, name: str, minimum=1):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {text}")
        return value
    return check


def _budget(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def _speedup(text: str) -> float:
    value = _budget(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number, got {text} (to plan on error only, use --assume-fast)")
    return value


# -- models and data -----------------------------------------------------------------------
def model_names() -> List[str]:
    from . import models

    return models.list_models()


def _import_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise usage(f"model {spec!r}: expected a reference model name or module:factory",
                    f"models: {', '.join(model_names())}; or e.g. mypkg.models:make_model")
    if os.getcwd() not in sys.path:  # as `python -m` does: the user's own modules import
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CliError(f"model {spec!r}: cannot import {module_name!r} ({e})",
                       "run loka from the directory that holds the module, or install it") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise CliError(f"model {spec!r}: {module_name} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CliError(f"model {spec!r}: {attr} is not callable")
    return factory


def build_model(spec: str, preset: str, mods, features=None, seed: int = 0):
    """A reference model ``name`` at ``preset`` or the module returned by ``module:factory()``.

    Returns:
        ``(model, description)``.
    """
    import torch
    from torch import nn

    from . import models

    torch.manual_seed(seed)
    if ":" in spec:
        factory = _import_factory(spec)
        try:
            model = factory()
        except Exception as e:  # noqa: BLE001 - the user's code: report it in one line
            raise CliError(f"model {spec!r}: the factory raised {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": "),
                           "module:factory must be callable without arguments and return "
                           "an nn.Module") from None
        if not isinstance(model, nn.Module):
            raise CliError(f"model {spec!r}: the factory returned a {type(model).__name__}, "
                           "not an nn.Module")
        if mods is not None and mods.any:
            from .mods import convert

            convert(model, mods)
        return model, spec
    if spec not in models.list_models():
        raise usage(f"unknown model {spec!r}", f"models: {', '.join(models.list_models())}; "
                    "or module:factory for your own")
    presets = list(models.presets(spec))
    if preset not in presets:
        raise usage(f"unknown preset {preset!r} for {spec}", f"presets: {', '.join(presets)}")
    overrides = {} if features is None else {"features": features}
    return models.build(spec, preset, mods=mods, **overrides), f"{spec}/{preset}"


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """What ``--data`` names: the synthetic stream, or Criteo TSV files (train, eval)."""

    kind: str
    train_path: Optional[str] = None
    eval_path: Optional[str] = None


def parse_data(text: str) -> DataSpec:
    if text == "synthetic":
        return DataSpec("synthetic")
    if text.startswith("criteo:"):
        from .data import sample_path

        paths = text[len("criteo:"):].split(",")
        paths = [sample_path() if p == "sample" else p for p in paths]
        if not paths[0] or len(paths) > 2:
            raise usage(f"--data {text!r}: expected criteo:TRAIN.tsv[,EVAL.tsv]",
                        "or criteo:sample for the sample shipped with LoKA")
        for p in paths:
            if not os.path.isfile(p):
                raise CliError(f"--data: no Criteo file at {p!r}",
                               "give the path of a Criteo TSV file, or criteo:sample")
        return DataSpec("criteo", paths[0], paths[1] if len(paths) == 2 else None)
    raise usage(f"--data {text!r}: expected 'synthetic' or 'criteo:PATH'",
                "e.g. --data synthetic, --data criteo:day_0.tsv,day_1.tsv, --data criteo:sample")


def criteo_features(spec: str, preset: str):
    """The Criteo FeatureSpec hashed into the preset's table size (its first table's rows)."""
    from . import models
    from .data import criteo_feature_spec

    if ":" in spec:
        return None
    if spec in models.list_models() and preset in models.presets(spec):
        rows = models.presets(spec)[preset].features.tables[0].num_embeddings
        return criteo_feature_spec(rows)
    return None


def make_streams(data: DataSpec, model, batch_size: int, seed: int, device):
    """``(train_stream, eval_stream)``: iterables of Batch with ``state_dict`` support."""
    from .data import CriteoReader, SyntheticCTR

    if data.kind == "synthetic":
        spec = getattr(model, "feature_spec", None)
        if spec is None:
            raise CliError("--data synthetic needs the model's feature_spec (a "
                           "loka.data.FeatureSpec attribute) to generate its features",
                           "give your model a feature_spec, or use --data criteo:PATH")
        stream = SyntheticCTR(spec, batch_size, seed=seed, device=device)
        return stream, stream.held_out()
    sizes = [t.num_embeddings for t in model.feature_spec.tables] if hasattr(
        model, "feature_spec") else 100_000
    train = CriteoReader(data.train_path, batch_size, table_sizes=sizes, loop=True)
    held = CriteoReader(data.eval_path or data.train_path, batch_size, table_sizes=sizes,
                        loop=True)
    return train, held


def _device_batches(stream, device):
    for batch in stream:
        yield batch.to(device)


class _Optimizers:
    """Several optimizers stepped as one (dense AdamW + SparseAdam), for ``loka.probe``."""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


# -- files -----------------------------------------------------------------------------------
PROBE_HINT = "make one with 'loka probe wukong --preset tiny -o report.json'"
PLAN_HINT = "make one with 'loka plan report.json -o plan.json'"


def _load_file(load: Callable[[str], Any], path: str, kind: str,
               hints: Tuple[Optional[str], Optional[str], Optional[str]]):
    """``load(path)``, its usual failures turned into one-line CliErrors; ``hints`` for a
    missing file, a directory, and a file that is not a valid ``kind`` file."""
    from .jsonio import ReportError

    missing, directory, invalid = hints
    try:
        return load(path)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", missing) from None
    except IsADirectoryError:
        raise CliError(f"{path} is a directory, not a {kind} file", directory) from None
    except ReportError as e:
        raise CliError(str(e).replace(": not a ", " is not a ", 1), invalid) from None


def load_report(path: str):
    from .probe.report import ProbeReport

    return _load_file(ProbeReport.load, path, "report", (PROBE_HINT,) * 3)


def load_plan(path: str):
    from .dispatch.plan import Plan

    return _load_file(Plan.load, path, "plan", (PLAN_HINT,) * 3)


def load_any(path: str):
    from .reporting import load

    return _load_file(load, path, "report or plan",
                      (f"{PROBE_HINT}, or {PLAN_HINT}", None,
                       "pass a report.json (loka probe) or a plan.json (loka plan)"))


def load_curves(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", "the demo writes curves.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: not valid JSON ({e})", "the demo writes curves.json") from None
    arms = data.get("arms", data) if isinstance(data, dict) else None
    bad = not isinstance(arms, dict) or not arms
    for arm in (arms.values() if not bad else ()):
        for part in ("train", "eval"):
            series = arm.get(part, {}) if isinstance(arm, dict) else None
            if not isinstance(series, dict) or not all(isinstance(v, list) for v in series.values()) \
                    or len({len(v) for v in series.values()}) > 1:
                bad = True
    if bad:
        raise CliError(f"{path}: not a curves file (expected {{arm: {{train: {{step, loss}}, "
                       "eval: {step, ne}}}}, series of equal length)", "the demo writes curves.json")
    return data


def mismatch_hint(what: str = "the model") -> str:
    return (f"the plan was made for another model: pass the --model/--preset/--mods it was "
            f"probed with, or probe and plan {what} ('loka probe ... && loka plan ...')")


# -- subcommands -------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from . import demo

    demo.run_from_args(args, device=resolve_device(args))
    return EXIT_OK


def cmd_train(args) -> int:
    from . import train as train_mod

    device = resolve_device(args)
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, args.seed)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    plan = None
    if args.plan:
        plan = load_plan(args.plan)
        from .dispatch import apply
        from .dispatch.plan import PlanMismatchError

        model.to(device)
        try:
            apply(model, plan)
        except PlanMismatchError as e:
            raise CliError(f"{args.plan}: {e}", mismatch_hint()) from None
    stream, held = make_streams(data, model, batch_size, args.seed, device)
    ckpt = os.path.join(args.out, train_mod.CHECKPOINT_NAME)
    if args.resume and not os.path.exists(ckpt):
        print(f"note: no checkpoint at {ckpt}; starting a fresh run", file=sys.stderr)
    print(f"training {desc} on {args.data} for {args.steps} steps (batch {batch_size}, "
          f"{device}{', plan ' + args.plan if plan else ''})")
    try:
        result = train_mod.train(
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
    from .jsonio import atomic_write_text

    atomic_write_text(os.path.join(args.out, "metrics.json"), json.dumps(metrics, indent=1))
    f = result.final
    if "ne" in f:
        print(f"step {result.steps}: held-out NE {f['ne']:.5f}, AUC {f['auc']:.4f}, "
              f"log loss {f['logloss']:.5f} ({result.samples_per_s:,.0f} samples/s)")
    print(f"wrote {ckpt} and {os.path.join(args.out, 'metrics.json')}")
    return EXIT_OK


def _probe_config(args):
    from .config import ROLES, ProbeConfig, Role

    kernels = None
    if args.kernels:
        from .kernels import registry

        kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
        known = {k.name for k in registry.all_kernels()}
        unknown = [k for k in kernels if k not in known]
        if unknown:
            raise usage(f"--kernels: unknown kernel(s) {unknown}", "list them with 'loka kernels'")
    roles = ROLES
    if args.roles:
        try:
            roles = tuple(Role.parse(r.strip()) for r in args.roles.split(",") if r.strip())
        except ValueError as e:
            raise usage(f"--roles: {e}") from None
    if args.module_filter:
        try:
            re.compile(args.module_filter)
        except re.error as e:
            raise usage(f"--module-filter {args.module_filter!r}: not a regular expression ({e})") from None
    try:
        return ProbeConfig(
            every_n_steps=args.every_n_steps, num_samples=args.num_samples,
            sample_rows=args.sample_rows, source=args.source, compare_naive=not args.no_naive,
            kernels=kernels, roles=roles, max_error=args.max_error, min_speedup=args.min_speedup,
            bootstrap=args.bootstrap, timing=not args.no_timing, seed=args.seed,
            module_filter=args.module_filter)
    except ValueError as e:
        raise usage(str(e)) from None


def cmd_probe(args) -> int:
    import torch

    from . import train as train_mod
    from .probe import probe

    device = resolve_device(args)
    cfg = _probe_config(args)
    mods = parse_mods(args.mods)
    data = parse_data(args.data)
    features = criteo_features(args.model, args.preset) if data.kind == "criteo" else None
    model, desc = build_model(args.model, args.preset, mods, features, args.seed)
    if args.checkpoint:
        _load_checkpoint(model, args.checkpoint)
    model.to(device)
    batch_size = args.batch_size or getattr(model, "default_batch_size", 512)
    stream, _ = make_streams(data, model, batch_size, args.seed, device)
    optimizer = _Optimizers(train_mod.make_optimizers(model, args.lr, device))

    def loss(m, batch):  # bf16 on GPUs, as training runs; the model's dtype on the CPU
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return train_mod.loss_fn(m, batch)

    print(f"probing {desc} on {args.data}: {args.steps} training steps, then measuring "
          f"kernels on {device}")
    try:
        report = probe(model, _device_batches(stream, device), loss, config=cfg,
                       optimizer=optimizer, steps=args.steps, device=device)
    except ValueError as e:  # e.g. no Linear matches --module-filter
        raise CliError(str(e), "check --module-filter against the model's Linear names") from None
    report.meta.update(model=desc, data=args.data, mods=dataclasses.asdict(mods),
                       batch_size=batch_size)
    report.save(args.out)
    print(report.summary_table())
    print(f"wrote {args.out}; next: loka plan {args.out} -o plan.json")
    return EXIT_OK


def _load_checkpoint(model, path: str) -> None:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", "loka train --out DIR writes DIR/checkpoint.pt") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CliError(f"{path}: not a loadable checkpoint ({type(e).__name__})",
                       "loka train --out DIR writes DIR/checkpoint.pt") from None
    state = state.get("model", state) if isinstance(state, dict) else state
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise CliError(f"{path} holds another model's weights ({str(e).splitlines()[0].strip()})",
                       "pass the --model/--preset/--mods the checkpoint was trained with") from None


def cmd_plan(args) -> int:
    from .config import ROLES
    from .dispatch import plan as make_plan

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
        from .dispatch import override

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
    from .dispatch import audit

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
    from .dispatch import check
    from .dispatch.plan import PlanMismatchError

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
    from .dispatch.plan import Plan
    from .probe.report import ProbeReport
    from . import reporting

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
        print(reporting.text_report(report, plan, args.metric))
    else:
        print(reporting.text_plan(plan))
    if args.html:
        reporting.write_html(args.html, report, plan, curves, title=args.title)
        print(f"wrote {args.html}")
    if args.markdown:
        reporting.write_markdown(args.markdown, report, plan, curves, title=args.title)
        print(f"wrote {args.markdown}")
    if args.tensorboard:
        try:
            n = reporting.write_tensorboard(args.tensorboard, report, plan, curves)
        except RuntimeError as e:
            raise CliError(str(e), "or leave out --tensorboard; report.html has the same plots") from None
        print(f"wrote {n} TensorBoard scalars to {args.tensorboard}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from . import bench

    if getattr(args, "device", None) is not None:
        resolve_device(args)
    try:
        bench.run_from_args(args)
    except ValueError as e:  # an unknown variant, model or preset
        raise usage(str(e)) from None
    return EXIT_OK


def kernel_table(device) -> Tuple[List[str], List[List[str]]]:
    """Headers and one row per registered kernel: what runs on ``device`` and why not."""
    from .kernels import registry

    headers = ["kernel", "library", "formats", "scaling", "roles", "available", "reason"]
    body = []
    for k in registry.all_kernels():
        ok = k.device_ok(device)
        roles = ",".join(r.value for r in sorted(k.roles, key=lambda r: ["fwd", "dgrad", "wgrad"].index(r.value)))
        body.append([k.name, k.library, " x ".join(k.formats), k.scaling, roles,
                     "yes" if ok else "no", "" if ok else ok.reason])
    return headers, body


def cmd_kernels(args) -> int:
    from .kernels import capabilities
    from .reporting.tables import format_table

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


# -- the parser --------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with LoKA's error format: one line and a hint instead of the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n"
                              f"hint: run '{self.prog} --help' for the options and examples\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; defaults shown where there is one to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _common() -> argparse.ArgumentParser:
    # accepted after the subcommand too; SUPPRESS keeps a value given before it
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default=argparse.SUPPRESS,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of a failure")
    return p


def _model_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", help="reference model (wukong, dcnv2, interformer, dlrm, "
                       "logreg) or module:factory returning your own nn.Module")
    else:
        p.add_argument("--model", default="wukong",
                       help="reference model name, or module:factory for your own")
    p.add_argument("--preset", default="tiny", help="model preset: tiny, small, paper")
    p.add_argument("--mods", default="none",
                   help="Mods: none, paper (no_bias,blocknorm=256,hardswish) or a comma list "
                        "of no_bias, blocknorm=N, hardswish, pad_to=N, merge_siblings, token_major")
    p.add_argument("--data", default="synthetic",
                   help="synthetic, or criteo:TRAIN.tsv[,EVAL.tsv] (criteo:sample: the "
                        "shipped sample)")


EPILOGS = {
    "demo": """examples:
  loka demo                      # Wukong small on synthetic CTR data, a few minutes on a CPU
  loka demo --quick              # tiny preset, few steps (CI smoke run)
  loka demo --out /tmp/demo --device cuda

writes report.json, plan.json, report.html, summary.md and curves.json to --out.""",
    "train": """examples:
  loka train --model wukong --preset small --steps 500 --out runs/wukong
  loka train --out runs/wukong --steps 1000 --resume        # continue that run
  loka train --plan plan.json --out runs/wukong-fp8         # train with a plan applied
  loka train --model dlrm --data criteo:day_0.tsv,day_1.tsv --out runs/dlrm""",
    "probe": """examples:
  loka probe wukong --preset tiny -o report.json
  loka probe wukong --preset small --checkpoint runs/wukong/checkpoint.pt --steps 50
  loka probe mypkg.models:make_model --data criteo:train.tsv --kernels bf16,cublas-rowwise
  loka probe dcnv2 --no-timing --num-samples 16 -o report.json

your own model (module:factory): factory() returns an nn.Module whose forward(batch)
returns logits (B,) for a loka.data.Batch; --data synthetic also needs a feature_spec.""",
    "plan": """examples:
  loka plan report.json -o plan.json
  loka plan report.json --max-error 0.1 --min-speedup 1.1 --role-budget wgrad=0.05
  loka plan report.json --site-budget 'over_arch\\..*'=0.05 --metric relfro
  loka plan cpu-report.json --assume-fast       # a CPU report: choose on error only
  loka plan report.json --replace triton-rowwise-cublas=cublas-rowwise
  loka plan report.json --assign 'over_arch.*:fwd=cublas-rowwise-fastacc'

--device names the device the plan is for (default: the report's).""",
    "audit": """examples:
  loka audit plan.json report.json
  loka audit plan.json report.json --json

checks, at every site and role the report measured, that the chosen kernel's error bound
is within the plan's budget and that no kernel within the budget was measured faster
(weight-quantized speeds for an inference plan); exit status 1 when one is not. Needs no
GPU: a kernel the report timed ran where the report was measured.""",
    "apply": """examples:
  loka apply --check plan.json --model wukong --preset small
  loka apply --check plan.json --model mypkg.models:make_model --inference

prints what loka.apply(model, plan) would change, and touches nothing.""",
    "report": """examples:
  loka report report.json                       # text table
  loka report report.json plan.json --html report.html --markdown summary.md
  loka report plan.json
  loka report report.json plan.json --curves curves.json --tensorboard runs/tb""",
    "bench": """examples:
  loka bench --device cpu --preset tiny --steps 3 --warmup 1     # a smoke run
  loka bench --train-variants bf16,bf16+mods,loka+mods --infer-variants none

delegates to loka.bench (the harness behind bench/run_all.py).""",
    "kernels": """examples:
  loka kernels
  loka kernels --device cpu --json""",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``loka`` argument parser (every subcommand and option)."""
    from . import __version__

    parser = _Parser(
        prog=PROG, formatter_class=_Formatter,
        description="LoKA: FP8 that pays off in recommendation models. Probe where FP8 is "
                    "safe and fast, plan a kernel per GEMM role, apply it.",
        epilog="run 'loka COMMAND --help' for a command's options and examples; "
               "start with 'loka demo'.")
    parser.add_argument("--version", action="version", version=f"loka {__version__}")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common()

    def add(name: str, help_: str, func) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOGS[name],
                           formatter_class=_Formatter, parents=[common])
        p.set_defaults(func=func)
        return p

    from . import demo

    p = add("demo", "train, probe, plan and apply end to end; compare bf16 with LoKA", cmd_demo)
    demo.add_arguments(p)

    p = add("train", "train a reference model (checkpoints, resume, optional plan)", cmd_train)
    _model_args(p)
    p.add_argument("--steps", type=_positive(int, "--steps", 0), default=200,
                   help="total training steps (counting those before a --resume)")
    p.add_argument("--batch-size", type=_positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--lr", type=_positive(float, "--lr", 0), default=1e-3, help="learning rate")
    p.add_argument("--seed", type=int, default=0, help="model, data and RNG seed")
    p.add_argument("--out", default="runs/loka", help="directory of checkpoint.pt and metrics.json")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--eval-every", type=_positive(int, "--eval-every", 0), default=0,
                   help="evaluate every N steps (0: at the end only)")
    p.add_argument("--eval-steps", type=_positive(int, "--eval-steps"), default=20,
                   help="held-out batches per evaluation")
    p.add_argument("--checkpoint-every", type=_positive(int, "--checkpoint-every", 0), default=0,
                   help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--plan", default=None, help="train with this plan applied (loka.apply)")

    p = add("probe", "learn each GEMM's distributions while training; measure every kernel",
            cmd_probe)
    _model_args(p, positional=True)
    p.add_argument("-o", "--out", default="report.json", help="the report to write")
    p.add_argument("--steps", type=_positive(int, "--steps"), default=20,
                   help="training steps observed")
    p.add_argument("--batch-size", type=_positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--lr", type=_positive(float, "--lr", 0), default=1e-3,
                   help="learning rate of the observed steps (0: weights fixed)")
    p.add_argument("--seed", type=int, default=0, help="model, data, sampler seed")
    p.add_argument("--checkpoint", default=None,
                   help="start from these weights (a loka train checkpoint.pt)")
    p.add_argument("--every-n-steps", type=_positive(int, "--every-n-steps"), default=5,
                   help="take statistics every N steps")
    p.add_argument("--num-samples", type=_positive(int, "--num-samples", 2), default=64,
                   help="synthetic operand pairs per site and role")
    p.add_argument("--sample-rows", type=_positive(int, "--sample-rows"), default=None,
                   help="rows per synthetic sample (default: the site's, up to 4096)")
    p.add_argument("--source", choices=("learned", "captured"), default="learned",
                   help="operands drawn from learned statistics, or real captured tensors")
    p.add_argument("--kernels", default=None, help="comma list of kernels (default: all available)")
    p.add_argument("--roles", default=None, help="comma list of fwd,dgrad,wgrad (default: all)")
    p.add_argument("--module-filter", default=None,
                   help="regular expression on Linear names to probe")
    p.add_argument("--bootstrap", type=_positive(int, "--bootstrap", 0), default=1000,
                   help="bootstrap resamples of the confidence intervals")
    p.add_argument("--max-error", type=_budget, default=0.2, help="the report's safe flag: MERE bound")
    p.add_argument("--min-speedup", type=_speedup, default=1.05, help="the report's fast flag")
    p.add_argument("--no-naive", action="store_true", help="skip the N(0, 1) comparison")
    p.add_argument("--no-timing", action="store_true", help="errors only, no speed measurement")

    p = add("plan", "choose a kernel per site and role under an accuracy budget", cmd_plan)
    p.add_argument("report", help="a report.json written by 'loka probe'")
    p.add_argument("-o", "--out", default="plan.json", help="the plan to write")
    p.add_argument("--max-error", type=_budget, default=0.2,
                   help="budget on the metric's upper 95%% bound")
    p.add_argument("--min-speedup", type=_speedup, default=1.05,
                   help="a kernel must beat bf16 by this factor")
    p.add_argument("--metric", choices=("mere", "relfro", "neg_sqnr"), default="mere",
                   help="error metric of the budget")
    p.add_argument("--role-budget", action="append", metavar="ROLE=X",
                   help="per-role budget, e.g. wgrad=0.1 (repeatable)")
    p.add_argument("--site-budget", action="append", metavar="REGEX=X",
                   help="per-site budget by regular expression (repeatable; strictest wins)")
    p.add_argument("--kernels", default=None, help="comma list of allowed kernels")
    p.add_argument("--assume-fast", action="store_true",
                   help="where no GPU timing decides (CPU reports), choose the lowest-error "
                        "safe kernel instead of bf16")
    p.add_argument("--replace", action="append", metavar="OLD=NEW", default=[],
                   help="then move every role on kernel OLD to kernel NEW (repeatable; "
                        "NEW must meet the budget where the report measured it)")
    p.add_argument("--assign", action="append", metavar="SITE_GLOB:ROLE=KERNEL", default=[],
                   help="then put these roles on KERNEL (ROLE fwd, dgrad, wgrad or *; "
                        "repeatable; the budget is checked as for --replace)")

    p = add("audit", "check a plan against its Probe report: budgets kept, fastest chosen",
            cmd_audit)
    p.add_argument("plan", help="a plan.json")
    p.add_argument("report", help="the report.json it was made from")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = add("apply", "check a plan against a model: what would change (touches nothing)",
            cmd_apply)
    p.add_argument("plan", help="a plan.json written by 'loka plan'")
    p.add_argument("--check", action="store_true", help="dry run (required)")
    _model_args(p)
    p.add_argument("--inference", action="store_true", help="check the inference application")

    p = add("report", "render a report and/or plan: text, self-contained HTML, Markdown",
            cmd_report)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a report.json and/or a plan.json (in any order)")
    p.add_argument("--html", default=None, help="write a self-contained HTML page here")
    p.add_argument("--markdown", default=None, help="write a Markdown summary here")
    p.add_argument("--curves", default=None, help="training curves (the demo's curves.json)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write TensorBoard scalars (needs tensorboard)")
    p.add_argument("--metric", choices=("mere", "relfro", "neg_sqnr"), default="mere",
                   help="error metric shown for a report without a plan")
    p.add_argument("--title", default="LoKA report", help="page title")

    p = add("bench", "benchmark bf16, torchao FP8 and LoKA side by side", cmd_bench)
    from . import bench

    bench.add_arguments(p)

    p = add("kernels", "every registered kernel: what runs on this machine and why not",
            cmd_kernels)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``loka`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or EXIT_OK)
    except CliError as e:
        if debug:
            raise
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback, unless --debug
        if debug:
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: {type(e).__name__}: {msg}" if msg else f"error: {type(e).__name__}",
              file=sys.stderr)
        print("hint: rerun with --debug for the traceback", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
