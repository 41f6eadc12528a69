"""A benchmark run: every variant of a :class:`BenchConfig` in one process on one device,
each finished row written to the JSON at once (a crash or a time-out loses nothing that was
measured), speedups against the baselines measured in the same run, and what the run says
about the Dispatch itself (:func:`checks`); :func:`run_sweep` repeats a run per batch size."""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from typing import Callable, List

import torch
import torch._inductor.config as inductor_config

from ..dispatch import audit
from ..jsonio import atomic_write_text
from ..kernels import capabilities as caps
from .config import BenchConfig
from .env import default_out, environment
from .plans import save_plans
from .plots import plot, plot_sweep
from .rows import run_infer_variant, run_train_variant
from .steps import release_memory
from .variants import RATIO_REFS, Base, Variant

__all__ = ["run", "run_sweep", "checks", "table"]


def ratios(rows: List[dict]) -> None:
    """Each measured row's ``speedup_vs_<ref>`` for every :data:`RATIO_REFS` row measured."""
    by = {r["variant"]: r for r in rows if "median_ms" in r}
    for r in rows:
        if "median_ms" not in r:
            continue
        for ref in RATIO_REFS:
            if ref in by:
                r[f"speedup_vs_{ref}"] = by[ref]["median_ms"] / r["median_ms"]


def checks(shared: dict, result: dict) -> dict:
    """What the run says about the Dispatch itself: ``oracle``, each Probe-made plan
    audited against its report (:func:`loka.dispatch.audit`: no kernel within the budget
    faster than the one chosen, at any site and role); ``search_gap``, each ``+tuned`` row
    against its ``+search`` twin (the best fixed choice per shape group by exhaustive
    whole-step timing): the tuned step's speed as a fraction of the searched one's, and
    whether it is within 3% of it (``within_3pct``)."""
    out: dict = {"oracle": {}, "search_gap": []}
    for tag, p in shared.get("plans", {}).items():
        if tag.startswith("@") or p.get("report") is None:
            continue
        for mode in ("train", "infer"):
            res = audit(p[mode], p["report"])
            out["oracle"][f"{tag or 'plain'}/{mode}"] = res
    for mode in ("train", "infer"):
        by = {r["variant"]: r for r in result[mode] if "median_ms" in r}
        for name, row in by.items():
            variant = Variant.parse(name)
            if not variant.search:
                continue
            twin = by.get(variant.replace(search=False, tuned=True).name)
            if twin is None:
                continue
            frac = row["median_ms"] / twin["median_ms"]
            out["search_gap"].append({"mode": mode, "tuned": twin["variant"], "search": name,
                                      "tuned_ms": twin["median_ms"], "search_ms": row["median_ms"],
                                      "tuned_speed_vs_search": frac, "within_3pct": frac >= 0.97})
    return out


def inductor_settings() -> dict:
    """Inductor's settings and the float32 matmul precision, to restore after a row."""
    return {"inductor": inductor_config.get_config_copy(),
            "matmul": torch.get_float32_matmul_precision()}


