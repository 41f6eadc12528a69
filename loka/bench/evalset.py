"""LoKA on models it has never seen: an evaluation set of the user's models in bf16, with
torchao's float8 recipes, and through LoKA's public path, side by side in one run.

The models come from a Python package given by its path (``loka bench --eval-set PATH``;
the repository ships one beside its benchmark scripts): it defines ``EVAL_MODELS`` (name -> a class
whose ``cls(scale)`` builds the model and whose ``model.make_batch(batch_size, device,
dtype, seed=...)`` returns ``(inputs, labels)``, the model called as ``model(*inputs)``),
``SCALES`` (the scales its classes take; the first is the full size) and
``loss_fn(model, batch)``. Nothing here knows any model of it.

Every row is the same model (same weights, same batch), compiled the same way
(``torch.compile``, with ``mode="reduce-overhead"`` for the CUDA-graph rows; with
``--graph-capture step``, the CUDA-graph rows instead compile in the default mode and capture
each whole step, the optimizer's update included, in one CUDA graph that every step
replays, :class:`loka.timing.CapturedStep`; such a training row's ``loss_first_step`` is
the loss after the capture's warm-up updates), and differs only in what its Linears run:

- ``bf16``: the model as written (bf16 weights and activations, the Mods built in);
- ``torchao-<recipe>``: training: ``convert_to_float8_training`` with
  ``Float8LinearConfig.from_recipe_name(recipe)`` (tensorwise, rowwise,
  rowwise_with_gw_hp) on every Linear whose dims are multiples of 16; serving:
  ``Float8DynamicActivationFloat8WeightConfig`` (per tensor, per row) through ``quantize_``;
  skipped, with the reason recorded, where torchao is missing or cannot run;
- ``loka-optimize``: ``loka.optimize`` on the same report: whole steps, compiled as the row
  is, decide which FP8 sites stay, and the plan is kept only if it wins its A/B rounds;
- ``loka-optimize-static`` (serving): the same with ``static_scales=True``, the public
  path to the static serving plan below with the same never-slower check;
- ``loka``: ``loka.probe(model, batches, loss_fn)`` -> ``loka.plan(report)`` (serving:
  ``loka.plan(report, inference=True)``) -> ``loka.apply(model, plan)`` (serving:
  ``inference=True``), then the same compile. The Probe runs once per model and batch size
  and both plans come from its report;
- ``loka-static`` (serving): ``loka.plan(report, inference=True, static_scales=True)``,
  the same report planned for static activation scales (the input amax the Probe observed
  at each site whose forward kernel takes one; kernels judged by that price), applied as
  the plan says: the casts need no amax pass and fuse into the kernels that make x; values
  beyond the observed amax saturate;
- ``loka-delayed`` (training): ``loka.plan(report, allowed_kernels=<the tensorwise kernels
  the report measured>)`` with ``plan.delayed_scaling`` set (``loka plan --kernels ...
  --delayed-scaling``): the same report, every FP8 role on a tensorwise kernel whose casts
  use scales from earlier steps.

Each row: median step time (a full training step: forward, BCE loss, backward, fused
AdamW; or a serving forward), GPU time per step and its split by kernel class
(torch.profiler), the host's time to issue the step (``host_ms``) and what the step makes
the host wait for (``host_syncs``: a compiled step should list nothing), peak memory, FP8
site count, the Probe's wall time, the output's change against bf16, and ratios against
the bf16 row of the same model, batch, mode and graph setting (with ``--paired-rounds``,
also in alternating rounds beside the bf16 row's step, kept for the group: ``paired_vs_bf16``,
for hosts whose speed drifts between rows; a row without a bf16 row to pair with, left out
or failed, has none; ``paired_pipelined_vs_bf16``: the same rounds with steps issued back
to back, one synchronization per round, as a training loop or a loaded server runs them,
and each row's ``pipelined_ms``). The JSON is rewritten
(atomically) after every row, so a run cut short keeps what it measured. On a CPU the run
checks the pipeline only: its timings say nothing about FP8 on a GPU (the JSON's ``env``
says so).

    loka bench --eval-set PATH --out bench/results/<run>/eval_set.json
    python bench/eval_set.py --out bench/results/<run>/eval_set.json   # the repository's set
    python bench/eval_set.py --models wukong --batch-sizes 4096 --modes train \\
        --probe-config '{"num_samples": 16, "compare_naive": false}' --out w.json
    python bench/eval_set.py --models wukong --batch-sizes 4096 \\
        --report 'runs/r.{model}.b{batch}.report.json' --out w2.json   # reuse a saved report
    python bench/eval_set.py --scale tiny --models wukong --batch-sizes 64 --modes train \\
        --steps 2 --warmup 1 --no-graphs --out /tmp/eval.json          # CPU smoke run

Length: one harness (rows, the Probe's once-per-case run, the GPU profile, the JSON and
its table) whose parts share the row format; split, each part would need all of it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.autograd import DeviceType
from torch._inductor import config as inductor_config
from torch.profiler import ProfilerActivity, profile

import importlib.metadata
import importlib.util
import types

from ..config import ProbeConfig
from ..dispatch import apply as apply_plan
from ..dispatch import optimize as optimize_plan
from ..dispatch import plan as make_plan
from ..dispatch import fp8_ceiling, predict_step
from ..dispatch.aot import aot_compile
from ..dispatch.linear import delayable
from ..dispatch.static import amax_from_report, static_scales_for
from ..dispatch.steptimer import check_host_slowdown
from ..jsonio import atomic_write_text, json_safe
from ..kernels import registry
from ..numerics.delayed import DEFAULT_DECAY
from ..probe import ProbeReport
from ..probe import probe as probe_model
from ..timing import CapturedStep, synchronize
from . import profiling, stepcode
from .env import source_digest
from .profiling import QUANTIZE_KERNELS, host_self_us

try:  # torchao is optional: its rows are skipped, with this reason, where it is missing
    import torchao
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    TORCHAO_VERSION: Optional[str] = getattr(torchao, "__version__", "unknown")
    TORCHAO_MISSING: Optional[str] = None
except Exception as e:  # noqa: BLE001 - any import failure means "no torchao rows"
    TORCHAO_VERSION, TORCHAO_MISSING = None, f"torchao not importable ({type(e).__name__}: {e})"
try:
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, PerRow,
                                      PerTensor, quantize_)
    TORCHAO_SERVE_MISSING: Optional[str] = TORCHAO_MISSING
except Exception as e:  # noqa: BLE001
    TORCHAO_SERVE_MISSING = TORCHAO_MISSING or (
        f"torchao has no float8 dynamic-activation inference config ({type(e).__name__}: {e})")

SCHEMA, VERSION = "loka.evalset", 1
MODES = ("train", "serve")
TORCHAO_TRAIN_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TORCHAO_SERVE_RECIPES = ("tensorwise", "rowwise")
VARIANTS = {
    "train": ("bf16",) + tuple(f"torchao-{r}" for r in TORCHAO_TRAIN_RECIPES)
    + ("loka", "loka-optimize", "loka-delayed"),
    "serve": ("bf16",) + tuple(f"torchao-{r}" for r in TORCHAO_SERVE_RECIPES)
    + ("loka", "loka-optimize", "loka-static", "loka-optimize-static"),
}
KERNEL_CLASSES = ("gemm_bf16", "gemm_fp8", "quantization", "copies", "triton", "optimizer",
                  "other")
# an Inductor kernel named after ops that only move or cast data is a copy
_COPY_OPS = re.compile(r"(?:_+(?:unsafe_view|constant_pad_nd|to_copy|transpose|permute|clone|"
                       r"expand|slice|copy|view|cat|t))+_*\d*")

# cuBLAS's Hopper GEMMs name FP8 operand types before "tst": q (e4m3), r (e5m2)
_NVJET_FP8 = re.compile(r"nvjet_(?:sm\d+_)?[qr]{2}t")
# ops of a norm: an Inductor kernel with them and a quantization fused the two
_NORM_OPS = ("rsqrt", "mean", "var_mean", "pow")
# a copy kernel of ATen or the driver ("cat" as a word: not "scatter")
_COPY_KERNEL = re.compile(r"copy|transpose|clone|memcpy|memset|(?<![a-z])cat")


class Skip(Exception):
    """A row that cannot run here; the message is the reason recorded for it."""


# ---------------------------------------------------------------------------- profiling

def kernel_class(name: str) -> str:
    """The class of a GPU kernel by its name: ``gemm_bf16``, ``gemm_fp8`` (names with
    f8/fp8/e4m3/scaled_mm, cuBLAS's FP8 ``nvjet_*qq/qr*`` kernels, per-row/tensor/block-scaled
    GEMMs), ``quantization`` (amax, cast and quantize kernels: LoKA's, FBGEMM's, and
    Inductor's that make an FP8 operand in a pass of their own), ``copies`` (copies,
    transposes, clones, concatenations, memcpy/memset, Inductor kernels fusing only such
    ops), ``triton`` (Inductor's fused elementwise and norm kernels, with any quantization
    fused into a norm), ``optimizer`` or ``other``."""
    n = name.lower()
    if "adam" in n or "multi_tensor_apply" in n or "foreach" in n:
        return "optimizer"
    inductor = n.startswith(("triton_poi", "triton_red", "triton_per"))
    gemm = n.startswith("triton_tem") or (not inductor and any(
        t in n for t in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_",
                         "matmul", "scaled_mm", "wgmma")))
    fp8 = any(t in n for t in ("f8", "fp8", "e4m3", "e5m2", "scaled_mm", "wise_gemm")) or bool(
        _NVJET_FP8.match(n))
    if gemm:
        return "gemm_fp8" if fp8 else "gemm_bf16"
    if inductor:
        ops = "_" + n.split("_fused_", 1)[1] if "_fused_" in n else ""
        if any(t in ops for t in ("amax", "_scaled_mm", "float8")):
            # a pass of its own makes an FP8 operand; fused into a norm it is the norm's
            return "triton" if any(t in ops for t in _NORM_OPS) else "quantization"
        return "copies" if _COPY_OPS.fullmatch(ops) else "triton"
    if n.startswith(QUANTIZE_KERNELS) or any(
            t in n for t in ("amax", "quant", "float8", "cast_kernel", "cast_split")):
        return "quantization"
    if _COPY_KERNEL.search(n):
        return "copies"
    if n.startswith("triton"):
        return "triton"
    return "other"


def profile_gpu(step: Callable[[], object], steps: int) -> dict:
    """GPU time per step of an already warmed-up ``step`` (sum of CUDA kernel times), split
    by :func:`kernel_class`, with the largest kernels, over ``steps`` steps."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: Dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != DeviceType.CUDA:
            continue
        per_kernel[evt.name] = per_kernel.get(evt.name, 0.0) + evt.device_time_total / steps
    by_class = {c: 0.0 for c in KERNEL_CLASSES}
    for k, us in per_kernel.items():
        by_class[kernel_class(k)] += us
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:15]
    return {"gpu_ms_per_step": sum(per_kernel.values()) / 1e3,
            "by_class_ms": {c: v / 1e3 for c, v in by_class.items()},
            "top_kernels_ms": [[k[:160], v / 1e3, kernel_class(k)] for k, v in ranked],
            "kernels_ms": {k: v / 1e3 for k, v in per_kernel.items()},
            "profiled_steps": steps}


