"""One benchmark row: build the variant's model, make it what the variant says (torchao's
recipe, a uniform kernel, LoKA's plan), time its training step or inference forward and
record what was learned on the way (FP8 sites, plans, peak memory, a profile)."""

from __future__ import annotations

import gc
from typing import Callable, Tuple

import torch

from ..data.batch import Batch
from ..dispatch import apply
from ..timing import synchronize, time_steps
from .baselines import torchao_inference, torchao_training
from .config import BenchConfig
from .models import automerge, build_model, cast_batch, count_fp8, make_batch, set_pooling
from .plans import static_change, static_scales, structure_plans, uniform_plan, whole_step_plan
from .profiling import profile_breakdown
from .steps import make_forward, make_step, peak_memory_gb
from .variants import Base, Variant

__all__ = ["prepare_train", "run_train_variant", "run_infer_variant"]


def prepare_train(variant: Variant, cfg: BenchConfig, device: torch.device,
                  shared: dict) -> Tuple[Callable[[], object], dict, Batch]:
    """Build ``variant`` and return ``(step, row, batch)``: ``step()`` runs one full
    training step; ``row`` holds what was learned while building (FP8 sites, plan)."""
    model = build_model(cfg, variant.mods_config(), device)
    set_pooling(model, variant)
    batch = cast_batch(make_batch(model, cfg, device), next(model.parameters()).dtype)
    row = {"variant": variant.name, "mode": "train"}
    if variant.automerge:
        row["automerge"] = automerge(model, batch, device)
    if variant.base is Base.TORCHAO:
        note = torchao_training(model, variant.recipe, variant.auto, device)
        if note:
            row["note"] = note
    elif variant.base is Base.UNIFORM:
        apply(model, uniform_plan(model, variant.kernel, big_only=variant.big_only))
    elif variant.applies_plan:
        plans = structure_plans(variant, model, batch, cfg, device, shared, row)
        plan = plans["train"]
        if variant.whole_step:
            plan = whole_step_plan(plans, variant, model, batch, cfg, device, row,
                                   progress=shared.get("progress"))
        apply(model, plan)
    row["fp8_sites"] = count_fp8(model)
    model.train()
    return make_step(model, batch, cfg, device, variant.graphs_on(device)), row, batch


def run_train_variant(variant: Variant, cfg: BenchConfig, device: torch.device,
                      shared: dict) -> dict:
    """The training row of ``variant``: median step time, final loss, peak memory."""
    step, row, batch = prepare_train(variant, cfg, device, shared)
    if device.type == "cuda":
        gc.collect()  # what earlier variants or tuning trials left in cycles is not counted
        torch.cuda.reset_peak_memory_stats(device)
    row.update(time_steps(step, device, cfg.steps, cfg.warmup))
    loss = step()
    synchronize(device)
    row["final_loss"] = float(loss.detach())
    if device.type == "cuda":
        row["peak_mem_gb"] = peak_memory_gb(torch.cuda.max_memory_allocated(device), step)
        if cfg.profiled("train", variant):
            row["profile"] = profile_breakdown(step, ops=cfg.profile_ops)
    row["samples_per_s"] = batch.labels.shape[0] / (row["median_ms"] / 1e3)
    return row


def run_infer_variant(variant: Variant, cfg: BenchConfig, device: torch.device,
                      shared: dict) -> dict:
    """The inference row of ``variant``: median forward time and peak memory, the model
    served as deployed (FP8 weights quantized once, their bf16 copies freed)."""
    model = build_model(cfg, variant.mods_config(), device).eval()
    set_pooling(model, variant)
    batch = cast_batch(make_batch(model, cfg, device), next(model.parameters()).dtype)
    row = {"variant": variant.name, "mode": "infer"}
    if variant.automerge:
        row["automerge"] = automerge(model, batch, device, roles=("fwd",))
    if variant.base is Base.TORCHAO:
        if variant.auto:
            raise ValueError(f"{variant.name}: torchao's auto filter is a training API "
                             "(no serving row)")
        torchao_inference(model, variant.recipe, set_inductor_config=not variant.plain_inductor)
    elif variant.applies_plan or variant.base is Base.UNIFORM:
        model.train()
        if variant.base is Base.UNIFORM:
            plans = {"infer": uniform_plan(model, variant.kernel, big_only=variant.big_only),
                     "report": None}
        else:
            plans = structure_plans(variant, model, batch, cfg, device, shared, row)
        plan = plans["infer"]
        model.eval()
        if variant.whole_step:
            plan = whole_step_plan(plans, variant, model, batch, cfg, device, row,
                                   inference=True, progress=shared.get("progress"))
            model.eval()
        row["plan_fwd_fp8_sites"] = sum(sp.kernel("fwd", plan.baseline) != plan.baseline
                                        for sp in plan.sites.values())
        static = None
        if variant.static:
            static = static_scales(plan, plans.get("report"))
            row["static_sites"] = len(static)
            row["static_logit_change"] = static_change(model, plan, static, batch)
        # served as deployed: FP8 weights only where the forward is FP8 (the bf16 copies
        # are freed, so peak memory counts what a server holds)
        apply(model, plan, inference=True, drop_weights=True, static_scales=static)
        row["hp_weights_dropped"] = sum(getattr(m, "weight", True) is None
                                        for m in model.modules())
    row["fp8_sites"] = count_fp8(model)
    if device.type == "cuda":
        gc.collect()  # what earlier variants or tuning trials left in cycles is not counted
        torch.cuda.reset_peak_memory_stats(device)
    step = make_forward(model, batch, cfg, device, variant.graphs_on(device))
    row.update(time_steps(step, device, cfg.steps, cfg.warmup))
    if device.type == "cuda":
        row["peak_mem_gb"] = peak_memory_gb(torch.cuda.max_memory_allocated(device), step)
        if cfg.profiled("infer", variant):
            row["profile"] = profile_breakdown(step, ops=cfg.profile_ops)
    row["samples_per_s"] = batch.labels.shape[0] / (row["median_ms"] / 1e3)
    return row
