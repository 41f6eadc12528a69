"""What the Probe does after training: measure the kernels (:func:`kernel_names`: on a GPU
the default set, on the CPU every available kernel) at every observed site and role on
operands drawn from the learned statistics, and assemble the
:class:`~loka.probe.report.ProbeReport` (:func:`measure_report`).

Per site and role: ``num_samples`` synthetic operand pairs (:mod:`loka.probe.sampler`) of
``sample_rows`` rows, each run through every measured kernel and compared with one
reference per sample (float64 on the CPU, float32 with TF32 off on GPUs); MERE, SQNR and
relative Frobenius error get bootstrap 95% CIs. With ``compare_naive`` the same with
N(0, 1) operands gives ``naive_mere``. Times are taken at the site's real row count M with
CUDA graphs (:mod:`loka.timing`), once per distinct (role, shape, dtype, kernel), against the
:data:`~loka.config.BASELINE` kernel (the GEMM in the site's own dtype). Forward kernels
are timed twice: with both operands quantized per call (training, where the weight
changes every step) and with the weight quantized beforehand (inference,
``time_us_weight_q``), so that ``loka.plan(..., inference=True)`` judges a serving plan by
what serving costs.

Two passes over the sites: every error sample first, then every timing. Between the
baselines' short estimates (the roofline's input) and the first error sample, the calls
the timing pass will compile go to child processes (:mod:`loka.probe.precompile`) that
compile them into torch.compile's on-disk caches while the errors are sampled; the
timing pass waits for them, then loads what they compiled.

A kernel that fails is a result, not an error: it is carried as a :class:`Failure` and
recorded in the report as :attr:`KernelResult.error <loka.probe.report.KernelResult.error>`
(one line), and a role that cannot be measured as its reason in the site's
``stats['skipped_roles']``. Kernels that cannot matter to a plan (over the error budget;
below ``min_speedup`` even at the device's peak rates) are not timed
(:attr:`KernelResult.not_timed <loka.probe.report.KernelResult.not_timed>`).

Length: errors, timings and the report of one measurement share the per-(site, role)
state they fill in; split, every part would pass all of it back and forth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..config import (BASELINE, GRAD_ROLES, REFERENCE_KERNEL, ProbeConfig, Role, config_to_dict,
                      role_shape)
from ..jsonio import ReportError
from ..kernels import ops, registry
from ..kernels.cublas import col_major
from ..kernels.roofline import autotune_limit, device_peaks, max_speedup
from ..kernels.registry import Kernel, Library
from ..numerics import mere_denominator
from ..timing import TimingResult, time_fn
from . import precompile
from .calls import COMPILE_ENTRIES, compiled_call, linear_dims, one_line
from .pricing import price, splits_gemm, static_cast_fuses
from .report import (ROOFLINE_NOT_TIMED, ErrorStat, KernelResult, ProbeReport, RoleReport,
                     SiteReport, nearest_the_loss)
from .sampler import OperandSampler, error_rows, naive_pair, seed_for
from .stats import SiteStats

__all__ = ["Failure", "SampleErrors", "error_metrics", "run_samples", "bootstrap_stat",
           "KernelTimer", "compiled_call", "compiles_for_timing", "kernel_names", "measure_report",
           "COMPILE_ENTRIES", "COMPILED_LIBRARIES"]

COMPILED_LIBRARIES = (Library.CUBLAS, Library.TORCHAO)
"""kernel libraries whose quantization is plain PyTorch, fused by Inductor when compiled"""


@dataclass(frozen=True)
class Failure:
    """Why a measurement has no value: a kernel raised, or a role could not be measured.

    ``reason`` is the one line the report records (``KernelResult.error``, or the role's
    entry in ``stats['skipped_roles']``)."""

    reason: str

    @classmethod
    def of(cls, exc: BaseException, prefix: str = "") -> "Failure":
        """``prefix`` and the exception's type and first line."""
        return cls(prefix + one_line(exc))


@dataclass(frozen=True)
class SampleErrors:
    """One kernel's errors against the reference, one value per sample pair."""

    mere: List[float]
    sqnr: List[float]
    """dB"""
    relfro: List[float]


# -- errors ------------------------------------------------------------------------------
class _Reference:
    """One sample's reference output with what every metric needs from it, computed once
    and shared by all kernels. Elementwise work runs in the reference's dtype (float64 on
    the CPU, float32 on GPUs, where the reference itself is float32), sums in float64."""

    def __init__(self, ref: torch.Tensor) -> None:
        self.ref = ref.detach()
        self.signal = self.ref.square().sum(dtype=torch.float64)
        self.denom = mere_denominator(self.ref)

    def measure(self, approx: torch.Tensor) -> torch.Tensor:
        """(2,) float64 ``[MERE, ‖approx - ref‖²]`` on the device."""
        if approx.shape != self.ref.shape:
            raise ValueError(f"shape mismatch: approx {tuple(approx.shape)} vs ref "
                             f"{tuple(self.ref.shape)}")
        diff = approx.detach().to(self.ref.dtype) - self.ref
        noise = diff.square().sum(dtype=torch.float64)
        mere_ = torch.div(diff.abs_(), self.denom, out=diff).mean(dtype=torch.float64)
        return torch.stack([mere_, noise])


def _sqnr_relfro(signal: float, noise: float) -> Tuple[float, float]:
    """SQNR (dB) and relative Frobenius error from ``‖ref‖²`` and ``‖approx - ref‖²``,
    with the special cases of :func:`loka.numerics.sqnr` and ``relative_frobenius``."""
    if not (math.isfinite(noise) and math.isfinite(signal)):
        s = math.nan
    elif noise == 0:
        s = math.inf
    elif signal == 0:
        s = -math.inf
    else:
        s = 10.0 * math.log10(signal / noise)
    if signal == 0:
        rf = 0.0 if noise == 0 else math.inf
    else:
        rf = math.sqrt(noise / signal) if noise == noise else math.nan
    return s, rf


