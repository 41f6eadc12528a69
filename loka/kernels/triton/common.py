"""Pieces shared by the Triton kernels: FP8 format constants, the NaN-propagating amax,
the exact scale-and-cast, the GEMMs' grouped tile order, and the autotuning helpers.

Numerics follow :func:`loka.numerics.quantize` bit for bit on the kernel's device: the
scale is ``max(amax, AMAX_EPS) / fmt.max`` in float32 as torch computes it there (see
:func:`amax_to_scale`), the value is
``x / scale`` (IEEE division), clamped to ``±fmt.max`` and cast round-to-nearest-even.
Triton's plain ``/`` is an approximate division on NVIDIA GPUs; the kernels divide exactly
with one reciprocal per scale and two fma corrections (:func:`div_by_scale`), which costs
far fewer instructions per element than ``tl.math.div_rn``.

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the float-to-FP8 cast is not
round-to-nearest-even (it truncates, and a mantissa carry does not reach the exponent), so
the kernels then round to the FP8 grid in float32 first (``SOFT_ROUND``); the cast of a
value already on the grid is exact. On the GPU ``SOFT_ROUND`` is off and the hardware
cast (``cvt.rn.satfinite``) rounds.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ...numerics import AMAX_EPS, get_format
from ..roofline import autotune_limit, max_autotune_configs

_FP8_DTYPES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
AMAX_EPS_CONST = tl.constexpr(AMAX_EPS)


def interpreted() -> bool:
    """Whether Triton kernels run under the CPU interpreter (decided when they are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> None:
    """Make Triton 3.6's interpreter work with numpy >= 2.4: it turns a scalar kernel
    argument (a 1-element array) into a loop bound with ``int(array)``, which numpy 2.4
    rejects; this takes the element instead. A no-op for a fixed interpreter."""
    from triton.runtime import interpreter as interp

    if getattr(interp._patch_lang_tensor, "_loka_patched", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._loka_patched = True
    interp._patch_lang_tensor = patched


if interpreted():
    patch_interpreter()


def fp8_meta(fmt) -> Dict[str, object]:
    """The ``tl.constexpr`` arguments that describe an FP8 format to a kernel.

    Only the OCP formats (e4m3fn, e5m2) have Triton kernels here; the AMD ``fnuz`` formats
    are refused with a one-line error.
    """
    f = get_format(fmt)
    if f.dtype not in _FP8_DTYPES:
        raise ValueError(f"Triton kernels support e4m3 and e5m2, not {f.name}")
    min_exp = 1 - (2 ** (f.exponent_bits - 1) - 1)  # exponent of the smallest normal
    # the kernels' float32 reciprocal 1/FMT_MAX is torch's (no double-rounding surprise)
    assert np.float32(1.0) / np.float32(f.max) == np.float32(1.0 / f.max)
    return {"FMT_MAX": f.max, "MANT_BITS": f.mantissa_bits, "MIN_EXP": min_exp,
            "SOFT_ROUND": interpreted()}


def check_fp8(t: torch.Tensor, name: str) -> None:
    if t.dtype not in _FP8_DTYPES:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")


def check_gemm_operands(a: torch.Tensor, b: torch.Tensor) -> Tuple[int, int, int]:
    """``(M, K, N)`` of ``a @ b`` for 2-D FP8 ``a`` (M, K) and ``b`` (K, N)."""
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        check_fp8(t, name)
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"GEMM shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    return m, k, b.shape[1]


def check_float_input(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else triton.next_power_of_2(int(n))


_TUNING = {"configs": 0, "seconds": 0.0}
"""configs benchmarked by LoKA's autotuners in this process, and the wall time it took
(each config's first launch compiles it, so this holds those compiles too)"""


def tuning_spent() -> Tuple[int, float]:
    """(configs benchmarked, seconds) by LoKA's autotuners so far in this process."""
    return _TUNING["configs"], _TUNING["seconds"]


_PRUNED = threading.local()
"""how many configs the autotuner of this thread kept for the shape it is tuning"""


def _bench(kernel_call, quantiles=None):
    """Autotuning benchmark: short, 1 ms of warm-up and 5 of timing (the Probe tunes dozens
    of shapes; a config's time at these sizes is tens of microseconds, so 5 ms are hundreds
    of calls); a no-op when interpreted or when only one config is left to choose from
    (Triton benchmarks even that one: it is compiled at its launch instead)."""
    if interpreted() or getattr(_PRUNED, "kept", 2) == 1:
        return [0.0, 0.0, 0.0] if quantiles else 0.0
    t0 = time.perf_counter()
    try:
        return triton.testing.do_bench(kernel_call, warmup=1, rep=5, quantiles=quantiles)
    finally:
        _TUNING["configs"] += 1
        _TUNING["seconds"] += time.perf_counter() - t0


def _tile_area(cfg: triton.Config) -> int:
    area = 1
    for key, value in cfg.kwargs.items():
        if key.startswith("BLOCK_"):
            area *= value
    return area


def autotune(configs: List[triton.Config], key: List[str], prune=None,
             reset_to_zero: Optional[List[str]] = None):
    """``triton.autotune`` with LoKA's pruning and benchmark. Under the interpreter, or
    with ``LOKA_TRITON_AUTOTUNE=0`` (numerical self-tests), only the surviving config with
    the largest tile is kept: nothing to tune on a CPU, the interpreter's cost grows with the
    number of programs, and every compiled config costs seconds. Inside
    :func:`loka.kernels.roofline.autotune_limit` at most that many configs (the largest
    tiles) are tried per new key. ``reset_to_zero`` names
    the outputs a kernel accumulates into (atomics): the benchmark launches it many times
    on the same arguments, so they restart from zero before every benchmarked launch and
    once more before the real one. No pre- or post-hooks: Inductor launches these kernels
    from its own code (:func:`launch`) and runs no Python around them."""

    def early_prune(cfgs, named_args, **kwargs):
        kept = prune(cfgs, named_args, **kwargs) if prune is not None else list(cfgs)
        kept = kept or list(cfgs[:1])
        if interpreted() or os.environ.get("LOKA_TRITON_AUTOTUNE", "1") == "0":
            _PRUNED.kept = 1
            return [max(kept, key=_tile_area)]
        limit = max_autotune_configs()  # loka.kernels.roofline.autotune_limit
        if limit is not None and len(kept) > limit:
            kept = sorted(kept, key=_tile_area, reverse=True)[:limit]
        _PRUNED.kept = len(kept)
        return kept

    return triton.autotune(configs=configs, key=key, do_bench=_bench,
                           reset_to_zero=reset_to_zero,
                           prune_configs_by={"early_config_prune": early_prune})


_OP_BODY = threading.local()


@contextlib.contextmanager
def op_body() -> Iterator[None]:
    """Marks the body of a ``torch.library.triton_op``: inside it :func:`launch` wraps
    every kernel with ``torch.library.wrap_triton``, so that tracing (``torch.compile``,
    ``make_fx``) records the kernel itself and Inductor launches it from the code it
    generates, with no Python-level op dispatch per call and captured by CUDA graphs."""
    before = getattr(_OP_BODY, "on", False)
    _OP_BODY.on = True
    try:
        yield
    finally:
        _OP_BODY.on = before


def launch(kernel):
    """``kernel`` as the wrappers launch it: ``wrap_triton(kernel)`` inside a triton op's
    body (:func:`op_body`; torch itself unwraps it again for an eager call), the kernel
    itself elsewhere (a direct eager call pays for no wrapper).

    Inside an op's body no tensor may be passed twice (:func:`check_distinct`): tracing
    functionalizes the kernel, copying each argument it may write, and writes the copies
    back one argument after the other, so a tensor passed as two arguments ends up holding
    the copy that the kernel did not write (an argument the kernel does not touch takes a
    :func:`placeholder`)."""
    if not getattr(_OP_BODY, "on", False):
        return kernel
    return _CheckedLaunch(wrap_triton(kernel),
                          getattr(getattr(kernel, "fn", kernel), "__name__", "kernel"))


class _CheckedLaunch:
    """A ``wrap_triton`` kernel whose launches refuse a tensor passed twice."""

    def __init__(self, traceable, name: str) -> None:
        self.traceable = traceable
        """what ``torch.library.wrap_triton`` made of the kernel"""
        self.name = name

    def __getitem__(self, grid):
        run = self.traceable[grid]

        def call(*args, **kwargs):
            check_distinct(self.name, list(args) + list(kwargs.values()))
            return run(*args, **kwargs)
        return call


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel does not touch, of ``like``'s dtype and device: never a
    tensor passed already (:func:`launch`)."""
    return torch.empty((1,), dtype=like.dtype, device=like.device)


def check_distinct(name: str, args) -> None:
    """Raise ValueError where two of a Triton kernel's arguments are one tensor, or views
    of one storage (see :func:`launch`)."""
    seen: Dict[int, int] = {}
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor) or a.device.type == "meta":
            continue
        try:  # the storage itself: the same for views, for fake and functional tensors too
            key = a.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            key = id(a)
        if key in seen:
            raise ValueError(f"{name}: arguments {seen[key]} and {i} are one tensor (or share "
                             f"its memory); a traced launch would write one of them back "
                             f"over the other")
        seen[key] = i


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)``, the output tile of GEMM program ``pid`` in grouped launch order:
    ``GROUP_M`` consecutive row tiles sweep the columns together, for L2 reuse of b."""
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % group) % group_m)
    pid_n = (pid % group) // group_m
    return pid_m, pid_n


@triton.jit
def nan_max(a, b):
    """Elementwise max that propagates NaN, as ``torch.amax`` does."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_amax(x, axis: tl.constexpr):
    """``amax(|x|)`` of float32 ``x`` along ``axis``, NaN if any element is NaN (as
    ``torch.amax``; ``tl.max`` alone drops NaN). One integer max over the bits of ``|x|``:
    the bits of a non-negative float order as the float does, with +inf above every finite
    value and every NaN above +inf, so NaN propagates with no separate NaN test."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(bits, axis).to(tl.float32, bitcast=True)


@triton.jit
def amax_to_scale(amax, FMT_MAX: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """``max(amax, AMAX_EPS) / FMT_MAX`` in float32, as torch computes it on the kernel's
    device: on CUDA, torch divides by a Python scalar as a product with its float32
    reciprocal (``div_true_kernel_cuda``); on the CPU (the interpreter's reference) it
    divides, IEEE-rounded."""
    amax = tl.maximum(amax, AMAX_EPS_CONST, propagate_nan=tl.PropagateNan.ALL)
    if SOFT_ROUND:
        return tl.math.div_rn(amax, tl.zeros_like(amax) + FMT_MAX)
    return amax * (1.0 / FMT_MAX)


@triton.jit
def or_sign(q, x):
    """float32 ``q`` with the sign bit of ``x`` set in it: ``q`` itself wherever its sign
    already is ``x``'s, and ``-0`` for a ``+0`` that should be negative."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_fp8_grid(y, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round float32 ``y`` (already clamped to the format's range) to the nearest value of
    an FP8 grid with ``MANT_BITS`` mantissa bits, ties to even, subnormals included."""
    bits = y.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP)
    ulp = ((exp - MANT_BITS + 127) << 23).to(tl.float32, bitcast=True)
    t = y / ulp  # exact: ulp is a power of two
    r = (t + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds |t| < 2**22 to an integer, RNE
    return or_sign(r * ulp, y)  # a value rounded to zero keeps y's sign, as the cast does


@triton.jit
def round_to(y, dtype: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """float32 ``y`` rounded to ``dtype`` (bf16/fp16/fp32), returned as float32. Under the
    interpreter (``SOFT_ROUND``), whose float casts truncate, it rounds to nearest-even
    first, with integer arithmetic for bf16."""
    if SOFT_ROUND:
        if dtype == tl.bfloat16:
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            y = bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            y = round_to_fp8_grid(y, 10, -14)
    return y.to(dtype).to(tl.float32)


@triton.jit
def div_by_scale(x, scale, X16: tl.constexpr = False):
    """``x / scale`` correctly rounded (IEEE), for a positive ``scale`` (inf and NaN
    included) that broadcasts against ``x`` and ``|x / scale| < 2**126`` (every scale here
    is an amax divided by the format's max, ``|x| <= amax``).

    The division is a product with the reciprocal of the scale, computed once per scale
    (not per element), and two fma corrections: ``q0 = x * r`` is within 1.5 ulp of the
    quotient, the first correction ``q1 = q0 + (x - s q0) r`` within 0.5 ulp + O(2**-46),
    so faithful, and with ``r = RN(1/s)`` and a faithful ``q1`` the residual ``x - s q1`` is
    exact and ``q2 = RN(q1 + (x - s q1) r)`` is the correctly rounded quotient (Markstein's
    theorem: P. Markstein, IBM J. Res. Dev. 34(1), 1990; see also J.-M. Muller et al.,
    *Handbook of Floating-Point Arithmetic*). ``tests/kernels/test_exact_division.py``
    checks the sequence with exact rational arithmetic.
    Five floating-point operations per element, against a division's reciprocal
    approximation, Newton steps, range check and slow-path branch. Special cases as IEEE:
    ``scale = inf`` gives ``±0`` for finite ``x`` and NaN for ``x = ±inf``; a NaN scale gives
    NaN (its sign bit may be set); ``x = -0`` gives ``-0`` (a quotient that rounds to zero
    keeps the sign of ``x``).

    ``X16``: ``x`` holds bf16 or fp16 values and ``scale`` is ``max(amax, AMAX_EPS) /
    fmt.max`` of such a value (:func:`amax_to_scale`), and the quotient is only cast to FP8.
    Then the first correction alone gives the FP8 value of the correctly rounded quotient
    (the float32 quotient itself may be one ulp off): three operations per element. This
    is no theorem but an exhaustive check: every bf16 and fp16 amax mantissa against every
    value of the format below it over the 42 binades an FP8 format can resolve, for e4m3
    and e5m2 (``tests/kernels/test_exact_division.py``)."""
    return or_sign(unsigned_zero_quotient(x, scale, X16), x)  # a zero quotient has x's sign


@triton.jit
def unsigned_zero_quotient(x, scale, X16: tl.constexpr = False):
    """:func:`div_by_scale` except that a zero quotient may be ``+0`` where IEEE says
    ``-0`` (the corrections give ``-0 + 0 = +0``): for a consumer that cannot tell the two
    apart, such as a product sum."""
    s_inf = scale == float("inf")
    r = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)  # once per scale; 0 for inf
    # -scale once per scale (Triton's ``-q`` is ``0 - q``: an instruction per element);
    # for an inf scale r = 0, and -1 in its place makes every correction vanish
    ns = tl.where(s_inf, -1.0, -scale)
    q = x * r
    q = tl.fma(tl.fma(q, ns, x), r, q)
    if not X16:
        q = tl.fma(tl.fma(q, ns, x), r, q)
    return q


@triton.jit
def scale_and_clamp(x, scale, FMT_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                    MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr, X16: tl.constexpr = False):
    """``x / scale`` in float32 as the cast to FP8 must see it to give
    ``clamp(x / scale, ±FMT_MAX)`` cast round-to-nearest-even (``scale`` broadcasts
    against ``x``; ``|x| <= 448 scale`` up to rounding, as :func:`div_by_scale` needs;
    ``X16`` as there: 16-bit values and the scale of their amax, FP8 values exact). The
    caller casts it to FP8 at once. On the GPU the clamp is the cast's own: Triton casts
    float32 to FP8 with ``cvt.rn.satfinite``, which turns a quotient past ``±FMT_MAX`` (only
    rounding makes one) into ``±FMT_MAX`` and keeps NaN, as the clamp would (an
    instruction per element saved). Under the interpreter, whose ``fma`` rounds twice and
    whose cast neither rounds to nearest nor saturates: an IEEE division, the clamp, and
    the rounding to the FP8 grid."""
    if not SOFT_ROUND:
        return div_by_scale(x, scale, X16)
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    y = tl.clamp(y, -FMT_MAX, FMT_MAX, propagate_nan=tl.PropagateNan.ALL)
    return round_to_fp8_grid(y, MANT_BITS, MIN_EXP)


_KERNEL_MODULES = ("quantize", "gemm_rowwise", "gemm_blockwise", "norm_act_quant",
                   "embedding_bag")
"""the modules of this package that hold autotuned kernels"""


def _autotuners(load: bool = False):
    """(kernel name, Autotuner) of every LoKA Triton autotuner loaded in this process;
    ``load``: import the kernel modules first (they load lazily, on a kernel's first use)."""
    import importlib
    import sys

    from triton.runtime.autotuner import Autotuner

    package = __name__.rsplit(".", 1)[0]
    for modname in _KERNEL_MODULES:
        name = f"{package}.{modname}"
        mod = importlib.import_module(name) if load else sys.modules.get(name)
        for attr, obj in (vars(mod).items() if mod is not None else ()):
            if isinstance(obj, Autotuner):
                yield attr, obj


@contextlib.contextmanager
def untuned() -> Iterator[None]:
    """Inside, each of LoKA's autotuners launches a new shape with one config (the largest
    tile that fits), and forgets the shapes it met inside on exit: for calls whose results
    matter but whose speed does not (the Probe's error samples, which every config computes
    alike), so that no config is benchmarked for them and a later timed call at the same
    shape still tunes. For one thread at a time: the autotuners' caches are shared, and
    Triton's autotuner is not thread-safe either."""
    before = {id(t): set(t.cache) for _, t in _autotuners()}
    try:
        with autotune_limit(1):
            yield
    finally:
        for _, tuner in _autotuners():
            known = before.get(id(tuner), set())
            for key in [k for k in tuner.cache if k not in known]:
                del tuner.cache[key]


def _key_part(text: str):
    """One element of an autotuning key as :func:`autotune_choices` wrote it: an int, a
    bool, or a string (a dtype's name)."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return text


def seed_autotune(choices: Mapping[str, Mapping[str, str]]) -> Tuple[int, List[str]]:
    """Preload LoKA's Triton autotuners with the choices of an earlier run (a Probe
    report's ``meta['autotuned']``, as :func:`autotune_choices` wrote them): a shape seen
    before is then launched with its recorded config, with no benchmarking. Only configs
    the autotuner itself offers are taken; choices made on another GPU are valid but may
    not be the fastest here.

    Returns:
        (entries seeded, what was skipped and why).

    Raises:
        ValueError: ``choices`` is not a mapping of kernel name -> {key -> config}.
    """
    if not isinstance(choices, Mapping) or not all(
            isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(c, str)
                                           for k, c in v.items())
            for v in choices.values()):
        raise ValueError("autotune choices must map a kernel name to {key: config} strings")
    tuners = dict(_autotuners(load=True))  # a fresh process has loaded none of them
    seeded, skipped = 0, []
    for name, entries in choices.items():
        tuner = tuners.get(name)
        if tuner is None:
            skipped.append(f"{name}: no such LoKA Triton autotuner")
            continue
        offered = {str(cfg): cfg for cfg in tuner.configs}
        for key, cfg in entries.items():
            if cfg not in offered:
                skipped.append(f"{name}[{key}]: config not offered: {cfg}")
                continue
            tuner.cache[tuple(_key_part(p) for p in key.split(","))] = offered[cfg]
            seeded += 1
    return seeded, skipped


def autotune_choices() -> Dict[str, Dict[str, str]]:
    """kernel name -> {autotuning key -> chosen config} of every LoKA Triton autotuner
    that has tuned something in this process."""
    out: Dict[str, Dict[str, str]] = {}
    for attr, tuner in _autotuners():
        if tuner.cache:
            out[attr] = {",".join(map(str, key)): str(cfg) for key, cfg in tuner.cache.items()}
    return out
