"""Where a Probe's wall time goes: one ``loka.probe`` of an evaluation-set model under
cProfile, with the report's own phase split beside it.

The Probe target is a wall time on a *fresh* machine: empty Triton and Inductor caches.
``--fresh-caches`` points both at new temporary folders before torch is imported (the
Probe's precompile children inherit them), so that several configurations can be timed
cold, one process each, on one machine:

    python bench/probe_time.py --fresh-caches --out a.json
    python bench/probe_time.py --fresh-caches --probe-config '{"autotune_configs": 2}' --out b.json
    python bench/probe_time.py --scale tiny --batch-size 64 --device cpu --out cpu.json  # smoke

Writes JSON: the Probe's wall time, the report's ``meta`` (phases, compile and autotuning
seconds, the parent's FX graph cache hits and misses, precompile), the top functions of
the parent process by cumulative and by own time, and the parent's time in a few named
groups (Dynamo, Inductor, Triton's compiler, LoKA's autotuner, host syncs). Children are
not profiled; their wall time is in ``meta['precompile']``; why any of the parent's
graphs bypassed the FX graph or AOTAutograd cache is in ``cache_bypass_reasons``.
cProfile does not see into frames Dynamo evaluates: compiled code is attributed to its
callers, and the groups of compile work can read 0 on a GPU run.
"""

from __future__ import annotations

import os
import sys
import tempfile


def _fresh_caches() -> dict:
    """New, empty Triton and Inductor cache folders for this process and its children."""
    root = tempfile.mkdtemp(prefix="loka-probe-time-")
    dirs = {"TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor")}
    for k, v in dirs.items():
        os.makedirs(v, exist_ok=True)
        os.environ[k] = v
    return dirs


# before torch is imported: Inductor and Triton read these once
_CACHES = _fresh_caches() if "--fresh-caches" in sys.argv[1:] else {}

import argparse  # noqa: E402
import cProfile  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from loka.bench.env import environment  # noqa: E402
from loka.bench.evalset import load_eval_set  # noqa: E402
from loka.config import ProbeConfig  # noqa: E402
from loka.jsonio import atomic_write_text  # noqa: E402
from loka.probe import probe as probe_model  # noqa: E402

GROUPS = {
    "dynamo": ("torch/_dynamo/convert_frame.py", "_compile"),
    "inductor_compile_fx": ("torch/_inductor/compile_fx.py", "compile_fx"),
    "triton_compile": ("triton/compiler/compiler.py", "compile"),
    "loka_autotune": ("loka/kernels/triton/common.py", None),
    "cuda_synchronize": ("torch/cuda/__init__.py", "synchronize"),
    "precompile_wait": ("loka/probe/precompile.py", "wait"),
}
"""group -> (file suffix, function name or None for every function of the file): the
parent's cumulative time in the outermost call of each (recursion counted once)"""


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-set", default=os.path.join(_ROOT, "bench", "evalset"))
    ap.add_argument("--model", default="wukong")
    ap.add_argument("--scale", default="paper")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--probe-batches", type=int, default=4)
    ap.add_argument("--inference", action="store_true",
                    help="a serving Probe: forwards only (roles ['fwd'])")
    ap.add_argument("--probe-config", default=None,
                    help="JSON object of ProbeConfig fields (e.g. '{\"autotune_configs\": 2}')")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fresh-caches", action="store_true",
                    help="empty Triton and Inductor caches for this run (a fresh machine)")
    ap.add_argument("--no-profile", action="store_true", help="time only, no cProfile")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--report-out", default=None,
                    help="also save the Probe's report (JSON) here: its kernels' times and "
                         "errors, to compare runs")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.fresh_caches and not _CACHES:
        ap.error("--fresh-caches must be on the command line (the caches are set before "
                 "torch is imported), not passed to main()")
    if args.batch_size < 1 or args.probe_batches < 1 or args.top < 1:
        ap.error("--batch-size, --probe-batches and --top must be >= 1")
    try:
        fields = json.loads(args.probe_config) if args.probe_config else {}
    except json.JSONDecodeError as e:
        ap.error(f"--probe-config: not JSON: {e}")
    if not isinstance(fields, dict):
        ap.error("--probe-config: expected a JSON object")
    if args.inference:
        fields.setdefault("roles", ["fwd"])
    try:
        args.config = ProbeConfig(**fields)
    except (TypeError, ValueError) as e:
        ap.error(f"--probe-config: {e}")
    return args