HOST_SKIP = ("ProfilerStep", "cudaDeviceSynchronize", "cudaStreamSynchronize",
             "cudaEventSynchronize")
"""host events that wait for the GPU rather than work for the step"""


def profile_host(step: Callable[[], object], device: torch.device, steps: int,
                 top: int = 12) -> dict:
    """Where the host's time goes in ``steps`` steps of an already warmed-up ``step``, on its
    own (the CPU side alone, so that the GPU profile is not slowed by it): the self CPU
    time per step of every host event (operators, compiled-graph calls, Dynamo's cache
    lookup, CUDA API calls), the total, and the ``top`` largest. A step without CUDA graphs
    is host-bound when this total approaches its wall time."""
    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    own = host_self_us(prof.key_averages(), steps, skip=HOST_SKIP)
    ranked = sorted(own.items(), key=lambda kv: -kv[1])[:top]
    return {"host_us_per_step": sum(own.values()),
            "host_top_us": [[k[:120], round(v, 1)] for k, v in ranked]}


# ---------------------------------------------------------------------------- variants

def dims_fit_fp8(mod: nn.Module) -> bool:
    """A Linear torchao's float8 can take: both dims multiples of 16 (the logit is not)."""
    return isinstance(mod, nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def contiguous_input(module, args):
    """Forward pre-hook: the first input made contiguous (torchao's rowwise casts cannot
    take the transposed views Wukong's Linears over the embedding axis read)."""
    return (args[0].contiguous(),) + tuple(args[1:])


def torchao_train(model: nn.Module, recipe: str, device: torch.device) -> Tuple[int, List[str]]:
    if TORCHAO_MISSING:
        raise Skip(TORCHAO_MISSING)
    if device.type != "cuda":
        raise Skip("torchao float8 training needs a CUDA device")
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: dims_fit_fp8(m))
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    notes = []
    if recipe.startswith("rowwise"):
        for m in converted:
            m.register_forward_pre_hook(contiguous_input)
        notes.append(f"inputs made contiguous at {len(converted)} Linear(s) (torchao's rowwise "
                     "casts need it); the copies are charged to this row")
    return len(converted), notes


def torchao_serve(model: nn.Module, recipe: str, device: torch.device) -> Tuple[int, List[str]]:
    if TORCHAO_SERVE_MISSING:
        raise Skip(TORCHAO_SERVE_MISSING)
    if device.type != "cuda":
        raise Skip("torchao float8 inference needs a CUDA device")
    kwargs = {"granularity": PerRow() if recipe == "rowwise" else PerTensor()}
    notes = []
    if "set_inductor_config" in getattr(Float8DynamicActivationFloat8WeightConfig,
                                        "__dataclass_fields__", {}):
        # torchao's default changes Inductor's global settings for every later row
        kwargs["set_inductor_config"] = False
        notes.append("set_inductor_config=False: every row compiles with the same settings")
    chosen = []

    def filt(mod, fqn):
        ok = dims_fit_fp8(mod)
        if ok:
            chosen.append(fqn)
        return ok
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(**kwargs), filter_fn=filt)
    return len(chosen), notes


def fp8_sites(plan) -> Dict[str, Dict[str, str]]:
    """The plan's non-baseline choices: site -> {role: kernel}."""
    out = {}
    for site, sp in plan.sites.items():
        roles = {str(r): c.kernel for r, c in sp.roles.items() if c.kernel != plan.baseline}
        if roles:
            out[site] = roles
    return out


@dataclasses.dataclass
class Case:
    """One model at one batch size: its weights, batches and (once) the Probe's plans."""

    name: str
    batch_size: int
    base: nn.Module                         # on the CPU, in the run's dtype
    batch: tuple                            # timed batch, on the device
    ref_out: Dict[str, torch.Tensor]        # mode -> eager bf16 logits (float32)
    linears: int
    probe_s: Optional[float] = None
    report: Optional[object] = None         # the Probe's report (loka.ProbeReport)
    plans: Optional[dict] = None            # mode -> Plan
    probe_error: Optional[str] = None
    probe_files: Optional[dict] = None
    probed: bool = False


def set_mode(model: nn.Module, mode: str) -> None:
    model.train(mode == "train")


