"""Where a benchmarked step's GPU time goes: torch.profiler's kernels grouped by class
(bf16 GEMM, FP8 GEMM, quantization, Inductor's Triton kernels, embedding, optimizer), and
by the operator and stack frame that launched them."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

__all__ = ["KERNEL_CLASSES", "QUANTIZE_KERNELS", "host_self_us", "kernel_class",
           "op_breakdown", "profile_breakdown"]

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
