#!/usr/bin/env python3
"""Does the compiled step launch LoKA's Triton kernels from Inductor's code? (GPU check)

A tower of ``--layers`` Linears (``--width`` wide, Hard Swish between them, batch
``--batch``) trains one step at a time, compiled with Inductor, in bf16 and with every
Linear on one LoKA kernel for all three roles (the ``--kernels`` list). Per row: the
median wall time of a synchronized step, the GPU time of a step (CUDA events around it),
their ratio (a host-bound step has wall >> GPU), the number of Python-level ``loka::``
op calls in the compiled graphs (0 when Inductor launches the kernels itself), and the
loss and gradients against the same step run eagerly (the compiled step must compute what
the eager one does). Every row is written to ``--out`` as soon as it is measured.

    python bench/traced_check.py --out $OUT/traced.json
    python bench/traced_check.py --device cpu --width 64 --batch 64 --layers 2 --steps 2 \\
        --kernels emulated-rowwise-e4m3 --out /tmp/traced.json      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn

import loka
from loka.jsonio import atomic_write_text, json_safe

KERNELS = ("triton-rowwise", "triton-rowwise-cublas-fastacc", "triton-tensorwise-cublas",
           "cublas-rowwise", "cublas-tensorwise")


class Tower(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(layers)
                                    for m in (nn.Linear(width, width, bias=False), nn.Hardswish())])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(-1)


def step_fn(model, opt, x, y):
    def step():
        loss = nn.functional.binary_cross_entropy_with_logits(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def measure(kernel: str, args, device) -> dict:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = Tower(args.width, args.layers).to(device, dtype)
    x = torch.randn(args.batch, args.width, device=device, dtype=dtype)
    y = (torch.rand(args.batch, device=device) < 0.3).float()
    row = {"kernel": kernel, "width": args.width, "layers": args.layers, "batch": args.batch}
    models = {}
    for mode in ("eager", "compiled"):
        m = Tower(args.width, args.layers).to(device, dtype)
        m.load_state_dict(base.state_dict())
        if kernel != "bf16":
            plan = loka.Plan.uniform(m, kernel, device=device)
            loka.apply(m, plan)
        models[mode] = m
    # the compiled step against the eager one: one step each, same weights, same batch
    losses, grads = {}, {}
    for mode, m in models.items():
        run = torch.compile(m) if mode == "compiled" else m
        loss = nn.functional.binary_cross_entropy_with_logits(run(x).float(), y)
        loss.backward()
        losses[mode] = float(loss)
        grads[mode] = torch.cat([p.grad.float().flatten() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    row["loss_eager"], row["loss_compiled"] = losses["eager"], losses["compiled"]
    row["grad_rel_diff"] = float((grads["compiled"] - grads["eager"]).norm()
                                 / grads["eager"].norm().clamp(min=1e-30))
    # Python-level loka:: op calls in the compiled graphs
    calls = []

    def count(gm, inputs):
        calls.append(sum(str(n.target).startswith("loka.") for n in gm.graph.nodes
                         if n.op == "call_function"))
        return make_boxed_func(gm.forward)

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    probe = torch.compile(models["compiled"], backend=aot_autograd(fw_compiler=count,
                                                                  bw_compiler=count))
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        probe(x).float().sum().backward()
    models["compiled"].zero_grad(set_to_none=True)
    row["loka_op_calls"] = sum(calls)
    # timing: wall (synchronized) and GPU (events) per step
    m = models["compiled"]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type == "cuda")
    step = step_fn(torch.compile(m), opt, x, y)
    for _ in range(args.warmup):
        step()
    walls, gpus = [], []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize(device)
            walls.append((time.perf_counter() - t0) * 1e3)
            gpus.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
    row["step_ms"] = statistics.median(walls)
    row["gpu_ms"] = statistics.median(gpus) if gpus else None
    row["wall_over_gpu"] = row["step_ms"] / row["gpu_ms"] if gpus else None
    row["status"] = "ok"
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    doc = {"schema": "loka.traced_check", "version": 1, "argv": sys.argv[1:],
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "rows": []}
    for kernel in ["bf16"] + [k for k in args.kernels.split(",") if k]:
        try:
            row = measure(kernel, args, device)
        except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
            row = {"kernel": kernel, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
        doc["rows"].append(row)
        atomic_write_text(args.out, json.dumps(json_safe(doc), indent=1) + "\n")
        print(json.dumps({k: row.get(k) for k in ("kernel", "status", "step_ms", "gpu_ms",
                                                   "wall_over_gpu", "loka_op_calls",
                                                   "grad_rel_diff", "error")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
