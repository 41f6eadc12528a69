"""The plans of LoKA's benchmark rows: probed and planned once per model structure and run
(or loaded from ``--plan`` / ``--plans``), tuned or searched by whole-step timings
(``+tuned``, ``+search``), with static activation scales (``+static``), the uniform
yardsticks (``loka-uniform-<kernel>``), and the files they are saved to beside the
result."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from typing import Callable, Dict, Optional

import torch
from torch import nn

from .. import dispatch
from ..config import LinearConfig, ProbeConfig
from ..data.batch import Batch
from ..dispatch import FUSIBLE_TWINS, Plan, amax_from_report, search_speed, tune_speed
from ..dispatch.static import static_scales_for
from ..kernels import registry
from ..probe import ProbeReport
from ..probe import probe as run_probe
from ..timing import time_steps
from ..train import loss_fn
from .config import BenchConfig
from .models import count_fp8
from .steps import make_forward, make_optimizer, make_step, release_memory
from .variants import Variant

__all__ = ["beside", "probe_and_plan", "structure_plans", "named_plan", "save_plans",
           "uniform_plan", "whole_step_plan", "static_scales", "static_change",
           "REPORT_TWINS", "TUNE_STEPS", "SEARCH_CANDIDATES"]

REPORT_TWINS = {"fbgemm-rowwise": "cublas-rowwise-fastacc"}
"""twins ``+tuned`` also tries when the Probe's report is at hand (FBGEMM's quantizer and
CUTLASS GEMM against cuBLAS with PyTorch quantization that Inductor fuses; the report
decides whether the twin's error fits the budget)"""
TUNE_STEPS = 10
"""timed steps per trial of ``+tuned`` (after the variant's warm-up)"""
SEARCH_CANDIDATES = {
    False: ("cublas-rowwise-fastacc", "triton-tensorwise-cublas",
            LinearConfig(fwd="cublas-rowwise-fastacc"),
            LinearConfig(fwd="cublas-rowwise-fastacc", dgrad="cublas-rowwise-fastacc")),
    True: (LinearConfig(fwd="cublas-rowwise-fastacc"), LinearConfig(fwd="fbgemm-rowwise")),
}
"""fixed choices ``+search`` times at every group of same-shape sites (training, inference):
FP8 forwards, forwards and input gradients, or every role, with PyTorch quantization that
Inductor fuses (cuBLAS rowwise), LoKA's tensorwise kernels (one quantization per tensor
shared by the roles) or FBGEMM's (serving); kernels absent on the device are skipped"""


def beside(plan_path: str, kind: str, tag: str = "") -> str:
    """The file of ``kind`` ('plan', 'report') for structure ``tag`` beside a plan file:
    ``run.plan.json`` -> ``run.report.json``, ``run.merge.plan.json``."""
    stem = plan_path.removesuffix(".plan.json").removesuffix(".json")
    return f"{stem}{'.' + tag if tag else ''}.{kind}.json"


def probe_and_plan(model: nn.Module, batch: Batch, cfg: BenchConfig, device: torch.device,
                   log: dict):
    """``(report, plan)``: probe the model on ``cfg.probe_steps`` steps of ``batch`` and
    plan under the budget, or load ``cfg.plan`` (and the report beside it, if there is
    one; else None). What happened goes into ``log`` (the row)."""
    if cfg.plan:
        plan = Plan.load(cfg.plan)
        log["plan_source"] = cfg.plan
        report_path = beside(cfg.plan, "report")
        report = None
        if cfg.plan.endswith(".plan.json") and os.path.exists(report_path):
            report = ProbeReport.load(report_path)  # what +tuned checks twins against
            log["report_source"] = report_path
        return report, plan
    opt = make_optimizer(model, device, capturable=False)
    kernels = None
    if cfg.probe_kernels is not None:
        kernels = tuple(k.name for k in registry.available(device, names=cfg.probe_kernels))
    pcfg = ProbeConfig(every_n_steps=1, num_samples=cfg.probe_samples, bootstrap=200,
                       seed=cfg.seed, kernels=kernels, all_kernels=kernels is None,
                       compare_naive=False)
    t0 = time.perf_counter()
    report = run_probe(model, [batch] * cfg.probe_steps, loss_fn, config=pcfg, optimizer=opt)
    log["probe_s"] = time.perf_counter() - t0
    # the probing optimizer's state and the gradients must not stay alive into the timed
    # variant (they would count in its peak memory)
    model.zero_grad(set_to_none=True)
    del opt
    # nor what the Probe's compiled kernel timings left in Dynamo's caches (compiled
    # callables and the tensors their guards and graphs hold); the variant compiles anew
    torch._dynamo.reset()
    release_memory(device)
    plan = dispatch.plan(report, max_error=cfg.max_error, min_speedup=cfg.min_speedup)
    log["plan"] = plan.to_dict()
    return report, plan