def run_probe(case: Case, args, device, dtype, out_stem: Optional[str]) -> None:
    """``loka.probe`` on a copy of the model, then both plans, through the public API."""
    if args.report:
        path = args.report.format(model=case.name, batch=case.batch_size)
        report = case.report = ProbeReport.load(path)
        case.probe_files = {"report": path}
        case.plans = {"train": make_plan(report, **args.plan_kwargs),
                      "serve": make_plan(report, inference=True, **args.plan_kwargs),
                      "static": make_plan(report, inference=True, static_scales=True,
                                          **args.plan_kwargs)}
        return
    model = copy.deepcopy(case.base).to(device)
    batches = [model.make_batch(case.batch_size, device, dtype, seed=1 + i)
               for i in range(args.probe_batches)]
    t0 = time.perf_counter()
    report = case.report = probe_model(model, batches, args.eval_set.loss_fn,
                                       config=args.probe_config)
    synchronize(device)
    case.probe_s = time.perf_counter() - t0
    case.plans = {"train": make_plan(report, **args.plan_kwargs),
                  "serve": make_plan(report, inference=True, **args.plan_kwargs),
                  "static": make_plan(report, inference=True, static_scales=True,
                                      **args.plan_kwargs)}
    if out_stem:
        stem = f"{out_stem}.{case.name}.b{case.batch_size}"
        case.probe_files = {"report": stem + ".report.json",
                            "plan_train": stem + ".plan.train.json",
                            "plan_serve": stem + ".plan.serve.json",
                            "plan_static": stem + ".plan.static.json"}
        report.save(case.probe_files["report"])
        for mode in ("train", "serve", "static"):
            case.plans[mode].save(case.probe_files["plan_" + mode])
    del model, batches, report


def probe_case(case: Case, args, device, out_stem: Optional[str]) -> dict:
    """Run the Probe for ``case`` (once), keeping a failure as the LoKA rows' reason."""
    case.probed = True
    try:
        run_probe(case, args, device, args.dtype, out_stem)
    except Exception as e:  # noqa: BLE001 - the other rows still run
        case.probe_error = f"{type(e).__name__}: {e}"[:2000]
    return {"model": case.name, "batch_size": case.batch_size, "probe_wall_s": case.probe_s,
            "error": case.probe_error, "files": case.probe_files,
            "fp8_sites": None if case.plans is None else
            {m: len(fp8_sites(p)) for m, p in case.plans.items()}}


def _case_report(case: Case) -> ProbeReport:
    """The case's Probe report; Skip, saying why, where there is none."""
    if case.report is None:
        raise Skip(f"no report: the Probe failed ({case.probe_error})" if case.probe_error
                   else "no report: the time budget was spent before the Probe")
    return case.report


def _case_plans(case: Case) -> dict:
    """The case's plans (mode -> Plan); Skip, saying why, where there are none."""
    if case.plans is None:
        raise Skip(f"no plan: the Probe failed ({case.probe_error})" if case.probe_error
                   else "no plan: the time budget was spent before the Probe")
    return case.plans


def static_scales(report: ProbeReport, plan) -> Dict[str, float]:
    """The report's observed input amax (:func:`~loka.dispatch.static.amax_from_report`) of
    each site whose planned forward kernel takes a static input scale (a dynamic plan served
    with static scales: ``bench/ab_steps.py --static-b``, ``bench/step_code.py
    --static-report``)."""
    return static_scales_for(plan, amax_from_report(report))


def delayed_plan(report: ProbeReport, **plan_kwargs):
    """The ``loka-delayed`` row's plan: ``loka.plan`` on the report's tensorwise kernels that
    delayed scaling serves (PyTorch quantizers), with ``delayed_scaling`` at its default."""
    known = {k.name: k for k in registry.all_kernels()}
    allowed = [k for k in report.kernel_names() if k in known and delayable(known[k])]
    if not allowed:
        raise Skip("the report measured no tensorwise kernel that delayed scaling serves")
    plan = make_plan(report, allowed_kernels=allowed,
                     **{k: v for k, v in plan_kwargs.items() if k != "allowed_kernels"})
    plan.delayed_scaling = DEFAULT_DECAY
    return plan


def convert(model: nn.Module, variant: str, mode: str, case: Case, device: torch.device,
            graphs: bool = False, args=None) -> Tuple[int, List[str], dict]:
    """Turn the bf16 model into ``variant`` in place: (FP8 sites, notes, extra row fields)."""
    if variant == "bf16":
        return 0, [], {}
    if variant.startswith("torchao-"):
        recipe = variant[len("torchao-"):]
        sites, notes = (torchao_train if mode == "train" else torchao_serve)(model, recipe, device)
        return sites, notes, {}
    if variant == "loka":
        plan = _case_plans(case)[mode]
        applied = apply_plan(model, plan, inference=(mode == "serve"))
        chosen = fp8_sites(plan)
        extra = {"probe_wall_s": case.probe_s, "plan": chosen, "_plan": plan,
                 "apply_notes": list(getattr(applied, "notes", []) or []),
                 "probe_files": case.probe_files}
        return len(chosen), [], extra
    if variant == "loka-static":
        plan = _case_plans(case)["static"]
        if not plan.static_scales:
            raise Skip("no FP8 forward of the static serving plan takes a static input scale")
        applied = apply_plan(model, plan, inference=True)
        chosen = fp8_sites(plan)
        extra = {"plan": chosen, "_plan": plan, "static_sites": sorted(plan.static_scales),
                 "apply_notes": list(getattr(applied, "notes", []) or [])}
        return len(chosen), [], extra
    if variant == "loka-delayed":
        plan = delayed_plan(_case_report(case), **(getattr(args, "plan_kwargs", None) or {}))
        applied = apply_plan(model, plan)
        chosen = fp8_sites(plan)
        extra = {"plan": chosen, "_plan": plan, "delayed_scaling": plan.delayed_scaling,
                 "apply_notes": list(getattr(applied, "notes", []) or [])}
        return len(chosen), [], extra
    if variant in ("loka-optimize", "loka-optimize-static"):
        static = variant == "loka-optimize-static"
        if static and mode != "serve":
            raise Skip("static activation scales are for serving")
        report = _case_report(case)
        # loka.optimize on the Probe's report: whole compiled steps (compiled as this row is)
        # decide which FP8 sites stay; it keeps a plan only if it wins its A/B rounds
        result = optimize_plan(
            model, [case.batch], args.eval_set.loss_fn, inference=(mode == "serve"),
            report=report,
            forward=_served,
            compile_mode=("reduce-overhead" if graphs and not captured(args)
                          and not aoti_row(args, mode) else None),
            # AOTInductor's rows: captured whole steps, a host as light as the package's
            capture_steps=(graphs and captured(args)) or (aoti_row(args, mode)
                                                          and device.type == "cuda"),
            max_trials=getattr(args, "optimize_trials", 8),
            rounds=getattr(args, "optimize_rounds", 3), static_scales=static,
            synchronized_steps=bool(getattr(args, "optimize_synchronized", False)),
            paired_trials=bool(getattr(args, "optimize_paired_trials", False)),
            **({} if getattr(args, "optimize_host_slowdown", None) is None
               else {"host_slowdown": args.optimize_host_slowdown}))
        applied = apply_plan(model, result.plan, inference=(mode == "serve"))
        chosen = fp8_sites(result.plan)
        extra = {"plan": chosen, "_plan": result.plan, "optimize_speedup": result.speedup,
                 "optimize_synchronized_speedup": result.synchronized_speedup,
                 "optimize_rounds": result.rounds, "optimize_trials": len(result.trials),
                 "optimize_ab_timing": result.plan.budget.get("optimize", {}).get("ab_timing"),
                 "optimize_host_bound": result.host_bound,
                 "optimize_host_check": result.plan.budget.get("optimize", {}).get("host_check"),
                 "optimize_synchronized": bool(getattr(args, "optimize_synchronized", False)),
                 "optimize_log": [{"sites": len(t.get("sites", ())),
                                   **{k: t[k] for k in ("family", "twins", "removed", "role",
                                                         "time", "raw_time", "baseline_time",
                                                         "paired_with")
                                      if k in t}} for t in result.trials],
                 "untuned_fp8_sites": len(fp8_sites(result.untuned)), "timed": result.timed,
                 "apply_notes": list(getattr(applied, "notes", []) or [])}
        if static:
            # the sites that serve with one (a plan moved back keeps its scales unused)
            extra["static_sites"] = sorted(static_scales_for(result.plan,
                                                             result.plan.static_scales or {}))
        return len(chosen), list(result.plan.notes[-2:]), extra
    raise ValueError(f"unknown variant {variant!r}")


