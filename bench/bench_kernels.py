"""FP8 GEMM kernel sweep: every registered kernel available on the GPU against bf16.

Shapes: a representative grid (M 1024..65536, K and N 64..8192) and every GEMM of the
Wukong paper configuration (batch 4096, n=64 embeddings of d=256, k=32, nF=nL=32, FM MLP
2048 -> 2048 -> 8192, top MLP 16384 -> 2048 -> 1024 -> 1; the FM projection and the LCB
are Linears over the n axis of (B*d, n) = (1048576, 64) -> 32) in each role (fwd, dgrad,
wgrad, with the operand layouts loka.Linear passes; the merged FM projection + LCB of the
benchmark's ``+merge`` rows too). Times include the quantization of both operands (CUDA
graphs, median; ``loka.timing``); forward GEMMs are also timed with the weight
quantized once ("weight-q"), the inference and fused-producer case, and with both operands
pre-quantized ("gemm only"). Kernels whose quantization is PyTorch ops (cuBLAS through
``torch._scaled_mm``, torchao) are timed under ``torch.compile`` specialized to the shape,
as the Probe times them and as they run inside a compiled model, where Inductor fuses the
quantization (``--eager`` times them eagerly instead); LoKA's Triton kernels and FBGEMM's
quantize in their own kernels and are called as they are. Errors: relative Frobenius and
MERE against a float32 (TF32 off) product.

The Wukong cases time every registered kernel; the grid times one kernel per library and
scaling (``GRID_KERNELS``) to keep the sweep inside one GPU call (``--grid-kernels all``
for every kernel). The JSON is rewritten after every case, so a sweep cut short by a time
limit keeps what it measured.

    PYTHONPATH=. python bench/bench_kernels.py [--quick] [--out bench/results/kernels_h200.json]

Prints which library wins where and writes JSON plus a PNG plot next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import loka
from loka.config import role_shape
from loka.kernels import capabilities as caps
from loka.numerics import mere, relative_frobenius
from loka.jsonio import atomic_write_text
from loka.probe.measure import compiled_call, compiles_for_timing
from loka.timing import time_fn

WUKONG = {  # site: (M tokens, in_features K, out_features N) of the forward GEMM
    "fm_projection / lcb": (1048576, 64, 32),
    "merged fm_projection+lcb": (1048576, 64, 64),
    "fm_mlp.0": (4096, 2048, 2048),
    "fm_mlp.1": (4096, 2048, 8192),
    "top_mlp.0": (4096, 16384, 2048),
    "top_mlp.1": (4096, 2048, 1024),
    "top_mlp.2": (4096, 1024, 1),
}
GRID_M = (1024, 8192, 65536)
GRID_KN = ((64, 64), (256, 256), (1024, 1024), (4096, 4096), (8192, 8192), (512, 2048),
           (2048, 512), (64, 1024), (1024, 64))
GRID_KERNELS = ("cublas-tensorwise-fastacc", "cublas-rowwise-fastacc",
                "triton-rowwise-cublas-fastacc", "triton-tensorwise-cublas-fastacc",
                "triton-rowwise-fastacc", "triton-blockwise", "torchao-tensorwise-fastacc",
                "torchao-rowwise-fastacc", "fbgemm-rowwise", "fbgemm-tensorwise")
"""one kernel per library and scaling (fast accumulation where there is a choice)"""
TARGET = (4096, 4096, 4096)


def grid_shapes(quick: bool):
    out = []
    for m in GRID_M:
        for k, n in GRID_KN:
            if m * k * n > 2 ** 40:  # keep the sweep inside its time budget
                continue
            out.append((m, k, n))
    if quick:
        out = [s for s in out if s[0] in (8192, 65536) and s[1] == s[2] and s[1] in (256, 1024)]
    return out


def operands(role: str, m: int, k: int, n: int, device):
    """(a, b) of the GEMM (M, K) @ (K, N) with the layouts loka.Linear passes for ``role``."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    if role == "fwd":  # b = Wᵀ, a transposed view of the (N, K) weight
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
    else:  # dgrad: b = W (row-major); wgrad: a = dyᵀ (made contiguous), b = x (row-major)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    if role == "dgrad":
        a = a * 1e-3
    return a, b


def fp8_kernels(device):
    return [k for k in loka.kernels.available(device, fp8_only=True) if not k.is_emulated]


class Caller:
    """``caller(kern)(a, b)``: the kernel as the Probe times it: under ``torch.compile``
    (one compiled function per kernel, specialized to each shape) when its quantization is
    PyTorch ops that Inductor fuses, else called as it is."""

    def __init__(self, device, compiled: bool) -> None:
        self.device, self.compiled, self.fns = device, compiled, {}

    def is_compiled(self, kern) -> bool:
        return self.compiled and compiles_for_timing(kern, self.device, "auto")

    def __call__(self, kern):
        if not self.is_compiled(kern):
            return lambda a, b: kern(a, b, torch.bfloat16)
        if kern.name not in self.fns:
            self.fns[kern.name] = compiled_call(kern, torch.bfloat16)
        return self.fns[kern.name]


