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

With ``--ne-steps N`` each arm also trains a fresh model for N steps on a synthetic stream
whose global batch (``--ne-batch``) is the same whatever the world size, each rank its
rows, and scores ``--ne-eval-batches`` held-out global batches: NE, and each example's log
loss in the global order (``<out>.ne.npz``, plain arrays). Against a ``--baseline`` run
with one rank and the same NE settings, each arm gets ``ne_vs_baseline``: the relative NE
change over the same examples, its 95% paired interval, and whether the interval holds
zero (the quality check of a multi-GPU run: for bf16, data parallelism changes only the
order of the gradients' sums; an FP8 arm also scales each rank's activations by that
rank's rows and, for LoKA, gathers its weights in FP8).

With ``--compile`` each child of the root module, and each member of a child that is a
``ModuleList`` or ``ModuleDict`` (the blocks FSDP shards among them), runs under
``torch.compile`` (``module.compile()``; the root's glue between them stays eager): FSDP2's
hooks, which issue the all-gathers and reduce-scatters, are closed to Dynamo and run
eagerly between the compiled regions, whose kernels are Inductor's, LoKA's FP8 casts fused
where they can be. Dynamo's caches are emptied before each arm, which records how many
graphs it compiled (``compiled_graphs``). A ``--baseline`` must share the run's settings
(:func:`run_settings`).

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
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import loka
import loka.distributed as ld
from loka.assembly import build_reference
from loka.bench.config import BenchConfig
from loka.bench.env import source_digest
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.dispatch import Plan
from loka.jsonio import atomic_write_text
from loka.quality.stats import example_log_losses, ratio_interval
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


BLOCKS = ("layers", "blocks")


def _shard(model, mp_policy):
    from torch.distributed.fsdp import fully_shard
    for block in [m for name in BLOCKS for m in getattr(model, name, [])]:
        fully_shard(block, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)


COMPILE_SCOPE = "children"
"""what ``--compile`` compiles (:func:`_compile`); compiled runs written before it, which
compiled the root module whole, read as ``'root'``"""


def _compile(model) -> None:
    """``module.compile()`` on each child of the root, and on each member of a child that
    is a ``ModuleList`` or ``ModuleDict`` (the blocks FSDP shards among them): containers
    are never called themselves. The root's own forward (the glue between them) stays
    eager. Compiling the root whole does not work under FSDP2: its hooks are closed to
    Dynamo, and a graph break inside the root's loop over its blocks makes Dynamo run the
    whole root forward eagerly."""
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for module in child.children():
                module.compile()
        else:
            child.compile()


def _build(args, device, arm):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    model = build_reference(args.model, args.preset, MODS[args.mods], device, seed=0,
                            table_rows=args.table_rows or None,
                            fused_embeddings=args.fused_embeddings)
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
    if args.compile:
        _compile(model)
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


OPTIMIZERS = ("fused", "default")
"""``--optimizer``: AdamW's fused implementation (a few kernels per device and dtype, and
under FSDP2 one DTensor dispatch, per parameter group and step), or the one torch picks
(``foreach`` on CUDA, a loop over the parameters on the CPU; each of its ops over
DTensors is dispatched on the host), as runs written before the option did"""


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, as ``--optimizer`` says."""
    extra = {"fused": True} if args.optimizer == "fused" else {}
    return torch.optim.AdamW(model.parameters(), lr=args.lr, **extra)


def _train_step(model, opt, arm, batch):
    """One training step of an arm on this rank's batch: loss, backward, optimizer step,
    and the scales of the next step's FP8 all-gathers; its loss."""
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _after_step(model, arm)
    return loss


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _fresh_compiler(args) -> None:
    """With ``--compile``, Dynamo's caches emptied before an arm builds its model: each arm
    compiles its own graphs (``compiled_graphs`` counts them), with the shapes it runs, and
    never meets the recompile limit of the code objects the arms share."""
    if args.compile:
        import torch._dynamo
        torch._dynamo.reset()


def _profile(step, device, steps: int) -> dict:
    """This rank's GPU time per step by kernel class with the ten largest kernels
    (:func:`loka.bench.evalset.profile_gpu`), and its host time per step
    (:func:`~loka.bench.evalset.profile_host`), each over ``steps`` more steps: where the
    step's time goes beside its median."""
    from loka.bench.evalset import profile_gpu, profile_host

    gpu = profile_gpu(step, steps)
    gpu.pop("kernels_ms", None)
    gpu["top_kernels_ms"] = gpu["top_kernels_ms"][:10]
    return {**gpu, **profile_host(step, device, steps)}


def run_arm(args, device, arm, world):
    _fresh_compiler(args)
    graphs_before = _graphs_compiled()
    model, note = _build(args, device, arm)
    if model is None:
        return {"skipped": note}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batch_size = args.batch_size or model.default_batch_size
    data = SyntheticCTR(model.feature_spec, batch_size * world, seed=0, device=device)
    batches = [ld.shard_batch(next(data)) for _ in range(args.distinct_batches)]
    opt = make_optimizer(model, args)

    def step(batch):
        return _train_step(model, opt, arm, batch)

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
    if args.compile:
        out["compiled_graphs"] = _graphs_compiled() - graphs_before
    if args.profile_steps:
        out["profile"] = _profile(lambda: step(batches[0]), device, args.profile_steps)
    if note:
        out["note"] = note
    return out


def _gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's rows of ``t`` (equal counts), in rank order: the global batch's order
    (:func:`loka.distributed.shard_batch` gives rank r the r-th slice)."""
    if world == 1:
        return t
    t = t.contiguous().to(ld.collective_device())
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def normalized_entropy(losses: np.ndarray, labels: np.ndarray) -> float:
    """Mean log loss over the entropy of the labels' base rate (NE; below 1: better than
    predicting the base rate)."""
    p = float(np.clip(labels.mean(), 1e-12, 1 - 1e-12))
    return float(losses.mean() / -(p * np.log(p) + (1 - p) * np.log(1 - p)))


def ne_check(args, device, arm, world):
    """Train a fresh model of ``arm`` for ``--ne-steps`` steps (global batch ``--ne-batch``,
    each rank its rows), then score ``--ne-eval-batches`` held-out global batches. Returns
    the arm's NE fields and the per-example log losses and labels (global order; every
    rank holds them)."""
    _fresh_compiler(args)
    model, note = _build(args, device, arm)
    if model is None:
        return {"skipped": note}, None, None
    if args.ne_batch % world:
        raise ValueError(f"--ne-batch {args.ne_batch} does not split over {world} ranks")
    stream = SyntheticCTR(model.feature_spec, args.ne_batch, seed=1, device=device)
    opt = make_optimizer(model, args)
    for _ in range(args.ne_steps):
        _train_step(model, opt, arm, ld.shard_batch(next(stream)))
    held_out = stream.held_out()
    logits, labels = [], []
    with torch.no_grad():
        for _ in range(args.ne_eval_batches):
            batch = next(held_out)
            logits.append(_gather_rows(model(ld.shard_batch(batch)).float(), world).cpu())
            labels.append(batch.labels.float().cpu())
    z = torch.cat(logits).double().numpy()
    y = torch.cat(labels).double().numpy()
    losses = example_log_losses(z, y)
    if not np.isfinite(losses).all():
        raise RuntimeError(f"{arm}: non-finite log loss after {args.ne_steps} steps")
    return ({"ne": normalized_entropy(losses, y), "ne_examples": int(y.size)}, losses, y)


def run_settings(args) -> dict:
    """What a ``--baseline`` run must share with this one for its step times and NE to
    compare: the model and how it is built, the device, the per-rank batch (None: the
    model's), what was compiled, the optimizer, and the loka arm's kernel or plan (its file
    name)."""
    return {"model": args.model, "preset": args.preset, "mods": args.mods,
            "device": args.device, "batch_size": args.batch_size,
            "table_rows": args.table_rows, "fused_embeddings": args.fused_embeddings,
            "compile": args.compile, "compile_scope": COMPILE_SCOPE if args.compile else None,
            "optimizer": args.optimizer, "kernel": args.kernel,
            "plan": Path(args.plan).name if args.plan else None}


def as_recorded(settings: dict) -> dict:
    """A run's recorded settings, with what runs written before an option existed did:
    the preset's tables, one per feature, eager or (``compile`` true) compiled whole, torch's
    default AdamW, the model's batch, the default kernel."""
    older = {"batch_size": None, "table_rows": 0, "fused_embeddings": False,
             "compile": False, "compile_scope": "root" if settings.get("compile") else None,
             "optimizer": "default", "kernel": None, "plan": None}
    return {**older, **settings}


def baseline_mismatch(baseline: dict, args) -> Optional[str]:
    """The run settings (:func:`run_settings`) in which ``baseline`` differs from this run,
    as ``'key=theirs (this run: ours)'`` joined by commas; None where none does."""
    theirs = as_recorded(baseline)
    differ = [f"{key}={theirs.get(key)!r} (this run: {ours!r})"
              for key, ours in run_settings(args).items() if theirs.get(key) != ours]
    return ", ".join(differ) or None


def _ne_settings(args) -> dict:
    """What two runs' NE checks must share to be compared: the run's settings
    (:func:`run_settings`) and the check's own sizes."""
    return {**run_settings(args), "ne_steps": args.ne_steps, "ne_batch": args.ne_batch,
            "ne_eval_batches": args.ne_eval_batches, "lr": args.lr}


def ne_vs_baseline(baseline: dict, baseline_path: Path, arm: str, losses: np.ndarray,
                   labels: np.ndarray, settings: dict) -> dict:
    """This run's per-example log losses against the world-size-1 baseline's, paired by
    example: ``mean(this) / mean(baseline) - 1`` and its 95% interval; ``matches``: the
    interval holds zero. A baseline with other NE settings or without this arm's losses
    is reported as not comparable."""
    theirs = as_recorded(baseline["ne_settings"]) if baseline.get("ne_settings") else None
    if theirs != settings:
        return {"comparable": False,
                "reason": f"baseline NE settings {baseline.get('ne_settings')} != {settings}"}
    npz = baseline_path.parent / baseline.get("ne_losses_file", "")
    if not baseline.get("ne_losses_file") or not npz.is_file():
        return {"comparable": False, "reason": f"no per-example losses beside {baseline_path}"}
    try:
        with np.load(npz, allow_pickle=False) as saved:
            if f"{arm}_losses" not in saved.files:
                return {"comparable": False, "reason": f"the baseline has no {arm} losses"}
            base, base_labels = saved[f"{arm}_losses"], saved["labels"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        return {"comparable": False, "reason": f"cannot read {npz}: {type(e).__name__}: {e}"}
    if base.shape != losses.shape or not np.array_equal(base_labels, labels):
        return {"comparable": False, "reason": "the baseline scored other examples"}
    change, low, high = ratio_interval(base, losses)
    return {"comparable": True, "relative_change": change, "interval_95": [low, high],
            "matches": bool(low <= 0.0 <= high)}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wukong")
    p.add_argument("--preset", default="paper")
    p.add_argument("--mods", choices=sorted(MODS), default="paper")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    p.add_argument("--plan",
                   help="a LoKA plan JSON for the loka arm (default: --kernel everywhere)")
    p.add_argument("--kernel", help="the loka arm's kernel without --plan "
                                    "(default: cublas-rowwise; emulated-rowwise-e4m3 on the CPU)")
    p.add_argument("--batch-size", type=int, help="per rank (default: the model's)")
    p.add_argument("--table-rows", type=int, default=BenchConfig.table_rows,
                   help="cap on embedding-table rows, as loka bench caps them (default "
                        f"{BenchConfig.table_rows}; 0: the preset's tables, whose dense "
                        "gradients and AdamW update then dominate the step)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--distinct-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="fused",
                   help="AdamW fused (default: a few fused kernels and, under FSDP2, one host "
                        "dispatch per step) or torch's default implementation (as runs before "
                        "this option)")
    p.add_argument("--fused-embeddings", action=argparse.BooleanOptionalAction,
                   default=BenchConfig.fused_embeddings,
                   help="all tables in one (loka.models.fused_embedding), as loka bench runs "
                        "them: one embedding bag and one dense gradient per step instead of "
                        "one per table, each with its own sort and launches")
    p.add_argument("--baseline", help="this script's JSON of a world-size-1 run: scaling "
                                      "efficiency, and with --ne-steps the NE comparison")
    p.add_argument("--ne-steps", type=int, default=0,
                   help="train a fresh model per arm this many steps and score held-out "
                        "batches (0: no NE check)")
    p.add_argument("--ne-batch", type=int, default=256,
                   help="the NE check's global batch (the same for every world size)")
    p.add_argument("--ne-eval-batches", type=int, default=8,
                   help="held-out global batches the NE check scores")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each child of the root module and each block (the "
                        "root's glue and FSDP2's hooks stay eager)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA only: after the timing, profile this many steps of each arm on "
                        "this rank (GPU time by kernel class, the largest kernels, host time)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        p.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    if min(args.steps, args.distinct_batches) < 1 or args.warmup < 0:
        p.error("--steps and --distinct-batches must be >= 1, --warmup >= 0")
    if args.table_rows < 0:
        p.error("--table-rows must be >= 0 (0: the preset's tables)")
    if args.ne_steps < 0 or min(args.ne_batch, args.ne_eval_batches) < 1:
        p.error("--ne-steps must be >= 0, --ne-batch and --ne-eval-batches >= 1")
    if args.profile_steps < 0 or (args.profile_steps and args.device != "cuda"):
        p.error("--profile-steps must be >= 0, and profiles CUDA runs only")
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
        differ = baseline_mismatch(baseline, args)
        if differ:
            sys.exit(f"--baseline {args.baseline}: run with {differ}")
    arms = {}
    ne_arrays = {}
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
        if args.ne_steps and "error" not in arms[arm] and "skipped" not in arms[arm]:
            try:
                fields, losses, labels = ne_check(args, device, arm, world)
            except Exception as e:
                if world > 1:
                    raise  # as for the timing: every rank stops
                print(f"{arm} NE check failed: {type(e).__name__}: {e}", file=sys.stderr)
                first = (str(e).splitlines() or [""])[0]
                fields, losses, labels = {"ne_error": f"{type(e).__name__}: {first[:300]}"}, \
                    None, None
            arms[arm].update(fields)
            if losses is not None:
                ne_arrays[f"{arm}_losses"], ne_arrays["labels"] = losses, labels
                if baseline is not None:
                    arms[arm]["ne_vs_baseline"] = ne_vs_baseline(
                        baseline, Path(args.baseline), arm, losses, labels, _ne_settings(args))
        base = (baseline or {}).get("arms", {}).get(arm, {})
        if "samples_per_s" in arms[arm]:
            arms[arm]["scaling_efficiency"] = (
                arms[arm]["samples_per_s"] / (world * base["samples_per_s"])
                if "samples_per_s" in base else (1.0 if world == 1 else None))
    result = {**run_settings(args), "world_size": world,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or platform.machine(),
              "torch": torch.__version__, "source_sha1": source_digest(),
              "backend": dist.get_backend(),
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), "arms": arms}
    out = Path(args.out or f"bench/results/distributed_{args.preset}_w{world}.json")
    if args.ne_steps:
        result["ne_settings"] = _ne_settings(args)
        if ne_arrays:
            result["ne_losses_file"] = out.name + ".ne.npz"
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        if ne_arrays:
            with open(out.parent / result["ne_losses_file"], "wb") as f:
                np.savez(f, **ne_arrays)
        atomic_write_text(out, json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