# ---------------------------------------------------------------------------- timing

def _served(model: nn.Module, batch):
    """A serving forward as the rows run it (:func:`make_step`): under ``inference_mode``,
    so that ``loka.optimize`` times the steps the row then reports (its own timer's
    ``no_grad`` alone compiles and guards another graph)."""
    with torch.inference_mode():
        return model(*batch[0])


def captured(args) -> bool:
    """Do the run's CUDA-graph rows capture whole steps (``--graph-capture step``)?"""
    return getattr(args, "graph_capture", "trees") == "step"


def aoti_row(args, mode: str) -> bool:
    """Does a row of ``mode`` run its model as an AOTInductor package
    (``--serve-runtime aoti``, serving rows; :func:`loka.dispatch.aot.aot_compile`)?"""
    return mode == "serve" and getattr(args, "serve_runtime", "compile") == "aoti"


def make_step(compiled: nn.Module, model: nn.Module, mode: str, batch, graphs: bool,
              device: torch.device, loss_fn: Callable,
              capture: bool = False) -> Callable[[], torch.Tensor]:
    """One training step (forward, BCE loss, backward, fused AdamW) or one serving forward.
    With ``graphs``: Inductor's CUDA graphs (each call marks a new step), or with
    ``capture`` the whole step captured in one CUDA graph (:class:`CapturedStep`; the
    optimizer capturable)."""
    trees = graphs and not capture
    if mode == "serve":
        def serve():
            if trees:
                torch.compiler.cudagraph_mark_step_begin()
            return _served(compiled, batch)
        return CapturedStep(serve, device) if graphs and capture else serve
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda,
                            capturable=cuda and graphs and capture)

    def train():
        if trees:
            torch.compiler.cudagraph_mark_step_begin()
        loss = loss_fn(compiled, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return CapturedStep(train, device) if graphs and capture else train


def time_steps(step, device, warmup: int, steps: int) -> dict:
    """Median wall time of ``steps`` synchronized steps after ``warmup`` (the first compiles),
    and the host's time of each: from the step's start (the device idle, every earlier
    step synchronized) to the return of its call, before waiting for the device. On a GPU
    that is the time the host takes to issue the step (Python, Dynamo's guards, the
    compiled code's launches); a step whose ``host_ms`` is near its wall time is
    host-bound, and GPU time saved there saves no wall time. On the CPU it equals the wall
    time (the work runs in the call)."""
    t0 = time.perf_counter()
    first = step()
    first_value = float(first.detach().float().mean()) if first is not None else None
    synchronize(device)
    compile_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        step()
    synchronize(device)
    times, host = [], []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        issued = time.perf_counter()
        synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
        host.append((issued - t) * 1e3)
    q = sorted(times)
    return {"step_ms": statistics.median(q), "step_ms_min": q[0], "step_ms_max": q[-1],
            "host_ms": statistics.median(host), "first_step_s": compile_s,
            "first_value": first_value}


def time_pipelined(step, device, steps: int, repeats: int = 3) -> dict:
    """Steps issued back to back, as a training loop or a loaded server issues them: each
    of ``repeats`` blocks is ``steps`` calls with one synchronization at the end, timed
    from an idle device to that synchronization; ``pipelined_ms`` is the median block's
    time per step. The host issues the next step while the GPU runs the last, so the
    per-step start-up and synchronization that :func:`time_steps` pays are paid once per
    block: what is left is the larger of the host's and the GPU's time per step. A step
    that returns an output the next call overwrites (a CUDA-graph replay) is fine here,
    nothing reads it."""
    synchronize(device)
    per_step = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        per_step.append((time.perf_counter() - t) * 1e3 / steps)
    return {"pipelined_ms": statistics.median(per_step), "pipelined_ms_min": min(per_step),
            "pipelined_ms_max": max(per_step), "pipelined_steps": steps}


def round_order(rounds: int) -> List[str]:
    """A B, B A, A B, ...: each of two variants goes first in half the rounds."""
    return [v for r in range(rounds) for v in (("A", "B") if r % 2 == 0 else ("B", "A"))]


def paired_summary(medians: Dict[str, List[float]]) -> dict:
    """Per-round ratios A/B (> 1: B is faster), their median and range, and A's and B's own
    spread (max over min of their round medians: how far a variant moves against itself)."""
    ratios = [a / b for a, b in zip(medians["A"], medians["B"])]
    return {"ratio_a_over_b": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "a_spread": max(medians["A"]) / min(medians["A"]),
            "b_spread": max(medians["B"]) / min(medians["B"]),
            "a_ms": statistics.median(medians["A"]), "b_ms": statistics.median(medians["B"])}


def paired_rounds(step_a: Callable[[], object], step_b: Callable[[], object],
                  device: torch.device, rounds: int, steps: int) -> dict:
    """Two compiled steps, both callable, timed in alternating rounds (:func:`round_order`):
    each round is the median wall time of ``steps`` synchronized steps after one untimed
    step. A host whose speed drifts (shared machines: the same step's wall time moved by
    up to 3x between rows of one run) drifts under both alike, so the per-round ratio
    holds where two rows timed one after the other do not."""
    return _alternate(step_a, step_b, rounds, steps,
                      lambda step: time_steps(step, device, 1, steps)["step_ms"])


def paired_pipelined(step_a: Callable[[], object], step_b: Callable[[], object],
                     device: torch.device, rounds: int, steps: int) -> dict:
    """:func:`paired_rounds` with each round one block of ``steps`` steps issued back to
    back (:func:`time_pipelined`, one block): the pair's throughput ratio."""
    return _alternate(step_a, step_b, rounds, steps,
                      lambda step: time_pipelined(step, device, steps, repeats=1)["pipelined_ms"])


def _alternate(step_a, step_b, rounds: int, steps: int, time_one) -> dict:
    """``time_one(step) -> ms`` of A and B in the order of :func:`round_order`."""
    per_round: Dict[str, List[float]] = {"A": [], "B": []}
    for v in round_order(rounds):
        per_round[v].append(time_one(step_a if v == "A" else step_b))
    return {"rounds": rounds, "steps": steps, "round_ms": per_round,
            **paired_summary(per_round)}


def host_syncs(step: Callable[[], object], device: torch.device) -> Optional[List[str]]:
    """What one step makes the host wait for (``torch.cuda.set_sync_debug_mode``): the
    first 200 characters of each synchronizing call's warning, in order. A compiled step
    should have none; one that has some pays the GPU's time and the host's in series, not
    overlapped. None off CUDA."""
    if device.type != "cuda":
        return None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    # torch's own notice that the mode is a prototype is not a synchronization
    return [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message).lower()
            and "prototype" not in str(w.message)]


def code_launches(codes: List[str]) -> Optional[List["stepcode.Launch"]]:
    """The kernel launches of the compiled step, read from Inductor's CUDA code
    (:mod:`loka.bench.stepcode`): what each kernel moves, beside the profile's times.
    None when no code was captured or it cannot be read (a diagnostic: it never costs the
    row its timings)."""
    try:
        launches = [launch for code in codes for launch in stepcode.inventory(code)]
    except Exception:  # noqa: BLE001 - another torch's wrapper code: no inventory
        return None
    return launches if codes else None


def kernel_rates(kernels_ms: Dict[str, float], launches) -> Optional[dict]:
    """:func:`loka.bench.stepcode.rates`, or None without launches or where it fails."""
    if not launches:
        return None
    try:
        return stepcode.rates(kernels_ms, launches)
    except Exception:  # noqa: BLE001 - a diagnostic never costs the row its timings
        return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp(min=1e-12))


