"""LoKA's standalone Triton quantizers against a copy of the same tensor, at Wukong's shapes.

A quantizer reads a bf16 tensor and writes FP8 (plus scales): at best it runs at the rate
of a copy. Per shape, timed with CUDA graphs and the L2 cache flushed before every call
(``loka.timing.time_fn(flush_l2=True)``: in a step the operand was written by another
kernel long before, and a weight of 8192 x 2048 fits in the L2 of an H100):

* ``copy``: ``x.clone()`` (reads 2 bytes and writes 2 per element): the reference rate;
* ``rowwise``: :func:`~loka.kernels.triton.quantize.quantize_rowwise` of x (one pass);
* ``rowwise_t``: the same of ``x.t()`` (a transposed view, the weight gradient's layout:
  two stages, so x is read twice);
* ``dual``: :func:`~loka.kernels.triton.quantize.quantize_rowwise_dual` (both layouts);
* ``tensorwise``: :func:`~loka.kernels.triton.quantize.quantize_tensorwise` (two passes).

* with ``--compiled`` (the default; ``--no-compiled`` leaves them out), the same
  quantizations in PyTorch ops under ``torch.compile``, as Inductor writes them inside a
  compiled step: ``c_rowwise`` (:func:`loka.numerics.quantize`, rowwise), ``c_dual`` (x and
  ``x.t()``, one compiled function), and the power-of-two path whose second layout comes
  from the FP8 rows (:func:`loka.numerics.requantize_transposed`): ``c_p2_rowwise``,
  ``c_p2_requant`` (from its FP8 rows alone: one byte read and one written per element),
  ``c_p2_dual`` (both in one function) and ``c_p2_direct_t`` (the transposed layout from x
  directly). ``c_p2_dual`` records its relative error against x and ``x.t()`` (float64)
  beside that of the direct power-of-two quantizations, and the fraction of its
  transposed values (dequantized) that equal the direct ones.

``dual``'s output is checked bit for bit against :func:`loka.numerics.quantize` (x and
``x.t()``, rowwise), after it is timed. Each row gives the
median time, the bytes it must move at least (one read of 2 bytes and one write of 1 per
element and layout; scales ignored) and that rate as a fraction of the copy's.

    PYTHONPATH=. python bench/bench_quantizers.py [--shapes 8192x2048,4096x8192] [--out q.json]

Without a GPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``) at the given
(small) shapes, for its tests; the times are then CPU wall clock and mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

DEFAULT_SHAPES = "8192x2048,2048x2048,4096x2048,4096x8192,2048x16384"
"""the Wukong `paper` operands: fm.mlp.3's and fm.mlp.0's weights, the FM MLP's input and
fm.mlp.3's output gradient at batch 4096, the top MLP's first weight"""


def parse_shapes(text: str) -> List[Tuple[int, int]]:
    """'RxC,RxC' -> [(R, C), ...]; one-line ValueError on anything else."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            r, c = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {part!r} is not RxC (e.g. 4096x2048)") from None
        if r < 1 or c < 1:
            raise ValueError(f"--shapes: {part!r} needs positive sizes")
        shapes.append((r, c))
    if not shapes:
        raise ValueError("--shapes: no shape given")
    return shapes


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def _rel_err(q, ref: torch.Tensor) -> float:
    from loka.numerics import dequantize
    ref = ref.double()
    return float((dequantize(q, torch.float64) - ref).norm() / ref.norm().clamp(min=1e-300))


