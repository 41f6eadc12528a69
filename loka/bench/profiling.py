"""Where a benchmarked step's GPU time goes: torch.profiler's kernels grouped by class
(bf16 GEMM, FP8 GEMM, quantization, Inductor's Triton kernels, embedding, optimizer), and
by the operator and stack frame that launched them."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["KERNEL_CLASSES", "QUANTIZE_KERNELS", "STEP_MARK", "attribute_idle", "gpu_idle",
           "host_self_us", "idle_intervals", "idle_summary", "kernel_class",
           "op_breakdown", "profile_breakdown", "timeline"]

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


def host_self_us(averages, steps: int, skip: Tuple[str, ...] = ()) -> Dict[str, float]:
    """Host events' own CPU time per step (us) from a profiler's ``key_averages()`` over
    ``steps`` steps: each CPU event's self time, keyed by name, those starting with one of
    ``skip`` left out."""
    own: Dict[str, float] = {}
    for evt in averages:
        if evt.device_type != DeviceType.CPU or not evt.self_cpu_time_total:
            continue
        if skip and evt.key.startswith(skip):
            continue
        own[evt.key] = own.get(evt.key, 0.0) + evt.self_cpu_time_total / steps
    return own


def profile_breakdown(step: Callable[[], object], steps: int = 5, top: int = 30,
                      ops: bool = False) -> dict:
    """GPU time per step by kernel class (and the ``top`` kernels) over ``steps`` steps of
    an already warmed-up ``step``, with torch.profiler. ``ops``: also by launching
    operator and stack frame (:func:`op_breakdown`; records the CPU side and stacks)."""
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=acts, with_stack=ops) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: Dict[str, float] = {}
    averages = prof.key_averages()
    for evt in averages:
        if ops and evt.device_type != DeviceType.CUDA:
            # with the CPU side recorded, its events also carry their kernels' time; their
            # own host time (what a step without graphs waits on) is host_self_us's
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
        cpu_self = host_self_us(averages, steps)
        out["host_us_per_step"] = sum(cpu_self.values())
        out["host_top_ops_us"] = sorted(([k, v] for k, v in cpu_self.items()),
                                        key=lambda kv: -kv[1])[:top]
    return out


# ------------------------------------------------------------------ where the GPU waits

STEP_MARK = "loka::timed_step"
"""the ``record_function`` label :func:`gpu_idle` puts around each profiled step"""

PROFILER_EVENTS = ("Activity Buffer Request",)
"""host events of the profiler's own work: idle time under them is the profiler's cost
(``profiler_us``), which unprofiled steps do not pay"""

_RUNTIME = ("cuda", "cu", "Pregraph bytecode")
"""host events named with their caller: the CUDA runtime's and driver's own calls (an idle
GPU under one of them waits for a launch, or a synchronization, that the enclosing
operator issued) and Dynamo's pregraph bytecode (run for the compiled region around it)"""