PAIR_WARMUP = 3
"""untimed steps of each of two paired variants before their rounds (CUDA graphs record on
the second or third call)"""


def run_row(case: Case, variant: str, mode: str, graphs: bool, args, device,
            pair_with: Optional[Callable[[], object]] = None, keep_step: bool = False) -> dict:
    """One row (module docstring). ``pair_with``: the bf16 row's step, still alive; after
    this row's own timings both are timed in ``args.paired_rounds`` alternating rounds
    (``paired_vs_bf16``: its ``ratio_a_over_b`` is bf16's time over this row's). The
    ``torch._dynamo.reset()`` that starts each row (every row compiles the same forward
    code again) makes the kept step compile again, from the compile caches, in its untimed
    steps before the rounds (``PAIR_WARMUP``): the same graphs, compiled once more.
    ``keep_step``: return the compiled step as ``row['_step']`` (the caller pops it).
    ``peak_mem_gib`` is the row's own: its peak above what was allocated when it started."""
    capture = graphs and captured(args)
    aoti = aoti_row(args, mode)
    row = {"model": case.name, "scale": args.scale, "batch_size": case.batch_size, "mode": mode,
           "variant": variant, "graphs": graphs, "status": "ok", "reason": None,
           "compile_mode": ("aoti" if aoti else
                            "reduce-overhead" if graphs and not capture else "default"),
           "runtime": "aoti" if aoti else "compile",
           "graph_capture": ("step" if capture else "trees") if graphs else None,
           "backend": args.backend, "linears": case.linears, "notes": []}
    model = compiled = step = None
    held = 0  # bytes allocated before the row (the batch; with pairing, the kept bf16 step)
    if hasattr(os, "getloadavg"):  # a diagnostic: other work on the host while it is timed
        row["loadavg_1m"] = os.getloadavg()[0]
    try:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        torch._dynamo.reset()
        model = copy.deepcopy(case.base).to(device)
        set_mode(model, mode)
        sites, notes, extra = convert(model, variant, mode, case, device, graphs, args)
        row.update(fp8_sites=sites, **extra)
        row["notes"] += notes
        set_mode(model, mode)
        # eager, before compiling: what the variant computes (no_grad in training: tensors
        # a module caches under inference_mode could not take part in autograd later)
        with torch.inference_mode() if mode == "serve" else torch.no_grad():
            row["output_rel_err_vs_bf16"] = rel_err(model(*case.batch[0]), case.ref_out[mode])
        if aoti:
            # the loaded package no longer reads its file: the folder goes at once
            with tempfile.TemporaryDirectory(prefix="loka-aot-") as folder:
                t0 = time.perf_counter()
                compiled = aot_compile(model, case.batch[0], os.path.join(folder, "model.pt2"),
                                       single_threaded=True)
            row.update(aot_compile_s=time.perf_counter() - t0, aot_check=compiled.check)
        else:
            compiled = torch.compile(model, backend=args.backend,
                                     mode=row["compile_mode"] if graphs and not capture else None)
        step = make_step(compiled, model, mode, case.batch, graphs, device, args.eval_set.loss_fn,
                         capture=capture)
        with stepcode.output_code() as codes:  # the first step compiles
            timing = time_steps(step, device, args.warmup, args.steps)
        launches = code_launches(codes) if device.type == "cuda" else None
        row["inductor_code"] = (dict(stepcode.summarize(launches), graphs=len(codes))
                                if launches else None)
        row.update(step_ms=timing["step_ms"], step_ms_min=timing["step_ms_min"],
                   step_ms_max=timing["step_ms_max"], host_ms=timing["host_ms"],
                   first_step_s=timing["first_step_s"],
                   samples_per_s=case.batch_size / (timing["step_ms"] / 1e3))
        try:  # a diagnostic: it never fails the row
            row.update(time_pipelined(step, device, args.steps))
        except Exception as e:  # noqa: BLE001
            row.update(pipelined_ms=None, pipelined_error=f"{type(e).__name__}: {e}"[:300])
        if mode == "train":
            row["loss_first_step"] = timing["first_value"]
        try:  # a diagnostic: it never fails the row
            row["host_syncs"] = host_syncs(step, device)
        except Exception as e:  # noqa: BLE001
            row["host_syncs"] = [f"not checked: {type(e).__name__}: {e}"[:200]]
        try:  # a diagnostic: it never fails the row
            row.update(profile_host(step, device, args.profile_steps))
        except Exception as e:  # noqa: BLE001
            row.update(host_us_per_step=None, host_top_us=None,
                       host_profile_error=f"{type(e).__name__}: {e}"[:300])
        if device.type == "cuda":
            prof = profile_gpu(step, args.profile_steps)
            row.update(gpu_ms=prof["gpu_ms_per_step"], profile_ms=prof["by_class_ms"],
                       top_kernels_ms=prof["top_kernels_ms"],
                       # bytes (from the code) over time (from the profile), kernel by kernel
                       kernel_rates=kernel_rates(prof["kernels_ms"], launches),
                       wall_over_gpu=row["step_ms"] / max(prof["gpu_ms_per_step"], 1e-9),
                       host_over_gpu=row["host_ms"] / max(prof["gpu_ms_per_step"], 1e-9),
                       # the row's own peak: above what it found allocated
                       peak_mem_gib=(torch.cuda.max_memory_allocated(device) - held) / 2**30)
            try:  # a diagnostic: it never fails the row
                row["gpu_idle"] = profiling.gpu_idle(step, args.profile_steps)
            except Exception as e:  # noqa: BLE001
                row["gpu_idle"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        else:
            row.update(gpu_ms=None, profile_ms=None, top_kernels_ms=None, kernel_rates=None,
                       wall_over_gpu=None, host_over_gpu=None, peak_mem_gib=None,
                       gpu_idle=None)
        if pair_with is not None:
            try:  # a diagnostic: it never fails the row
                for s in (pair_with, step):
                    for _ in range(PAIR_WARMUP):
                        s()
                synchronize(device)
                row["paired_vs_bf16"] = paired_rounds(pair_with, step, device,
                                                      args.paired_rounds, args.paired_steps)
            except Exception as e:  # noqa: BLE001
                row["paired_vs_bf16"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            try:  # a diagnostic of its own: it never costs the row the synchronized pair
                row["paired_pipelined_vs_bf16"] = paired_pipelined(
                    pair_with, step, device, args.paired_rounds, args.paired_steps)
            except Exception as e:  # noqa: BLE001
                row["paired_pipelined_vs_bf16"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        if keep_step:
            row["_step"] = step
    except Skip as e:
        row.update(status="skipped", reason=str(e))
    except Exception as e:  # noqa: BLE001 - keep the other rows
        row.update(status="error", reason=f"{type(e).__name__}: {e}"[:2000])
    finally:
        del model, compiled, step
        gc.collect()
    return row


def _bf16_row(rows: List[dict], row: dict) -> Optional[dict]:
    """The measured bf16 row of ``row``'s model, batch, mode and graph setting; None when
    ``row`` itself failed or there is none."""
    if row["status"] != "ok":
        return None
    return next((r for r in rows if r["status"] == "ok" and r["variant"] == "bf16"
                 and all(r[k] == row[k] for k in ("model", "batch_size", "mode", "graphs"))),
                None)


def add_ratios(rows: List[dict], row: dict) -> None:
    """Ratios against the bf16 row of the same model, batch, mode and graph setting:
    speedups (> 1: faster than bf16) and the memory ratio (< 1: less than bf16)."""
    row["vs_bf16"] = None
    base = _bf16_row(rows, row)
    if base is None:
        return

    def ratio(a, b):
        return a / b if a is not None and b else None
    row["vs_bf16"] = {"step": ratio(base["step_ms"], row["step_ms"]),
                      "gpu": ratio(base.get("gpu_ms"), row.get("gpu_ms")),
                      "peak_mem": ratio(row.get("peak_mem_gib"), base.get("peak_mem_gib"))}


def add_prediction(rows: List[dict], row: dict, report) -> None:
    """What the Probe's timings predicted for a LoKA row (``loka.dispatch.predict_step``
    on the bf16 row's step), beside what was measured: ``prediction_error`` is measured
    over predicted, less one (> 0: the step was slower than predicted), for the step-aware
    prediction and (``isolated_prediction_error``) the isolated-GEMM one.

    The Probe prices GPU time, so the same prediction is also made on the bf16 row's GPU
    time (``predicted_gpu_ms``, ``gpu_prediction_error``: against the row's GPU time),
    where a profile measured both. ``host_bound`` says whether the bf16 row's host took
    longer to issue its step than its GPU took to run it: there the wall time follows the
    host, which the Probe does not price, and only the GPU prediction is a test of it.

    ``ceiling`` is :func:`loka.dispatch.fp8_ceiling` on the bf16 row's GPU time (its wall
    time where no profile was taken): the most FP8 GEMMs could give this step, at the
    device's roofline and on the fastest kernels the report timed whatever their error,
    with the plan's head sites and static scales."""
    plan = row.pop("_plan", None)
    row["prediction"] = None
    base = _bf16_row(rows, row)
    if plan is None or report is None or base is None:
        return
    row["ceiling"] = ceiling_of(plan, report, base, row["mode"] == "serve")
    try:
        pred = predict_step(plan, report, base["step_ms"], inference=row["mode"] == "serve")
    except ValueError as e:
        row["prediction"] = {"error": str(e)}
        return
    row["prediction"] = {**pred.to_dict(), "measured_step_ms": row["step_ms"],
                         "prediction_error": row["step_ms"] / pred.predicted_step_ms - 1,
                         "isolated_prediction_error":
                             row["step_ms"] / pred.isolated_step_ms - 1}
    base_gpu, base_host = base.get("gpu_ms"), base.get("host_ms")
    row["prediction"]["host_bound"] = (bool(base_host > base_gpu)
                                       if base_gpu and base_host is not None else None)
    if base_gpu and row.get("gpu_ms"):
        try:
            on_gpu = predict_step(plan, report, base_gpu, inference=row["mode"] == "serve")
        except ValueError as e:  # savings beyond the GPU time: no prediction to test
            row["prediction"]["gpu_prediction_note"] = str(e)
        else:
            row["prediction"].update(
                predicted_gpu_ms=on_gpu.predicted_step_ms,
                gpu_prediction_error=row["gpu_ms"] / on_gpu.predicted_step_ms - 1)


def ceiling_of(plan, report, base: dict, serve: bool) -> Optional[dict]:
    """:func:`loka.dispatch.fp8_ceiling` of a LoKA row's step (:func:`add_prediction`), as
    a dict naming the bf16 time it divides (``on``: 'gpu' or 'wall'); None where it cannot
    be taken (its error under ``error``)."""
    on = "gpu" if base.get("gpu_ms") else "wall"
    step = base.get("gpu_ms") or base.get("step_ms")
    if not step:
        return None
    try:
        c = fp8_ceiling(report, step, inference=serve,
                        static_scales=bool(getattr(plan, "static_scales", None)),
                        head_sites=int(plan.budget.get("head_sites", 3)))
    except ValueError as e:
        return {"on": on, "error": str(e)}
    return {"on": on, **c.to_dict()}


def summarize(rows: List[dict]) -> List[dict]:
    """Per model, batch, mode and graph setting: bf16, the best torchao row, LoKA."""
    keys = []
    for r in rows:
        k = (r["model"], r["batch_size"], r["mode"], r["graphs"])
        if k not in keys:
            keys.append(k)
    out = []
    for k in keys:
        group = [r for r in rows if (r["model"], r["batch_size"], r["mode"], r["graphs"]) == k]
        ok = [r for r in group if r["status"] == "ok"]
        bf16 = next((r for r in ok if r["variant"] == "bf16"), None)
        tao = [r for r in ok if r["variant"].startswith("torchao-")]
        best = min(tao, key=lambda r: r["step_ms"]) if tao else None
        lk = next((r for r in ok if r["variant"] == "loka"), None)
        opt = next((r for r in ok if r["variant"] == "loka-optimize"), None)
        static = next((r for r in ok if r["variant"] == "loka-static"), None)
        opt_static = next((r for r in ok if r["variant"] == "loka-optimize-static"), None)

        def cell(r):
            if r is None:
                return None
            c = {"variant": r["variant"], "step_ms": r["step_ms"], "gpu_ms": r.get("gpu_ms"),
                 "host_ms": r.get("host_ms"),
                 "vs_bf16": (r.get("vs_bf16") or {}).get("step"),
                 "fp8_sites": r.get("fp8_sites")}
            idle = r.get("gpu_idle") or {}
            if "idle_us" in idle:  # profiled: the GPU's idle time per step, what it waited on
                c["gpu_idle_us"] = idle["idle_us"]
            pred = r.get("prediction") or {}
            if "prediction_error" in pred:  # measured / predicted - 1, both predictions
                c["prediction_error"] = pred["prediction_error"]
                c["isolated_prediction_error"] = pred["isolated_prediction_error"]
                c["gpu_prediction_error"] = pred.get("gpu_prediction_error")
                c["host_bound"] = pred.get("host_bound")
            paired = r.get("paired_vs_bf16") or {}
            if "ratio_a_over_b" in paired:  # bf16's wall time over this row's, paired
                c["paired_vs_bf16"] = paired["ratio_a_over_b"]
            c["pipelined_ms"] = r.get("pipelined_ms")
            paired = r.get("paired_pipelined_vs_bf16") or {}
            if "ratio_a_over_b" in paired:  # the same with steps issued back to back
                c["paired_pipelined_vs_bf16"] = paired["ratio_a_over_b"]
            ceil = r.get("ceiling") or {}
            if "measured_speedup" in ceil:  # the most FP8 GEMMs could give this step
                c["ceiling"] = {k: ceil[k] for k in ("on", "gemm_share", "roofline_speedup",
                                                     "roofline_speedup_eligible",
                                                     "measured_speedup",
                                                     "measured_speedup_eligible")}
            return c
        # the host-speed control: a group whose bf16 step the host issues more slowly than
        # the GPU runs it is host-bound, and its wall ratios measure the host, not FP8
        host_bound = (bool(bf16["host_ms"] > bf16["gpu_ms"])
                      if bf16 is not None and bf16.get("gpu_ms") and bf16.get("host_ms") is not None
                      else None)
        out.append({"model": k[0], "batch_size": k[1], "mode": k[2], "graphs": k[3],
                    "graph_capture": group[0].get("graph_capture"),
                    "runtime": group[0].get("runtime"),
                    "host_bound": host_bound,
                    "bf16": cell(bf16), "best_torchao": cell(best), "loka": cell(lk),
                    "loka_optimize": cell(opt), "loka_static": cell(static),
                    "loka_optimize_static": cell(opt_static)})
    return out


# ---------------------------------------------------------------------------- run

def git_state() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=here,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"git_commit": commit, "git_dirty": dirty}


def environment(device: torch.device, args) -> dict:
    cuda = device.type == "cuda"
    env = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "device": str(device),
           "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "loka": _version(), "eval_set": args.eval_set.__file__, "torchao": TORCHAO_VERSION,
           "torchao_missing": TORCHAO_MISSING, "torchao_serve_missing": TORCHAO_SERVE_MISSING,
           "timings_meaningful": cuda,
           "note": None if cuda else ("CPU run: it checks the pipeline end to end; its timings say "
                                      "nothing about FP8 on a GPU, and no GPU profile is taken"),
           "dtype": str(args.dtype).replace("torch.", ""), "backend": args.backend,
           "inductor_config": dict(getattr(args, "inductor_config", None) or {}),
           "probe_config": dataclasses.asdict(args.probe_config), "probe_batches": args.probe_batches,
           "plan_kwargs": args.plan_kwargs,
           "optimizer": "AdamW(lr=1e-4, fused on CUDA" + (
               ", capturable in the CUDA-graph rows)" if captured(args) else ")"),
           "graph_capture": getattr(args, "graph_capture", "trees"),
           "serve_runtime": getattr(args, "serve_runtime", "compile"),
           "kernel_classes": list(KERNEL_CLASSES),
           "env_vars": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(("LOKA_", "TORCHINDUCTOR_", "PYTORCH_CUDA_ALLOC"))}}
    env.update(git_state())
    # the code that ran, where a copied tree's git metadata lags its files (git_commit then
    # names an older commit): compare with source_digest() in a checkout
    env["source_sha1"] = source_digest()
    return env


