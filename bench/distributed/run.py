"""Data-parallel training step of a reference model, three ways, on any number of ranks:

* ``bf16``: bf16 (+ Mods) under FSDP2, parameters all-gathered in bf16;
* ``torchao``: torchao's Float8Linear with its tensorwise FP8 all-gather (needs torchao and
  a GPU; recorded as skipped otherwise);
* ``loka``: a LoKA plan (``--plan``, or every Linear on ``--kernel``) with LoKA's rowwise
  FP8 all-gather.

Per arm: median step time, samples/s (global batch / step time), scaling efficiency
against a world-size-1 run (``--baseline``, a JSON this script wrote with one rank), the
bytes and time of the all-gathers of one step (summed over ranks; timed in a separate
step, since timing each all-gather serializes it), and peak memory (the largest over
ranks: CUDA allocator peak, or the process's peak RSS on the CPU).

    torchrun --nproc_per_node 8 bench/distributed/run.py --preset paper --mods paper \
        --baseline bench/results/distributed_paper_w1.json
    torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper
    python bench/distributed/run.py --device cpu --preset tiny --steps 2 --warmup 1  # smoke

Without torchrun it runs as one rank. Rank 0 writes the JSON (``--out``, default
``bench/results/distributed_<preset>_w<world>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import loka
import loka.distributed as ld
from loka.assembly import build_reference
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.dispatch import Plan
from loka.jsonio import atomic_write_text
from loka.train.loop import loss_fn

ARMS = ("bf16", "torchao", "loka")
MODS = {"none": None, "paper": ModsConfig.paper()}


def _init(device_kind: str):
    if "RANK" not in os.environ:  # one rank, without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    return device


def _shard(model, mp_policy):
    from torch.distributed.fsdp import fully_shard
    blocks = [m for name in ("layers", "blocks") for m in getattr(model, name, [])]
    for block in blocks:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)


def _build(args, device, arm):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    model = build_reference(args.model, args.preset, MODS[args.mods], device, seed=0)
    note = None
    if arm == "loka":
        plan = (Plan.load(args.plan) if args.plan else
                ld.plan_once(lambda: Plan.uniform(model, args.kernel or _default_kernel(device))))
        plan = ld.broadcast_plan(plan)
        loka.apply(model, plan, strict=False)
        ld.check_same_plan(plan)
        wrapped = ld.fp8_all_gather(model, "rowwise")
        note = f"{sum(v == 'fp8' for v in wrapped.values())} of {len(wrapped)} planned Linears " \
               "all-gather FP8"
    elif arm == "torchao":
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        except ImportError:
            return None, "torchao is not installed"
        if device.type != "cuda":
            return None, "torchao's Float8Linear needs a GPU"
        # torch._scaled_mm needs both dims of a Linear to be multiples of 16 (the logit
        # Linear's single output is not): those stay in bf16, as torchao users filter them
        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda mod, fqn: not isinstance(mod, torch.nn.Linear) or (
                mod.in_features % 16 == 0 and mod.out_features % 16 == 0))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if arm == "bf16" and \
        device.type == "cuda" else MixedPrecisionPolicy()
    _shard(model, mp)
    return model, note


def _default_kernel(device) -> str:
    return "cublas-rowwise" if device.type == "cuda" else "emulated-rowwise-e4m3"


def _after_step(model, arm):
    """The scales of the next step's FP8 all-gathers, in one collective per kind (part of
    the step: its bytes are counted)."""
    if arm == "loka":
        ld.precompute_fp8_scales(model)
    elif arm == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(model)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_arm(args, device, arm, world):
    model, note = _build(args, device, arm)
    if model is None:
        return {"skipped": note}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batch_size = args.batch_size or model.default_batch_size
    data = SyntheticCTR(model.feature_spec, batch_size * world, seed=0, device=device)
    batches = [ld.shard_batch(next(data)) for _ in range(args.distinct_batches)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step(batch):
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _after_step(model, arm)
        return loss

    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        dist.barrier()
        tic = time.perf_counter()
        loss = step(batches[i % len(batches)])
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - tic)
    with ld.count_all_gather(timed=True) as counted:
        step(batches[0])
    if not torch.isfinite(loss.float()):
        raise RuntimeError(f"{arm}: non-finite loss {loss.item()}")
    local = torch.tensor([float(counted.bytes), counted.seconds, _peak_mb(device),
                          statistics.median(times)], dtype=torch.float64,
                         device=ld.collective_device())
    summed, peak = local.clone(), local.clone()
    dist.all_reduce(summed)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step_s = float(peak[3])  # the slowest rank sets the step
    out = {"step_time_s": step_s, "samples_per_s": batch_size * world / step_s,
           "global_batch": batch_size * world, "all_gather_bytes_per_step": int(summed[0]),
           "all_gather_s_per_step": float(summed[1]) / world, "peak_memory_mb": float(peak[2]),
           "all_gathers_per_step": counted.count}
    if note:
        out["note"] = note
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default="paper")
    p.add_argument("--mods", choices=sorted(MODS), default="paper")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    p.add_argument("--plan", help="a LoKA plan JSON for the loka arm (default: --kernel everywhere)")
    p.add_argument("--kernel", help="the loka arm's kernel without --plan "
                                    "(default: cublas-rowwise; emulated-rowwise-e4m3 on the CPU)")
    p.add_argument("--batch-size", type=int, help="per rank (default: the model's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--distinct-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--baseline", help="this script's JSON of a world-size-1 run: scaling efficiency")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        p.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if min(args.steps, args.distinct_batches) < 1 or args.warmup < 0:
        p.error("--steps and --distinct-batches must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu")
    device = _init(args.device)
    rank, world = ld.world()
    baseline = None
    if args.baseline:
        baseline = json.loads(Path(args.baseline).read_text())
        if baseline.get("world_size") != 1:
            sys.exit(f"--baseline {args.baseline}: not a world-size-1 run")
    arms = {}
    for arm in args.arms:
        try:
            arms[arm] = run_arm(args, device, arm, world)
        except Exception as e:
            if world > 1:
                # a rank that went on alone would pair its next collectives with the
                # other ranks' pending ones: every rank stops (torchrun ends the job)
                raise
            # one rank: the arm's failure is recorded and the other arms still run
            print(f"{arm} failed: {type(e).__name__}: {e}", file=sys.stderr)
            first = (str(e).splitlines() or [""])[0]
            arms[arm] = {"error": f"{type(e).__name__}: {first[:300]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        base = (baseline or {}).get("arms", {}).get(arm, {})
        if "samples_per_s" in arms[arm]:
            arms[arm]["scaling_efficiency"] = (
                arms[arm]["samples_per_s"] / (world * base["samples_per_s"])
                if "samples_per_s" in base else (1.0 if world == 1 else None))
    result = {"model": args.model, "preset": args.preset, "mods": args.mods,
              "world_size": world, "device": str(device.type),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or platform.machine(),
              "torch": torch.__version__, "backend": dist.get_backend(),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), "arms": arms}
    if rank == 0:
        out = Path(args.out or f"bench/results/distributed_{args.preset}_w{world}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