def _interval_union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    merged: List[Tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            if e > merged[-1][1]:
                merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    return merged


def idle_intervals(window: Tuple[float, float],
                   kernels: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The parts of ``window`` (start, end) in which no kernel of ``kernels`` runs, in
    order: before the first kernel, between kernels (overlapping kernels merged) and after
    the last one."""
    w0, w1 = window
    busy = _interval_union([(max(s, w0), min(e, w1)) for s, e in kernels if e > w0 and s < w1])
    gaps, t = [], w0
    for s, e in busy:
        if s > t:
            gaps.append((t, s))
        t = max(t, e)
    if w1 > t:
        gaps.append((t, w1))
    return gaps


def attribute_idle(gaps: List[Tuple[float, float]],
                   host: List[Tuple[str, float, float]]) -> Dict[str, Dict[str, float]]:
    """Which host work the GPU waited on: every instant of ``gaps`` given to the innermost
    host event (name, start, end) running then, and to the outermost one (the step's
    phase: a compiled graph's call, the optimizer, the loss's own operators). A CUDA
    runtime call is named with the operator that made it (``aten::mm > cudaLaunchKernel``).
    Time with no host event running is ``(no host event)``. Returns ``{"inner": {name:
    us}, "outer": {name: us}}``."""
    inner: Dict[str, float] = {}
    outer: Dict[str, float] = {}
    events = sorted(host, key=lambda h: (h[1], -h[2]))
    for g0, g1 in gaps:
        live = [h for h in events if h[2] > g0 and h[1] < g1]
        cuts = sorted({g0, g1, *(max(h[1], g0) for h in live), *(min(h[2], g1) for h in live)})
        for a, b in zip(cuts[:-1], cuts[1:]):
            if b <= a:
                continue
            mid = (a + b) / 2
            running = [h for h in live if h[1] <= mid < h[2]]
            if not running:
                inner["(no host event)"] = inner.get("(no host event)", 0.0) + b - a
                outer["(no host event)"] = outer.get("(no host event)", 0.0) + b - a
                continue
            running.sort(key=lambda h: h[2] - h[1])  # innermost first
            name = running[0][0]
            # the profiler's own work is its own phase too, whatever it interrupted
            top = name if name in PROFILER_EVENTS else running[-1][0]
            if name.startswith(_RUNTIME) and len(running) > 1:
                caller = next((h[0] for h in running[1:] if not h[0].startswith(_RUNTIME)),
                              None)
                name = f"{caller} > {name}" if caller else name
            inner[name] = inner.get(name, 0.0) + b - a
            outer[top] = outer.get(top, 0.0) + b - a
    return {"inner": inner, "outer": outer}


def idle_summary(windows: List[Tuple[float, float]], kernels: List[Tuple[float, float]],
                 host: List[Tuple[str, float, float]], top: int = 12) -> dict:
    """Per-step means over ``windows`` (one per step, from its call to the end of its
    synchronization): wall, GPU-busy and idle time (us), the idle time before the step's
    first kernel (``lead_us``, the host's start-up: Dynamo's guards, the wrapper's
    prologue, the first launch) and after its last (``tail_us``, the synchronization's
    latency), the part spent under the profiler's own events (``profiler_us``, left out of
    the rankings), and the ``top`` host events the idle time went to
    (:func:`attribute_idle`), innermost and outermost, largest first."""
    n = max(len(windows), 1)
    wall = busy = lead = tail = 0.0
    all_gaps: List[Tuple[float, float]] = []
    for w in windows:
        gaps = idle_intervals(w, kernels)
        wall += w[1] - w[0]
        idle = sum(e - s for s, e in gaps)
        busy += (w[1] - w[0]) - idle
        if gaps and gaps[0][0] == w[0]:
            lead += gaps[0][1] - gaps[0][0]
        if gaps and gaps[-1][1] == w[1] and (len(gaps) > 1 or gaps[0][0] != w[0]):
            tail += gaps[-1][1] - gaps[-1][0]
        all_gaps += gaps
    marked = [h for h in host if h[0] != STEP_MARK]
    parts = attribute_idle(all_gaps, marked)

    def ranked(d):
        return [[k[:160], round(v / n, 1)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])
                if v / n >= 0.05 and k not in PROFILER_EVENTS][:top]

    profiler = sum(v for k, v in parts["inner"].items() if k in PROFILER_EVENTS)
    return {"steps": len(windows), "wall_us": wall / n, "busy_us": busy / n,
            "idle_us": (wall - busy) / n, "lead_us": lead / n, "tail_us": tail / n,
            "profiler_us": profiler / n,
            "idle_by_host_event_us": ranked(parts["inner"]),
            "idle_by_phase_us": ranked(parts["outer"])}


def gpu_idle(step: Callable[[], object], steps: int = 3, top: int = 12) -> dict:
    """Where a CUDA step's wall time is not GPU time: ``steps`` synchronized steps of an
    already warmed-up ``step`` (as the timing loop runs them: each from an idle GPU),
    profiled host and device together; :func:`idle_summary` of the result. The profiler
    slows the host, so the idle time here is larger than in unprofiled steps; what it is
    spent under is the finding."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.autograd.profiler.record_function(STEP_MARK):
                step()
                torch.cuda.synchronize()
    kernels, host, windows = timeline(prof.events())
    return idle_summary(windows, kernels, host, top)


def timeline(events) -> Tuple[List[Tuple[float, float]], List[Tuple[str, float, float]],
                              List[Tuple[float, float]]]:
    """``(kernels, host, windows)`` from a profiler's events: the device's work (kernels,
    copies, memsets: CUDA events that are not user annotations, whose GPU-side spans of a
    ``record_function`` range cover the gaps between the kernels they hold), every host
    event as (name, start, end), and the :data:`STEP_MARK` windows in order (us)."""
    kernels, host, windows = [], [], []
    for evt in events:
        tr = evt.time_range
        if evt.device_type == DeviceType.CUDA:
            if not getattr(evt, "is_user_annotation", False):
                kernels.append((float(tr.start), float(tr.end)))
        elif evt.device_type == DeviceType.CPU:
            if evt.name == STEP_MARK:
                windows.append((float(tr.start), float(tr.end)))
            host.append((str(evt.name), float(tr.start), float(tr.end)))
    return kernels, host, sorted(windows)