def write(path: str, env: dict, rows: List[dict], probes: List[dict]) -> None:
    doc = {"schema": SCHEMA, "version": VERSION, "env": env, "probes": probes, "rows": rows,
           "summary": summarize(rows)}
    atomic_write_text(path, json.dumps(json_safe(doc), indent=1) + "\n")


def graphs_label(row: dict) -> str:
    """A row's graph setting in the table: False, True (Inductor's graphs) or ``step``
    (whole steps captured); an AOTInductor row's ``aoti`` (no graphs) or ``aoti-s``."""
    if row.get("runtime") == "aoti":
        return "aoti-s" if row.get("graph_capture") == "step" else "aoti"
    return "step" if row.get("graph_capture") == "step" else str(row["graphs"])


def table(rows: List[dict]) -> str:
    head = (f"{'model':7s} {'B':>6s} {'mode':5s} {'variant':27s} {'graphs':6s} {'ms':>9s} "
            f"{'gpu ms':>8s} {'host ms':>8s} {'vs bf16':>7s} {'gpu x':>6s} {'pair x':>6s} "
            f"{'pipe x':>6s} "
            f"{'ceil x':>6s} {'fp8':>4s} {'GiB':>6s}  status")
    lines = [head, "-" * len(head)]

    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-".rjust(int(spec.split(".")[0].rstrip("df")))
    for r in rows:
        v, g = ((r.get("vs_bf16") or {}).get(k) for k in ("step", "gpu"))
        pair = (r.get("paired_vs_bf16") or {}).get("ratio_a_over_b")
        pipe = (r.get("paired_pipelined_vs_bf16") or {}).get("ratio_a_over_b")
        # the most the kernels the report timed could give this step (head sites kept)
        ceil = (r.get("ceiling") or {}).get("measured_speedup_eligible")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r['reason'] or '')[:60]}"
        lines.append(f"{r['model']:7s} {r['batch_size']:6d} {r['mode']:5s} {r['variant']:27s} "
                     f"{graphs_label(r):6s} {f(r.get('step_ms'), '9.3f')} {f(r.get('gpu_ms'), '8.3f')} "
                     f"{f(r.get('host_ms'), '8.3f')} "
                     f"{f(v, '7.3f')} {f(g, '6.3f')} {f(pair, '6.3f')} {f(pipe, '6.3f')} "
                     f"{f(ceil, '6.3f')} "
                     f"{f(r.get('fp8_sites'), '4d')} "
                     f"{f(r.get('peak_mem_gib'), '6.2f')}  {status}")
    return "\n".join(lines)