def error_metrics(approx: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float, float]:
    """``(MERE, SQNR dB, relative Frobenius)`` of ``approx`` against ``ref``, as
    :func:`loka.numerics.mere`, :func:`~loka.numerics.sqnr` and
    :func:`~loka.numerics.relative_frobenius` define them, the way the Probe computes
    them (one reference pass shared by every kernel)."""
    r = _Reference(ref.double() if ref.device.type == "cpu" else ref.float())
    mere_, noise = r.measure(approx).tolist()
    return (mere_, *_sqnr_relfro(float(r.signal), noise))


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 on the CPU; on GPUs float32 with TF32 off (the registry's 'fp32' kernel)."""
    if a.device.type == "cpu":
        return torch.mm(a.double(), b.double())
    return registry.get(REFERENCE_KERNEL)(a, b, torch.float32)


def run_samples(pairs: Iterable[Tuple[torch.Tensor, torch.Tensor]], kernels: Sequence[Kernel],
                dtype: torch.dtype, twins: Optional[Mapping[str, Sequence[Kernel]]] = None,
                checked: Optional[Dict[str, Optional[str]]] = None
                ) -> Dict[str, Union[SampleErrors, Failure]]:
    """Every kernel on every pair ``(a (M, K), b (K, N))`` against one reference per pair.

    Args:
        twins: ``{twin name: [kernel, ...]}``: kernels that are not sampled because their
            output is said to equal the twin's (one of ``kernels``) bit for bit. On the
            first pair each runs beside its twin, and ``checked[kernel name]`` says None
            where the two outputs are equal, else why not (it raised, its twin raised, or
            the outputs differ).

    Returns:
        ``{kernel name: SampleErrors}``, or a :class:`Failure` for a kernel that raised
        (it is not called again). One host sync per kernel.
    """
    acc: Dict[str, List[torch.Tensor]] = {k.name: [] for k in kernels}
    failed: Dict[str, Failure] = {}
    signals = []
    with torch.no_grad():
        for i, (a, b) in enumerate(pairs):
            ref = _Reference(_reference(a, b))
            signals.append(ref.signal)
            for k in kernels:
                if k.name in failed:
                    continue
                try:
                    y = k(a, b, dtype)
                    acc[k.name].append(ref.measure(y))
                except Exception as e:  # noqa: BLE001 - a failing kernel is a result
                    failed[k.name] = Failure.of(e)
                    y = None
                if i == 0 and twins and checked is not None:
                    for dep in twins.get(k.name, ()):
                        checked[dep.name] = _same_bits(dep, a, b, dtype, y)
    signal = torch.stack(signals).tolist() if signals else []
    out: Dict[str, Union[SampleErrors, Failure]] = {}
    for name, vals in acc.items():
        if name in failed:
            out[name] = failed[name]
            continue
        meres, noises = torch.stack(vals).t().tolist()
        sq, rf = zip(*(_sqnr_relfro(s, n) for s, n in zip(signal, noises)))
        out[name] = SampleErrors(meres, list(sq), list(rf))
    return out


def _same_bits(kern: Kernel, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
               want: Optional[torch.Tensor]) -> Optional[str]:
    """None where ``kern(a, b)`` equals its twin's output ``want`` bit for bit, else why not."""
    if want is None:
        return "its twin failed"
    try:
        got = kern(a, b, dtype)
    except Exception as e:  # noqa: BLE001
        return f"it raised {one_line(e)}"
    if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
        return "its output differs from its twin's"
    return None


def twin_sources(kernels: Sequence[Kernel]) -> Dict[str, str]:
    """``{kernel: twin}`` for each kernel of ``kernels`` whose output equals a kernel's
    among them bit for bit (``Kernel.same_bits_as``), where that twin is sampled itself
    (it names no twin among them: in a chain or a cycle the kernels sampled decide, none
    is copied from a copy): its errors are the twin's (``ProbeConfig.twin_errors``)."""
    names = {k.name for k in kernels}
    named = {k.name: k.same_bits_as for k in kernels
             if k.same_bits_as is not None and k.same_bits_as in names
             and k.same_bits_as != k.name}
    return {name: twin for name, twin in named.items() if twin not in named}


def bootstrap_stat(values, resamples: int = 1000, seed: int = 0, level: float = 0.95
                   ) -> ErrorStat:
    """Mean of per-sample values with a percentile-bootstrap confidence interval.

    Args:
        values: (n,) per-sample statistics (e.g. one MERE per synthetic sample).
        resamples: bootstrap resamples; 0 gives the normal interval ``mean ± 1.96 s/√n``.
        seed: seed of the resampling.
        level: coverage of the interval.

    Returns:
        :class:`~loka.probe.report.ErrorStat` (mean, lo, hi, n, std). Non-finite values
        propagate (a NaN anywhere makes every field NaN), so they never pass a budget.
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n = v.size
    if n == 0:
        raise ValueError("bootstrap_stat needs at least one value")
    with np.errstate(all="ignore"):
        mean = float(v.mean())
        std = float(v.std(ddof=1)) if n > 1 else 0.0
        if not np.isfinite(v).all():
            return ErrorStat(mean, mean, mean, n, std)
        alpha = (1.0 - level) / 2.0
        if resamples == 0 or n == 1:
            half = statistics.NormalDist().inv_cdf(1.0 - alpha) * std / math.sqrt(n)
            return ErrorStat(mean, mean - half, mean + half, n, std)
        rng = np.random.default_rng(seed)
        means = v[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return ErrorStat(mean, float(lo), float(hi), n, std)


# -- timing ------------------------------------------------------------------------------
def gemm_layouts(a, b):
    """FP8 operands ``a`` and ``b`` (:class:`~loka.numerics.scaling.QTensor`) laid out as
    the library GEMMs of compiled kernels read them (``torch._scaled_mm``: a row-major, b
    column-major), the same values. Inside a compiled call the quantization writes these
    layouts as it casts; the GEMM timed alone on operands made beforehand must not pay a
    layout copy of its own (an FP8 transpose outside the fused cast), or it takes longer
    than the whole call."""
    return (dataclasses.replace(a, data=a.data.contiguous()),
            dataclasses.replace(b, data=col_major(b.data)))


def kernel_names(config: ProbeConfig, device: torch.device) -> Optional[Tuple[str, ...]]:
    """The kernel names a Probe measures on ``device`` (None: every available kernel):
    ``config.kernels`` where given; else on a GPU the default set
    (:data:`loka.kernels.registry.PROBE_DEFAULT`) unless ``config.all_kernels``."""
    if config.kernels is not None:
        return tuple(config.kernels)
    if torch.device(device).type != "cpu" and not config.all_kernels:
        return registry.PROBE_DEFAULT
    return None


def _warn_slow_cpu(config: ProbeConfig, device: Optional[torch.device]) -> Dict[str, float]:
    """On a CPU whose ``torch._scaled_mm`` is very slow
    (:func:`loka.kernels.registry.slow_cpu_kernels`), a warning naming the kernels of this
    Probe that call it (whatever shapes its sites have), before anything is measured: they
    are measured as asked where the shapes allow, and their emulated twins would give the
    same FP8 numbers in a fraction of the time. Returns ``{kernel: slowdown}`` for the
    report's ``meta['slow_cpu_kernels']`` (empty elsewhere)."""
    if device is None or device.type != "cpu":
        return {}
    names, slow = registry.slow_cpu_kernels(
        registry.available(device, names=kernel_names(config, device)))
    if not names:
        return {}
    warnings.warn(f"loka.probe: this CPU's torch._scaled_mm takes {slow:.0f}x a float32 "
                  f"matmul's time, so measuring {', '.join(names)} will be slow; their "
                  "emulated twins (emulated-*) compute the same FP8 numbers: leave them out "
                  "with ProbeConfig(kernels=...) or the CLI's --kernels", stacklevel=4)
    return {name: round(slow, 1) for name in names}


def not_runnable(config: ProbeConfig, device: torch.device) -> Dict[str, str]:
    """The kernels ``config.kernels`` names that cannot run on ``device`` (or are not
    registered), each with why: the Probe measures the others and says so (the report's
    ``meta['kernels_not_measured']``, a warning, a note in every plan made from it)."""
    out: Dict[str, str] = {}
    for name in config.kernels or ():
        why = registry.why_not_runnable(name, device)
        if why is not None:
            out[name] = why
    return out


def compiles_for_timing(kern: Kernel, dev: torch.device, mode: str) -> bool:
    """Whether the Probe times ``kern`` under ``torch.compile`` on ``dev``, for
    ``ProbeConfig.timing_compile`` ``mode`` ('on', 'off' or 'auto': on CUDA only)."""
    if mode == "off" or (mode == "auto" and dev.type != "cuda"):
        return False

    # own quantization kernels (Triton kernels, C++ libraries) gain no fusion from
    # Inductor; emulated kernels are references, not candidates for speed
    return kern.is_fp8 and kern.library in COMPILED_LIBRARIES and not ops.is_opaque(kern)


class KernelTimer:
    """Times kernel calls for one report: each (kernel, role, shape, dtype, device,
    ``weight_q``) once, all on one N(0, 1) operand pair per (role, shape, dtype, device),
    each compiled kernel compiled once per output dtype."""

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self._results: Dict[tuple, Union[TimingResult, Failure]] = {}
        self._operands: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._compiled: Dict[tuple, Callable] = {}

    def time(self, kernel: str, role: Role, shape: Tuple[int, int, int], dev: torch.device,
             dtype: torch.dtype, weight_q: bool = False, gemm_only: bool = False
             ) -> Union[TimingResult, Failure]:
        """The kernel's :class:`~loka.timing.TimingResult` at GEMM ``shape`` (M, K, N), or
        a :class:`Failure` ('timing failed: ...'). ``weight_q``: the b operand (the weight)
        is quantized before timing (inference); ``gemm_only``: both operands are."""
        key = (kernel, role, tuple(shape), dtype, str(dev), weight_q, gemm_only)
        if key not in self._results:
            derived = None if gemm_only else self._derive(kernel, role, shape, dev, dtype,
                                                          weight_q)
            self._results[key] = derived or self._measure(kernel, role, shape, dev, dtype,
                                                          weight_q, gemm_only)
        return self._results[key]

    def estimate(self, kernel: str, role: Role, shape: Tuple[int, int, int], dev: torch.device,
                 dtype: torch.dtype) -> Optional[float]:
        """A kernel's median time (us) from a short timing (2 calls of warm-up, 5 timed),
        not kept (:meth:`time` times it in full when asked); None where it failed."""
        try:
            a, b = self._pair(role, shape, dev, dtype)
            kern = registry.get(kernel)
            with torch.no_grad():
                return time_fn(lambda: kern(a, b, dtype), device=dev, warmup=2, iters=5,
                               budget_ms=None).median_us
        except Exception:  # noqa: BLE001 - no estimate: nothing is ruled out
            return None

    def _derive(self, kernel, role, shape, dev, dtype, weight_q) -> Optional[TimingResult]:
        """The compiled call of a kernel that quantizes as another one does
        (``Kernel.quantizes_as``), from that kernel's compiled call, less its GEMM, plus
        this kernel's GEMM (both timed alone, uncompiled: no compile for this kernel);
        None where that kernel's call was not timed compiled or a time is missing."""
        kern = registry.get(kernel)
        twin = kern.quantizes_as
        if not twin or not compiles_for_timing(kern, dev, self.config.timing_compile):
            return None
        call = self._results.get((twin, role, tuple(shape), dtype, str(dev), weight_q, False))
        if not (isinstance(call, TimingResult) and call.method.endswith("+compiled")):
            return None
        gemm_twin = self.time(twin, role, shape, dev, dtype, gemm_only=True)
        gemm = self.time(kernel, role, shape, dev, dtype, gemm_only=True)
        if not (isinstance(gemm_twin, TimingResult) and isinstance(gemm, TimingResult)):
            return None
        us = call.median_us - gemm_twin.median_us + gemm.median_us
        if not us > 0:
            return None
        method = call.method[:-len("+compiled")] + "+derived+compiled"
        return TimingResult(us, method, min(call.iters, gemm.iters),
                            note=f"derived: {twin}'s compiled call with this kernel's GEMM")

    def tune(self, kernel: str, role: Role, shape: Tuple[int, int, int], dev: torch.device,
             dtype: torch.dtype, weight_q: bool = False) -> bool:
        """Call an eagerly timed kernel once on the operands :meth:`time` will use, without
        timing it: its Triton autotuners pick their configs for these shapes now (under
        ``ProbeConfig.autotune_configs``), and the later timing launches the chosen ones.
        Returns whether the call ran (a failure is left for :meth:`time` to record)."""
        a, b = self._pair(role, shape, dev, dtype)
        kern = registry.get(kernel)
        try:
            with torch.no_grad(), autotune_limit(self.config.autotune_configs):
                if weight_q:
                    b = kern.quantize_b(b)
                kern(a, b, dtype)
            return True
        except Exception:  # noqa: BLE001 - timed (and recorded as failed) later
            return False

    def _pair(self, role, shape, dev, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (role, tuple(shape), dtype, str(dev))
        if key not in self._operands:
            gen = torch.Generator(device=dev)
            gen.manual_seed(self.config.seed)
            self._operands[key] = naive_pair(role, *linear_dims(role, shape), dev, dtype, gen)
        return self._operands[key]

    def _compiled_call(self, kern: Kernel, dtype: torch.dtype) -> Callable:
        key = (kern.name, dtype)
        if key not in self._compiled:
            self._compiled[key] = compiled_call(kern, dtype)
        return self._compiled[key]

    def _measure(self, kernel, role, shape, dev, dtype, weight_q, gemm_only=False
                 ) -> Union[TimingResult, Failure]:
        cfg = self.config
        a, b = self._pair(role, shape, dev, dtype)
        kern = registry.get(kernel)
        try:
            if weight_q or gemm_only:
                with torch.no_grad():
                    b = kern.quantize_b(b)
                    if gemm_only:
                        a, b = gemm_layouts(kern.quantize_a(a), b)
            timed = functools.partial(time_fn, device=dev, warmup=cfg.timing_warmup,
                                      iters=cfg.timing_iters, budget_ms=cfg.timing_budget_ms,
                                      flush_l2=cfg.cold_cache)
            with torch.no_grad(), autotune_limit(cfg.autotune_configs):
                # the GEMM alone is one library call on operands quantized beforehand:
                # Inductor has nothing to fuse into it, so it is timed as it is (a compiled
                # graph per shape for it would add a third of the Probe's compiles)
                if gemm_only or not compiles_for_timing(kern, dev, cfg.timing_compile):
                    return timed(lambda: kern(a, b, dtype))
                call = self._compiled_call(kern, dtype)
                try:
                    result = timed(lambda: call(a, b))
                    return dataclasses.replace(result, method=result.method + "+compiled")
                except Exception as e:  # noqa: BLE001 - compilation failed: time eagerly
                    result = timed(lambda: kern(a, b, dtype))
                    return dataclasses.replace(
                        result, note=f"torch.compile failed, timed eagerly: {one_line(e)}")
        except Exception as e:  # noqa: BLE001
            return Failure.of(e, "timing failed: ")


# -- one report --------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


@dataclass
class _RoleWork:
    """One role of one site between the Probe's passes: what it measures, and what it
    measured so far."""

    role: Role
    shape: Tuple[int, int, int]
    """the timed GEMM shape (M, K, N) at the site's row count"""
    m_time: int
    m_err: int
    kernels: List[Kernel] = dataclasses.field(default_factory=list)
    errors: Dict[str, Union[SampleErrors, Failure]] = dataclasses.field(default_factory=dict)
    naive: Dict[str, Union[SampleErrors, Failure]] = dataclasses.field(default_factory=dict)
    errors_from: Dict[str, str] = dataclasses.field(default_factory=dict)
    """kernels whose errors are a bit-identical twin's (:func:`twin_sources`)"""
    est_base_us: Optional[float] = None
    """the baseline's time from a short timing before the errors (what to compile ahead)"""

    def timed_shape(self, kern: Kernel) -> Tuple[int, int, int]:
        """The shape ``kern`` is timed at: the weight gradient runs at the kernel's padded
        token count, as loka.Linear runs it."""
        if self.role is Role.WGRAD:
            k_in, n_out = self.shape[2], self.shape[0]
            return role_shape(self.role, kern.padded_tokens(self.m_time), k_in, n_out)
        return self.shape


@dataclass
class _SiteWork:
    """One observed site between the Probe's passes."""

    name: str
    site: SiteStats
    module: nn.Linear
    dev: torch.device
    dtype: torch.dtype
    roles: List[_RoleWork] = dataclasses.field(default_factory=list)
    skipped: Dict[str, str] = dataclasses.field(default_factory=dict)


class _Measurement:
    """The state of one :func:`measure_report`: its timer and its wall time per phase."""

    def __init__(self, config: ProbeConfig, status: Callable[[str], None] = lambda s: None
                 ) -> None:
        self.config = config
        self.timer = KernelTimer(config)
        self.phases: Dict[str, float] = {}
        self.not_timed: Dict[str, int] = {}
        """why kernels were not timed -> how many (site, role, kernel) triples"""
        self.status = status
        """shows what is being measured (the progress bar's postfix)"""
        self.where = ""
        self.twin_mismatches: List[str] = []
        """site, role and kernel where a kernel's output did not equal its twin's (then
        sampled itself; the report's ``meta['twin_mismatches']``)"""
        self.head: Tuple[str, ...] = ()
        """the sites nearest the loss, measured forwards only (``ProbeConfig.head_sites``)"""

    @contextlib.contextmanager
    def phase(self, name: str, dev: torch.device):
        """Accumulate wall time per phase (the report's ``meta['phases_s']``)."""
        self.status(f"{self.where} {name}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def plan_role(self, site: SiteStats, role: Role, dev: torch.device
                  ) -> Union["_RoleWork", Failure]:
        """What one role will measure (its shapes and kernels), or why nothing: no work on
        the device yet."""
        cfg = self.config
        k_in, n_out = site.in_features, site.out_features
        m_time = cfg.timing_rows or site.tokens
        m_err = error_rows(site, cfg.source, cfg.sample_rows)
        if m_err == 0:
            return Failure("nothing captured")
        shape = role_shape(role, m_time, k_in, n_out)
        err_shape = role_shape(role, m_err, k_in, n_out)
        work = _RoleWork(role, shape, m_time, m_err)
        kernels = [k for k in registry.available(dev, role=role, names=kernel_names(cfg, dev))
                   if k.supports(dev, *work.timed_shape(k), role=role)
                   and k.supports(dev, *err_shape, role=role)]
        if cfg.kernels is None and dev.type != "cpu":
            # off the CPU the reference *is* the fp32 kernel: measuring it would say nothing
            kernels = [k for k in kernels if k.name != REFERENCE_KERNEL]
            if cfg.skip_emulated_twins:
                real = {k.name for k in kernels}
                kernels = [k for k in kernels if not (k.is_emulated and k.emulates in real)]
        if not kernels:
            return Failure("no kernel supports this shape")
        work.kernels = kernels
        return work

    def plan_site(self, name: str, site: SiteStats, module: nn.Linear, dev: torch.device
                  ) -> "_SiteWork":
        """Every configured role of one observed site, planned (:meth:`plan_role`)."""
        dtype = site.dtype or module.weight.dtype
        work = _SiteWork(name, site, module, dev, dtype)
        for role in self.config.roles:
            if role in GRAD_ROLES and site.grad.updates == 0:
                work.skipped[role.value] = "no output gradient observed"
                continue
            if role in GRAD_ROLES and name in self.head:
                work.skipped[role.value] = (
                    f"nearest the loss (ProbeConfig.head_sites={self.config.head_sites}): "
                    f"a training plan keeps it on the baseline, a serving plan needs no "
                    f"gradient")
                continue
            rw = self.plan_role(site, role, dev)
            if isinstance(rw, Failure):
                work.skipped[role.value] = rw.reason
            else:
                work.roles.append(rw)
        return work

    def estimate_baselines(self, works: Sequence["_SiteWork"]) -> None:
        """A short timing of the baseline at every planned role's shape, for the roofline
        bounds of :meth:`compile_plan` only. It is not kept: timed in a pass of their own
        before the errors, the bf16 GEMMs ran up to 18% slower on an H100 than in a run
        that timed each beside its kernels, while the FP8 kernels' times agreed within 2%
        (bench/results/2026-12-06-h100-precompile/NOTE.md), so the timing pass times the
        baseline again beside the kernels it is compared with."""
        if not self.config.timing:
            return
        seen: Dict[tuple, Optional[float]] = {}
        for work in works:
            self.where = work.name
            for rw in work.roles:
                key = (rw.role, rw.shape, work.dtype, str(work.dev))
                if key not in seen:
                    with self.phase("timing", work.dev):
                        seen[key] = self.timer.estimate(BASELINE, rw.role, rw.shape,
                                                        work.dev, work.dtype)
                rw.est_base_us = seen[key]

    def compile_plan(self, works: Sequence["_SiteWork"]) -> List["precompile.Entry"]:
        """The calls the timing pass will compile (:func:`compiles_for_timing`): each
        kernel whose time is not derived from a twin's (``Kernel.quantizes_as``) and that
        the roofline does not rule out, at its timed shape, and forwards with the weight
        quantized beforehand too. Kernels over the error budget are in it: the errors are
        not known yet."""
        cfg = self.config
        out: Dict[tuple, precompile.Entry] = {}
        if not cfg.timing:
            return []
        for work in works:
            for rw in work.roles:
                names = {k.name for k in rw.kernels}
                for k in rw.kernels:
                    if not compiles_for_timing(k, work.dev, cfg.timing_compile) or (
                            k.quantizes_as in names):
                        continue
                    shape = rw.timed_shape(k)
                    if self._roofline_bound(k, rw.role, shape, work.dev, work.dtype,
                                            rw.est_base_us, work.site.producers) is not None:
                        continue
                    variants = (False, True) if (rw.role is Role.FWD
                                                 and k.quantize_b is not None) else (False,)
                    for weight_q in variants:
                        e = precompile.Entry(k.name, rw.role.value, tuple(shape),
                                             str(work.dtype).replace("torch.", ""), weight_q)
                        out[e] = e
        return list(out)

    def errors(self, work: "_SiteWork") -> None:
        """The error samples of every planned role of one site."""
        cfg = self.config
        site, dev, dtype = work.site, work.dev, work.dtype
        kept, shared = [], {}
        for rw in work.roles:
            self.where = f"{site.name} {rw.role.value}"
            rw.errors_from = twin_sources(rw.kernels) if cfg.twin_errors else {}
            sampled = [k for k in rw.kernels if k.name not in rw.errors_from]
            checked: Dict[str, Optional[str]] = {}
            try:
                with self.phase("errors", dev), _untuned(rw.kernels):
                    def draw():
                        return OperandSampler(site, rw.role, dev, dtype, source=cfg.source,
                                              weight_source=cfg.weight_source,
                                              weight=work.module.weight, seed=cfg.seed,
                                              shared=shared).pairs(cfg.num_samples, rw.m_err)
                    by_name = {k.name: k for k in rw.kernels}
                    twins: Dict[str, List[Kernel]] = {}
                    for name, twin in rw.errors_from.items():
                        twins.setdefault(twin, []).append(by_name[name])
                    rw.errors = run_samples(draw(), sampled, dtype, twins, checked)
                    # a twin that failed, or a kernel that did not match it: sampled itself,
                    # on the same pairs (the sampler's stream restarts from its seed)
                    for name, twin in rw.errors_from.items():
                        if checked.get(name) is None and isinstance(rw.errors[twin], Failure):
                            checked[name] = "its twin failed"
                    own = [k for k in rw.kernels if checked.get(k.name) is not None]
                    for k in own:
                        del rw.errors_from[k.name]
                        self.twin_mismatches.append(
                            f"{site.name} {rw.role.value} {k.name}: {checked[k.name]}")
                    if own:
                        rw.errors.update(run_samples(draw(), own, dtype))
                        sampled += own
            except ValueError as e:  # too little data to build the sampler
                work.skipped[rw.role.value] = Failure.of(e).reason
                continue
            for name, twin in rw.errors_from.items():
                rw.errors[name] = rw.errors[twin]
            # entered (and reported) when off
            with self.phase("naive", dev), _untuned(sampled):
                rw.naive = (self.naive(site, rw.role, dev, dtype, sampled, rw.m_err)
                            if cfg.compare_naive else {})
            for name, twin in rw.errors_from.items():
                if twin in rw.naive:
                    rw.naive[name] = rw.naive[twin]
            kept.append(rw)
        work.roles = kept

    def tune_ahead(self, works: Sequence["_SiteWork"]) -> int:
        """While the compiling children finish (:mod:`loka.probe.precompile`), let LoKA's
        Triton kernels autotune at the shapes the timing pass will time them at: each
        timed eager call of a Triton kernel whose errors are within ``max_error`` (or
        ``time_unsafe``) and that the roofline does not rule out, and its forward with the
        weight quantized beforehand. Autotuning picks configs and times nothing kept; the
        timings themselves still start once the children are done. Returns the calls
        made (the report's ``meta['tuned_ahead']``)."""
        cfg, calls = self.config, 0
        if not cfg.timing:
            return 0
        for work in works:
            for rw in work.roles:
                for k in rw.kernels:
                    if (k.library is not Library.TRITON or not k.is_fp8
                            or compiles_for_timing(k, work.dev, cfg.timing_compile)):
                        continue
                    measured = rw.errors.get(k.name)
                    if not isinstance(measured, SampleErrors) or not (
                            cfg.time_unsafe or self._within_budget(
                                bootstrap_stat(measured.mere, cfg.bootstrap,
                                               self._bootstrap_seed(work, rw)))):
                        continue
                    shape = rw.timed_shape(k)
                    if self._roofline_bound(k, rw.role, shape, work.dev, work.dtype,
                                            rw.est_base_us, work.site.producers) is not None:
                        continue
                    self.where = f"{work.name} {rw.role.value}"
                    variants = (False, True) if (rw.role is Role.FWD
                                                 and k.quantize_b is not None) else (False,)
                    for weight_q in variants:
                        with self.phase("tune_ahead", work.dev):
                            calls += self.timer.tune(k.name, rw.role, shape, work.dev,
                                                     work.dtype, weight_q)
        return calls

    def _bootstrap_seed(self, work: "_SiteWork", rw: "_RoleWork") -> int:
        return seed_for(self.config.seed, work.site.name, rw.role.value, "bootstrap")

    def _within_budget(self, mere: Optional[ErrorStat]) -> bool:
        """A kernel's ``safe`` flag from its errors: the MERE's upper bound is finite and
        under ``max_error``."""
        return mere is not None and math.isfinite(mere.hi) and mere.hi < self.config.max_error

    def finish(self, work: "_SiteWork") -> SiteReport:
        """Time what :meth:`errors` found worth timing and assemble the site's report."""
        site = work.site
        stats = site.summary()
        sr = SiteReport(work.name, site.in_features, site.out_features, site.tokens,
                        str(work.dtype).replace("torch.", ""), stats,
                        producers=dict(site.producers), order=site.order)
        for rw in work.roles:
            sr.roles[rw.role] = self.role_report(work, rw)
        if work.skipped:
            stats["skipped_roles"] = {r.value: work.skipped[r.value] for r in self.config.roles
                                      if r.value in work.skipped}
        return sr

    def role_report(self, work: "_SiteWork", rw: "_RoleWork") -> RoleReport:
        """Every kernel of one role: its errors (measured) and its times."""
        cfg, site, dev, dtype, role = self.config, work.site, work.dev, work.dtype, rw.role
        self.where = f"{site.name} {role.value}"
        base_us = None
        if cfg.timing:
            with self.phase("timing", dev):
                baseline = self.timer.time(BASELINE, role, rw.shape, dev, dtype)
            base_us = baseline.median_us if isinstance(baseline, TimingResult) else None
        rr = RoleReport(role, rw.shape, base_us)
        seed = self._bootstrap_seed(work, rw)
        for k in rw.kernels:
            kr = KernelResult(k.name, errors_from=rw.errors_from.get(k.name))
            measured = rw.errors[k.name]
            if isinstance(measured, Failure):
                kr.error = measured.reason
            else:
                kr.mere, kr.sqnr, kr.relfro = (
                    bootstrap_stat(v, cfg.bootstrap, seed)
                    for v in (measured.mere, measured.sqnr, measured.relfro))
            naive_k = rw.naive.get(k.name)
            if isinstance(naive_k, SampleErrors):
                kr.naive_mere = bootstrap_stat(naive_k.mere, cfg.bootstrap, seed)
            kr.safe = kr.error is None and self._within_budget(kr.mere)
            if cfg.timing and kr.error is None:
                kr.not_timed = self._not_timed(kr, k, role, rw.timed_shape(k), dev, dtype,
                                               base_us, site.producers)
                if kr.not_timed is None:
                    self._time_kernel(kr, k, role, rw.timed_shape(k), dev, dtype, base_us,
                                      site.producers)
                    kr.safe = kr.safe and kr.error is None
                else:
                    reason = kr.not_timed.split(":")[0]
                    self.not_timed[reason] = self.not_timed.get(reason, 0) + 1
            # a CPU wall clock says nothing of FP8 speed on a GPU: never flagged fast; the
            # step-aware speedup decides where the report has one
            speedup = kr.step_speedup if kr.step_speedup is not None else kr.speedup
            kr.fast = (speedup is not None and speedup > cfg.min_speedup
                       and not kr.timing.startswith("cpu-wallclock"))
            rr.kernels[k.name] = kr
        return rr

    def _not_timed(self, kr: KernelResult, k: Kernel, role: Role, shape, dev: torch.device,
                   dtype: torch.dtype, base_us: Optional[float],
                   producers: Mapping[str, str] = {}) -> Optional[str]:
        """Why timing ``k`` here would tell the plan nothing, or None to time it: an FP8
        kernel over the error budget is no candidate (``ProbeConfig.time_unsafe``), and one
        whose roofline bound (:mod:`loka.kernels.roofline`) cannot reach ``min_speedup``
        over the measured baseline is never fast (``ProbeConfig.roofline_prune``)."""
        cfg = self.config
        if not k.is_fp8:
            return None
        if not kr.safe and not cfg.time_unsafe:
            return f"unsafe: MERE upper bound over {cfg.max_error:g}"
        bound = self._roofline_bound(k, role, shape, dev, dtype, base_us, producers)
        if bound is not None:
            kr.roofline_bound = float(bound)
            return ROOFLINE_NOT_TIMED.format(bound=bound)
        return None

    def _roofline_bound(self, k: Kernel, role: Role, shape, dev: torch.device,
                        dtype: torch.dtype, base_us: Optional[float],
                        producers: Mapping[str, str] = {}) -> Optional[float]:
        """The roofline bound of FP8 kernel ``k``'s speedup where it rules the kernel out
        (below ``min_speedup``), else None. A forward is bounded as a serving plan can run
        it, the kinder way: its weight quantized beforehand, and, for a kernel whose
        quantizer Inductor compiles where x's producer takes a static cast
        (:func:`~loka.probe.pricing.static_cast_fuses`), x arriving in FP8 too (a
        memory-bound GEMM then reads half the bytes)."""
        cfg = self.config
        peaks = device_peaks(dev) if cfg.roofline_prune and base_us and k.is_fp8 else None
        if peaks is None:
            return None
        fwd = role is Role.FWD
        free_x = (fwd and compiles_for_timing(k, dev, cfg.timing_compile)
                  and static_cast_fuses(producers))
        bound = max_speedup(base_us, shape, peaks, quantizes_a=not free_x, quantizes_b=not fwd,
                            in_bytes=dtype.itemsize, out_bytes=dtype.itemsize)
        return bound if bound < cfg.min_speedup else None

    def _time_kernel(self, kr: KernelResult, k: Kernel, role: Role, shape, dev, dtype,
                     base_us: Optional[float], producers: Mapping[str, str] = {}) -> None:
        """Fill ``kr``'s times and speedups (the step-aware ones too: the GEMM timed with
        its operands quantized beforehand, :mod:`loka.probe.pricing`), or its ``error`` if
        the timing failed."""
        with self.phase("timing", dev):
            t = self.timer.time(k.name, role, shape, dev, dtype)
        if isinstance(t, Failure):
            kr.error = t.reason
            return
        kr.time_us, kr.timing = t.median_us, t.method
        if base_us is not None and t.median_us > 0:
            kr.speedup = base_us / t.median_us
        if role is Role.FWD and k.is_fp8 and k.quantize_b is not None:
            with self.phase("timing", dev):
                tq = self.timer.time(k.name, role, shape, dev, dtype, weight_q=True)
            if isinstance(tq, TimingResult):
                kr.time_us_weight_q = tq.median_us
                if base_us is not None and tq.median_us > 0:
                    kr.speedup_weight_q = base_us / tq.median_us
        # the GEMM alone splits the call's time, where a quantization could fuse in the step
        if splits_gemm(k, role, producers, kr.timing.endswith("+compiled")):
            with self.phase("timing", dev):
                tg = self.timer.time(k.name, role, shape, dev, dtype, gemm_only=True)
            if isinstance(tg, TimingResult):
                kr.time_us_gemm = tg.median_us
                price(kr, k, role, shape, producers, base_us)

    def naive(self, site: SiteStats, role: Role, dev: torch.device, dtype: torch.dtype,
              kernels: Sequence[Kernel], rows: int) -> Dict[str, Union[SampleErrors, Failure]]:
        """:func:`run_samples` on N(0, 1) operands of the same shapes."""
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed_for(self.config.seed, site.name, role.value, "naive"))
        pairs = (naive_pair(role, rows, site.in_features, site.out_features, dev, dtype, gen)
                 for _ in range(self.config.naive_samples))
        return run_samples(pairs, kernels, dtype)


@contextlib.contextmanager
def _untuned(kernels: Sequence[Kernel]):
    """The error samples' calls of LoKA's Triton kernels launch one config and leave no
    autotuning behind (:func:`loka.kernels.triton.common.untuned`): every config computes
    the same errors, and these shapes (``sample_rows``) are never timed."""
    if not any(k.library is Library.TRITON for k in kernels):
        yield
        return
    from ..kernels.triton import common

    with common.untuned():
        yield


def _spent() -> Dict[str, float]:
    """Seconds spent so far in this process by Dynamo and Inductor compiling, and by LoKA's
    Triton autotuners (with the configs' own compiles), and the configs benchmarked; the
    compiled graphs Inductor loaded from its FX graph cache (``fxgraph_hits``: what the
    precompile children made), compiled itself (``fxgraph_misses``) or could not cache
    (``fxgraph_bypasses``), and the same three counts of AOTAutograd's cache
    (``aot_hits``, ``aot_misses``, ``aot_bypasses``), which sits in front of it."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out = {"compile_s": float(sum(compilation_time_metrics.get("_compile.compile_inner", ())))}
    inductor = counters["inductor"]
    for key, name in (("fxgraph_cache_hit", "fxgraph_hits"),
                      ("fxgraph_cache_miss", "fxgraph_misses"),
                      ("fxgraph_cache_bypass", "fxgraph_bypasses")):
        out[name] = float(inductor.get(key, 0))
    aot = counters["aot_autograd"]
    for key, name in (("autograd_cache_hit", "aot_hits"), ("autograd_cache_miss", "aot_misses"),
                      ("autograd_cache_bypass", "aot_bypasses")):
        out[name] = float(aot.get(key, 0))
    common = sys.modules.get("loka.kernels.triton.common")
    configs, seconds = common.tuning_spent() if common is not None else (0, 0.0)
    out.update(autotune_s=float(seconds), autotune_configs=float(configs))
    return out


def _autotune_choices() -> Dict[str, Dict[str, str]]:
    """The configs LoKA's Triton autotuners chose (kept in the report, so that a run can
    see what was tuned); empty where the kernels were never loaded."""
    if "loka.kernels.triton.common" not in sys.modules:
        return {}
    from ..kernels.triton import common

    return common.autotune_choices()


def _seed_autotune(path: str) -> Dict[str, object]:
    """Load the Triton autotuning choices of the report at ``path`` (``autotune_from``)."""
    report = ProbeReport.load(path)
    choices = report.meta.get("autotuned", {})
    try:
        from ..kernels.triton import common
    except ImportError as e:
        return {"from": str(path), "seeded": 0, "skipped": [f"Triton is not available: {e}"]}
    try:
        seeded, skipped = common.seed_autotune(choices)
    except ValueError as e:
        raise ReportError(f"{path}: meta.autotuned: {e}") from None
    return {"from": str(path), "seeded": seeded, "skipped": skipped}


def measure_report(sites: Mapping[str, SiteStats], modules: Mapping[str, nn.Linear],
                   config: ProbeConfig, device: "torch.device | str | None" = None,
                   meta: Optional[Mapping[str, object]] = None) -> ProbeReport:
    """Measure every available kernel at every observed site and role.

    Args:
        sites: what was learned per site (fully qualified name -> statistics).
        modules: the Linear of each site (its weight's device, dtype and values).
        config: the Probe's settings.
        device: where to measure (default: each site's weight device).
        meta: entries that come first in the report's ``meta`` (the steps observed).

    Returns:
        :class:`~loka.probe.report.ProbeReport`; sites never observed are listed in
        ``meta['unobserved_sites']``.
    """
    start, spent = time.perf_counter(), _spent()
    seeded = _seed_autotune(config.autotune_from) if config.autotune_from else None
    unobserved = [name for name in sites if sites[name].act.updates == 0]
    observed = [name for name in sites if sites[name].act.updates > 0]
    # two passes over the sites: errors, then timings (each site's bar step once per pass)
    bar = tqdm(total=2 * len(observed), desc="probe", unit="step",
               disable=not config.progress, dynamic_ncols=True)
    run = _Measurement(config, status=bar.set_postfix_str)
    run.head = tuple(nearest_the_loss({n: sites[n].order for n in observed}, config.head_sites))
    works = []
    for name in observed:
        module = modules[name]
        dev = torch.device(device) if device is not None else module.weight.device
        works.append(run.plan_site(name, sites[name], module, dev))
    used = works[0].dev if works else None
    missing = not_runnable(config, used) if used is not None else {}
    if missing:
        warnings.warn("loka.probe: kernels asked for that cannot run here were not measured: "
                      + "; ".join(f"{n} ({why})" for n, why in missing.items()), stacklevel=3)
    slow_kernels = _warn_slow_cpu(config, used)
    # the baselines' estimates first: they rule kernels out (roofline) before anything compiles
    run.estimate_baselines(works)
    pre = precompile.start(run.compile_plan(works), used, config) if works else None
    precompiled, tuned_ahead = None, 0
    try:
        for work in works:
            run.errors(work)
            bar.update()
        if config.tune_ahead and pre is not None and pre.running():
            tuned_ahead = run.tune_ahead(works)
        precompiled = pre.wait(status=bar.set_postfix_str) if pre is not None else None
        if precompiled and precompiled.get("state_changed"):
            warnings.warn("loka.probe: settings that key the compile caches changed after the "
                          "compiling children started ("
                          + ", ".join(precompiled["state_changed"]) + "): the timing pass "
                          "will compile again what they compiled; set such flags before "
                          "the Probe starts, not during it", stacklevel=3)
    finally:
        if pre is not None:
            pre.stop()
    reports: Dict[str, SiteReport] = {}
    for work in works:
        reports[work.name] = run.finish(work)
        bar.update()
    bar.close()
    used = used or torch.device(device or "cpu")
    meta = {**(meta or {}),
            "reference": "float64" if used.type == "cpu" else "float32 (TF32 off)",
            "baseline": BASELINE, "unobserved_sites": unobserved,
            "report_s": time.perf_counter() - start, "phases_s": dict(run.phases),
            "slow_cpu_kernels": slow_kernels,
            "not_timed": dict(run.not_timed), "autotuned": _autotune_choices(),
            "head_forwards_only": list(run.head), "kernels_not_measured": missing,
            "twin_errors": sum(len(rw.errors_from) for w in works for rw in w.roles),
            "tuned_ahead": tuned_ahead, "twin_mismatches": run.twin_mismatches[:20],
            "spent": {k: round(max(v - spent[k], 0.0), 3) for k, v in _spent().items()}}
    if seeded is not None:
        meta["autotune_seeded"] = seeded
    if precompiled is not None:
        meta["precompile"] = precompiled
    return ProbeReport(sites=reports, device=str(used), device_name=_device_name(used),
                       torch_version=torch.__version__, config=config_to_dict(config), meta=meta)
