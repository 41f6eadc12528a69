#!/usr/bin/env python3
"""Does a paired check from a checkpoint need the checkpoint's optimizer states?

A reference model trains ``--start-steps`` steps on its own stream (``--lr``,
``--warmup-steps``), with a checkpoint at the end; then, per seed, two copies of it train
``--steps`` more steps on that seed's stream: one continuing the checkpoint's AdamW states
(``loka.train.train(optimizer_state=...)``), one with a fresh AdamW. Each is scored on the
same held-out examples. A fresh AdamW's first updates are ``lr`` on every weight whatever
its gradient (its bias-corrected moments give ``m / sqrt(v) = sign(g)``), which a trained
wide model may not survive; the run records every training loss and the held-out NE.

    OMP_NUM_THREADS=2 PYTHONPATH=. python bench/adam_restart.py --models wukong:paper \\
        --batch-size 512 --lr 1e-3 --warmup-steps 20 --start-steps 40 --steps 5 \\
        --out bench/results/adam_restart_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time

import torch

from loka.assembly import build_reference
from loka.data import SyntheticCTR
from loka.data.metrics import normalized_entropy
from loka.jsonio import atomic_write_text, json_safe
from loka.train import predict, train
from loka.train.checkpoint import CHECKPOINT_NAME, read_checkpoint


def run(name: str, preset: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = build_reference(name, preset, None, device, seed=0, table_rows=args.table_rows)
    spec = model.feature_spec
    held = SyntheticCTR(spec, args.eval_batch, seed=10_000)
    held_batches = [held.batch(i).to(device) for i in range(args.eval_batches)]

    def ne(m) -> float:
        logits, labels = predict(m, iter(held_batches), None, device=device)
        return float(normalized_entropy(logits, labels, from_logits=True))

    t0 = time.time()
    with tempfile.TemporaryDirectory() as ckpt_dir:
        stream = SyntheticCTR(spec, args.batch_size, seed=99)
        start = train(model, (stream.batch(i).to(device) for i in range(args.start_steps)),
                      args.start_steps, lr=args.lr, device=device, progress=False,
                      warmup_steps=args.warmup_steps, checkpoint_dir=ckpt_dir)
        saved = read_checkpoint(os.path.join(ckpt_dir, CHECKPOINT_NAME), map_location=device)
    out = {"start": {"steps": args.start_steps, "ne": ne(model), "losses": start.losses,
                     "seconds": round(time.time() - t0, 1)}, "arms": []}
    print(f"  start: {args.start_steps} steps, held-out NE {out['start']['ne']:.4f}", flush=True)
    for seed in args.seeds:
        for continued in (True, False):
            arm = copy.deepcopy(model)
            data = SyntheticCTR(spec, args.batch_size, seed=seed)
            res = train(arm, (data.batch(i).to(device) for i in range(args.steps)), args.steps,
                        lr=args.lr, device=device, progress=False, seed=seed,
                        optimizer_state=saved["optimizers"] if continued else None)
            row = {"seed": seed, "optimizer": "continued" if continued else "fresh",
                   "ne": ne(arm), "losses": res.losses, "max_loss": max(res.losses)}
            out["arms"].append(row)
            print(f"  seed {seed} {row['optimizer']:9s} NE {row['ne']:.4f}  max loss "
                  f"{row['max_loss']:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="wukong:paper", help="comma list of name:preset")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--start-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--table-rows", type=int, default=100)
    p.add_argument("--eval-batch", type=int, default=1024)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if min(args.start_steps, args.steps) < 1 or args.warmup_steps < 0:
        p.error("--start-steps and --steps must be >= 1, --warmup-steps >= 0")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    device = torch.device(args.device)
    doc = {"schema": "loka.bench.adam_restart", "version": 1,
           "env": {"torch": torch.__version__, "python": platform.python_version(),
                   "device": str(device), "threads": torch.get_num_threads()},
           "config": {k: v for k, v in vars(args).items() if k != "out"},
           "command": "python bench/adam_restart.py " + " ".join(sys.argv[1:] if argv is None
                                                                  else argv),
           "models": {}}
    for spec in args.models.split(","):
        name, preset = spec.split(":")
        print(f"{name} {preset}", flush=True)
        doc["models"][spec] = run(name, preset, args, device)
        atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1, allow_nan=False))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