def _version() -> Optional[str]:
    try:
        return importlib.metadata.version("loka")
    except importlib.metadata.PackageNotFoundError:
        return None


class EvalSetError(ValueError):
    """The path given as an evaluation set is not one (a one-line reason)."""


def load_eval_set(path: "str | os.PathLike") -> types.ModuleType:
    """Import the evaluation-set package at ``path`` (a folder with ``__init__.py``, or one
    ``.py`` file) and check that it defines ``EVAL_MODELS``, ``SCALES`` and ``loss_fn``.

    Raises:
        EvalSetError: no such package, it fails to import, or a name is missing.
    """
    path = os.path.abspath(os.fspath(path))
    init = os.path.join(path, "__init__.py") if os.path.isdir(path) else path
    if not os.path.isfile(init) or not init.endswith(".py"):
        raise EvalSetError(f"{path}: not an evaluation set (a package folder with __init__.py, "
                           f"or a .py file)")
    name = "loka_eval_set_" + re.sub(r"\W", "_", os.path.basename(os.path.dirname(init)
                                                                  if os.path.isdir(path) else init[:-3]))
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[path] if os.path.isdir(path) else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its submodules import relative to it
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's code, in one line
        sys.modules.pop(name, None)
        raise EvalSetError(f"{init}: failed to import: {type(e).__name__}: {e}") from e
    models, scales = getattr(module, "EVAL_MODELS", None), getattr(module, "SCALES", None)
    if not isinstance(models, dict) or not models or not all(callable(m) for m in models.values()):
        raise EvalSetError(f"{init}: EVAL_MODELS must be a non-empty dict of model classes")
    if not isinstance(scales, (tuple, list)) or not scales:
        raise EvalSetError(f"{init}: SCALES must be a non-empty tuple of scale names")
    if not callable(getattr(module, "loss_fn", None)):
        raise EvalSetError(f"{init}: loss_fn(model, batch) is missing")
    return module


def eval_set_with(path: "str | os.PathLike", model: str) -> types.ModuleType:
    """:func:`load_eval_set` for a script that runs one of its models: EvalSetError also
    where ``model`` is not one of them."""
    module = load_eval_set(path)
    if model not in module.EVAL_MODELS:
        raise EvalSetError(f"unknown model {model!r}; choose from {list(module.EVAL_MODELS)}")
    return module


