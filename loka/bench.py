"""The benchmark harness behind ``loka bench`` and ``bench/run_all.py``.

One process, one device, every variant side by side: bf16, bf16 + CUDA graphs, bf16 +
Mods, torchao's float8 recipes (all eligible Linears and torchao's auto filter, with and
without Mods) and LoKA (Probe -> plan -> apply, with Mods), for the training step and the
inference forward. Ratios are only meaningful within one run: the baselines are always
re-measured beside LoKA. Each finished variant is written to the JSON at once, so a crash
or a time-out loses nothing that was measured.

Timing: the median of per-step CUDA-event times (a full step: forward, BCE loss, backward,
optimizer) after warm-up; on the CPU, wall-clock medians (a smoke test, not a result).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .config import LinearConfig, ModsConfig, ProbeConfig
from .kernels import capabilities as caps

TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
PROBE_KERNELS = ("bf16", "cublas-rowwise", "cublas-tensorwise", "cublas-rowwise-fastacc",
                 "triton-rowwise", "triton-rowwise-cublas", "triton-rowwise-cublas-fastacc",
                 "triton-tensorwise-cublas", "fbgemm-rowwise",
                 "emulated-rowwise-e4m3", "emulated-tensorwise-e4m3")
"""the Probe's default shortlist in the benchmark (kernels absent on a device are skipped)"""
FASTEST = ("bf16+mods+merge+graphs+token-major+triton-emb",
           "loka+mods+merge+tuned+graphs+token-major+triton-emb")
"""the strongest bf16 row and LoKA's fastest configuration: every Mod and layout change
that keeps the model's function, with and without LoKA's FP8 plan"""
TRAIN_VARIANTS = (
    ["bf16", "bf16+graphs", "bf16+mods", "bf16+mods+graphs"]
    + [f"torchao-{r}{a}{m}" for m in ("", "+mods") for r in TORCHAO_RECIPES for a in ("", "-auto")]
    + ["loka+mods", "loka+mods+graphs", "bf16+mods+merge+graphs", "loka+mods+merge+graphs",
       "loka+mods+merge+tuned+graphs"] + list(FASTEST)
)
INFER_VARIANTS = (
    ["bf16", "bf16+graphs", "bf16+mods", "bf16+mods+graphs"]
    + [f"torchao-{r}{m}" for m in ("", "+mods") for r in ("tensorwise", "rowwise")]
    + ["loka+mods", "loka+mods+graphs", "bf16+mods+merge+graphs", "loka+mods+merge+graphs",
       "loka+mods+merge+tuned+graphs"] + list(FASTEST)
)
"""Variant names: a base (bf16, torchao-<recipe>[-auto], loka, loka-uniform-<kernel>[-big])
and suffixes: +mods (the paper's Mods: No Bias, BlockNorm, Hard Swish), +merge (also
LoKA's shape Mod that merges sibling Linears reading one input into one GEMM), +automerge
(the same, only where timing the siblings' GEMMs apart and merged says it pays,
``loka.mods.merge_pays``), +tuned
(LoKA's plan tuned by whole-step timings, ``loka.dispatch.tune_speed``), +search (the
best fixed choice per group of same-shape sites by exhaustive whole-step timing,
``loka.dispatch.search_speed``: the yardstick the plan is judged against),
+graphs (the whole step captured in one CUDA graph), +plain-inductor (torchao's inference
quantization leaves Inductor's settings as they are, ``set_inductor_config=False``: by
default ``quantize_`` switches on coordinate-descent tuning for the whole process, which
took 212 s of compilation on the Wukong paper inference step on an H200). Every row runs
under the Inductor settings the run started with; what a row changed is recorded in its
``inductor_changed`` and undone before the next row. +triton-emb (the embedding bags pooled
by LoKA's Triton kernel instead of ``F.embedding_bag``; the model's function is the same),
+token-major (with +mods: ``ModsConfig.token_major``, Wukong's token-axis Linears as
``W @ X`` on the layout the layer holds), +fused-norm (with +mods:
``ModsConfig.fuse_norm_quant``, each norm and activation in front of a Linear that takes an
FP8 input fused with its quantization), +static (LoKA inference rows: static activation
scales from the Probe's observed amax where the forward kernel takes one, and the logits'
relative change against dynamic scales in ``static_logit_change``)."""


def variant_mods(name: str) -> Optional[ModsConfig]:
    """The Mods a variant's model is built with (None: the plain model)."""
    if "+mods" not in name:
        return None
    return dataclasses.replace(ModsConfig.paper(), merge_siblings="+merge" in name,
                               token_major="+token-major" in name,
                               fuse_norm_quant="+fused-norm" in name)


@dataclass
class BenchConfig:
    model: str = "wukong"
    """reference model name (loka.models)"""
    preset: str = "paper"
    """model preset: tiny (CPU smoke), small, paper (GPU)"""
    device: str = "cuda"
    batch_size: Optional[int] = None
    """None: the preset's default batch size"""
    steps: int = 30
    """timed steps per variant"""
    warmup: int = 5
    """untimed steps (compilation happens here)"""
    compile: bool = True
    """torch.compile the model (all variants alike)"""
    train_variants: List[str] = field(default_factory=lambda: list(TRAIN_VARIANTS))
    infer_variants: List[str] = field(default_factory=lambda: list(INFER_VARIANTS))
    max_error: float = 0.2
    min_speedup: float = 1.05
    probe_steps: int = 3
    probe_samples: int = 16
    probe_kernels: Optional[Tuple[str, ...]] = PROBE_KERNELS
    """kernels the LoKA variants' Probe measures (None: every available kernel; the
    default is a shortlist of one kernel per library and scaling, which keeps the Probe
    to about a minute on the paper preset)"""
    plan: Optional[str] = None
    """a plan JSON to apply in the LoKA variants instead of probing (the plan of an
    earlier run: ``<out>.plan.json``)"""
    tune_trials: int = 10
    """whole-step timings a ``+tuned`` variant may spend (each one compiles the model)"""
    search_trials: int = 24
    """whole-step timings a ``+search`` variant may spend"""
    plans: Dict[str, str] = field(default_factory=dict)
    """named plan JSONs for the variants ``loka@<name>...`` (several plans side by side in
    one run); a ``+merge`` variant reads ``<stem>.merge.plan.json`` beside the file"""
    profile: Tuple[str, ...] = ()
    """variants whose timed step is also profiled (torch.profiler, CUDA only): GPU time
    per kernel class goes into the row's ``profile``; ``train:<variant>`` (or a bare name)
    names a training variant, ``infer:<variant>`` an inference one; a name that is not
    among the run's variants is refused"""
    profile_ops: bool = False
    """profiles also attribute GPU time to the operator and stack frame that launched it
    (``profile['by_op_us']``; meaningful for variants without CUDA graphs)"""
    table_rows: Optional[int] = 1000
    """cap on embedding-table rows, so that the optimizer update of huge tables does not
    drown the dense part the benchmark is about (None: the preset's tables)"""
    fused_embeddings: bool = True
    """stack all embedding tables into one (loka.models.fused_embedding) in every variant"""
    out: Optional[str] = None
    plot: bool = True
    seed: int = 0