def restore_inductor_settings(saved: dict) -> dict:
    """Undo what a row changed of the settings (torchao's ``quantize_`` sets Inductor
    options for the whole process); returns the changes as {name: value the row set}."""
    now = inductor_config.get_config_copy()
    changed = {k: v for k, v in now.items()
               if k in saved["inductor"] and v != saved["inductor"][k]
               and isinstance(v, (bool, int, float, str, type(None)))}
    inductor_config.load_config(saved["inductor"])
    if torch.get_float32_matmul_precision() != saved["matmul"]:
        changed["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(saved["matmul"])
    return changed


def write(result: dict, path: str) -> None:
    atomic_write_text(path, json.dumps(result, indent=1, default=str))


def run(cfg: BenchConfig, progress: Callable[[str], None] = print) -> dict:
    """Every training and inference row of ``cfg``, in order; returns the result written
    to ``cfg.out`` (default :func:`~loka.bench.env.default_out`), with the plans and
    reports beside it and, with ``cfg.plot``, a chart. The rows run with TF32 float32
    matmuls allowed; the process's setting is restored after."""
    cfg.check_profile()
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but no CUDA device is visible")
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 (what allow_tf32 = True sets)
    try:
        return _run(cfg, device, progress)
    finally:
        torch.set_float32_matmul_precision(precision)


def _run(cfg: BenchConfig, device: torch.device, progress: Callable[[str], None]) -> dict:
    env = environment(device)
    out = cfg.out or default_out(env)
    result = {"schema": "loka.bench", "version": 1, "env": env, "config": cfg.to_dict(),
              "train": [], "infer": [], "notes": [], "checks": {"oracle": {}, "search_gap": []}}
    if not caps.torchao_available():
        skipped = [v for v in cfg.train_variants + cfg.infer_variants if v.base is Base.TORCHAO]
        if skipped:
            result["notes"].append("torchao is not installed: torchao rows skipped")
        cfg.train_variants = [v for v in cfg.train_variants if v.base is not Base.TORCHAO]
        cfg.infer_variants = [v for v in cfg.infer_variants if v.base is not Base.TORCHAO]
    shared: dict = {"out": out, "progress": progress}
    for mode, variants, fn in (("train", cfg.train_variants, run_train_variant),
                               ("infer", cfg.infer_variants, run_infer_variant)):
        for variant in variants:
            progress(f"[{mode}] {variant.name} ...")
            t0 = time.perf_counter()
            counters = torch._dynamo.utils.counters
            counters.clear()
            phases = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
            if isinstance(phases, dict):
                phases.clear()
            inductor = inductor_settings()
            try:
                row = fn(variant, cfg, device, shared)
            except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the rest
                row = {"variant": variant.name, "mode": mode, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=8)}
            row["wall_s"] = time.perf_counter() - t0
            changed = restore_inductor_settings(inductor)
            if changed:
                row["inductor_changed"] = changed
            if cfg.compile:  # a graph break costs a host round trip per step: show them
                row["graph_breaks"] = sum(counters["graph_break"].values())
                row["compiled_graphs"] = counters["stats"].get("unique_graphs", 0)
                if isinstance(phases, dict) and phases:
                    # where compilation time went: seconds per phase, summed over its calls
                    # (a phase that runs inside itself, a nested frame, counts twice)
                    top = sorted(((k, sum(v)) for k, v in phases.items()), key=lambda kv: -kv[1])
                    row["compile_phases_s"] = {k: round(v, 3) for k, v in top[:8]}
            result[mode].append(row)
            ratios(result[mode])
            progress("   " + row_text(row))
            release_memory(device)  # the finished variant's, before the next one's peak
            torch._dynamo.reset()
            result["checks"] = checks(shared, result)  # a run cut short keeps them too
            write(result, out)
    save_plans(shared, result, out)
    if cfg.plot:
        try:
            result["chart"] = plot(result, out.removesuffix(".json") + ".png")
        except Exception as e:  # noqa: BLE001 - no chart (no matplotlib, no rows) is no failure
            result.setdefault("notes", []).append(f"no chart: {type(e).__name__}: {e}")
    write(result, out)
    result["out"] = out
    return result


def run_sweep(cfg: BenchConfig, batch_sizes: List[int],
              progress: Callable[[str], None] = print) -> dict:
    """The same variants at several batch sizes (where FP8 starts to pay): one full
    :func:`run` per size, written to ``<out>.b<size>.json`` (each with its own Probe pass
    and plans, since the GEMM shapes change with the batch), and a summary
    ``<out>`` with every variant's time and speedups per size, plus a chart."""
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    env = environment(torch.device(cfg.device))
    out = cfg.out or default_out(env).removesuffix(".json") + ".sweep.json"
    stem = out.removesuffix(".json")
    sweep = {"schema": "loka.bench-sweep", "version": 1, "env": env,
             "config": cfg.to_dict(), "batch_sizes": list(batch_sizes),
             "runs": {}, "train": {}, "infer": {}}
    for b in batch_sizes:
        progress(f"== batch {b} ==")
        res = run(dataclasses.replace(cfg, batch_size=int(b), out=f"{stem}.b{b}.json",
                                      plot=False), progress)
        sweep["runs"][str(b)] = res["out"]
        for mode in ("train", "infer"):
            for row in res[mode]:
                keep = {k: v for k, v in row.items()
                        if k in ("median_ms", "samples_per_s", "fp8_sites", "peak_mem_gb", "error")
                        or k.startswith("speedup_vs_")}
                sweep[mode].setdefault(row["variant"], {})[str(b)] = keep
        write(sweep, out)
    if cfg.plot:
        try:
            sweep["chart"] = plot_sweep(sweep, stem + ".png")
        except Exception as e:  # noqa: BLE001 - no chart is no failure: say why
            sweep.setdefault("notes", []).append(f"no chart: {type(e).__name__}: {e}")
        write(sweep, out)
    sweep["out"] = out
    return sweep


def row_text(row: dict) -> str:
    """One row as a line of the run's log and table."""
    if "error" in row:
        return f"{row['variant']:<34} FAILED {row['error'][:120]}"
    s = f"{row['variant']:<34} {row['median_ms']:8.3f} ms  fp8={row.get('fp8_sites', 0):<3}"
    for ref in ("bf16", "bf16+mods"):
        if f"speedup_vs_{ref}" in row:
            s += f"  x{row[f'speedup_vs_{ref}']:.3f} vs {ref}"
    if "peak_mem_gb" in row:
        s += f"  {row['peak_mem_gb']:.1f} GiB"
    return s


def table(result: dict) -> str:
    """The run's rows as text, per mode."""
    lines = []
    for mode in ("train", "infer"):
        lines.append(f"== {mode} ({result['config']['model']} {result['config']['preset']}, "
                     f"{result['env'].get('gpu', result['env']['device'])}) ==")
        lines += [row_text(r) for r in result[mode]]
    return "\n".join(lines)