def structure_plans(variant: Variant, model: nn.Module, batch: Batch, cfg: BenchConfig,
                    device: torch.device, shared: dict, row: dict) -> dict:
    """The LoKA plans of a variant's model structure, made once per run and structure
    (one Probe pass serves every LoKA variant built alike): {"tag", "report", "train",
    "infer"}. The inference plan judges the forward with the weight quantized once; with
    ``cfg.plan`` (no report) the given plan serves both."""
    tag = variant.structure
    plans = shared.setdefault("plans", {})
    if variant.plan:
        return named_plan(variant.plan, tag, cfg, plans)
    if tag not in plans:
        run = cfg
        if cfg.plan and tag:  # a merged model has other sites: its plan file, else probe
            own = beside(cfg.plan, "plan", tag)
            run = dataclasses.replace(cfg, plan=own if os.path.exists(own) else None)
        report, train = probe_and_plan(model, batch, run, device, row)
        infer = train if report is None else dispatch.plan(
            report, max_error=cfg.max_error, min_speedup=cfg.min_speedup, inference=True)
        plans[tag] = {"tag": tag, "report": report, "train": train, "infer": infer,
                      "probed": not run.plan}
        if shared.get("out"):  # on disk at once: a run cut short keeps its plans
            save_plans({"plans": {tag: plans[tag]}}, {}, shared["out"])
    return plans[tag]


def named_plan(named: str, tag: str, cfg: BenchConfig, plans: dict) -> dict:
    """The plan ``--plans`` names ``named`` (for structure ``tag``: the ``.<tag>.plan.json``
    beside it unless the file is one), loaded once per run."""
    if named not in cfg.plans:
        raise ValueError(f"variant names plan {named!r}, but --plans gives only "
                         f"{sorted(cfg.plans) or 'none'}")
    key = f"@{named}{'.' + tag if tag else ''}"
    if key not in plans:
        path = cfg.plans[named]
        if tag and not path.endswith(f".{tag}.plan.json"):  # a merged model's plan as given
            path = beside(path, "plan", tag)
            if not os.path.exists(path):
                raise FileNotFoundError(f"a +{tag} variant of plan {named!r} needs {path}")
        plan = Plan.load(path)
        plans[key] = {"tag": key, "report": None, "train": plan, "infer": plan, "path": path}
    return plans[key]


def save_plans(shared: dict, result: dict, out: str) -> None:
    """Write each structure's plans and report beside the result JSON (and into it)."""
    for tag, p in shared.get("plans", {}).items():
        if tag.startswith("@"):
            continue  # given as files, or kept in the rows that used them
        key = f"loka{'_' + tag if tag else ''}"
        result[f"{key}_plan"] = p["train"].to_dict()
        result[f"{key}_infer_plan"] = p["infer"].to_dict()
        p["train"].save(beside(out, "plan", tag))
        p["infer"].save(beside(out, "infer-plan", tag))
        if p["report"] is not None and p.get("probed"):  # a loaded report is a file already
            p["report"].save(beside(out, "report", tag))


def uniform_plan(model: nn.Module, kernel: str, big_only: bool = False,
                 min_dim: int = 1024) -> Plan:
    """One kernel on every role of every eligible Linear (a fixed, per-model choice, the
    yardstick a per-site plan must beat): :meth:`Plan.uniform` over the plain Linears
    whose K and N the kernel aligns (``big_only``: also both >= ``min_dim``). The logit
    Linear stays on the baseline."""
    kern = registry.get(kernel)
    ok = kern.device_ok(next(model.parameters()).device)
    if not ok:
        raise ValueError(f"loka-uniform-{kernel}: {ok.reason}")
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    eligible = [fqn for fqn, lin in linears[:-1]
                if not (lin.in_features % kern.align or lin.out_features % kern.align
                        or (big_only and min(lin.in_features, lin.out_features) < min_dim))]
    only = "^(?:" + "|".join(map(re.escape, eligible)) + ")$" if eligible else "(?!)"
    return Plan.uniform(model, kernel, module_filter=only)