# -- environment ----------------------------------------------------------------------
def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for mod in ("triton", "torchao"):
        if caps.module_available(mod):
            env[mod] = getattr(__import__(mod), "__version__", "?")
    env["commit"] = os.environ.get("LOKA_COMMIT", "")
    try:
        env["commit"] = env["commit"] or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=5,
                                       cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - not a git checkout
        env["commit"] = "unknown"
    env["source_sha1"] = source_digest()
    return env


def source_digest() -> str:
    """SHA-1 over the package's Python sources (paths and contents): names the code that
    ran even where the checkout's git metadata is missing or stale (a copied tree)."""
    import hashlib

    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha1()
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- building blocks ----------------------------------------------------------------
def capped_features(features, table_rows: Optional[int]):
    """``features`` (a :class:`~loka.data.batch.FeatureSpec`) with every table capped at
    ``table_rows`` rows (None or 0: as it is)."""
    from .data.batch import FeatureSpec, TableSpec

    if not table_rows:
        return features
    return FeatureSpec(features.num_dense, tuple(
        TableSpec(t.name, min(t.num_embeddings, table_rows), t.mean_bag_length)
        for t in features.tables))


def build_model(cfg: BenchConfig, mods: Optional[ModsConfig], device: torch.device) -> torch.nn.Module:
    from . import models

    torch.manual_seed(cfg.seed)
    base = models.presets(cfg.model)[cfg.preset] if hasattr(models, "presets") else None
    overrides = {}
    if base is not None and hasattr(base, "sparse_embeddings"):
        overrides["sparse_embeddings"] = False  # dense grads: fused AdamW, CUDA graphs
    if cfg.table_rows and base is not None and hasattr(base, "features"):
        overrides["features"] = capped_features(base.features, cfg.table_rows)
    model = models.build(cfg.model, cfg.preset, mods=mods, **overrides)
    if cfg.fused_embeddings:
        from .models.fused_embedding import fuse_embeddings
        fuse_embeddings(model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype)


def _release_memory(device: torch.device) -> None:
    """Frees what finished work left: reference cycles (hooks, optimizers, compiled
    callables) and, on CUDA, the allocator's cache and cuBLAS's workspaces, one per stream
    it ran on (side streams of graph captures and timings), so that none of it counts in
    the next row's peak."""
    gc.collect()
    if device.type == "cuda":
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def _graphs(name: str, device: torch.device) -> bool:
    """Whether variant ``name`` captures its step in a CUDA graph (``+graphs``, on CUDA)."""
    return "+graphs" in name and device.type == "cuda"


def set_pooling(model, name: str) -> int:
    """``+triton-emb``: the fused embedding tables pool their bags with LoKA's Triton kernel
    (``loka.kernels.triton.embedding_bag``) instead of ``F.embedding_bag``; returns how many
    embedding archs were switched."""
    if "+triton-emb" not in name:
        return 0
    from .models.fused_embedding import FusedEmbeddingArch

    archs = [m for m in model.modules() if isinstance(m, FusedEmbeddingArch)]
    if not archs:
        raise ValueError(f"{name}: +triton-emb needs fused embedding tables (fused_embeddings)")
    for m in archs:
        m.pooling = "triton"
    return len(archs)


def automerge(model, batch, device: torch.device, roles=("fwd", "dgrad", "wgrad")) -> dict:
    """``+automerge``: merge each group of sibling Linears only where timing their GEMMs
    apart and merged at the rows they see on ``batch`` says it pays
    (:func:`loka.mods.merge_pays`); returns what was merged and every decision."""
    from .mods import merge_pays, merge_siblings, observed_rows

    rows = observed_rows(model, lambda: model(batch))
    record: List[dict] = []
    when = merge_pays(lambda sib: rows[sib[0]], device=device,
                      dtype=next(model.parameters()).dtype, roles=roles, record=record)
    changes = merge_siblings(model, when=when)
    return {"merged": [c.fqn for c in changes], "decisions": record}


def make_batch(model, cfg: BenchConfig, device: torch.device):
    from .data.synthetic import SyntheticCTR

    bs = cfg.batch_size or getattr(model, "default_batch_size", 4096)
    batch = SyntheticCTR(model.feature_spec, bs, seed=cfg.seed, device=device).batch(0)
    if device.type == "cuda":
        batch = batch.to(device)
    return batch


def _cast_batch(batch, dtype):
    from dataclasses import replace
    return replace(batch, dense=batch.dense.to(dtype), labels=batch.labels.to(dtype))


def _loss(model, batch):
    logits = model(batch)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())


def _optimizer(model, device, capturable: bool):
    kw = {"lr": 1e-3}
    if device.type == "cuda":
        kw["fused"] = True
        if capturable:
            kw["capturable"] = True
    return torch.optim.AdamW(model.parameters(), **kw)


