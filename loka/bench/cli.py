"""The harness as a command: ``loka bench`` and ``bench/run_all.py`` parse their options
(:mod:`loka.bench.args`) and run them here."""

from __future__ import annotations

import argparse
import datetime
import shlex

from . import evalset
from .args import DESCRIPTION, add_arguments, config_from_args
from .runner import run, run_sweep, table

__all__ = ["run_from_args", "eval_set_argv", "main"]


def eval_set_argv(args) -> list:
    """The evaluation-set harness's options (:mod:`loka.bench.evalset`) from those of
    ``loka bench``: ``--device``, ``--batch-sizes`` (or ``--batch-size``), ``--steps``,
    ``--warmup`` and ``--out`` carry over; ``--eval-args`` is appended as it is."""
    try:
        extra = shlex.split(args.eval_args or "")
    except ValueError as e:
        raise ValueError(f"--eval-args: {e}") from None
    argv = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if getattr(args, "device", None):
        argv += ["--device", str(args.device)]
    sizes = getattr(args, "batch_sizes", None) or (str(args.batch_size) if args.batch_size else None)
    if sizes:
        argv += ["--batch-sizes", sizes]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M%S")
    argv += ["--out", args.out or f"bench/results/{stamp}-eval-set.json"]
    return argv + extra


def run_from_args(args) -> dict:
    if getattr(args, "eval_set", None):
        status = evalset.main(eval_set_argv(args), eval_set=args.eval_set)
        return {"eval_set": args.eval_set, "status": status}
    cfg = config_from_args(args)
    if getattr(args, "batch_sizes", None):
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise ValueError(f"--batch-sizes takes integers, got {args.batch_sizes!r}") from None
        sweep = run_sweep(cfg, sizes)
        print(f"wrote {sweep['out']}")
        return sweep
    result = run(cfg)
    print(table(result))
    print(f"wrote {result['out']}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/run_all.py", description=DESCRIPTION)
    p.add_argument("--device", default=None)
    add_arguments(p)
    run_from_args(p.parse_args(argv))
    return 0
