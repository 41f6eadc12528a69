"""The demo's run: train with the Probe, measure, plan, train both arms, compare, write."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import reporting
from ..assembly import build_model
from ..config import ROLES, ProbeConfig
from ..data import SyntheticCTR
from ..dispatch import apply as apply_plan
from ..dispatch import plan as make_plan
from ..jsonio import atomic_write_text
from ..kernels import registry
from ..probe import Probe
from ..reporting.tables import format_table
from ..train import CHECKPOINT_NAME, train
from .config import CPU_KERNELS, QUICK_KERNELS, DemoConfig

__all__ = ["run"]


def _stage(log: Callable[[str], None], i: int, text: str) -> float:
    log(f"[{i}/5] {text}")
    return time.perf_counter()


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _build(cfg: DemoConfig, device) -> torch.nn.Module:
    model, _ = build_model(cfg.model, cfg.preset, None, seed=cfg.seed)
    return model.to(device)


def _curves(result) -> Dict[str, Dict[str, List[float]]]:
    losses = list(result.losses)
    ev = result.eval_history
    return {"train": {"step": list(range(1, len(losses) + 1)), "loss": losses},
            "eval": {"step": [e["step"] for e in ev], "ne": [e["ne"] for e in ev],
                     "auc": [e["auc"] for e in ev], "logloss": [e["logloss"] for e in ev]}}


def _pct(new: float, old: float) -> str:
    return f"{(new - old) / old * 100:+.2f}%" if old else "-"


def run(cfg: DemoConfig = DemoConfig(), device="cpu",
        log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run the demo; returns the summary (also written to ``cfg.out``).

    Returns:
        dict(arms={name: final eval dict}, summary={headers, rows, notes}, files={...},
        decisions={site: {role: kernel}}, device, error_only).
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    out = os.path.abspath(cfg.out)
    ckpt_root = os.path.join(out, "checkpoints")
    os.makedirs(ckpt_root, exist_ok=True)
    tic_all = time.perf_counter()
    model = _build(cfg, device)
    batch_size = cfg.batch_size or model.default_batch_size
    base_stream = SyntheticCTR(model.feature_spec, batch_size, seed=cfg.seed, device=device)
    baseline_name = "bf16" if on_gpu else "fp32"  # the model's dtype: bf16 autocast on GPUs
    total = cfg.probe_steps + cfg.steps
    # every train() call gets a fresh held-out stream at position 0: the same batches for
    # every evaluation of both arms
    eval_every = cfg.eval_every or max(1, total // 8)
    train_kw = dict(lr=cfg.lr, device=device, eval_every=eval_every,
                    eval_steps=cfg.eval_steps, seed=cfg.seed, progress=cfg.progress)
    log(f"LoKA demo: {cfg.model}/{cfg.preset} on synthetic CTR data, {device}, batch "
        f"{batch_size}; {cfg.probe_steps} shared steps, then {cfg.steps} per arm -> {out}")

    kernels, kernel_note = _kernels(cfg, device)
    if kernel_note:
        log(f"note: {kernel_note}")

    # 1. train with the Probe attached
    t = _stage(log, 1, f"training {cfg.probe_steps} steps with the Probe attached")
    # ten statistics steps over the shared run, at most 1024 rows each: the Probe's
    # statistics cost stays a small share of the demo
    pcfg = ProbeConfig(every_n_steps=max(1, cfg.probe_steps // 10), max_rows_per_update=1024,
                       num_samples=cfg.num_samples, naive_samples=cfg.num_samples,
                       compare_naive=True,
                       sample_rows=cfg.sample_rows, bootstrap=cfg.bootstrap,
                       kernels=kernels,
                       max_error=cfg.max_error, min_speedup=cfg.min_speedup, seed=cfg.seed,
                       timing_warmup=10 if on_gpu else 1, timing_iters=50 if on_gpu else 3,
                       progress=cfg.progress)
    base_dir = os.path.join(ckpt_root, "shared")
    shutil.rmtree(base_dir, ignore_errors=True)
    with Probe(model, pcfg) as probe:
        train(model, base_stream, cfg.probe_steps, checkpoint_dir=base_dir,
              eval_iter=base_stream.held_out(), **train_kw)
    times = {"train_probe_s": time.perf_counter() - t}

    # 2. measure the kernels
    t = _stage(log, 2, f"measuring kernels at {len(probe.sites)} GEMM sites x 3 roles "
                       f"({'CUDA graphs' if on_gpu else 'CPU: emulated and CPU _scaled_mm kernels'})")
    report = probe.report(device)
    report.meta.update(model=f"{cfg.model}/{cfg.preset}", data="synthetic", demo=True)
    files = {"report": os.path.join(out, "report.json")}
    report.save(files["report"])
    times["probe_s"] = time.perf_counter() - t

    # 3. plan
    t = _stage(log, 3, "planning" + ("" if on_gpu else " on error only (CPU timings do not "
                                                      "decide FP8 speed)"))
    fp8 = [k for k in report.kernel_names() if _is_fp8(k)]
    plan = make_plan(report, max_error=cfg.max_error, min_speedup=cfg.min_speedup,
                     allowed_kernels=fp8, device=device, assume_fast=not on_gpu)
    files["plan"] = os.path.join(out, "plan.json")
    plan.save(files["plan"])
    times["plan_s"] = time.perf_counter() - t

    # 4. both arms from the same checkpoint, same steps, same held-out batches
    results = {}
    for i, arm in enumerate(("baseline", "loka")):
        label = baseline_name if arm == "baseline" else "LoKA"
        t = _stage(log, 4, f"arm {i + 1}/2, {label}: {cfg.steps} more steps from the shared "
                           "checkpoint")
        arm_dir = os.path.join(ckpt_root, arm)
        os.makedirs(arm_dir, exist_ok=True)
        shutil.copyfile(os.path.join(base_dir, CHECKPOINT_NAME), os.path.join(arm_dir, CHECKPOINT_NAME))
        arm_model = _build(cfg, device)
        if arm == "loka":
            apply_plan(arm_model, plan)
        stream = base_stream.held_out(seed=cfg.seed)  # the same stream; resume sets its position
        results[arm] = train(arm_model, stream, total, checkpoint_dir=arm_dir, resume=True,
                             eval_iter=base_stream.held_out(), **train_kw)
        times[f"{arm}_s"] = time.perf_counter() - t

    # 5. compare and write
    _stage(log, 5, "comparing")
    base, lk = results["baseline"].final, results["loka"].final
    fp8_roles, all_roles = reporting.tables.fp8_fraction(plan)
    headers = ["", baseline_name, "LoKA", "change"]
    rows = [
        ["held-out NE (lower is better)", f"{base['ne']:.5f}", f"{lk['ne']:.5f}",
         _pct(lk["ne"], base["ne"])],
        ["held-out AUC", f"{base['auc']:.4f}", f"{lk['auc']:.4f}",
         f"{lk['auc'] - base['auc']:+.4f}"],
        ["held-out log loss", f"{base['logloss']:.5f}", f"{lk['logloss']:.5f}",
         _pct(lk["logloss"], base["logloss"])],
        ["GEMM roles on FP8", f"0 / {all_roles}", f"{fp8_roles} / {all_roles}", ""],
    ]
    if on_gpu:
        sb, sl = results["baseline"].samples_per_s, results["loka"].samples_per_s
        rows.append(["train samples/s", f"{sb:,.0f}", f"{sl:,.0f}", f"{sl / sb:.2f}x" if sb else "-"])
    notes = [f"Both arms resumed from the checkpoint of step {cfg.probe_steps} (weights, "
             f"optimizer, RNG, data position) and trained {cfg.steps} steps on the same stream; "
             f"evaluated on the same {base['count']} held-out examples."]
    if not on_gpu:
        notes.append("CPU run: the plan was made on error only (loka.plan(..., assume_fast=True)): "
                     "CPU timings of emulated and CPU _scaled_mm kernels say nothing about FP8 "
                     "speed on a GPU, so no speed is compared. Run 'loka demo --device cuda' on "
                     "a GPU for speed.")
        notes.append("The CPU baseline runs in float32 (the model's dtype); on a GPU it is bf16.")
    if kernel_note:
        notes.append(kernel_note)
    summary = {"headers": headers, "rows": rows, "notes": notes}
    decisions = reporting.decisions(plan)
    site_rows = [[s, "x".join(map(str, report.sites[s].shape)) if s in report.sites else "-"]
                 + [decisions[s][r.value] for r in ROLES] for s in decisions]

    curves = {"schema": "loka.curves", "version": 1, "branch_step": cfg.probe_steps,
              "labels": {"baseline": baseline_name, "loka": "LoKA"},
              "arms": {arm: _curves(results[arm]) for arm in ("baseline", "loka")}}
    files["curves"] = os.path.join(out, "curves.json")
    atomic_write_text(files["curves"], json.dumps(curves, indent=1))
    title = f"LoKA demo: {cfg.model}/{cfg.preset} on {device.type}"
    files["html"] = reporting.write_html(os.path.join(out, "report.html"), report, plan, curves,
                                         summary, title)
    files["markdown"] = reporting.write_markdown(os.path.join(out, "summary.md"), report, plan,
                                                 curves, summary, title)
    times["total_s"] = time.perf_counter() - tic_all

    log("")
    log(format_table(["site", "M x K x N"] + [r.value for r in ROLES], site_rows))
    log("")
    log(format_table(headers, rows))
    for n in notes:
        log(f"note: {n}")
    log(f"wrote {', '.join(_shown(f) for f in files.values())}")
    log("time: " + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.0f} s" for k, v in times.items()))
    return {"arms": {baseline_name: base, "LoKA": lk}, "summary": summary, "files": files,
            "decisions": decisions, "device": str(device), "error_only": not on_gpu,
            "times": times, "config": dataclasses.asdict(cfg)}


def _kernels(cfg: DemoConfig, device) -> Tuple[Optional[Tuple[str, ...]], str]:
    """The kernels the demo probes, and a note where the default or the quick CPU list
    left some out."""
    wanted = cfg.kernels if cfg.kernels is not None else (
        None if device.type == "cuda" else CPU_KERNELS)
    if wanted is None:
        return None, ""
    here = {k.name for k in registry.available(device)}
    kernels = tuple(k for k in wanted if k in here)
    note = ""
    if cfg.kernels is None or cfg.kernels == QUICK_KERNELS:  # a user's list runs as it is
        dropped, slow = registry.slow_cpu_kernels(registry.get(k) for k in kernels)
        if dropped:
            kernels = tuple(k for k in kernels if k not in dropped)
            note = (f"this CPU's torch._scaled_mm takes {slow:.0f}x a float32 matmul's time: "
                    f"{', '.join(dropped)} left out (their emulated twins compute the same "
                    "FP8 numbers)")
    return kernels, note


def _is_fp8(name: str) -> bool:
    try:
        return registry.get(name).is_fp8
    except KeyError:
        return False