@contextlib.contextmanager
def _capture_peak(owner):
    """Records in ``owner.capture_peak_bytes`` the allocator's peak while a CUDA graph is
    captured. A replay reuses the graph's private pool without the caching allocator seeing
    it, so the peak of replayed steps counts only what stays allocated between steps
    (weights, optimizer state, static outputs), not the activations of a step; the peak of
    the capture does count them (one step's allocations, made through the allocator)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        owner.capture_peak_bytes = torch.cuda.max_memory_allocated()


def peak_memory_gb(peak_bytes: int, step=None) -> float:
    """Peak GPU memory of a benchmarked step in GiB: ``peak_bytes`` (the allocator's peak
    since the last reset) or, for a step replayed from a CUDA graph, the larger of that and
    the peak while the graph was captured (see :func:`_capture_peak`)."""
    return max(int(peak_bytes), int(getattr(step, "capture_peak_bytes", 0))) / 2 ** 30


class GraphedStep:
    """A whole training step (forward, loss, backward, optimizer) captured in one CUDA
    graph: the step never waits on the host. Inputs are copied into static buffers."""

    def __init__(self, model, opt, batch, warmup: int = 3):
        self.model, self.opt, self.batch = model, opt, batch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                opt.zero_grad(set_to_none=True)
                _loss(model, batch).backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with _capture_peak(self):
            with torch.cuda.graph(self.graph):
                self.loss = _loss(model, batch)
                self.loss.backward()
                opt.step()

    def __call__(self):
        self.graph.replay()
        return self.loss


class GraphedForward:
    """An inference forward (under ``torch.inference_mode``) captured in one CUDA graph."""

    def __init__(self, model, batch, warmup: int = 3):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(warmup):
                model(batch)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with _capture_peak(self), torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = model(batch)

    def __call__(self):
        self.graph.replay()
        return self.out


def _time_steps(step: Callable[[], object], device: torch.device, steps: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm_s = time.perf_counter() - t0
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            start.record()
            step()
            end.record()
        _sync(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times),
            "max_ms": max(times), "warmup_s": warm_s,
            "timing": "cuda-events" if device.type == "cuda" else "cpu-wallclock"}


def _maybe_compile(model, cfg: BenchConfig):
    return torch.compile(model) if cfg.compile else model


def _count_fp8(model) -> int:
    from .dispatch.linear import Linear

    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and any(k.is_fp8 for k in m.kernels):
            n += 1
        elif type(m).__name__ == "Float8Linear":
            n += 1
        elif isinstance(m, torch.nn.Linear) and any(
                hasattr(m.weight, a) for a in ("tensor_impl", "qdata")):
            n += 1  # torchao inference-quantized weight (AQT: tensor_impl; Float8Tensor: qdata)
    return n


# -- variant preparation --------------------------------------------------------------
def _torchao_convert(model, recipe: str, auto: bool) -> Optional[str]:
    """Convert to torchao's float8 training recipe; returns a note when the auto filter
    had to stand in (torchao 0.17 has none for ``rowwise_with_gw_hp``: its rowwise filter,
    which judges the same forward GEMMs, is used)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    config = Float8LinearConfig.from_recipe_name(recipe)
    last = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1:]
    note = None
    if auto:
        try:
            filt = _auto_filter_for_recipe(recipe, filter_fqns=last)
        except NotImplementedError:
            filt = _auto_filter_for_recipe("rowwise", filter_fqns=last)
            note = (f"torchao has no auto filter for {recipe}: its rowwise filter chose "
                    "the Linears")
    else:
        def filt(mod, fqn):  # every Linear torchao can take (dims % 16), except the logit
            return (isinstance(mod, torch.nn.Linear) and fqn not in last
                    and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    convert_to_float8_training(model, config=config, module_filter_fn=filt)
    if recipe.startswith("rowwise"):
        # torchao 0.17's rowwise casts cannot clone a strided input ("aten.clone.default
        # with axiswise scaling is not supported yet"), which Wukong's FM projection of the
        # transposed embeddings is: its Linears get their input made contiguous, a copy
        # charged to these rows
        n = 0
        for mod in model.modules():
            if type(mod).__name__ == "Float8Linear":
                mod.register_forward_pre_hook(_contiguous_input)
                n += 1
        if n:
            note = "; ".join(filter(None, [note, f"inputs made contiguous at {n} Linear(s) "
                                                  "(torchao's rowwise casts need it)"]))
    return note


def _contiguous_input(module, args):
    return (args[0].contiguous(),) + tuple(args[1:])


def _torchao_inference(model, recipe: str, set_inductor_config: bool = True):
    """torchao's float8 inference quantization (dynamic activations, weights once) of every
    Linear with both dimensions divisible by 16 except the logit; ``set_inductor_config``
    is torchao's own switch (its default, True, turns on coordinate-descent tuning)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor, quantize_

    gran = PerRow() if recipe == "rowwise" else PerTensor()
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1:]

    def filt(mod, fqn):
        return (isinstance(mod, torch.nn.Linear) and mod not in last
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(
        granularity=gran, set_inductor_config=set_inductor_config), filter_fn=filt)
    return model


def _beside(plan_path: str, kind: str, tag: str = "") -> str:
    """The file of ``kind`` ('plan', 'report') for structure ``tag`` beside a plan file:
    ``run.plan.json`` -> ``run.report.json``, ``run.merge.plan.json``."""
    stem = plan_path.removesuffix(".plan.json").removesuffix(".json")
    return f"{stem}{'.' + tag if tag else ''}.{kind}.json"


def _loka_plan(model, batch, cfg: BenchConfig, device, log: dict):
    """Probe the Mods model on a few real steps, plan under the budget."""
    from . import dispatch, probe as probe_mod

    if cfg.plan:
        plan = dispatch.Plan.load(cfg.plan)
        log["plan_source"] = cfg.plan
        beside = _beside(cfg.plan, "report")
        report = None
        if cfg.plan.endswith(".plan.json") and os.path.exists(beside):
            report = probe_mod.ProbeReport.load(beside)  # what +tuned checks twins against
            log["report_source"] = beside
        return report, plan
    opt = _optimizer(model, device, capturable=False)
    kernels = None
    if cfg.probe_kernels is not None:
        from .kernels import registry
        kernels = tuple(k.name for k in registry.available(device, names=cfg.probe_kernels))
    pcfg = ProbeConfig(every_n_steps=1, num_samples=cfg.probe_samples, bootstrap=200,
                       seed=cfg.seed, kernels=kernels, compare_naive=False)
    t0 = time.perf_counter()
    report = probe_mod.probe(model, [batch] * cfg.probe_steps, _loss, config=pcfg, optimizer=opt)
    log["probe_s"] = time.perf_counter() - t0
    # the probing optimizer's state and the gradients must not stay alive into the timed
    # variant (they would count in its peak memory)
    model.zero_grad(set_to_none=True)
    del opt
    # nor what the Probe's compiled kernel timings left in Dynamo's caches (compiled
    # callables and the tensors their guards and graphs hold); the variant compiles anew
    torch._dynamo.reset()
    _release_memory(device)
    plan = dispatch.plan(report, max_error=cfg.max_error, min_speedup=cfg.min_speedup)
    log["plan"] = plan.to_dict() if hasattr(plan, "to_dict") else str(plan)
    return report, plan


def _plans(name: str, model, batch, cfg: BenchConfig, device, shared: dict, row: dict) -> dict:
    """The LoKA plans of a variant's model structure, made once per run and structure
    (one Probe pass serves every LoKA variant built alike): {"tag", "report", "train",
    "infer"}. The inference plan judges the forward with the weight quantized once; with
    ``cfg.plan`` (no report) the given plan serves both."""
    from .dispatch import plan as make_plan

    tag = "merge" if "+merge" in name else "automerge" if "+automerge" in name else ""
    named = plan_name(name)
    plans = shared.setdefault("plans", {})
    if named is not None:
        return _named_plan(named, tag, cfg, plans)
    if tag not in plans:
        run = cfg
        if cfg.plan and tag:  # a merged model has other sites: its plan file, else probe
            own = _beside(cfg.plan, "plan", tag)
            run = dataclasses.replace(cfg, plan=own if os.path.exists(own) else None)
        report, train = _loka_plan(model, batch, run, device, row)
        infer = train if report is None else make_plan(
            report, max_error=cfg.max_error, min_speedup=cfg.min_speedup, inference=True)
        plans[tag] = {"tag": tag, "report": report, "train": train, "infer": infer,
                      "probed": not run.plan}
        if shared.get("out"):  # on disk at once: a run cut short keeps its plans
            _save_plans({"plans": {tag: plans[tag]}}, {}, shared["out"])
    return plans[tag]


def plan_name(variant: str) -> Optional[str]:
    """'loka@fast+mods+graphs' -> 'fast'; None for variants without a named plan."""
    base = variant.split("+")[0]
    return base.split("@", 1)[1] if base.startswith("loka@") else None


def _named_plan(named: str, tag: str, cfg: BenchConfig, plans: dict) -> dict:
    from .dispatch import Plan

    if named not in cfg.plans:
        raise ValueError(f"variant names plan {named!r}, but --plans gives only "
                         f"{sorted(cfg.plans) or 'none'}")
    key = f"@{named}{'.' + tag if tag else ''}"
    if key not in plans:
        path = cfg.plans[named]
        if tag and not path.endswith(f".{tag}.plan.json"):  # a merged model's plan as given
            path = _beside(path, "plan", tag)
            if not os.path.exists(path):
                raise FileNotFoundError(f"a +{tag} variant of plan {named!r} needs {path}")
        plan = Plan.load(path)
        plans[key] = {"tag": key, "report": None, "train": plan, "infer": plan, "path": path}
    return plans[key]


def _save_plans(shared: dict, result: dict, out: str) -> None:
    """Write each structure's plans and report beside the result JSON (and into it)."""
    for tag, p in shared.get("plans", {}).items():
        if tag.startswith("@"):
            continue  # given as files, or kept in the rows that used them
        key = f"loka{'_' + tag if tag else ''}"
        result[f"{key}_plan"] = p["train"].to_dict()
        result[f"{key}_infer_plan"] = p["infer"].to_dict()
        p["train"].save(_beside(out, "plan", tag))
        p["infer"].save(_beside(out, "infer-plan", tag))
        if p["report"] is not None and p.get("probed"):  # a loaded report is a file already
            p["report"].save(_beside(out, "report", tag))


def _uniform_spec(name: str):
    """'loka-uniform-<kernel>[-big][+mods][+graphs]' -> (kernel, big_only)."""
    body = name[len("loka-uniform-"):].split("+")[0]
    big = body.endswith("-big")
    return body.removesuffix("-big"), big


def uniform_fp8(model, kernel: str, big_only: bool = False, min_dim: int = 1024) -> int:
    """One kernel on every role of every eligible Linear (a fixed, per-model choice, the
    yardstick a per-site plan must beat). ``big_only``: only Linears with K, N >= min_dim.
    The logit Linear and Linears the kernel cannot align stay on the baseline."""
    from .config import LinearConfig
    from .dispatch.linear import Linear
    from .kernels import get

    kern = get(kernel)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    count = 0
    for fqn, lin in linears[:-1]:
        k, n = lin.in_features, lin.out_features
        if k % kern.align or n % kern.align or (big_only and min(k, n) < min_dim):
            continue
        grad_kernel = kernel
        cfg = LinearConfig(fwd=kernel, dgrad=grad_kernel, wgrad=grad_kernel)
        parent, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, Linear.from_linear(lin, cfg))
        count += 1
    return count


