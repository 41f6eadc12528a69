"""The options of ``loka bench`` (and ``bench/run_all.py``), read into a
:class:`BenchConfig`; variant names are parsed here, once
(:func:`~loka.bench.variants.parse_variants`). Light to import: the command line's parser
is built from it without loading the harness."""

from __future__ import annotations

import argparse
from typing import Dict

import torch

from .config import PROBE_KERNELS, BenchConfig
from .variants import INFER_VARIANTS, TRAIN_VARIANTS, parse_variants

__all__ = ["add_arguments", "config_from_args", "named_plans", "DESCRIPTION"]

DESCRIPTION = "The benchmark harness behind ``loka bench`` and ``bench/run_all.py``."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="wukong", help="reference model (default: wukong)")
    p.add_argument("--preset", default=None, help="preset (default: paper on GPU, tiny on CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-sizes", default=None,
                   help="comma list: run every variant at each batch size (a sweep); "
                        "writes one result per size and a summary")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per variant")
    p.add_argument("--no-compile", action="store_true", help="run eager (default: torch.compile)")
    p.add_argument("--train-variants", default=None,
                   help=f"comma list, or 'none' (default: all of {','.join(TRAIN_VARIANTS)})")
    p.add_argument("--infer-variants", default=None,
                   help=f"comma list, or 'none' (default: all of {','.join(INFER_VARIANTS)})")
    p.add_argument("--max-error", type=float, default=0.2, help="LoKA plan budget (MERE)")
    p.add_argument("--min-speedup", type=float, default=1.05, help="LoKA plan speed threshold")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<gpu>-<commit>.json)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument("--eval-set", default=None, metavar="PATH",
                   help="instead of a reference model, run the evaluation set at PATH (a "
                        "package of your models defining EVAL_MODELS, SCALES and loss_fn; "
                        "bench/eval_set.py runs this repository's) in bf16, with torchao's recipes "
                        "and through LoKA's public path; --device, --batch-sizes, --steps, "
                        "--warmup and --out apply, --eval-args passes the rest")
    p.add_argument("--eval-args", default="", metavar="ARGS",
                   help="options of the evaluation-set harness, quoted as one string (e.g. "
                        "\"--models wukong --modes train --scale tiny\"; python "
                        "bench/eval_set.py --help lists them)")
    p.add_argument("--plan", default=None,
                   help="apply this plan JSON in the LoKA variants instead of probing")
    p.add_argument("--plans", default="",
                   help="named plans for variants loka@<name>...: name=path[,name=path]")
    p.add_argument("--probe-kernels", default=None,
                   help="comma list of kernels the Probe measures, or 'all' "
                        f"(default: {','.join(PROBE_KERNELS)})")
    p.add_argument("--profile", default="",
                   help="comma list of variants to profile by kernel class (CUDA); "
                        "infer:<variant> for an inference variant")
    p.add_argument("--profile-ops", action="store_true",
                   help="profiles also attribute GPU time to launching ops and stack frames")


def named_plans(text: str) -> Dict[str, str]:
    """``--plans``: ``name=path[,name=path]`` -> {name: path} (names without + or @)."""
    plans = {}
    for item in (t.strip() for t in (text or "").split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip() or "+" in name or "@" in name:
            raise ValueError(f"--plans takes name=path items (names without + or @), got {item!r}")
        plans[name.strip()] = path.strip()
    return plans


def config_from_args(args) -> BenchConfig:
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = torch.device(device).type == "cpu"
    preset = args.preset or ("tiny" if on_cpu else "paper")
    return BenchConfig(
        model=args.model, preset=preset, device=device, batch_size=args.batch_size,
        steps=args.steps, warmup=args.warmup,
        compile=not args.no_compile and not on_cpu,
        train_variants=parse_variants(args.train_variants, TRAIN_VARIANTS, TRAIN_VARIANTS),
        infer_variants=parse_variants(args.infer_variants, INFER_VARIANTS, INFER_VARIANTS),
        max_error=args.max_error, min_speedup=args.min_speedup, out=args.out,
        plot=not args.no_plot, plan=args.plan, plans=named_plans(args.plans),
        probe_kernels=(PROBE_KERNELS if args.probe_kernels is None else None
                       if args.probe_kernels.strip() == "all"
                       else tuple(k.strip() for k in args.probe_kernels.split(",") if k.strip())),
        profile=tuple(v.strip() for v in args.profile.split(",") if v.strip()),
        profile_ops=args.profile_ops)