def _compiled_rows(x: torch.Tensor, timed: Callable[..., None],
                   rows: Dict[str, Dict[str, object]]) -> None:
    """The ``c_*`` rows (module docstring): PyTorch quantization under ``torch.compile``."""
    from loka.numerics import Granularity, QTensor, get_format, quantize, requantize_transposed

    n = x.numel()
    torch.compiler.reset()  # each shape compiles its own graphs (no recompile limit met)

    def rowwise(t, p2=False):  # row-major output, as the Triton kernels write (t.t() too)
        q = quantize(t, "e4m3", "rowwise", "a", power_of_two=p2)
        return q.data.contiguous(), q.scale

    def requant(data, scale):
        q = QTensor(data, scale, get_format("e4m3"), (1, data.shape[1]), Granularity.ROWWISE)
        r = requantize_transposed(q, check_scale=False)
        return r.data, r.scale

    def p2_dual(t):
        data, scale = rowwise(t, True)
        return (data, scale, *requant(data, scale))

    c_rowwise = torch.compile(lambda t: rowwise(t))
    c_dual = torch.compile(lambda t: (*rowwise(t), *rowwise(t.t())))
    c_p2 = torch.compile(lambda t: rowwise(t, True))
    c_requant = torch.compile(requant)
    c_p2_dual = torch.compile(p2_dual)
    c_p2_t = torch.compile(lambda t: rowwise(t.t(), True))
    data, scale = c_p2(x)
    timed("c_rowwise", lambda: c_rowwise(x), 3 * n)
    timed("c_dual", lambda: c_dual(x), 6 * n)
    timed("c_p2_rowwise", lambda: c_p2(x), 3 * n)
    timed("c_p2_requant", lambda: c_requant(data, scale), 2 * n)
    timed("c_p2_dual", lambda: c_p2_dual(x), 6 * n)
    timed("c_p2_direct_t", lambda: c_p2_t(x), 3 * n)
    q, s, qt, st = c_p2_dual(x)
    direct = quantize(x, "e4m3", "rowwise", "a", power_of_two=True)
    direct_t = quantize(x.t(), "e4m3", "rowwise", "a", power_of_two=True)
    fmt = get_format("e4m3")
    mine = QTensor(q, s, fmt, (1, x.shape[1]), Granularity.ROWWISE)
    mine_t = QTensor(qt, st, fmt, (1, x.shape[0]), Granularity.ROWWISE)
    rows["c_p2_dual"].update(
        rows_bit_exact=bool(_same(q, direct.data) and torch.equal(s, direct.scale)),
        transposed_values_equal=float((mine_t.dequantize(torch.float64)
                                       == direct_t.dequantize(torch.float64)).double().mean()),
        rel_err=_rel_err(mine, x), rel_err_direct=_rel_err(direct, x),
        rel_err_t=_rel_err(mine_t, x.t()), rel_err_t_direct=_rel_err(direct_t, x.t()))


def run(shapes: List[Tuple[int, int]], device: str, iters: int = 50,
        compiled: bool = True) -> Dict[str, object]:
    """Time every row at every shape; returns the JSON document's ``cases``."""
    from loka.kernels.triton import quantize as Q
    from loka.numerics import quantize
    from loka.timing import time_fn

    cases = []
    for r, c in shapes:
        gen = torch.Generator(device="cpu").manual_seed(r * 31 + c)
        x = (torch.randn(r, c, generator=gen) * 3).to(torch.bfloat16).to(device)
        n = r * c
        rows: Dict[str, Dict[str, object]] = {}

        def timed(name: str, fn: Callable[[], object], nbytes: int) -> None:
            t = time_fn(fn, device, warmup=3, iters=iters, flush_l2=device != "cpu")
            rows[name] = {"us": t.median_us, "method": t.method, "mbytes": nbytes / 1e6,
                          "gb_per_s": nbytes / t.median_us / 1e3}

        timed("copy", x.clone, 4 * n)
        timed("rowwise", lambda: Q.quantize_rowwise(x), 3 * n)
        timed("rowwise_t", lambda: Q.quantize_rowwise(x.t()), 3 * n)
        timed("dual", lambda: Q.quantize_rowwise_dual(x), 6 * n)
        timed("tensorwise", lambda: Q.quantize_tensorwise(x), 3 * n)
        # against loka.numerics.quantize, the reference every kernel matches bit for bit
        ref, ref_t = quantize(x, "e4m3", "rowwise", "a"), quantize(x.t(), "e4m3", "rowwise", "a")
        d = Q.quantize_rowwise_dual(x)
        rows["dual"]["bit_exact"] = bool(
            _same(d[0], ref.data) and _same(d[2], ref_t.data)
            and torch.equal(d[1].reshape(ref.scale.shape), ref.scale)
            and torch.equal(d[3].reshape(ref_t.scale.shape), ref_t.scale))
        if compiled:
            _compiled_rows(x, timed, rows)
        copy_rate = rows["copy"]["gb_per_s"]
        for row in rows.values():
            row["of_copy_rate"] = row["gb_per_s"] / copy_rate
        cases.append({"shape": [r, c], "rows": rows})
        print(f"{r}x{c}: " + ", ".join(f"{k} {v['us']:.1f} us ({v['of_copy_rate']:.2f})"
                                       for k, v in rows.items()), flush=True)
    return {"cases": cases}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of RxC (bf16 inputs)")
    p.add_argument("--iters", type=int, default=50, help="timed graph replays per row")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="also the c_* rows: PyTorch quantization under torch.compile")
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    if args.iters < 1:
        p.error("--iters must be >= 1")
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if gpu else "cpu"
    doc = {"schema": "loka.bench.quantizers", "version": 1,
           "command": " ".join(["bench/bench_quantizers.py"] + (argv if argv is not None
                                                                 else sys.argv[1:])),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(),
           "device_name": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
           **run(shapes, device, args.iters, args.compiled)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