# -- the runs -------------------------------------------------------------------------
def prepare_train(name: str, cfg: BenchConfig, device: torch.device, shared: dict):
    """Build variant ``name`` and return ``(step, row, batch)``: ``step()`` runs one full
    training step; ``row`` holds what was learned while building (FP8 sites, plan)."""
    mods = variant_mods(name)
    model = build_model(cfg, mods, device)
    set_pooling(model, name)
    batch = _cast_batch(make_batch(model, cfg, device), next(model.parameters()).dtype)
    row = {"variant": name, "mode": "train"}
    if "+automerge" in name:
        row["automerge"] = automerge(model, batch, device)
    if name.startswith("torchao-"):
        recipe = name[len("torchao-"):].split("+")[0]
        auto = recipe.endswith("-auto")
        note = _torchao_convert(model, recipe.removesuffix("-auto"), auto)
        if note:
            row["note"] = note
    elif name.startswith("loka-uniform-"):
        kernel, big = _uniform_spec(name)
        uniform_fp8(model, kernel, big_only=big)
    elif name.startswith("loka"):
        from .dispatch import apply

        plans = _plans(name, model, batch, cfg, device, shared, row)
        plan = plans["train"]
        if "+tuned" in name or "+search" in name:
            plan = _whole_step_plan(plans, name, model, batch, cfg, device, row,
                                    progress=shared.get("progress"))
        apply(model, plan)
    row["fp8_sites"] = _count_fp8(model)
    graphs = _graphs(name, device)
    model.train()
    return _make_step(model, batch, cfg, device, graphs), row, batch


def _make_step(model, batch, cfg: BenchConfig, device, graphs: bool) -> Callable[[], object]:
    """One full training step of ``model`` as the benchmark runs it (compiled unless
    ``cfg.compile`` is off; on CUDA with ``graphs``, captured in one CUDA graph)."""
    compiled = _maybe_compile(model, cfg)
    opt = _optimizer(model, device, capturable=graphs)
    if graphs:
        return GraphedStep(compiled, opt, batch)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = _loss(compiled, batch)
        loss.backward()
        opt.step()
        return loss
    return step


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


def _trial_timer(model, batch, cfg: BenchConfig, device, graphs: bool, inference: bool,
                 progress: Optional[Callable[[str], None]] = None):
    """``time_step(model) -> median ms`` over :data:`TUNE_STEPS` steps, compiled afresh,
    with the weights restored after every trial (each trial reported to ``progress``)."""
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    count = [0]

    def time_step(m) -> float:
        count[0] += 1
        fp8 = _count_fp8(m)
        torch._dynamo.reset()
        if inference:
            step = _make_forward(m.eval(), batch, cfg, device, graphs)
        else:
            step = _make_step(m, batch, cfg, device, graphs)
        t = _time_steps(step, device, TUNE_STEPS, cfg.warmup)["median_ms"]
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


