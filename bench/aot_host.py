"""Host time per call of a served model: ``torch.compile`` against an AOTInductor package.

A serving forward's wall time is the larger of what the GPU runs and what the host takes
to issue it. This script measures the host's part where it can be isolated from the
device's: on the CPU, with one row per call, the compute is a few microseconds and the
time per call is the issuing: Dynamo's guards, AOTAutograd's wrappers and the Python
wrapper of ``torch.compile``'s code, against ``loka.aot_compile``'s package (its input
checks, then one C++ call; the package's own ``__call__``, which decodes its input and
output layouts from JSON at every call, beside it). A GPU adds each kernel's launch to
both; the evaluation set's ``--serve-runtime aoti`` rows measure that whole.

    python bench/aot_host.py --out bench/results/aot_host_cpu.json

Models: one ``nn.Linear``, and the evaluation set's three models at their tiny scale
(float32; the first call of each runtime compiles and is not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import timeit

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import loka  # noqa: E402
from loka.bench.env import source_digest  # noqa: E402
from loka.jsonio import atomic_write_text  # noqa: E402


def per_call_us(fn, number: int, repeat: int) -> float:
    """The fastest of ``repeat`` timings of ``number`` calls, per call, in microseconds."""
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def models(rows: int):
    from evalset import EVAL_MODELS

    torch.manual_seed(0)
    yield "linear", nn.Linear(16, 16).eval(), (torch.randn(rows, 16),)
    for name, cls in EVAL_MODELS.items():
        torch.manual_seed(0)
        model = cls("tiny").eval()
        inputs, _ = model.make_batch(rows, device="cpu", dtype=torch.float32, seed=0)
        yield name, model, tuple(inputs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1, help="rows per call")
    ap.add_argument("--number", type=int, default=500, help="calls per timing")
    ap.add_argument("--repeat", type=int, default=7, help="timings (the fastest is kept)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name, model, inputs in models(args.rows):
            served = loka.aot_compile(model, inputs, os.path.join(folder, f"{name}.pt2"))
            with torch.inference_mode():
                compiled = torch.compile(model)
                same = bool(torch.equal(compiled(*inputs), served(*inputs)))
                row = {"model": name, "rows": args.rows, "outputs_equal": same,
                       "eager_us": per_call_us(lambda: model(*inputs), args.number, args.repeat),
                       "compile_us": per_call_us(lambda: compiled(*inputs), args.number,
                                                 args.repeat),
                       "aot_us": per_call_us(lambda: served(*inputs), args.number, args.repeat),
                       "package_call_us": per_call_us(lambda: served._package(*inputs),
                                                      args.number, args.repeat)}
            row["compile_over_aot"] = row["compile_us"] / row["aot_us"]
            results.append(row)
            print(f"{name:7s} eager {row['eager_us']:8.1f} us  torch.compile "
                  f"{row['compile_us']:8.1f} us  AOTModel {row['aot_us']:8.1f} us  package's "
                  f"own call {row['package_call_us']:8.1f} us  equal={same}", flush=True)
            torch._dynamo.reset()
    doc = {"schema": "loka.bench.aot_host", "version": 1,
           "env": {"torch": torch.__version__, "python": platform.python_version(),
                   "machine": platform.machine(), "processor": platform.processor(),
                   "threads": 1, "source_sha1": source_digest(),
                   "command": "python bench/aot_host.py " + " ".join(argv or sys.argv[1:])},
           "rows": results}
    atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