def measure(case, kernels, device, budget_ms, errors=True, caller=None):
    """Time bf16 and every kernel that supports the case; errors vs a float32 product."""
    role, (m, k, n) = case["role"], case["shape"]
    caller = caller or Caller(device, compiled=False)
    a, b = operands(role, m, k, n, device)
    bf16 = time_fn(lambda: torch.mm(a, b), device, budget_ms=budget_ms).median_us
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch.mm(a.float(), b.float()) if errors else None
    case.update(bf16_us=bf16, kernels={})
    for kern in kernels:
        ok = kern.supports(device, m, k, n, role=role)
        if not ok:
            continue
        rec = {"library": kern.library, "compiled": caller.is_compiled(kern)}
        call = caller(kern)
        try:
            with torch.no_grad():
                rec["us"] = time_fn(lambda: call(a, b), device, budget_ms=budget_ms).median_us
            rec["speedup"] = bf16 / rec["us"]
            if role == "fwd" and kern.quantize_b is not None:
                qb = kern.quantize_b(b)
                with torch.no_grad():
                    rec["weight_q_us"] = time_fn(lambda: call(a, qb), device,
                                                 budget_ms=budget_ms).median_us
                rec["weight_q_speedup"] = bf16 / rec["weight_q_us"]
                qa = kern.quantize_a(a)
                rec["gemm_only_us"] = time_fn(lambda: kern(qa, qb, torch.bfloat16), device,
                                              budget_ms=budget_ms).median_us
            if errors:
                y = kern(a, b, torch.bfloat16)
                rec["relfro"] = relative_frobenius(y, ref)
                rec["mere"] = mere(y, ref)
        except Exception as e:  # noqa: BLE001 - a kernel that fails is reported, not fatal
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        case["kernels"][kern.name] = rec
    del a, b, ref
    return case


def best(case, pred, key="us"):
    """(name, record) of the fastest kernel satisfying ``pred(name, rec)``."""
    cands = [(n, r) for n, r in case["kernels"].items() if key in r and pred(n, r)]
    return min(cands, key=lambda nr: nr[1][key]) if cands else (None, None)


def summarize(cases):
    rows, lib_wins = [], {}
    for c in cases:
        name, rec = best(c, lambda n, r: True)
        libs = {}
        for lib in sorted({r["library"] for r in c["kernels"].values()}):
            ln, lr = best(c, lambda n, r, lib=lib: r["library"] == lib)
            if ln:
                libs[lib] = {"kernel": ln, "speedup": lr["speedup"]}
        winner = name if rec and rec["speedup"] > 1.0 else "bf16"
        lib = rec["library"] if winner != "bf16" else "bf16"
        lib_wins[lib] = lib_wins.get(lib, 0) + 1
        rows.append({"label": c["label"], "role": c["role"], "shape": c["shape"], "winner": winner,
                     "winner_speedup": rec["speedup"] if rec else None, "by_library": libs})
    return rows, lib_wins


def targets(cases):
    out = {}
    wk = [c for c in cases if c["label"].startswith("wukong")]
    ours, theirs = [], []
    for c in wk:
        on, orec = best(c, lambda n, r: n.startswith("triton-rowwise"))
        tn, trec = best(c, lambda n, r: r["library"] == "torchao")
        if orec and trec:
            ours.append({"case": f'{c["label"]} {c["role"]}', "loka": on, "loka_speedup": orec["speedup"],
                         "torchao": tn, "torchao_speedup": trec["speedup"],
                         "loka_vs_torchao": trec["us"] / orec["us"]})
    out["wukong_fused_rowwise_vs_torchao_best"] = ours
    tgt = [c for c in cases if tuple(c["shape"]) == TARGET and c["role"] == "fwd"]
    if tgt:
        c = tgt[0]
        wn, wrec = best(c, lambda n, r: r["library"] == "triton", key="weight_q_us")
        bn, brec = best(c, lambda n, r: r["library"] == "triton")
        out["4096^3"] = {
            "bf16_us": c["bf16_us"],
            "weight_quantized_once": {"kernel": wn, "us": wrec and wrec["weight_q_us"],
                                      "speedup": wrec and wrec["weight_q_speedup"],
                                      "target": 1.5, "met": bool(wrec and wrec["weight_q_speedup"] >= 1.5)},
            "both_quantized": {"kernel": bn, "us": brec and brec["us"],
                               "speedup": brec and brec["speedup"]}}
    return out