def _whole_step_plan(plans: dict, name: str, model, batch, cfg: BenchConfig, device,
                     row: dict, inference: bool = False,
                     progress: Optional[Callable[[str], None]] = None):
    """The structure's plan tuned by whole-step timings (``+tuned``:
    :func:`loka.dispatch.tune_speed`, trying the fusible twins of its kernels too), or the
    best fixed choice per group of same-shape sites by exhaustive timing (``+search``:
    :func:`loka.dispatch.search_speed`, the yardstick of the plan); once per structure,
    mode and graph mode. The variant itself starts from the same weights."""
    from .dispatch import search_speed, tune_speed
    from .dispatch.plan import FUSIBLE_TWINS
    from .kernels import registry

    graphs = _graphs(name, device)
    how = "search" if "+search" in name else "tuned"
    key = ("infer-" if inference else "") + how + ("+graphs" if graphs else "")
    if key not in plans:
        time_step = _trial_timer(model, batch, cfg, device, graphs, inference, progress)
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


def run_train_variant(name: str, cfg: BenchConfig, device: torch.device, shared: dict) -> dict:
    step, row, batch = prepare_train(name, cfg, device, shared)
    if device.type == "cuda":
        gc.collect()  # what earlier variants or tuning trials left in cycles is not counted
        torch.cuda.reset_peak_memory_stats(device)
    row.update(_time_steps(step, device, cfg.steps, cfg.warmup))
    loss = step()
    _sync(device)
    row["final_loss"] = float(loss.detach())
    if device.type == "cuda":
        row["peak_mem_gb"] = peak_memory_gb(torch.cuda.max_memory_allocated(device), step)
        if name in cfg.profile or f"train:{name}" in cfg.profile:
            row["profile"] = profile_breakdown(step, ops=cfg.profile_ops)
    row["samples_per_s"] = batch.labels.shape[0] / (row["median_ms"] / 1e3)
    return row


# -- where the time goes ------------------------------------------------------------------
KERNEL_CLASSES = ("gemm", "gemm-fp8", "quantize", "triton", "embedding", "optimizer", "other")
QUANTIZE_KERNELS = ("rowwise_quant_kernel", "rowwise_amax_split_kernel",
                    "rowwise_cast_split_kernel", "tensor_amax_kernel", "tensor_cast_kernel",
                    "block_quant_kernel", "norm_act_quant_kernel")
"""LoKA's Triton kernels that quantize (loka/kernels/triton/); the fused norm -> quantize
kernel counts here too: it replaces a norm plus a quantization pass"""


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel by its name: GEMM (bf16), FP8 GEMM, quantization
    (LoKA's Triton quantizers, FBGEMM's), Triton (Inductor-generated), embedding,
    optimizer, or other."""
    n = name.lower()
    if n.startswith(("triton_poi", "triton_red", "triton_per", "triton_tem")):
        return "triton"  # Inductor's kernels (named after the ops they fuse)
    # cuBLAS's Hopper kernels are named nvjet_*: "qq" marks FP8 operands (e.g. _qqtst_)
    if n.startswith("nvjet") and "_qq" in n:
        return "gemm-fp8"
    if n.startswith(QUANTIZE_KERNELS) or "quantize" in n:
        return "quantize"  # standalone quantization: LoKA's Triton kernels, FBGEMM's
    if n.startswith(("rowwise_gemm_kernel", "blockwise_gemm_kernel")) or "f8f8" in n or (
            any(t in n for t in ("fp8", "e4m3", "scaled_mm")) and "gemm" in n):
        return "gemm-fp8"  # LoKA's Triton FP8 GEMMs, CUTLASS (FBGEMM's f8f8bf16*), cuBLAS
    if any(t in n for t in ("radix_sort", "sum_and_scatter", "compute_grad_weight_bags",
                            "embeddingbag", "embedding_bag", "krn_partials_per_segment",
                            "segment_offsets")):
        return "embedding"
    if any(t in n for t in ("gemm", "cutlass", "xmma", "cublas", "nvjet", "sm90_", "matmul")):
        return "gemm-fp8" if "e4m3" in n or "f8" in n else "gemm"
    if "embedding" in n or "index_select" in n or "indexing_backward" in n:
        return "embedding"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if n.startswith("triton_") or "triton" in n:
        return "triton"
    return "other"


def op_breakdown(events, steps: int = 1, top: int = 20) -> List[list]:
    """GPU time per step by the operator that launched it: for each profiler event with
    kernels, the outermost ``aten::`` op above it and the innermost stack frame in LoKA's
    or Inductor's code (when stacks were recorded). Rows ``[op, frame, us]``, largest
    first. Kernels replayed from a CUDA graph belong to ``cudaGraphLaunch``: profile a
    step without graphs to see their ops."""
    totals: Dict[tuple, float] = {}
    for evt in events:
        kernels = getattr(evt, "kernels", None) or []
        if not kernels:
            continue
        op = evt
        while getattr(op, "cpu_parent", None) is not None and \
                str(op.cpu_parent.name).startswith("aten::"):
            op = op.cpu_parent
        frames = [f for f in (getattr(evt, "stack", None) or [])
                  if "/loka/" in f or "torchinductor" in f or "output_code" in f]
        key = (str(op.name), frames[0] if frames else "")
        totals[key] = totals.get(key, 0.0) + sum(k.duration for k in kernels) / steps
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return [[op, frame, us] for (op, frame), us in ranked]


def profile_breakdown(step: Callable[[], object], steps: int = 5, top: int = 30,
                      ops: bool = False) -> dict:
    """GPU time per step by kernel class (and the ``top`` kernels) over ``steps`` steps of
    an already warmed-up ``step``, with torch.profiler. ``ops``: also by launching
    operator and stack frame (:func:`op_breakdown`; records the CPU side and stacks)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=acts, with_stack=ops) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    per_kernel: Dict[str, float] = {}
    cpu_self: Dict[str, float] = {}
    for evt in prof.key_averages():
        if ops and evt.device_type != DeviceType.CUDA:
            # with the CPU side recorded, its events also carry their kernels' time; keep
            # their own host time instead: what a step without graphs waits on
            if evt.device_type == DeviceType.CPU and evt.self_cpu_time_total:
                cpu_self[evt.key] = cpu_self.get(evt.key, 0.0) + evt.self_cpu_time_total / steps
            continue
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        key = evt.key or ""
        # CPU-op rows summarise their kernels (they would count twice)
        if not t or key.startswith(("aten::", "cuda", "Torch-Compiled", "CompiledFunction",
                                    "## ", "ProfilerStep")):
            continue
        per_kernel[key] = per_kernel.get(key, 0.0) + t / steps
    cats = {c: 0.0 for c in KERNEL_CLASSES}
    for k, v in per_kernel.items():
        cats[kernel_class(k)] += v
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    out = {"gpu_us_per_step": sum(per_kernel.values()), "by_class_us": cats,
           "top_kernels_us": [[k, v, kernel_class(k)] for k, v in ranked], "steps": steps}
    if ops:
        out["by_op_us"] = op_breakdown(prof.events(), steps)
        out["host_us_per_step"] = sum(cpu_self.values())
        out["host_top_ops_us"] = sorted(([k, v] for k, v in cpu_self.items()),
                                        key=lambda kv: -kv[1])[:top]
    return out