def _where(key) -> str:
    path, line, func = key
    for marker in ("site-packages/", "dist-packages/", "/loka/", "/bench/"):
        i = path.rfind(marker)
        if i >= 0:
            path = path[i + len(marker):] if "packages" in marker else path[i + 1:]
            break
    return f"{path}:{line}:{func}"


def _rows(stats: pstats.Stats, key: str, top: int):
    data = stats.stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    idx = {"cumulative": 3, "own": 2}[key]
    ranked = sorted(data.items(), key=lambda kv: kv[1][idx], reverse=True)[:top]
    return [{"function": _where(k), "calls": v[1], "own_s": round(v[2], 4),
             "cumulative_s": round(v[3], 4)} for k, v in ranked]


def _groups(stats: pstats.Stats) -> dict:
    out = {}
    for group, (suffix, func) in GROUPS.items():
        total = 0.0
        for (path, _line, name), (_cc, _nc, _tt, ct, callers) in stats.stats.items():
            if not path.replace("\\", "/").endswith(suffix):
                continue
            if func is not None and name != func:
                continue
            # outermost calls only: drop time reached through a caller of the same group
            inner = sum(c[3] for ck, c in callers.items()
                        if ck[0].replace("\\", "/").endswith(suffix)
                        and (func is None or ck[2] == func))
            total += max(ct - inner, 0.0)
        out[group] = round(total, 3)
    return out


class _Bypasses(logging.Filter):
    """Why a compiled graph of the parent skipped Inductor's FX graph cache or AOTAutograd's
    (their INFO records that start 'Bypassing'), counted by reason. The two loggers are
    lowered to INFO to emit them; the filter drops every record (these included) that
    their level before would have dropped, so nothing more reaches torch's handlers."""

    LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")

    def __init__(self) -> None:
        super().__init__()
        self.reasons: dict = {}
        self._before: dict = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("Bypassing"):
            key = f"{record.name}: {text[:300]}"
            self.reasons[key] = self.reasons.get(key, 0) + 1
        return record.levelno >= self._before.get(record.name, (0, logging.NOTSET))[1]

    def __enter__(self):
        for name in self.LOGGERS:
            lg = logging.getLogger(name)
            self._before[name] = (lg.level, lg.getEffectiveLevel())
            if not lg.isEnabledFor(logging.INFO):
                lg.setLevel(logging.INFO)
            lg.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            lg = logging.getLogger(name)
            lg.removeFilter(self)
            lg.setLevel(self._before[name][0])


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    es = load_eval_set(args.eval_set)
    if args.model not in es.EVAL_MODELS:
        print(f"probe_time: unknown model {args.model!r}; choose from {list(es.EVAL_MODELS)}",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = es.EVAL_MODELS[args.model](args.scale).to(device, dtype)
    batches = [model.make_batch(args.batch_size, device, dtype, seed=1 + i)
               for i in range(args.probe_batches)]
    prof = None if args.no_profile else cProfile.Profile()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    try:
        with _Bypasses() as bypasses:
            report = probe_model(model, batches, es.loss_fn, config=args.config)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if prof is not None:
            prof.disable()
    wall = time.perf_counter() - t0
    if args.report_out:
        report.save(args.report_out)
    out = {"schema": "loka.bench.probe_time", "version": 1,
           "env": environment(device), "model": args.model, "scale": args.scale,
           "batch_size": args.batch_size, "probe_batches": args.probe_batches,
           "fresh_caches": dict(_CACHES), "probe_config": dataclasses.asdict(args.config),
           "probe_wall_s": wall, "meta": report.meta,
           "cache_bypass_reasons": bypasses.reasons,
           "sites": len(report.sites)}
    if prof is not None:
        stats = pstats.Stats(prof)
        out["groups_s"] = _groups(stats)
        out["top_cumulative"] = _rows(stats, "cumulative", args.top)
        out["top_own"] = _rows(stats, "own", args.top)
    atomic_write_text(args.out, json.dumps(out, indent=1, default=str) + "\n")
    print(f"probe {args.model} b{args.batch_size}: {wall:.1f} s "
          f"(phases {json.dumps({k: round(v, 1) for k, v in report.meta['phases_s'].items()})}"
          f"; groups {json.dumps(out.get('groups_s', {}))}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
