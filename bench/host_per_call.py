"""The host's cost of one GEMM call, per kernel: what a step without CUDA graphs pays per
FP8 GEMM before the GPU sees any work.

At a small shape (default 256 x 256 x 256, a few microseconds of GPU work) calls issued back
to back are bound by the host, so the wall time per call is the host's time per call. Per
kernel (bf16 and FP8 kernels of the registry), two ways:

* ``eager``: ``kernel(a, b, dtype)`` on operands quantized beforehand (the GEMM call alone:
  for cuBLAS kernels one ``torch._scaled_mm``);
* ``compiled``: the same call inside ``torch.compile`` (one compiled function per kernel),
  as a compiled model launches it (Inductor's code; quantization of the operands included
  where the kernel quantizes with PyTorch ops, bf16 operands then).

Each row gives the wall time per call over ``--calls`` back-to-back calls (median of
``--repeats``) and, on a GPU, the GPU time per call (CUDA graphs, :func:`loka.timing.time_fn`);
``host_bound`` says whether the wall time exceeds the GPU time by half, so that the wall
time is the host's. Serving steps of the evaluation-set DCNv2 and DLRM (a third of a
millisecond of GPU time) paid about 0.08 ms more wall time with 5 FP8 GEMMs than bf16
(bench/results/2026-12-05-h100-ab/): this says how much of it is the GEMM call.

    PYTHONPATH=. python bench/host_per_call.py [--shape 256x256x256] [--out host.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loka.kernels import registry  # noqa: E402
from loka.timing import synchronize, time_fn  # noqa: E402

DEFAULT_KERNELS = ("bf16", "cublas-rowwise-fastacc", "cublas-tensorwise-fastacc",
                   "triton-rowwise-cublas-fastacc", "triton-rowwise")


def parse_shape(text: str):
    """'MxKxN' -> (M, K, N), one-line ValueError otherwise."""
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shape: {text!r} is not MxKxN (e.g. 256x256x256)") from None
    if min(m, k, n) < 1:
        raise ValueError(f"--shape: {text!r} needs positive sizes")
    return m, k, n


def wall_per_call(call, device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` back-to-back calls, per call (us)."""
    per = []
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(device)
        per.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per)


def measure(name: str, shape, device: torch.device, dtype: torch.dtype, calls: int,
            repeats: int) -> List[dict]:
    """The eager and compiled rows of one kernel (or one row with its error)."""
    kern = registry.get(name)
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = []
    qa = kern.quantize_a(a) if kern.is_fp8 and kern.quantize_a is not None else a
    qb = kern.quantize_b(b) if kern.is_fp8 and kern.quantize_b is not None else b
    compiled = torch.compile(lambda x, y: kern(x, y, dtype), dynamic=False)
    for how, call in (("eager", lambda: kern(qa, qb, dtype)), ("compiled", lambda: compiled(a, b))):
        row = {"kernel": name, "how": how, "shape": list(shape)}
        try:
            for _ in range(3):  # compile, autotune, cuBLAS handles
                call()
            row["wall_us_per_call"] = wall_per_call(call, device, calls, repeats)
            if device.type == "cuda":
                row["gpu_us_per_call"] = time_fn(call, device, warmup=3, iters=20).median_us
                row["host_bound"] = row["wall_us_per_call"] > 1.5 * row["gpu_us_per_call"]
        except Exception as e:  # noqa: BLE001 - a kernel that fails here is a row, not a stop
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        out.append(row)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="256x256x256", help="MxKxN of the GEMM")
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                   help="comma list of registered kernels (those unavailable here are skipped)")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        p.error(str(e))
    if args.calls < 1 or args.repeats < 1:
        p.error("--calls and --repeats must be >= 1")
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in names if k not in {x.name for x in registry.all_kernels()}]
    if unknown:
        p.error(f"--kernels: unknown kernel(s) {unknown}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    usable = {k.name for k in registry.available(device)}
    rows, skipped = [], {}
    for name in names:
        if name not in usable:
            skipped[name] = "not available on this device"
            continue
        rows += measure(name, shape, device, dtype, args.calls, args.repeats)
    doc = {"schema": "loka.bench.host_per_call", "version": 1,
           "command": " ".join(["bench/host_per_call.py"]
                               + (argv if argv is not None else sys.argv[1:])),
           "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "rows": rows, "skipped": skipped}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for r in rows:
        gpu = f", GPU {r['gpu_us_per_call']:.1f} us" if "gpu_us_per_call" in r else ""
        what = r.get("error") or f"wall {r['wall_us_per_call']:.1f} us per call{gpu}"
        print(f"{r['kernel']:32s} {r['how']:8s} {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
