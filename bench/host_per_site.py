"""The host's cost of one FP8 site inside a compiled step, per GEMM launcher.

A chain of ``--sites`` sites, each a pointwise producer (ReLU) and a GEMM with a (D, D)
weight, compiled as one graph (``torch.compile``, no CUDA graphs), the way a served model
with static activation scales runs: the cast to FP8 is written by the producer's kernel
(Inductor fuses it) and the GEMM reads the FP8 copy. Variants, one compiled graph each:

* ``bf16``: ``F.linear`` (cuBLAS through ATen's ``mm``);
* ``scaled_mm``: ``torch._scaled_mm`` tensorwise, fast accumulation (cuBLASLt through ATen);
* ``loka_scaled_mm``: the same through ``loka::scaled_mm`` and its Inductor lowering, as
  ``loka.Linear``'s cuBLAS kernels run under ``torch.compile``;
* ``triton_gemm``: LoKA's Triton FP8 GEMM (``loka::triton_gemm``, tensorwise scales),
  which Inductor launches from the code it generates;
* ``inductor_template``: ``torch._scaled_mm`` compiled with Inductor's own Triton GEMM
  templates only (``max_autotune_gemm``, backends ``TRITON``);
* ``bf16_modules`` and ``loka_modules``: the same chain as ``nn.ReLU`` and ``nn.Linear``
  modules, as written and with every forward on ``cublas-tensorwise-fastacc`` through
  ``loka.apply(..., inference=True)`` and a static input scale per Linear: the public
  path's host cost per site, Dynamo's guards on the modules included, beside the bare
  launchers' above.

Per variant: the wall time per step over back-to-back steps (median of ``--repeats``),
the GPU time per step (CUDA graphs, :func:`loka.timing.time_fn`), and the wall time per site
less bf16's. At a small ``--dim`` the steps are bound by the host, so the difference per site
is the launcher's host cost; at a large one (``--dim 2048 --rows 16384``) the GPU times say
what each GEMM costs the device. ``rel_err_vs_bf16`` (the output against the bf16 chain's)
only checks that every variant computes the same function. On a CPU (``--device cpu``) the
script runs as a check of itself; its times say nothing of a GPU's.

    PYTHONPATH=. python bench/host_per_site.py [--sites 8] [--rows 256] [--dim 256] \\
        [--out host_per_site.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from host_per_call import wall_per_call  # noqa: E402  (bench/, beside this script)
from loka.timing import time_fn  # noqa: E402

VARIANTS = ("bf16", "scaled_mm", "loka_scaled_mm", "triton_gemm", "inductor_template",
            "bf16_modules", "loka_modules")
FP8_MAX = 448.0


def chain(variant: str, weights: List[torch.Tensor], wq: List[torch.Tensor],
          x_scale: torch.Tensor, w_scales: List[torch.Tensor], rows: int = 0) -> Callable:
    """The step of ``variant``: ``h = relu(h); h = h @ W`` per site (fast accumulation on
    CUDA; the CPU build has none)."""
    inv = 1.0 / x_scale
    fast = x_scale.device.type == "cuda"

    def cast(h):
        return (h * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    if variant == "bf16":
        def step(x):
            h = x
            for w in weights:
                h = F.linear(torch.relu(h), w)
            return h
    elif variant in ("scaled_mm", "inductor_template"):
        def step(x):
            h = x
            for w, s in zip(wq, w_scales):
                h = torch._scaled_mm(cast(torch.relu(h)), w, scale_a=x_scale, scale_b=s,
                                     out_dtype=torch.bfloat16, use_fast_accum=fast)
            return h
    elif variant == "loka_scaled_mm":
        from loka.kernels import ops

        ops.scaled_mm_lowered()

        def step(x):
            h = x
            for w, s in zip(wq, w_scales):
                h = torch.ops.loka.scaled_mm(cast(torch.relu(h)), w, x_scale, s,
                                             torch.bfloat16, fast)
            return h
    elif variant == "triton_gemm":
        from loka.kernels.adapters.triton_kernels import triton_gemm

        def step(x):
            h = x
            for w, s in zip(wq, w_scales):
                h = triton_gemm(cast(torch.relu(h)), w, x_scale, s, "rowwise", torch.bfloat16,
                                fast)
            return h
    elif variant in ("bf16_modules", "loka_modules"):
        model = nn.Sequential(*(m for w in weights for m in (nn.ReLU(), _linear(w))))
        if variant == "loka_modules":
            import loka
            from loka.config import ROLES

            kernel = "cublas-tensorwise-fastacc" if fast else "cublas-tensorwise"
            plan = loka.Plan.uniform(model, kernel)
            for sp in plan.sites.values():
                for role in ROLES[1:]:
                    sp.roles[role] = loka.dispatch.RoleChoice(plan.baseline)
            loka.apply(model, plan, inference=True)
            for m in model.modules():
                if isinstance(m, loka.Linear):
                    m.set_input_amax(float(x_scale) * FP8_MAX, rows=rows)
        model.eval()

        def step(x):
            return model(x)
    else:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    return step


def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def measure(variant: str, args, device) -> Dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    d, sites = args.dim, args.sites
    weights = [(torch.randn(d, d, generator=gen) / d ** 0.5).to(device, torch.bfloat16)
               for _ in range(sites)]
    # FP8 weights as the GEMMs read them: b = Wᵀ, column-major (K contiguous)
    w_scales = [(w.float().abs().amax() / FP8_MAX).reshape(1, 1) for w in weights]
    wq = [(w.float() / s).to(torch.float8_e4m3fn).t() for w, s in zip(weights, w_scales)]
    x = torch.randn(args.rows, d, generator=gen).to(device, torch.bfloat16)
    x_scale = torch.full((1, 1), 4.0 / FP8_MAX, device=device)
    row: Dict[str, object] = {"variant": variant, "sites": sites, "rows": args.rows, "dim": d}
    # the variants share step functions' code: without a reset Dynamo would serve a variant
    # the graph another one compiled (the template variant differs only in Inductor options)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():  # served as a serving step is (no autograd wrapper)
            return _measure(variant, args, device, row, weights, wq, x_scale, w_scales, x)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not a stop
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return row


def _measure(variant, args, device, row, weights, wq, x_scale, w_scales, x):
    """One variant's compile, times and error into ``row``."""
    step = chain(variant, weights, wq, x_scale, w_scales, args.rows)
    if variant == "inductor_template":
        from torch._inductor import config as ic

        with ic.patch(max_autotune_gemm=True, max_autotune_gemm_backends="TRITON"):
            compiled = torch.compile(step, dynamic=False)
            t0 = time.perf_counter()
            compiled(x)
    else:
        compiled = torch.compile(step, dynamic=False)
        t0 = time.perf_counter()
        compiled(x)
    row["compile_s"] = time.perf_counter() - t0
    for _ in range(5):
        compiled(x)
    call = lambda: compiled(x)  # noqa: E731
    row["wall_us_per_step"] = wall_per_call(call, device, args.steps, args.repeats)
    if device.type == "cuda":
        row["gpu_us_per_step"] = time_fn(call, device, warmup=3, iters=20).median_us
    ref = chain("bf16", weights, wq, x_scale, w_scales)(x).float()
    got = compiled(x).float()
    row["rel_err_vs_bf16"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    return row


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=8)
    p.add_argument("--rows", type=int, default=256, help="tokens (M) per GEMM")
    p.add_argument("--dim", type=int, default=256, help="K = N of every GEMM (multiple of 16)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=200, help="back-to-back steps per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (what the numbers are for) or cpu (a check of the script)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.sites < 1 or args.rows < 1 or args.dim < 16 or args.dim % 16:
        p.error("--sites and --rows must be >= 1, --dim a positive multiple of 16")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; expected some of {list(VARIANTS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here")
    rows = [measure(v, args, device) for v in names]
    base = next((r for r in rows if r["variant"] == "bf16" and "wall_us_per_step" in r), None)
    for r in rows:
        if base is not None and "wall_us_per_step" in r:
            r["extra_wall_us_per_site"] = ((r["wall_us_per_step"] - base["wall_us_per_step"])
                                           / args.sites)
    doc = {"schema": "loka.bench.host_per_site", "version": 1,
           "command": " ".join(["bench/host_per_site.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:18s} {r['error']}", flush=True)
            continue
        extra = r.get("extra_wall_us_per_site")
        print(f"{r['variant']:18s} wall {r['wall_us_per_step']:8.1f} us/step, GPU "
              f"{r.get('gpu_us_per_step', float('nan')):8.1f} us/step"
              + (f", {extra:+.1f} us/site vs bf16" if extra is not None else "")
              + f", compile {r['compile_s']:.1f} s, rel err {r['rel_err_vs_bf16']:.3g}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
