"""``loka demo``: the whole of LoKA on one small model, end to end, in a few minutes.

1. Train Wukong (``small``) on the synthetic CTR stream with the Probe attached.
2. Measure every kernel at every GEMM site and role (``report.json``).
3. Plan under the error budget (``plan.json``).
4. Branch: both arms resume from the same checkpoint (weights, optimizer state, RNG,
   data position) and train the same number of steps on the same stream; the LoKA arm has
   the plan applied. Both are evaluated on the same held-out batches.
5. Print NE, AUC, the per-site decisions and (on a GPU) speed side by side; write
   ``report.html``, ``summary.md`` and ``curves.json``.

On the CPU the Probe measures the emulated kernels and torch's CPU ``_scaled_mm``; CPU
wall-clock says nothing about FP8 speed on a GPU, so the plan is made on error alone
(``loka.plan(..., assume_fast=True)``), and the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .config import ROLES, ProbeConfig
from .jsonio import atomic_write_text

CPU_KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3",
               "emulated-blockwise-e4m3", "emulated-rowwise-e5m2", "cublas-tensorwise",
               "cublas-rowwise")
"""kernels probed on the CPU: one per recipe (the emulated twins of the GPU kernels and
torch's CPU ``_scaled_mm``), which keeps the demo to minutes on two cores"""
QUICK_KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3", "cublas-rowwise")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains, probes and compares."""

    model: str = "wukong"
    """reference model (loka.models)"""
    preset: str = "small"
    """model preset; ``--quick`` uses tiny"""
    batch_size: Optional[int] = None
    """examples per step (None: the preset's, 512 for small)"""
    probe_steps: int = 200
    """steps trained with the Probe attached, shared by both arms"""
    steps: int = 200
    """steps each arm trains after the branch"""
    eval_every: int = 0
    """evaluate both arms every this many steps; 0: eight times over the run"""
    eval_steps: int = 16
    """held-out batches per evaluation (the same batches for both arms)"""
    lr: float = 1e-3
    max_error: float = 0.2
    """the plan's budget on MERE's upper 95% bound"""
    min_speedup: float = 1.05
    """the plan's speed threshold (GPU only; the CPU plans on error alone)"""
    num_samples: int = 8
    """synthetic operand pairs per site and role"""
    sample_rows: int = 256
    """rows of each synthetic operand"""
    bootstrap: int = 200
    kernels: Optional[Tuple[str, ...]] = None
    """kernels to probe; None: :data:`CPU_KERNELS` on the CPU, every available one on a GPU"""
    seed: int = 0
    out: str = "loka-demo"
    progress: bool = True

    @classmethod
    def quick(cls, **overrides) -> "DemoConfig":
        """Tiny preset, few steps: a smoke run of every stage (CI)."""
        base = dict(preset="tiny", batch_size=256, probe_steps=30, steps=30,
                    eval_steps=4, lr=3e-3, num_samples=4, sample_rows=64, bootstrap=50,
                    kernels=QUICK_KERNELS)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        for name in ("probe_steps", "steps", "eval_steps", "num_samples", "sample_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1")
        if self.eval_every < 0 or self.max_error < 0 or self.min_speedup <= 0:
            raise ValueError("DemoConfig needs eval_every >= 0, max_error >= 0, min_speedup > 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``loka demo`` options."""
    from .cli import _budget, _positive

    d = DemoConfig()
    p.add_argument("--quick", action="store_true", help="tiny preset and few steps (<1 min)")
    p.add_argument("--out", default="./loka-demo", help="where the files go")
    p.add_argument("--model", default=d.model, help="reference model")
    p.add_argument("--preset", default=None, help="model preset (default: small; tiny with --quick)")
    p.add_argument("--steps", type=_positive(int, "--steps"), default=None,
                   help=f"steps per arm after the branch (default: {d.steps})")
    p.add_argument("--probe-steps", type=_positive(int, "--probe-steps"), default=None,
                   help=f"steps trained under the Probe before the branch (default: {d.probe_steps})")
    p.add_argument("--batch-size", type=_positive(int, "--batch-size"), default=None,
                   help="default: the preset's (512 for small)")
    p.add_argument("--max-error", type=_budget, default=d.max_error, help="plan budget (MERE)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of model, data and sampler")


def config_from_args(args) -> DemoConfig:
    from .cli import usage

    given = {k: v for k, v in (("preset", args.preset), ("steps", args.steps),
                               ("probe_steps", args.probe_steps),
                               ("batch_size", args.batch_size)) if v is not None}
    given.update(model=args.model, max_error=args.max_error, seed=args.seed, out=args.out)
    try:
        return DemoConfig.quick(**given) if args.quick else DemoConfig(**given)
    except ValueError as e:
        raise usage(str(e)) from None


def run_from_args(args, device) -> dict:
    from .cli import build_model

    cfg = config_from_args(args)
    build_model(cfg.model, cfg.preset, None)  # an unknown model or preset: a usage error now
    return run(cfg, device)


# -- the run -----------------------------------------------------------------------------------
def _stage(log: Callable[[str], None], i: int, text: str) -> float:
    log(f"[{i}/5] {text}")
    return time.perf_counter()


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _build(cfg: DemoConfig, device):
    from . import models

    torch.manual_seed(cfg.seed)
    return models.build(cfg.model, cfg.preset).to(device)


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
    from . import reporting
    from .data import SyntheticCTR
    from .dispatch import apply as apply_plan
    from .dispatch import plan as make_plan
    from .probe import Probe
    from .reporting.tables import format_table
    from .train import CHECKPOINT_NAME, train

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

    # 1. train with the Probe attached
    t = _stage(log, 1, f"training {cfg.probe_steps} steps with the Probe attached")
    # ten statistics steps over the shared run, at most 1024 rows each: the Probe's
    # statistics cost stays a small share of the demo
    pcfg = ProbeConfig(every_n_steps=max(1, cfg.probe_steps // 10), max_rows_per_update=1024,
                       num_samples=cfg.num_samples, naive_samples=cfg.num_samples,
                       sample_rows=cfg.sample_rows, bootstrap=cfg.bootstrap,
                       kernels=_kernels(cfg, device),
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


def _kernels(cfg: DemoConfig, device) -> Optional[Tuple[str, ...]]:
    from .kernels import registry

    wanted = cfg.kernels if cfg.kernels is not None else (
        None if device.type == "cuda" else CPU_KERNELS)
    if wanted is None:
        return None
    here = {k.name for k in registry.available(device)}
    return tuple(k for k in wanted if k in here)


def _is_fp8(name: str) -> bool:
    from .kernels import registry

    try:
        return registry.get(name).is_fp8
    except KeyError:
        return False