def trial_timer(model: nn.Module, batch: Batch, cfg: BenchConfig, device: torch.device,
                graphs: bool, inference: bool,
                progress: Optional[Callable[[str], None]] = None) -> Callable[[nn.Module], float]:
    """``time_step(model) -> median ms`` over :data:`TUNE_STEPS` steps, compiled afresh,
    with the weights restored after every trial (each trial reported to ``progress``)."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    count = [0]

    def time_step(m) -> float:
        count[0] += 1
        fp8 = count_fp8(m)
        torch._dynamo.reset()
        if inference:
            step = make_forward(m.eval(), batch, cfg, device, graphs)
        else:
            step = make_step(m, batch, cfg, device, graphs)
        t = time_steps(step, device, TUNE_STEPS, cfg.warmup)["median_ms"]
        del step
        with torch.no_grad():
            m.load_state_dict(saved)
        gc.collect()  # compiled callables sit in reference cycles: free the trial's graph now
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:
            progress(f"      trial {count[0]}: {fp8} FP8 site(s), {t:.3f} ms")
        return t
    return time_step


def whole_step_plan(plans: dict, variant: Variant, model: nn.Module, batch: Batch,
                    cfg: BenchConfig, device: torch.device, row: dict, inference: bool = False,
                    progress: Optional[Callable[[str], None]] = None) -> Plan:
    """The structure's plan tuned by whole-step timings (``+tuned``:
    :func:`loka.dispatch.tune_speed`, trying the fusible twins of its kernels too), or the
    best fixed choice per group of same-shape sites by exhaustive timing (``+search``:
    :func:`loka.dispatch.search_speed`, the yardstick of the plan); once per structure,
    mode and graph mode. The variant itself starts from the same weights."""
    graphs = variant.graphs_on(device)
    how = variant.whole_step
    key = ("infer-" if inference else "") + how + ("+graphs" if graphs else "")
    if key not in plans:
        time_step = trial_timer(model, batch, cfg, device, graphs, inference, progress)
        start = plans["infer" if inference else "train"]
        t0 = time.perf_counter()
        if how == "search":
            runnable = {k.name for k in registry.available(device)}
            cands = [c for c in SEARCH_CANDIDATES[inference]
                     if ({c} if isinstance(c, str) else {c.fwd, c.dgrad, c.wgrad}) <= runnable]
            if not cands:
                raise ValueError(f"+search: none of its candidate kernels runs on {device}")
            plans[key], log = search_speed(start, model, time_step, cands,
                                           report=plans["report"], inference=inference,
                                           max_trials=cfg.search_trials)
        else:
            # with the report, twins of other numerics qualify where their measured error fits
            twins = FUSIBLE_TWINS if plans["report"] is None else {**FUSIBLE_TWINS, **REPORT_TWINS}
            plans[key], log = tune_speed(start, model, time_step, max_trials=cfg.tune_trials,
                                         inference=inference, twins=twins,
                                         report=plans["report"], per_role=True)
        torch._dynamo.reset()
        verb = "search" if how == "search" else "tune"
        row[f"{verb}_s"] = time.perf_counter() - t0
        row[f"{verb}_log"] = log
    row[f"{how}_plan"] = plans[key].to_dict()
    return plans[key]


def static_scales(plan: Plan, report: Optional[ProbeReport]) -> Dict[str, float]:
    """``+static``: a static input amax (the Probe's observed ``act.amax``) for every site
    whose FP8 forward kernel takes one (PyTorch-quantized kernels; LoKA's Triton and
    FBGEMM kernels quantize inside and stay dynamic)."""
    if report is None:
        raise ValueError("+static needs the Probe's statistics: probe in this run, or a "
                         ".report.json beside --plan")
    return static_scales_for(plan, amax_from_report(report))


def static_change(model: nn.Module, plan: Plan, static: Dict[str, float],
                  batch: Batch) -> Optional[float]:
    """Relative change of the logits on ``batch`` from dynamic to static activation scales
    (the same serving plan, eager): what the static scales cost in output accuracy."""
    if not static:
        return None
    with torch.inference_mode():
        dispatch.apply(model, plan, inference=True)
        dynamic = model(batch).double()
        dispatch.apply(model, plan, inference=True, static_scales=static)
        fixed = model(batch).double()
    dispatch.unapply(model)
    return float((fixed - dynamic).norm() / dynamic.norm().clamp(min=1e-30))
