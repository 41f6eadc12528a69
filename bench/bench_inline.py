"""Where the time of a quantization-bound FP8 GEMM goes: the inline-quantizing GEMM taken apart.

For the GEMMs whose FP8 path is bound by quantization (the FM projection's and the merged
projection's weight gradients of the Wukong ``paper`` model: M 32-64, K 2**20, N 64, and a
contrast case), this times, side by side with CUDA graphs (``loka.timing.time_fn``,
median):

* ``bf16``: ``torch.mm`` on the bf16 operands;
* ``amax_a`` / ``amax_b``: the amax pass of each operand alone (stage 1 of the two-stage
  quantizer, :func:`~loka.kernels.triton.quantize.amax_partials`), autotuned and with each
  tile config forced, with the bandwidth it reaches;
* ``inline``: :func:`~loka.kernels.triton.gemm_rowwise.gemm_rowwise_inline` (both amax
  passes and the GEMM), autotuned and with each GEMM tile config forced, so
  ``inline - amax_a - amax_b`` is the GEMM with its in-load casts;
* ``two_step``: :func:`quantize_rowwise` of both operands, then :func:`gemm_rowwise`.

Operands have the layouts ``loka.Linear`` passes for a weight gradient (``a = dyᵀ`` made
contiguous, ``b = x`` row-major), as in ``bench/bench_kernels.py``.

    PYTHONPATH=. python bench/bench_inline.py --out bench/results/inline_breakdown.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from loka.jsonio import atomic_write_text
from loka.timing import time_fn

CASES = {  # name: (M, K, N) of the wgrad GEMM
    "fm_projection wgrad": (32, 1 << 20, 64),
    "merged fm_projection+lcb wgrad": (64, 1 << 20, 64),
    "top_mlp.2 wgrad": (1, 4096, 1024),
    "top_mlp.1 wgrad": (1024, 4096, 2048),
}


def _cfg_name(cfg) -> str:
    kw = ",".join(f"{k[6:] if k.startswith('BLOCK_') else k}={v}" for k, v in cfg.kwargs.items()
                  if k != "GROUP_M")
    return f"{kw},w={cfg.num_warps},s={cfg.num_stages}"


@contextlib.contextmanager
def forced(tuner, attr_owner=None, attr=None, configs=None):
    """Within the block ``tuner`` (a Triton Autotuner) tunes over ``configs`` only: its own
    config list, or the module attribute ``attr`` its prune reads, is replaced, and its
    cache of tuned choices emptied before and after."""
    saved = (tuner.configs, getattr(attr_owner, attr) if attr else None, dict(tuner.cache))
    tuner.cache.clear()
    if attr:
        setattr(attr_owner, attr, configs)
    else:
        tuner.configs = configs
    try:
        yield
    finally:
        tuner.configs = saved[0]
        if attr:
            setattr(attr_owner, attr, saved[1])
        tuner.cache.clear()
        tuner.cache.update(saved[2])


def measure(name, m, k, n, budget_ms, device):
    from loka.kernels.triton import gemm_rowwise as G
    from loka.kernels.triton import quantize as Q

    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)

    def t(fn):
        try:
            return round(time_fn(fn, device, budget_ms=budget_ms).median_us, 2)
        except Exception as e:  # noqa: BLE001 - a config that fails is reported
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

    rec = {"case": name, "M": m, "K": k, "N": n, "bf16_us": t(lambda: torch.mm(a, b))}
    for key, view in (("amax_a", a), ("amax_b", b.t())):
        nbytes = view.numel() * view.element_size()
        tuned = t(lambda v=view: Q.amax_partials(v))
        per = {}
        kern = Q.rowwise_amax_split_kernel
        row_major = view.stride(1) == 1
        for cfg in Q._prune_split(Q._SPLIT_CONFIGS, {"R": view.shape[0], "C": view.shape[1],
                                                     "stride_xc": view.stride(1)}):
            with forced(kern, configs=[cfg]):
                per[_cfg_name(cfg)] = t(lambda v=view: Q.amax_partials(v))
        rec[key] = {"us": tuned, "GB_per_s": round(nbytes / tuned / 1e3, 1)
                    if isinstance(tuned, float) else None, "configs": per,
                    "nsplit_span": Q.split_plan(view.shape[0], view.shape[1], not row_major)}
    rec["inline_us"] = t(lambda: G.gemm_rowwise_inline(a, b))
    per = {}
    meta = {"QA_MAX": 448.0, "QB_MAX": 448.0}
    tm, tn = (n, m) if G.inline_transposed(m, n) else (m, n)  # the shape the kernel sees
    for cfg in G._prune(G.GEMM_CONFIGS, {"M": tm, "N": tn, "K": k}, **meta):
        with forced(G.rowwise_gemm_kernel, G, "INLINE_CONFIGS", [cfg]):
            per[_cfg_name(cfg)] = t(lambda: G.gemm_rowwise_inline(a, b))
    rec["inline_configs"] = per
    rec["inline_split"] = G.k_ranges(m, n, k, tile=64, unit=G.INLINE_SPLIT_UNIT)

    def two_step(out_dtype=torch.bfloat16):
        qa, sa = Q.quantize_rowwise(a)
        qb, sb = Q.quantize_rowwise(b.t())
        return G.gemm_rowwise(qa, qb.t(), sa, sb.t(), out_dtype=out_dtype)

    rec["two_step_us"] = t(two_step)
    if isinstance(rec["inline_us"], float) and all(isinstance(rec[x]["us"], float)
                                                   for x in ("amax_a", "amax_b")):
        rec["inline_gemm_part_us"] = round(rec["inline_us"] - rec["amax_a"]["us"]
                                           - rec["amax_b"]["us"], 2)
        nbytes = (a.numel() + b.numel()) * 2
        rec["inline_gemm_part_GB_per_s"] = round(nbytes / rec["inline_gemm_part_us"] / 1e3, 1)
    y = G.gemm_rowwise_inline(a, b, out_dtype=torch.float32)
    ref = two_step(torch.float32)
    rec["inline_vs_two_step_max_rel"] = float(((y - ref).abs().max() / ref.abs().max()).item())
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/inline_breakdown.json")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--budget-ms", type=float, default=8.0, help="timing budget per call")
    p.add_argument("--small", action="store_true",
                   help="K / 512, on the CPU under TRITON_INTERPRET=1 if there is no GPU "
                        "(a check of this script, not a measurement)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.small:
        print("bench_inline needs a CUDA GPU (or --small under TRITON_INTERPRET=1)")
        return 2
    names = args.cases.split(",")
    unknown = set(names) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; known: {sorted(CASES)}")
    out, t0, rows = Path(args.out), time.perf_counter(), []
    for name in names:
        m, k, n = CASES[name]
        rows.append(measure(name, m, max(256, k // 512) if args.small else k, n,
                            args.budget_ms, device))
        r = rows[-1]
        print(f"{name:32s} bf16 {r['bf16_us']} amax_a {r['amax_a']['us']} amax_b "
              f"{r['amax_b']['us']} inline {r['inline_us']} two-step {r['two_step_us']} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "small": args.small,
                  "seconds": round(time.perf_counter() - t0, 1), "cases": rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
