"""Train-step time of a reference model in bf16: forward, BCE, backward, optimizer.

    python bench/bench_train_bf16.py                          # Wukong paper, CUDA
    python bench/bench_train_bf16.py --compile --mods paper   # bf16 + Mods, compiled
    python bench/bench_train_bf16.py --device cpu --preset tiny --steps 5 --warmup 2

Weights and activations are bf16 (``model.to(bfloat16)``, no autocast); dense parameters
use AdamW(fused), sparse tables (the paper presets) SparseAdam, via
``loka.train.make_optimizers`` and ``loka.train.train_step``, the step the training loop
runs. Each timed step is bracketed by CUDA synchronisation; warm-up steps (compilation
included) are excluded; the median is reported. Batches are generated on the device before
timing and cycled, so data generation is not timed. Writes JSON to ``--out`` (default
bench/results/train_bf16_<device>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn as nn

import loka.models as M
from loka.config import ModsConfig, config_to_dict
from loka.data import SyntheticCTR
from loka.timing import synchronize
from loka.train import make_optimizers, train_step

MODS = {"none": None, "paper": ModsConfig.paper()}


def run(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:  # build the weights where they live: paper scale is 1.5B parameters
        model = M.build(args.model, args.preset, MODS[args.mods])
    model = model.to(torch.bfloat16)
    batch_size = args.batch_size or model.default_batch_size
    data = SyntheticCTR(model.feature_spec, batch_size, seed=0, device=device)
    batches = [next(data) for _ in range(args.distinct_batches)]
    optimizers = make_optimizers(model, args.lr, device)
    step_model = torch.compile(model) if args.compile else model

    times = []
    for i in range(args.warmup + args.steps):
        batch = batches[i % len(batches)]
        synchronize(device)
        tic = time.perf_counter()
        loss = train_step(step_model, batch, optimizers)
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - tic)
    if not torch.isfinite(loss.float()):
        raise RuntimeError(f"non-finite loss {loss.item()}")
    median = statistics.median(times)
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [median] * 9
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return {
        "model": args.model, "preset": args.preset, "mods": args.mods,
        "compile": args.compile, "batch_size": batch_size, "dtype": "bfloat16",
        "steps": args.steps, "warmup": args.warmup,
        "step_ms": {"median": 1e3 * median, "p10": 1e3 * q[0], "p90": 1e3 * q[-1],
                    "min": 1e3 * min(times)},
        "samples_per_s": batch_size / median,
        "final_loss": float(loss),
        "num_linears": len(linears),
        "dense_params": sum(p.numel() for n, p in model.named_parameters()
                            if "embedding_arch" not in n),
        "embedding_params": sum(p.numel() for n, p in model.named_parameters()
                                if "embedding_arch" in n),
        "optimizers": [type(o).__name__ for o in optimizers],
        "model_config": {k: (str(v) if k == "features" else v)
                         for k, v in config_to_dict(model.config).items()},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "host": platform.node(), "python": platform.python_version(),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="wukong", choices=M.list_models())
    p.add_argument("--preset", default="paper")
    p.add_argument("--mods", default="none", choices=sorted(MODS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=0, help="0: the preset's default")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--distinct-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    r = run(args)
    s = r["step_ms"]
    print(f"{'model':<18}{'mods':<7}{'compile':<9}{'batch':>7}{'step ms (p10-p90)':>24}"
          f"{'samples/s':>13}")
    print(f"{r['model'] + '/' + r['preset']:<18}{r['mods']:<7}{str(r['compile']):<9}"
          f"{r['batch_size']:>7}{s['median']:>10.2f} ({s['p10']:.2f}-{s['p90']:.2f})"
          f"{r['samples_per_s']:>13,.0f}")
    print(f"{r['num_linears']} Linears; torch {r['torch']}; {r['gpu'] or r['device']}")
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"train_bf16_{torch.device(args.device).type}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(r, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
