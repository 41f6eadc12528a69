"""Compile every LoKA Triton kernel for a GPU target, on a machine without a GPU.

The Triton interpreter checks what the kernels compute, not whether they compile: a kernel
that is exact under ``TRITON_INTERPRET=1`` can still fail in Triton's compiler (a type the
interpreter accepts, a layout the backend rejects, a tile that runs out of registers). GPU
time is scarce, so this script finds those failures on the CPU. It runs the kernels' own
Python wrappers (``loka.kernels.triton.*``) on CPU tensors of the Wukong shapes and lets
each launch compile, all the way to a cubin, *every* config the autotuner would try at
that shape, for each target architecture. It then skips the launch. Triton's own
``ptxas`` does the last step, so no CUDA toolkit or driver is needed.

How: Triton's active driver is swapped for one that only names the target, and
``Autotuner.run`` for a loop that compiles each pruned config with ``warmup=True``
(compile, never launch). Both are restored on exit. The outputs the wrappers return are
uninitialized and meaningless; only compilation is checked.

    python bench/triton_aot.py [--arch 90,100] [--quick] [--sass] [--out aot.json]

``--sass`` adds each compiled config's instruction count and most frequent opcodes (from
the cubin's SASS, which Triton disassembles with the ``cuobjdump`` it ships): a way to
compare two versions of a kernel's arithmetic without a GPU.

Exit status 1 if any case fails to compile. ``tests/kernels/test_triton_aot.py`` runs it
(``--quick``) whenever Triton is installed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Tuple

os.environ.setdefault("LOKA_TRITON_AUTOTUNE", "1")  # every config the tuner would try

import torch


SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
"""shared memory one block may opt into, bytes, per SM version (CUDA programming guide,
compute capabilities table); the sm_90 figure is the H200's ``Hardware limit``"""


FP8_CAST = re.compile(r"\bcvt\.([a-z.]*)\.e[45]m[23]x2\.[a-z0-9]+\b")
"""a PTX conversion to a pair of FP8 values; group 1 holds its modifiers (``rn.satfinite``)"""


def fp8_casts(ptx: str) -> dict:
    """``{"saturating": n, "other": m}``: the PTX's conversions to FP8 with and without
    ``satfinite``. The quantizers leave the clamp to ``±max`` to a saturating cast
    (:func:`loka.kernels.triton.common.scale_and_clamp`), so an ``other`` is a bug."""
    mods = [m.group(1).split(".") for m in FP8_CAST.finditer(ptx)]
    sat = sum("satfinite" in m for m in mods)
    return {"saturating": sat, "other": len(mods) - sat}


def sass_profile(kernel) -> dict:
    """``{"instructions": n, "top_ops": [(opcode, count), ...], "fp8_casts": ...}`` of a
    compiled kernel's SASS (predicates dropped, so ``@P0 LDG.E.128`` counts as
    ``LDG.E.128``) and its PTX's FP8 conversions (:func:`fp8_casts`)."""
    ops = collections.Counter()
    for line in kernel.asm["sass"].splitlines():
        parts = line.split("\t")  # "<control codes>\t<instruction>;"
        if len(parts) < 2 or parts[0].count(":") != 4:
            continue
        words = parts[1].strip().rstrip(";").split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            ops[words[0]] += 1
    return {"instructions": sum(ops.values()), "top_ops": ops.most_common(12),
            "fp8_casts": fp8_casts(kernel.asm.get("ptx", ""))}