def plot(cases, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libs = sorted({r["library"] for c in cases for r in c["kernels"].values()})
    fig, axes = plt.subplots(2, 1, figsize=(14, 9))
    for ax, sel, title in ((axes[0], lambda c: c["label"].startswith("wukong"), "Wukong GEMMs by role"),
                           (axes[1], lambda c: not c["label"].startswith("wukong"), "shape grid")):
        sub = [c for c in cases if sel(c)]
        width = 0.8 / max(1, len(libs))
        for i, lib in enumerate(libs):
            vals = []
            for c in sub:
                _, rec = best(c, lambda n, r, lib=lib: r["library"] == lib)
                vals.append(rec["speedup"] if rec else 0.0)
            ax.bar([j + i * width for j in range(len(sub))], vals, width, label=lib)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 for j in range(len(sub))])
        ax.set_xticklabels([f'{c["role"]} {"x".join(map(str, c["shape"]))}' for c in sub],
                           rotation=70, fontsize=6)
        ax.set_ylabel("speedup vs bf16 (quantization included)")
        ax.set_title(title)
        ax.legend(fontsize=7, ncol=len(libs))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path (default bench/results/kernels_<gpu>.json)")
    p.add_argument("--quick", action="store_true", help="Wukong shapes, 4096^3 and a few grid shapes")
    p.add_argument("--budget-s", type=float, default=210.0, help="stop adding cases after this")
    p.add_argument("--case-budget-ms", type=float, default=10.0, help="timing budget per kernel")
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--grid-kernels", default=",".join(GRID_KERNELS),
                   help="kernels timed on the grid shapes: comma-separated names or 'all'")
    p.add_argument("--cases", choices=("all", "wukong", "grid"), default="all",
                   help="which cases: 4096^3 and the Wukong GEMMs, the grid, or all (default)")
    p.add_argument("--eager", action="store_true",
                   help="time every kernel eagerly (no torch.compile for PyTorch-op quantization)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().split()[0]
    out = Path(args.out or f"bench/results/kernels_{gpu}.json")
    kernels = fp8_kernels(device)
    if args.kernels:
        wanted = set(args.kernels.split(","))
        unknown = wanted - {k.name for k in loka.kernels.registry.all_kernels()}
        if unknown:
            p.error(f"unknown kernels: {sorted(unknown)}")
        kernels = [k for k in kernels if k.name in wanted]
    grid_kernels = kernels if args.grid_kernels == "all" else \
        [k for k in kernels if k.name in set(args.grid_kernels.split(","))]
    caller = Caller(device, compiled=not args.eager)
    cases = []
    if args.cases in ("all", "wukong"):
        cases.append({"label": "target", "role": "fwd", "shape": list(TARGET)})  # most important first
        for site, (m, k, n) in WUKONG.items():
            for role in ("fwd", "dgrad", "wgrad"):
                cases.append({"label": f"wukong {site}", "role": role,
                              "shape": list(role_shape(role, m, k, n))})
    if args.cases in ("all", "grid"):
        cases += [{"label": "grid", "role": "fwd", "shape": list(s)} for s in grid_shapes(args.quick)]
    t0, done = time.perf_counter(), []

    def write():
        rows, lib_wins = summarize(done)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "capabilities": caps.summary(device), "kernels": [k.name for k in kernels],
                  "grid_kernels": [k.name for k in grid_kernels],
                  "timing": "eager" if args.eager else
                  "torch.compile(dynamic=False) for cublas and torchao, eager for the others",
                  "seconds": round(time.perf_counter() - t0, 1), "cases": done, "winners": rows,
                  "library_wins": lib_wins, "targets": targets(done),
                  "unmeasured": [c for c in cases if c not in done]}
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, json.dumps(result, indent=1, default=str))
        return result

    for case in cases:
        if time.perf_counter() - t0 > args.budget_s:
            print(f"time budget reached: {len(cases) - len(done)} cases not measured")
            break
        measure(case, grid_kernels if case["label"] == "grid" else kernels, device,
                args.case_budget_ms, caller=caller)
        done.append(case)
        write()
        name, rec = best(case, lambda n, r: True)
        print(f'{case["label"]:26s} {case["role"]:5s} {"x".join(map(str, case["shape"])):>18s} '
              f'bf16 {case["bf16_us"]:9.1f} us  best {name} {rec["speedup"] if rec else float("nan"):.2f}x '
              f'({time.perf_counter() - t0:.0f} s)', flush=True)
    result = write()
    print("\nwins by library (fastest kernel per case, bf16 when none beats it):", result["library_wins"])
    print(json.dumps(result["targets"], indent=1, default=str))
    try:
        plot(done, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