def _make_forward(model, batch, cfg: BenchConfig, device, graphs: bool) -> Callable[[], object]:
    """One inference forward as the benchmark runs it (compiled unless ``cfg.compile`` is
    off; on CUDA with ``graphs``, captured in one CUDA graph)."""
    compiled = _maybe_compile(model, cfg)
    if graphs:
        return GraphedForward(compiled, batch)

    def step():
        with torch.inference_mode():
            return compiled(batch)
    return step


def run_infer_variant(name: str, cfg: BenchConfig, device: torch.device, shared: dict) -> dict:
    mods = variant_mods(name)
    model = build_model(cfg, mods, device).eval()
    set_pooling(model, name)
    batch = _cast_batch(make_batch(model, cfg, device), next(model.parameters()).dtype)
    row = {"variant": name, "mode": "infer"}
    if "+automerge" in name:
        row["automerge"] = automerge(model, batch, device, roles=("fwd",))
    if name.startswith("torchao-"):
        _torchao_inference(model, name[len("torchao-"):].split("+")[0],
                           set_inductor_config="+plain-inductor" not in name)
    elif name.startswith("loka"):
        from .dispatch import apply

        model.train()
        plans = _plans(name, model, batch, cfg, device, shared, row)
        plan = plans["infer"]
        model.eval()
        if "+tuned" in name or "+search" in name:
            plan = _whole_step_plan(plans, name, model, batch, cfg, device, row, inference=True,
                                    progress=shared.get("progress"))
            model.eval()
        row["plan_fwd_fp8_sites"] = sum(sp.kernel("fwd", plan.baseline) != plan.baseline
                                        for sp in plan.sites.values())
        static = None
        if "+static" in name:
            static = static_scales(plan, plans.get("report"))
            row["static_sites"] = len(static)
            row["static_logit_change"] = _static_change(model, plan, static, batch)
        # served as deployed: FP8 weights only where the forward is FP8 (the bf16 copies
        # are freed, so peak memory counts what a server holds)
        apply(model, plan, inference=True, drop_weights=True, static_scales=static)
        row["hp_weights_dropped"] = sum(getattr(m, "weight", True) is None
                                        for m in model.modules())
    row["fp8_sites"] = _count_fp8(model)
    if device.type == "cuda":
        gc.collect()  # what earlier variants or tuning trials left in cycles is not counted
        torch.cuda.reset_peak_memory_stats(device)
    step = _make_forward(model, batch, cfg, device, _graphs(name, device))
    row.update(_time_steps(step, device, cfg.steps, cfg.warmup))
    if device.type == "cuda":
        row["peak_mem_gb"] = peak_memory_gb(torch.cuda.max_memory_allocated(device), step)
        if f"infer:{name}" in cfg.profile:
            row["profile"] = profile_breakdown(step, ops=cfg.profile_ops)
    row["samples_per_s"] = batch.labels.shape[0] / (row["median_ms"] / 1e3)
    return row


RATIO_REFS = ("bf16", "bf16+mods", "bf16+mods+graphs", "bf16+mods+merge+graphs")
"""the baselines every row's speedup is given against (those measured in the run)"""


def static_scales(plan, report) -> Dict[str, float]:
    """``+static``: a static input amax (the Probe's observed ``act.amax``) for every site
    whose FP8 forward kernel takes one (PyTorch-quantized kernels; LoKA's Triton and
    FBGEMM kernels quantize inside and stay dynamic)."""
    from .dispatch import amax_from_report
    from .dispatch.linear import takes_static_input_scale
    from .kernels import registry

    if report is None:
        raise ValueError("+static needs the Probe's statistics: probe in this run, or a "
                         ".report.json beside --plan")
    amax = amax_from_report(report)
    out = {}
    for site, sp in plan.sites.items():
        name = sp.kernel("fwd", plan.baseline)
        if name == plan.baseline or site not in amax:
            continue
        if takes_static_input_scale(registry.get(name)):
            out[site] = amax[site]
    return out


def _static_change(model, plan, static: Dict[str, float], batch) -> Optional[float]:
    """Relative change of the logits on ``batch`` from dynamic to static activation scales
    (the same serving plan, eager): what the static scales cost in output accuracy."""
    from .dispatch import apply, unapply

    if not static:
        return None
    with torch.inference_mode():
        apply(model, plan, inference=True)
        dynamic = model(batch).double()
        apply(model, plan, inference=True, static_scales=static)
        fixed = model(batch).double()
    unapply(model)
    return float((fixed - dynamic).norm() / dynamic.norm().clamp(min=1e-30))


def _ratios(rows: List[dict]) -> None:
    by = {r["variant"]: r for r in rows if "median_ms" in r}
    for r in rows:
        if "median_ms" not in r:
            continue
        for ref in RATIO_REFS:
            if ref in by:
                r[f"speedup_vs_{ref}"] = by[ref]["median_ms"] / r["median_ms"]


def _inductor_settings() -> dict:
    """Inductor's settings and the float32 matmul precision, to restore after a row."""
    import torch._inductor.config as inductor_config
    return {"inductor": inductor_config.get_config_copy(),
            "matmul": torch.get_float32_matmul_precision()}