@contextlib.contextmanager
def compile_only(arch: int, log: List[dict], sass: bool = False):
    """Within the block, Triton launches compile for ``sm_<arch>`` and do not run; each
    compiled (kernel, config) is appended to ``log`` (with its :func:`sass_profile` if
    ``sass``)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", arch, 32)

    class TargetOnly:
        def get_current_device(self):  # kernels cache their compilations per device:
            return 1000 + arch  # one made-up device per target, none shared with a real GPU

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return target

        def get_active_torch_device(self):
            return torch.device("cpu")

    def record(fn, cfg, kernel, seconds):
        log.append({"kernel": fn.__name__, "config": cfg, "seconds": round(seconds, 3),
                    "cubin": kernel is not None and "cubin" in kernel.asm,
                    "arch": kernel.metadata.target.arch if kernel is not None else None,
                    "shared": kernel.metadata.shared if kernel is not None else None})
        if sass and kernel is not None:
            log[-1].update(sass_profile(kernel))

    def jit_run(self, *args, grid, warmup, **kwargs):  # a launch of a kernel not autotuned
        t = time.perf_counter()
        kernel = original_jit(self, *args, grid=grid, warmup=True, **kwargs)
        record(self, "-", kernel, time.perf_counter() - t)
        return kernel

    def tuner_run(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        grid = kwargs.pop("grid", None)
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        for cfg in configs:
            t = time.perf_counter()
            kernel = original_jit(self.fn, *args, grid=grid, warmup=True, **kwargs,
                                  **cfg.all_kwargs())
            record(self.fn, str(cfg), kernel, time.perf_counter() - t)

    original_jit, original_tuner = JITFunction.run, Autotuner.run
    original_driver = driver._active  # None where no GPU driver was ever made active
    driver.set_active(TargetOnly())
    JITFunction.run, Autotuner.run = jit_run, tuner_run
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = original_jit, original_tuner
        driver._active = original_driver


def _fp8(shape, col_major=False):
    t = torch.zeros(shape[::-1] if col_major else shape, dtype=torch.float8_e4m3fn)
    return t.t() if col_major else t


def _gemm(m, k, n, **kw):
    from loka.kernels.triton.gemm_rowwise import gemm_rowwise
    return lambda: gemm_rowwise(_fp8((m, k)), _fp8((k, n), col_major=True),
                                torch.ones(m, 1), torch.ones(1, n), **kw)


def _inline_gemm(m, k, n, a_transposed=True, **kw):
    """The inline-quantizing GEMM on bf16 operands (its amax passes compile too)."""
    from loka.kernels.triton.gemm_rowwise import gemm_rowwise_inline
    a = torch.zeros((k, m) if a_transposed else (m, k), dtype=torch.bfloat16)
    return lambda: gemm_rowwise_inline(a.t() if a_transposed else a,
                                       torch.zeros(k, n, dtype=torch.bfloat16), **kw)


def _blockwise_gemm(m, k, n):
    from loka.kernels.triton.gemm_blockwise import gemm_blockwise
    return lambda: gemm_blockwise(_fp8((m, k)), _fp8((k, n), col_major=True),
                                  torch.ones(m, -(-k // 128)), torch.ones(-(-k // 128), -(-n // 128)))


def _norm(m, d, **kw):
    from loka.kernels.triton.norm_act_quant import norm_act_quant
    x = torch.zeros(m, d, dtype=torch.bfloat16)
    if kw.get("norm") == "layernorm" and kw.pop("affine", False):
        kw.update(weight=torch.ones(d, dtype=torch.bfloat16), bias=torch.zeros(d, dtype=torch.bfloat16))
    return lambda: norm_act_quant(x, **kw)


def _bags(bags, mean_len, rows, d):
    from loka.kernels.triton.embedding_bag import embedding_bag_sum
    offsets = torch.arange(bags + 1, dtype=torch.int64) * mean_len
    values = torch.zeros(bags * mean_len, dtype=torch.int64)
    weight = torch.zeros(rows, d, dtype=torch.bfloat16)
    return lambda: embedding_bag_sum(values, offsets, weight)


def cases(quick: bool) -> Dict[str, Callable[[], Callable[[], object]]]:
    """name -> a builder of the call to compile (Wukong ``paper`` shapes, every operand
    layout loka.Linear passes, every epilogue and norm option)."""
    from loka.kernels.triton import quantize as tq

    act = torch.zeros(4096, 2048, dtype=torch.bfloat16)
    tokens = torch.zeros(65536, 64, dtype=torch.bfloat16)  # the FM projection's n axis
    out = {
        "quantize_rowwise row-major": lambda: lambda: tq.quantize_rowwise(act),
        "quantize_rowwise transposed (wgrad)": lambda: lambda: tq.quantize_rowwise(act.t()),
        "quantize_rowwise e5m2": lambda: lambda: tq.quantize_rowwise(act, "e5m2"),
        "quantize_colwise": lambda: lambda: tq.quantize_colwise(act),
        "quantize_rowwise_dual (x and xᵀ)": lambda: lambda: tq.quantize_rowwise_dual(act),
        "quantize_tensorwise row": lambda: lambda: tq.quantize_tensorwise(act),
        "quantize_tensorwise col": lambda: lambda: tq.quantize_tensorwise(act, layout="col"),
        "quantize_blockwise 1x128": lambda: lambda: tq.quantize_blockwise(act),
        "quantize_blockwise 128x128 col": lambda: lambda: tq.quantize_blockwise(
            act, block=(128, 128), layout="col"),
        "gemm_rowwise fm_mlp.1 fwd": lambda: _gemm(4096, 2048, 8192),
        "gemm_rowwise fm_projection fwd (N=32)": lambda: _gemm(65536, 64, 32),
        "gemm_rowwise top_mlp.0 split-K": lambda: _gemm(2048, 4096, 16384),
        "gemm_rowwise bias+hardswish fastacc": lambda: _gemm(4096, 2048, 1024, bias=torch.zeros(1024),
                                                             activation="hardswish", fast_accum=True),
        "gemm_rowwise fp8 out (N=256)": lambda: _gemm(4096, 2048, 256, fp8_out="e4m3"),
        "gemm_rowwise fp32 out": lambda: _gemm(4096, 1024, 2048, out_dtype=torch.float32),
        "gemm_rowwise BlockNorm statistics": lambda: _gemm(4096, 2048, 2048, norm_stats=256),
        "gemm_rowwise fp8 out + BlockNorm statistics": lambda: _gemm(
            4096, 2048, 256, fp8_out="e4m3", norm_stats=64),
        "gemm_rowwise_inline fm_projection wgrad": lambda: _inline_gemm(32, 1 << 20, 64),
        "gemm_rowwise_inline top_mlp.2 wgrad fastacc e5m2": lambda: _inline_gemm(
            1, 4096, 1024, a_transposed=False, a_fmt="e5m2", fast_accum=True),
        "gemm_rowwise_inline small dgrad (K = 64)": lambda: _inline_gemm(
            48, 64, 160, a_transposed=False),
        "gemm_blockwise": lambda: _blockwise_gemm(4096, 2048, 2048),
        "norm_act_quant blocknorm+hardswish rowwise": lambda: _norm(4096, 2048),
        "norm_act_quant blocknorm tensorwise fp8-only": lambda: _norm(
            4096, 2048, act="identity", granularity="tensorwise", return_hp=False),
        "norm_act_quant fmb norm 2048 rowwise fp8-only": lambda: _norm(
            4096, 2048, act="identity", return_hp=False),
        "norm_act_quant top norm 16384 rowwise fp8-only": lambda: _norm(
            4096, 16384, act="identity", return_hp=False),
        "norm_act_quant chunked 20000 tensorwise": lambda: _norm(
            64, 20000, norm="none", granularity="tensorwise"),
        "norm_act_quant layernorm affine": lambda: _norm(4096, 96, norm="layernorm", affine=True),
        "embedding_bag_sum Wukong tables (56 x 4096 bags, d 256)": lambda: _bags(
            56 * 4096, 4, 56000, 256),
    }
    if quick:  # one case per kernel family and option that the others do not cover
        keep = ("quantize_rowwise row-major", "quantize_rowwise transposed (wgrad)",
                "quantize_rowwise_dual (x and xᵀ)",
                "quantize_tensorwise col",
                "quantize_blockwise 128x128 col", "gemm_rowwise fm_projection fwd (N=32)",
                "gemm_rowwise bias+hardswish fastacc", "gemm_rowwise fp8 out (N=256)",
                "gemm_rowwise BlockNorm statistics",
                "gemm_rowwise fp8 out + BlockNorm statistics",
                "gemm_rowwise_inline fm_projection wgrad",
                "gemm_rowwise_inline small dgrad (K = 64)", "gemm_blockwise", "norm_act_quant blocknorm tensorwise fp8-only",
                "norm_act_quant chunked 20000 tensorwise",
                "embedding_bag_sum Wukong tables (56 x 4096 bags, d 256)")
        out = {k: v for k, v in out.items() if k in keep}
    return out


def run(archs: List[int], quick: bool = False,
        progress: Callable[[str], None] = print, sass: bool = False,
        only: str = "") -> Tuple[List[dict], List[dict]]:
    """(compiled, failures): every (kernel, config, arch) compiled, and every case that
    raised, with its error."""
    import triton  # noqa: F401  (ImportError: nothing to check)

    compiled, failures = [], []
    for arch in archs:
        for name, build in cases(quick).items():
            if only and only not in name:
                continue
            before = len(compiled)
            t = time.perf_counter()
            try:
                with compile_only(arch, compiled, sass):
                    build()()
            except Exception as e:  # noqa: BLE001 - report every case, not the first
                failures.append({"case": name, "arch": arch,
                                 "error": f"{type(e).__name__}: {e}"[:2000],
                                 "traceback": traceback.format_exc()[-4000:]})
                progress(f"sm_{arch} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            for c in compiled[before:]:
                c["case"] = name
            n = len(compiled) - before
            progress(f"sm_{arch} {name}: {n} config(s) compiled in {time.perf_counter() - t:.1f} s")
            if n == 0 or not all(c["cubin"] and c["arch"] == arch for c in compiled[before:]):
                failures.append({"case": name, "arch": arch, "error": (
                    f"no cubin for sm_{arch}" if n else "nothing was compiled")})
            limit = SHARED_LIMIT.get(arch)
            for c in compiled[before:]:
                # a kept config that cannot launch is a pruning defect: with autotuning off
                # (one config) the launch fails, with it each GPU compiles it for nothing
                if limit and c["shared"] is not None and c["shared"] > limit:
                    failures.append({"case": name, "arch": arch, "error": (
                        f"{c['kernel']} [{c['config']}] needs {c['shared']} bytes of shared "
                        f"memory, sm_{arch} has {limit}")})
                    progress(f"sm_{arch} {name}: {failures[-1]['error']}")
    return compiled, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="comma list of SM versions (90: Hopper)")
    p.add_argument("--quick", action="store_true", help="one case per kernel option")
    p.add_argument("--sass", action="store_true",
                   help="report each config's SASS instruction count and top opcodes")
    p.add_argument("--case", default="", help="only the cases whose name contains this")
    p.add_argument("--out", default=None, help="write the compiled configs and failures as JSON")
    args = p.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a.strip()]
    t = time.perf_counter()
    compiled, failures = run(archs, args.quick, sass=args.sass, only=args.case)
    if args.sass:
        for c in compiled:
            top = ", ".join(f"{op} {n}" for op, n in c.get("top_ops", [])[:6])
            print(f"sm_{c['arch']} {c['case']} | {c['kernel']} [{c['config']}]: "
                  f"{c.get('instructions', '?')} instructions ({top})")
    kernels = sorted({c["kernel"] for c in compiled})
    print(f"{len(compiled)} kernel configs of {len(kernels)} kernels compiled for "
          f"{', '.join(f'sm_{a}' for a in archs)} in {time.perf_counter() - t:.0f} s; "
          f"{len(failures)} failure(s)")
    if args.out:
        Path(args.out).write_text(json.dumps({"archs": archs, "kernels": kernels,
                                              "compiled": compiled, "failures": failures},
                                             indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
