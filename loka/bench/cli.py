"""The harness as a command: ``loka bench`` and ``bench/run_all.py`` parse their options
(:mod:`loka.bench.args`) and run them here."""

from __future__ import annotations

import argparse

from .args import DESCRIPTION, add_arguments, config_from_args
from .runner import run, run_sweep, table

__all__ = ["run_from_args", "main"]


def run_from_args(args) -> dict:
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