def _restore_inductor_settings(saved: dict) -> dict:
    """Undo what a row changed of the settings (torchao's ``quantize_`` sets Inductor
    options for the whole process); returns the changes as {name: value the row set}."""
    import torch._inductor.config as inductor_config
    now = inductor_config.get_config_copy()
    changed = {k: v for k, v in now.items()
               if k in saved["inductor"] and v != saved["inductor"][k]
               and isinstance(v, (bool, int, float, str, type(None)))}
    inductor_config.load_config(saved["inductor"])
    if torch.get_float32_matmul_precision() != saved["matmul"]:
        changed["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(saved["matmul"])
    return changed


def run(cfg: BenchConfig, progress: Callable[[str], None] = print) -> dict:
    _check_profile(cfg)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but no CUDA device is visible")
    torch.backends.cuda.matmul.allow_tf32 = True
    env = environment(device)
    out = cfg.out or _default_out(env)
    result = {"schema": "loka.bench", "version": 1, "env": env,
              "config": {k: v for k, v in cfg.__dict__.items()}, "train": [], "infer": [],
              "notes": [], "checks": {"oracle": {}, "search_gap": []}}
    if not caps.torchao_available():
        skipped = [v for v in cfg.train_variants + cfg.infer_variants if v.startswith("torchao")]
        if skipped:
            result["notes"].append("torchao is not installed: torchao rows skipped")
        cfg.train_variants = [v for v in cfg.train_variants if not v.startswith("torchao")]
        cfg.infer_variants = [v for v in cfg.infer_variants if not v.startswith("torchao")]
    shared: dict = {"out": out, "progress": progress}
    for mode, names, fn in (("train", cfg.train_variants, run_train_variant),
                            ("infer", cfg.infer_variants, run_infer_variant)):
        for name in names:
            progress(f"[{mode}] {name} ...")
            t0 = time.perf_counter()
            counters = torch._dynamo.utils.counters
            counters.clear()
            phases = getattr(torch._dynamo.utils, "compilation_time_metrics", None)
            if isinstance(phases, dict):
                phases.clear()
            inductor = _inductor_settings()
            try:
                row = fn(name, cfg, device, shared)
            except Exception as e:  # noqa: BLE001 - one variant's failure must not lose the rest
                row = {"variant": name, "mode": mode, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc(limit=8)}
            row["wall_s"] = time.perf_counter() - t0
            changed = _restore_inductor_settings(inductor)
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
            _ratios(result[mode])
            progress("   " + _row_text(row))
            _release_memory(device)  # the finished variant's, before the next one's peak
            torch._dynamo.reset()
            result["checks"] = checks(shared, result)  # a run cut short keeps them too
            _write(result, out)
    _save_plans(shared, result, out)
    if cfg.plot:
        try:
            result["chart"] = plot(result, out.removesuffix(".json") + ".png")
        except Exception as e:  # noqa: BLE001 - no chart (no matplotlib, no rows) is no failure
            result.setdefault("notes", []).append(f"no chart: {type(e).__name__}: {e}")
    _write(result, out)
    result["out"] = out
    return result


def checks(shared: dict, result: dict) -> dict:
    """What the run says about the Dispatch itself: ``oracle``, each Probe-made plan
    audited against its report (:func:`loka.dispatch.audit`: no kernel within the budget
    faster than the one chosen, at any site and role); ``search_gap``, each ``+tuned`` row
    against its ``+search`` twin (the best fixed choice per shape group by exhaustive
    whole-step timing): the tuned step's speed as a fraction of the searched one's, and
    whether it is within 3% of it (``within_3pct``)."""
    from .dispatch import audit

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
            twin = by.get(name.replace("+search", "+tuned")) if "+search" in name else None
            if twin is None:
                continue
            frac = row["median_ms"] / twin["median_ms"]
            out["search_gap"].append({"mode": mode, "tuned": twin["variant"], "search": name,
                                      "tuned_ms": twin["median_ms"], "search_ms": row["median_ms"],
                                      "tuned_speed_vs_search": frac, "within_3pct": frac >= 0.97})
    return out


def run_sweep(cfg: BenchConfig, batch_sizes: List[int],
              progress: Callable[[str], None] = print) -> dict:
    """The same variants at several batch sizes (where FP8 starts to pay): one full
    :func:`run` per size, written to ``<out>.b<size>.json`` (each with its own Probe pass
    and plans, since the GEMM shapes change with the batch), and a summary
    ``<out>`` with every variant's time and speedups per size, plus a chart."""
    if not batch_sizes or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be positive integers, got {batch_sizes}")
    env = environment(torch.device(cfg.device))
    out = cfg.out or _default_out(env).removesuffix(".json") + ".sweep.json"
    stem = out.removesuffix(".json")
    sweep = {"schema": "loka.bench-sweep", "version": 1, "env": env,
             "config": {k: v for k, v in cfg.__dict__.items()}, "batch_sizes": list(batch_sizes),
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
        _write(sweep, out)
    if cfg.plot:
        try:
            sweep["chart"] = plot_sweep(sweep, stem + ".png")
        except Exception as e:  # noqa: BLE001 - no chart is no failure: say why
            sweep.setdefault("notes", []).append(f"no chart: {type(e).__name__}: {e}")
        _write(sweep, out)
    sweep["out"] = out
    return sweep


def plot_sweep(sweep: dict, path: str, ref: str = "bf16+mods") -> str:
    """Speedup against ``ref`` (else bf16) per variant across batch sizes, one panel per
    mode that has such points."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for mode in ("train", "infer"):
        for r in dict.fromkeys((ref, "bf16")):
            key = f"speedup_vs_{r}"
            lines = {v: sorted((int(b), row[key]) for b, row in by_b.items() if key in row)
                     for v, by_b in sweep[mode].items()}
            lines = {v: pts for v, pts in lines.items() if pts}
            if lines:
                panels.append((mode, r, lines))
                break
    if not panels:
        raise ValueError(f"nothing to plot: no speedup against {ref} or bf16")
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (mode, r, lines) in zip(axes[0], panels):
        for variant, pts in lines.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=variant)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"speedup vs {r}")
        ax.set_title("training step" if mode == "train" else "inference forward")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _row_text(row: dict) -> str:
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
    lines = []
    for mode in ("train", "infer"):
        lines.append(f"== {mode} ({result['config']['model']} {result['config']['preset']}, "
                     f"{result['env'].get('gpu', result['env']['device'])}) ==")
        lines += [_row_text(r) for r in result[mode]]
    return "\n".join(lines)


def _default_out(env: dict) -> str:
    gpu = env.get("gpu", "cpu").replace(" ", "-").replace("/", "-")
    date = env["date"][:10]
    return os.path.join("bench", "results", f"{date}-{gpu}-{env.get('commit', 'unknown')}.json")


def _write(result: dict, path: str) -> None:
    from .jsonio import atomic_write_text

    atomic_write_text(path, json.dumps(result, indent=1, default=str))


def plot_panels(result: dict) -> List[Tuple[str, str, List[dict]]]:
    """``(mode, reference, rows)`` for each mode with measured rows: the rows' speedups
    against the first baseline of :data:`RATIO_REFS` that the run measured in that mode."""
    panels = []
    for mode in ("train", "infer"):
        for ref in RATIO_REFS:
            rows = [r for r in result.get(mode, []) if f"speedup_vs_{ref}" in r]
            if rows:
                panels.append((mode, ref, rows))
                break
    return panels


def plot(result: dict, path: str) -> str:
    """A bar chart of each variant's speedup, one panel per mode that has rows (against
    bf16, or the first baseline the run has: :func:`plot_panels`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(result)
    if not panels:
        raise ValueError("nothing to plot: no row has a speedup against a measured baseline")
    heights = max(len(rows) for _, _, rows in panels)
    # room for the longest variant name left of the bars, so titles never run off the page
    label_in = 0.075 * max(len(r["variant"]) for _, _, rows in panels for r in rows)
    fig, axes = plt.subplots(1, len(panels), figsize=((4.5 + label_in) * len(panels),
                                                      1.5 + 0.45 * heights), squeeze=False)
    for ax, (mode, ref, rows) in zip(axes[0], panels):
        names = [r["variant"] for r in rows]
        vals = [r[f"speedup_vs_{ref}"] for r in rows]
        colors = ["tab:green" if n.startswith("loka") else "tab:orange" if n.startswith("torchao")
                  else "tab:blue" for n in names]
        ax.barh(names, vals, color=colors)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlim(0, 1.15 * max(max(vals), 1.0))  # room for the value printed after each bar
        ax.set_title("training step" if mode == "train" else "inference forward")
        ax.set_xlabel(f"speedup vs {ref} (median step time)")
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    fig.suptitle(f"{result['config']['model']} {result['config']['preset']} on "
                 f"{result['env'].get('gpu', result['env']['device'])} ({result['env']['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- command line -----------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="wukong", help="reference model (default: wukong)")
    p.add_argument("--preset", default=None, help="preset (default: paper on GPU, tiny on CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-sizes", default=None,
                   help="comma list: run every variant at each batch size (a sweep); "
                        "writes one result per size and a summary")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up steps per variant")
    p.add_argument("--no-compile", action="store_true", help="run eager (default: torch.compile)")
    p.add_argument("--train-variants", default=None,
                   help=f"comma list, or 'none' (default: all of {','.join(TRAIN_VARIANTS)})")
    p.add_argument("--infer-variants", default=None,
                   help=f"comma list, or 'none' (default: all of {','.join(INFER_VARIANTS)})")
    p.add_argument("--max-error", type=float, default=0.2, help="LoKA plan budget (MERE)")
    p.add_argument("--min-speedup", type=float, default=1.05, help="LoKA plan speed threshold")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<gpu>-<commit>.json)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument("--plan", default=None,
                   help="apply this plan JSON in the LoKA variants instead of probing")
    p.add_argument("--plans", default="",
                   help="named plans for variants loka@<name>...: name=path[,name=path]")
    p.add_argument("--probe-kernels", default=None,
                   help="comma list of kernels the Probe measures, or 'all' "
                        f"(default: {','.join(PROBE_KERNELS)})")
    p.add_argument("--profile", default="",
                   help="comma list of variants to profile by kernel class (CUDA); "
                        "infer:<variant> for an inference variant")
    p.add_argument("--profile-ops", action="store_true",
                   help="profiles also attribute GPU time to launching ops and stack frames")


MODIFIERS = ("+tuned", "+search", "+plain-inductor", "+triton-emb", "+token-major",
             "+fused-norm", "+static")
"""suffixes that may be added to any listed variant (+automerge stands for +merge)"""


def _base_variant(name: str) -> str:
    """``name`` without the :data:`MODIFIERS` (and +automerge read as +merge)."""
    for suffix in MODIFIERS:
        name = name.replace(suffix, "")
    return name.replace("+automerge", "+merge")


def _variants(text: Optional[str], default, allowed) -> List[str]:
    if text is None:
        return list(default)
    if text.strip() == "none":
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed and not n.startswith("loka-uniform-")
           and _base_variant(n) not in allowed and not (n.startswith("loka@") and plan_name(n))]
    if bad:
        raise ValueError(f"unknown variant(s) {bad}; choose from {list(allowed)}")
    return names


def _named_plans(text: str) -> Dict[str, str]:
    plans = {}
    for item in (t.strip() for t in (text or "").split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip() or "+" in name or "@" in name:
            raise ValueError(f"--plans takes name=path items (names without + or @), got {item!r}")
        plans[name.strip()] = path.strip()
    return plans


def config_from_args(args) -> BenchConfig:
    device = getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    on_cpu = torch.device(device).type == "cpu"
    preset = args.preset or ("tiny" if on_cpu else "paper")
    return BenchConfig(
        model=args.model, preset=preset, device=device, batch_size=args.batch_size,
        steps=args.steps, warmup=args.warmup,
        compile=not args.no_compile and not on_cpu,
        train_variants=_variants(args.train_variants, TRAIN_VARIANTS, TRAIN_VARIANTS),
        infer_variants=_variants(args.infer_variants, INFER_VARIANTS, INFER_VARIANTS),
        max_error=args.max_error, min_speedup=args.min_speedup, out=args.out,
        plot=not args.no_plot, plan=args.plan, plans=_named_plans(args.plans),
        probe_kernels=(PROBE_KERNELS if args.probe_kernels is None else None
                       if args.probe_kernels.strip() == "all"
                       else tuple(k.strip() for k in args.probe_kernels.split(",") if k.strip())),
        profile=tuple(v.strip() for v in args.profile.split(",") if v.strip()),
        profile_ops=args.profile_ops)


def _check_profile(cfg: BenchConfig) -> None:
    """Every ``--profile`` entry names a variant of the run (a typo would profile nothing)."""
    known = set(cfg.train_variants) | {f"train:{v}" for v in cfg.train_variants} | {
        f"infer:{v}" for v in cfg.infer_variants}
    unknown = [p for p in cfg.profile if p not in known]
    if unknown:
        raise ValueError(f"--profile names no variant of this run: {unknown} (training "
                         f"variants as train:<name> or <name>, inference ones as infer:<name>)")


def run_from_args(args) -> dict:
    cfg = config_from_args(args)
    if getattr(args, "batch_sizes", None):
        try:
            sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
        except ValueError:
            raise ValueError(f"--batch-sizes takes integers, got {args.batch_sizes!r}") from None
        sweep = run_sweep(cfg, sizes)
        print(f"wrote {sweep['out']}")
        return sweep
    result = run(cfg)
    print(table(result))
    print(f"wrote {result['out']}")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/run_all.py", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None)
    add_arguments(p)
    run_from_args(p.parse_args(argv))
    return 0