def _slowdown(text: str) -> float:
    """An argparse ``type`` for ``--optimize-host-slowdown``: a finite number >= 1."""
    try:
        return check_host_slowdown(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1, got {text}") from None


def parse_args(argv, eval_set: "str | os.PathLike | types.ModuleType"):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[-12:-3]))
    es = eval_set if isinstance(eval_set, types.ModuleType) else load_eval_set(eval_set)
    models, scales = es.EVAL_MODELS, tuple(es.SCALES)
    ap.add_argument("--models", default=",".join(models), help="comma list of " + ", ".join(models))
    ap.add_argument("--batch-sizes", default="4096,16384")
    ap.add_argument("--scale", default=scales[0], choices=scales)
    ap.add_argument("--modes", default="train,serve")
    ap.add_argument("--variants", default=None,
                    help="comma list of bf16, torchao-<recipe>, loka, loka-optimize, "
                         "loka-static, loka-optimize-static, loka-delayed "
                         "(default: all of the mode)")
    ap.add_argument("--optimize-trials", type=int, default=8,
                    help="loka-optimize: at most this many whole-step timings while tuning")
    ap.add_argument("--optimize-paired-trials", action="store_true",
                    help="loka-optimize: time the step without FP8 beside each tuning trial "
                         "and compare by ratio (loka.optimize's paired_trials)")
    ap.add_argument("--optimize-synchronized", action="store_true",
                    help="loka-optimize: time each step from an idle GPU (loka.optimize's "
                         "synchronized_steps), as the rows' own step times are, not back "
                         "to back")
    ap.add_argument("--optimize-host-slowdown", type=_slowdown, default=None, metavar="F",
                    help="loka.optimize's host_slowdown (default its own; 1 turns the "
                         "check off)")
    ap.add_argument("--optimize-rounds", type=int, default=3,
                    help="loka-optimize: final A/B rounds the plan must win (from 3 rounds, "
                         "a lost one is weighed by extra rounds and a sign test)")
    ap.add_argument("--steps", type=int, default=50, help="timed steps (median)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (>= 1: the first compiles)")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (CUDA)")
    graphs = ap.add_mutually_exclusive_group()
    graphs.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph rows")
    graphs.add_argument("--graphs-only", action="store_true",
                        help="only the CUDA-graph rows (on a CUDA device)")
    ap.add_argument("--graph-capture", choices=("trees", "step"), default="trees",
                    help="how the CUDA-graph rows use graphs: trees, torch.compile's "
                         "mode='reduce-overhead' (the compiled graphs); step, each whole step "
                         "(the optimizer's update included) captured in one CUDA graph")
    ap.add_argument("--serve-runtime", choices=("compile", "aoti"), default="compile",
                    help="how the serving rows run their model: compile, torch.compile; aoti, "
                         "an AOTInductor package (loka.aot_compile: no Python per call; its "
                         "CUDA-graph rows need --graph-capture step, and loka-optimize times "
                         "captured steps)")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of every row")
    ap.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config option for every row (repeatable; VALUE is "
                         "JSON, e.g. realize_reads_threshold=3)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                    help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--seed", type=int, default=0, help="weights seed")
    ap.add_argument("--probe-batches", type=int, default=4)
    ap.add_argument("--probe-config", default=None,
                    help="JSON of loka.ProbeConfig fields (default: ProbeConfig() on CUDA; on the "
                         "CPU, emulated rowwise e4m3 only, 4 samples, no timing)")
    ap.add_argument("--plan-config", default=None,
                    help="JSON of loka.plan keyword arguments (default: none on CUDA; "
                         '{"assume_fast": true} on the CPU, where no timing decides)')
    ap.add_argument("--report", default=None,
                    help="plan from this saved Probe report instead of probing ('{model}' and "
                         "'{batch}' are filled in; the rows' probe_wall_s is then null)")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="start no new row or Probe after this many seconds (they are recorded as skipped)")
    ap.add_argument("--paired-rounds", type=int, default=0,
                    help="time each row (LoKA's, torchao's) beside its bf16 row's step, kept "
                         "for the group (it holds the bf16 model's memory), in this many "
                         "alternating rounds (paired_vs_bf16; 0: off, else >= 2): the ratio a "
                         "drifting host cannot bias")
    ap.add_argument("--paired-steps", type=int, default=10,
                    help="timed steps per paired round (their median)")
    ap.add_argument("--no-save-plans", action="store_true",
                    help="do not write the Probe's report and plans beside --out")
    ap.add_argument("--out", required=True, help="JSON file, rewritten after every row")
    args = ap.parse_args(argv)
    try:
        args.inductor_config = stepcode.inductor_options(args.inductor_config)
    except ValueError as e:
        ap.error(f"--inductor-config {e}")
    device = torch.device(args.device)
    args.models = [m for m in args.models.split(",") if m]
    args.eval_set = es
    unknown = [m for m in args.models if m not in models]
    if unknown:
        ap.error(f"unknown models {unknown}; choose from {list(models)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    if any(m not in MODES for m in args.modes):
        ap.error(f"--modes takes {', '.join(MODES)}")
    if args.variants is not None:
        args.variants = [v for v in args.variants.split(",") if v]
        known = set(VARIANTS["train"]) | set(VARIANTS["serve"])
        if any(v not in known for v in args.variants):
            ap.error(f"--variants takes {sorted(known)}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    if args.graphs_only and device.type != "cuda":
        ap.error("--graphs-only needs a CUDA device (CUDA graphs)")
    if args.graph_capture == "step" and args.no_graphs:
        ap.error("--graph-capture step sets how the CUDA-graph rows run: drop --no-graphs")
    if args.graph_capture == "step" and args.inductor_config.get("triton.cudagraphs"):
        ap.error("--graph-capture step captures whole steps: --inductor-config "
                 "triton.cudagraphs would put Inductor's graphs inside them")
    if args.serve_runtime == "aoti" and "serve" not in args.modes:
        ap.error("--serve-runtime aoti sets how the serving rows run: --modes has none")
    if args.serve_runtime == "aoti" and args.backend != "inductor":
        ap.error("--serve-runtime aoti compiles with Inductor: drop --backend")
    if (args.serve_runtime == "aoti" and args.graph_capture != "step"
            and not args.no_graphs and device.type == "cuda"):
        ap.error("--serve-runtime aoti: its CUDA-graph rows capture whole steps; add "
                 "--graph-capture step, or --no-graphs")
    if args.paired_rounds == 1 or args.paired_rounds < 0 or args.paired_steps < 1:
        ap.error("--paired-rounds must be 0 (off) or >= 2, --paired-steps >= 1")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cpu = device.type != "cuda"
    probe_fields = (json.loads(args.probe_config) if args.probe_config else
                    {"kernels": ["bf16", "emulated-rowwise-e4m3", "emulated-tensorwise-e4m3"],
                     "num_samples": 4,
                     "timing": False, "compare_naive": False, "bootstrap": 100} if cpu else {})
    if "kernels" in probe_fields and probe_fields["kernels"] is not None:
        probe_fields["kernels"] = tuple(probe_fields["kernels"])
    args.probe_config = ProbeConfig(**probe_fields)
    args.plan_kwargs = json.loads(args.plan_config) if args.plan_config else (
        {"assume_fast": True} if cpu else {})
    return args, device


def main(argv, eval_set: "str | os.PathLike | types.ModuleType") -> int:
    """Run the evaluation set at ``eval_set`` with the options in ``argv`` (see
    :func:`parse_args`); returns the exit status."""
    args, device = parse_args(argv, eval_set)
    with inductor_config.patch(args.inductor_config):
        return _run(args, device)


def _run(args, device) -> int:
    start = time.perf_counter()
    env = environment(device, args)
    out_stem = None if args.no_save_plans else os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows: List[dict] = []
    probes: List[dict] = []
    graph_settings = ([True] if args.graphs_only else
                      [False] if (args.no_graphs or device.type != "cuda") else [False, True])
    if device.type != "cuda" and not args.no_graphs:
        env["note_graphs"] = "CUDA-graph rows need a CUDA device: left out"

    def over_budget() -> bool:
        return args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s

    for name in args.models:
        for batch_size in args.batch_sizes:
            torch.manual_seed(args.seed)
            base = args.eval_set.EVAL_MODELS[name](args.scale).to(args.dtype)
            batch = base.make_batch(batch_size, device, args.dtype, seed=0)
            ref = copy.deepcopy(base).to(device)
            ref_out = {}
            for mode in MODES:
                set_mode(ref, mode)
                with torch.inference_mode():
                    ref_out[mode] = ref(*batch[0]).float()
            del ref
            case = Case(name, batch_size, base, batch, ref_out,
                        linears=sum(isinstance(m, nn.Linear) for m in base.modules()))
            wanted = {m: [v for v in VARIANTS[m] if args.variants is None or v in args.variants]
                      for m in args.modes}
            if (any(v.startswith("loka") for vs in wanted.values() for v in vs)
                    and not over_budget()):
                # the Probe runs before any row of the case, the baselines' included: every
                # row is timed in the process as the Probe leaves it (a host slowed for a
                # while after it would otherwise slow the LoKA rows alone)
                probes.append(probe_case(case, args, device, out_stem))
                write(args.out, env, rows, probes)
            for mode in args.modes:
                for graphs in graph_settings:
                    bf16_step = None  # with --paired-rounds: the bf16 row's step, alive
                    for variant in wanted[mode]:
                        if over_budget():
                            row = {"model": name, "scale": args.scale, "batch_size": batch_size,
                                   "mode": mode, "variant": variant, "graphs": graphs,
                                   "status": "skipped", "reason": "time budget spent"}
                        else:
                            pairing = args.paired_rounds > 0
                            row = run_row(case, variant, mode, graphs, args, device,
                                          pair_with=(bf16_step if pairing and
                                                     variant != "bf16" else None),
                                          keep_step=pairing and variant == "bf16")
                            bf16_step = row.pop("_step", bf16_step)
                        add_ratios(rows, row)
                        add_prediction(rows, row, case.report)
                        rows.append(row)
                        write(args.out, env, rows, probes)
                        print(table([row]).splitlines()[-1], flush=True)
                    del bf16_step
                    gc.collect()
            del case, base, batch
    env["wall_s"] = time.perf_counter() - start
    write(args.out, env, rows, probes)
    print()
    print(table(rows))
    if env["note"]:
        print(f"\nnote: {env['note']}")
    print(f"wrote {args.out}")
    return 0


