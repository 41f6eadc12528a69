"""Probe overhead per training step, and the time of a full ``probe.report()``.

The model is the Wukong paper preset as the benchmark builds it (``loka.bench.build_model``:
dense embedding gradients, tables capped in rows; batch 4096, bf16) or, with
``--stand-in``, an MLP with Wukong's large Linear shapes. A run of ``--steps`` training steps (forward, BCE, backward,
AdamW) is timed as a whole, without and with a Probe attached (statistics every
``--every`` steps), ``--reps`` times alternating; the overhead is the ratio of the median
totals (target: <= 1 %). One statistics step is also timed alone, and then a full
``report()`` (the Probe's default kernels, every site and role) on what the Probe learned.

    python bench/bench_probe.py                      # GPU
    python bench/bench_probe.py --device cpu --small # a CPU smoke run

Writes JSON to ``--out`` (default ``bench/results/probe_overhead_<device>.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn
import torch.nn.functional as F

import loka
from loka.bench import BenchConfig, build_model, make_batch
from loka.config import ProbeConfig
from loka.jsonio import atomic_write_text
from loka.timing import synchronize
from loka.train import loss_fn


class StandIn(nn.Module):
    """Wukong's large Linears without its embeddings: per layer an FM MLP
    ``width -> width -> 4 * width``, then a top MLP ``8 * width -> width -> width / 2 -> 1``
    (width 2048 gives the paper's 2048 -> 2048 -> 8192 and 16384 -> 2048 -> 1024 -> 1)."""

    def __init__(self, width: int = 2048, layers: int = 4):
        super().__init__()
        self.width = width
        self.fm = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.SiLU(),
                                              nn.Linear(width, 4 * width)) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.top = nn.Sequential(nn.Linear(8 * width, width), nn.SiLU(),
                                 nn.Linear(width, width // 2), nn.SiLU(), nn.Linear(width // 2, 1))

    def forward(self, batch):
        x, outs = batch[0], []
        for fm, norm in zip(self.fm, self.norms):
            y = fm(x)                                          # (B, 4 w)
            outs.append(y)
            x = norm(x + y.reshape(y.shape[0], 4, self.width).sum(1))
        return self.top(torch.cat(outs[-2:], dim=1)).squeeze(-1)


def stand_in_loss(model, batch):
    return F.binary_cross_entropy_with_logits(model(batch).float(), batch[1].float())


def build(args, device: torch.device, dtype: torch.dtype):
    """(model, batch, loss_fn, description)."""
    torch.manual_seed(0)
    if not args.stand_in:  # the reference step of loka.bench
        preset = "tiny" if args.small else "paper"
        bcfg = BenchConfig(model="wukong", preset=preset, device=str(device),
                           table_rows=args.table_rows, compile=False)
        model = build_model(bcfg, None, device).to(dtype)
        return model, make_batch(model, bcfg, device), loss_fn, f"wukong/{preset}"
    width, rows = (64, 256) if args.small else (2048, 4096)
    model = StandIn(width).to(device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    batch = (torch.randn(rows, width, device=device, generator=g).to(dtype),
             torch.randint(0, 2, (rows,), device=device, generator=g).to(dtype))
    return model, batch, stand_in_loss, f"stand-in MLP (width {width})"



def run_steps(model, batch, loss_fn, opt, steps, device) -> float:
    """Seconds for ``steps`` full training steps."""
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    synchronize(device)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--stand-in", action="store_true", help="use the stand-in MLP")
    p.add_argument("--table-rows", type=int, default=1000, help="cap on embedding table rows")
    p.add_argument("--steps", type=int, default=None, help="steps per timed run (300; small: 30)")
    p.add_argument("--every", type=int, default=None, help="stats every N steps (100; small: 10)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per variant")
    p.add_argument("--rows-per-update", type=int, default=ProbeConfig.max_rows_per_update,
                   help="ProbeConfig.max_rows_per_update (the statistics step's cost scales with it)")
    p.add_argument("--graph-updates", action=argparse.BooleanOptionalAction,
                   default=ProbeConfig.graph_updates,
                   help="ProbeConfig.graph_updates: replay statistics updates as CUDA graphs")
    p.add_argument("--num-samples", type=int, default=16)
    p.add_argument("--sample-rows", type=int, default=None)
    p.add_argument("--no-report", action="store_true", help="skip timing probe.report()")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    steps = args.steps or (30 if args.small else 300)
    every = args.every or (10 if args.small else 100)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    model, batch, loss_fn, what = build(args, device, dtype)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
    cfg = ProbeConfig(every_n_steps=every, num_samples=args.num_samples,
                      sample_rows=args.sample_rows, bootstrap=1000, progress=False,
                      max_rows_per_update=args.rows_per_update,
                      graph_updates=args.graph_updates)
    sites = sum(isinstance(m, nn.Linear) for m in model.modules())
    print(f"{what} on {device}: {sites} Linears, {steps} steps per run, stats every {every}")

    run_steps(model, batch, loss_fn, opt, max(5, steps // 20), device)  # warm-up
    probe = loka.Probe(model, cfg)
    with probe:  # its first stats steps allocate and capture the update graphs
        run_steps(model, batch, loss_fn, opt, 2 * every + 1, device)
    plain, probed = [], []
    for rep in range(args.reps):
        for with_probe in ((False, True) if rep % 2 == 0 else (True, False)):
            if with_probe:
                with probe:  # steps keep counting: each run holds steps//every stats steps
                    probed.append(run_steps(model, batch, loss_fn, opt, steps, device))
            else:
                plain.append(run_steps(model, batch, loss_fn, opt, steps, device))
    step_ms = statistics.median(plain) / steps * 1e3
    probed_ms = statistics.median(probed) / steps * 1e3
    overhead = probed_ms / step_ms - 1.0

    # statistics steps alone, steady state: alternate stats and plain steps on one Probe
    with loka.Probe(model, ProbeConfig(every_n_steps=2, progress=False,
                                       max_rows_per_update=args.rows_per_update,
                      graph_updates=args.graph_updates)):
        alternating = [run_steps(model, batch, loss_fn, opt, 1, device) for _ in range(22)]
    on, off = alternating[2::2], alternating[3::2]  # the first stats step allocates
    stats_step_extra_ms = (statistics.median(on) - statistics.median(off)) * 1e3
    first_stats_step_extra_ms = (alternating[0] - statistics.median(off)) * 1e3

    result = {
        "benchmark": "probe_overhead", "model": what, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "torch": torch.__version__, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "dtype": str(dtype).replace("torch.", ""), "sites": sites, "steps_per_run": steps,
        "rows_per_update": args.rows_per_update, "graph_updates": args.graph_updates,
        "every_n_steps": every, "reps": args.reps,
        "step_ms_without": step_ms, "step_ms_with": probed_ms, "overhead": overhead,
        "runs_s_without": plain, "runs_s_with": probed,
        "stats_steps_in_timed_runs": len(probe.stats_steps) - 3,
        "graph_replays": sum(st.act.graph_replays + st.grad.graph_replays
                             for st in probe.sites.values()),
        "stats_step_extra_ms": stats_step_extra_ms,
        "first_stats_step_extra_ms": first_stats_step_extra_ms,
        "overhead_at_every_n_from_stats_step": stats_step_extra_ms / (every * step_ms),
        "timing": "wall clock over whole runs (synchronised at both ends)",
    }
    print(f"step without Probe  {step_ms:9.3f} ms")
    print(f"step with Probe     {probed_ms:9.3f} ms   overhead {100 * overhead:+.2f} %   "
          f"({result['graph_replays']} graph-replayed updates)")
    print(f"one stats step      {stats_step_extra_ms:+9.3f} ms extra (the first: "
          f"{first_stats_step_extra_ms:+.1f} ms, allocation included)")

    name = (result["device_name"] if device.type == "cuda" else "cpu").replace(" ", "-")
    out = args.out or os.path.join("bench", "results", f"probe_overhead_{name}.json")
    atomic_write_text(out, json.dumps(result, indent=1))  # kept if the report runs out of time
    if not args.no_report:
        synchronize(device)
        t0 = time.perf_counter()
        report = probe.report()
        synchronize(device)
        result["report_s"] = time.perf_counter() - t0
        result["report_kernels"] = report.kernel_names()
        result["report_site_roles"] = sum(len(s.roles) for s in report.sites.values())
        result["report_measurements"] = sum(len(r.kernels) for s in report.sites.values()
                                            for r in s.roles.values())
        result["report_summary"] = report.summary_table().splitlines()
        result["report_phases_s"] = report.meta.get("phases_s")
        print(f"probe.report()      {result['report_s']:9.1f} s   "
              f"({result['report_measurements']} kernel x site x role results; phases "
              f"{ {k: round(v, 1) for k, v in result['report_phases_s'].items()} })")
        print(report.summary_table())

    atomic_write_text(out, json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
