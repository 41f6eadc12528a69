"""The Probe: learn each GEMM site's distributions while the model trains, then measure
every kernel's error and speed on operands drawn from them.

>>> with loka.Probe(model, config=loka.ProbeConfig()) as probe:      # doctest: +SKIP
...     for batch in batches:
...         loss = loss_fn(model, batch); loss.backward(); opt.step(); opt.zero_grad()
>>> report = probe.report()                                           # doctest: +SKIP

**Steps.** A step is one training-mode forward of the probed model with gradients
enabled (a forward pre-hook on the root module counts them; eval-mode and ``no_grad``
forwards are not steps). Statistics are taken on steps 0, N, 2N, ... (``every_n_steps``).
Calling :meth:`Probe.step` once switches to manual counting: each call then ends a step,
which is right for gradient accumulation or a loss function that calls submodules only.

**Overhead.** On a stats step the Probe registers a forward hook on every site; the hook
subsamples up to ``max_rows_per_update`` rows of the input, folds them into the site's
statistics, folds the weight into its EMA, and puts a hook on the output tensor that does
the same for the output gradient in the backward pass. Nothing syncs with the host. On
the next step the site hooks are removed, so off-steps cost one pre-hook call per forward
of the whole model. A statistics step's cost is GPU work that scales with
``max_rows_per_update`` (on the Wukong paper model, 19 sites, on an H200: 40.6 ms with
4096 rows, 15.6 ms with the default 1024 rows replayed as CUDA graphs, i.e. 0.76 % of an
eager 20.5 ms step at ``every_n_steps=100``; bench/BENCHMARKS.md). Each site is updated at
most once per step (a module called twice in
a step, or recomputed by activation checkpointing, is seen on its first call). The Probe
never changes the training computation: hooks return nothing, and its random subsampling
has its own generator. Attach it to an eager model (hooks inside a ``torch.compile``\\ d
region are traced by Dynamo, which recompiles when they change).

**Measurement** (:meth:`Probe.report`). Per site and role: ``num_samples`` synthetic
operand pairs (:mod:`loka.probe.sampler`) of ``sample_rows`` rows, each run through every
available kernel and compared with one reference per sample (float64 on the CPU, float32
with TF32 off on GPUs); MERE, SQNR and relative Frobenius error get bootstrap 95% CIs. The
same with N(0, 1) operands gives ``naive_mere``. Times are taken at the site's real row
count M with CUDA graphs (:mod:`loka.timing`), once per distinct (role, shape,
dtype, kernel), against the ``bf16`` baseline kernel (the GEMM in the site's own dtype).
Forward kernels are timed twice: with both operands quantized per call (training, where
the weight changes every step) and with the weight quantized beforehand (inference,
``time_us_weight_q``), so that ``loka.plan(..., inference=True)`` judges a serving plan
by what serving costs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import platform
import re
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..config import (BASELINE, GRAD_ROLES, REFERENCE_KERNEL, ProbeConfig, Role, config_to_dict,
                      role_shape)
from ..kernels import ops, registry
from ..numerics import mere_denominator
from ..timing import TimingResult, time_fn
from .report import KernelResult, ProbeReport, RoleReport, SiteReport
from .sampler import OperandSampler, error_rows, naive_pair, seed_for
from .stats import SiteStats, bootstrap_stat

__all__ = ["Probe", "probe"]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}".rstrip(": ")


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


def _linear_dims(role: Role, shape: Tuple[int, int, int]) -> Tuple[int, int, int]:
    """(M, in_features, out_features) of the Linear whose ``role`` GEMM is ``shape``
    (the inverse of :func:`~loka.config.role_shape`)."""
    a, b, c = shape
    return {Role.FWD: (a, b, c), Role.DGRAD: (a, c, b), Role.WGRAD: (b, c, a)}[role]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


class Probe:
    """Learns per-site statistics during training; :meth:`report` measures the kernels.

    Args:
        model: any module; every ``nn.Linear`` in it (``loka.Linear`` included) whose
            qualified name matches ``config.module_filter`` (``re.search``) is a site.
        config: :class:`~loka.config.ProbeConfig`.

    Raises:
        ValueError: no Linear matches, a bad filter, or an unknown kernel name.
    """

    def __init__(self, model: nn.Module, config: ProbeConfig = ProbeConfig()) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Probe needs an nn.Module, got {type(model).__name__}")
        if not isinstance(config, ProbeConfig):
            raise TypeError(f"config must be a ProbeConfig, got {type(config).__name__}")
        self.model, self.config = model, config
        try:
            pattern = re.compile(config.module_filter) if config.module_filter else None
        except re.error as e:
            raise ValueError(f"ProbeConfig.module_filter {config.module_filter!r} is not a "
                             f"valid regular expression ({e})") from None
        for name in config.kernels or ():
            registry.get(name)  # a KeyError listing the registered names
        root = getattr(model, "_orig_mod", model)  # name sites as in the uncompiled model
        self.modules: Dict[str, nn.Linear] = {}
        self.sites: Dict[str, SiteStats] = {}
        for name, mod in root.named_modules():
            if isinstance(mod, nn.Linear) and (pattern is None or pattern.search(name)):
                self.modules[name] = mod
                self.sites[name] = SiteStats(
                    name, mod.in_features, mod.out_features,
                    max_full_cov_dim=config.max_full_cov_dim, block_size=config.block_size,
                    weight_ema=config.weight_ema, graphs=config.graph_updates)
        if not self.sites:
            what = "" if pattern is None else f" matching {config.module_filter!r}"
            raise ValueError(f"no nn.Linear{what} in {type(model).__name__}")
        self._step = 0
        self._forwards = 0
        self._manual = False
        self._attached = False
        self._root_handle = None
        self._site_handles: List = []
        self._last_update: Dict[str, int] = {n: -1 for n in self.sites}
        self.stats_steps: List[int] = []
        """indices of the steps on which statistics were taken"""
        self._generators: Dict[torch.device, torch.Generator] = {}

    # -- lifecycle -------------------------------------------------------------------
    def attach(self) -> "Probe":
        """Start observing (what ``with`` does on entry); step 0 is a stats step."""
        if self._attached:
            raise RuntimeError("this Probe is already attached")
        self._attached = True
        self._root_handle = self.model.register_forward_pre_hook(self._on_root_forward)
        self._set_step(self._step)
        return self

    def detach(self) -> None:
        """Remove every hook; what was learned stays and :meth:`report` still works."""
        if self._root_handle is not None:
            self._root_handle.remove()
            self._root_handle = None
        self._hooks_off()
        self._attached = False

    def __enter__(self) -> "Probe":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def steps(self) -> int:
        """Steps seen so far (training forwards, or :meth:`step` calls in manual mode)."""
        return self._step if self._manual else self._forwards

    @property
    def active(self) -> bool:
        """Whether the current step takes statistics (site hooks are registered)."""
        return bool(self._site_handles)

    def step(self) -> None:
        """End the current step (manual counting; the first call switches it on)."""
        self._manual = True
        self._set_step(self._step + 1)

    # -- hooks -----------------------------------------------------------------------
    def _set_step(self, step: int) -> None:
        self._step = step
        want = self._attached and step % self.config.every_n_steps == 0
        if want and not self._site_handles:
            for name, mod in self.modules.items():
                self._site_handles.append(mod.register_forward_hook(
                    functools.partial(self._on_forward, name), with_kwargs=True))
        elif not want:
            self._hooks_off()

    def _hooks_off(self) -> None:
        for h in self._site_handles:
            h.remove()
        self._site_handles = []

    def _on_root_forward(self, module: nn.Module, args) -> None:
        if self._manual or not (module.training and torch.is_grad_enabled()):
            return
        self._set_step(self._forwards)
        self._forwards += 1

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self.config.seed)
        return gen

    def _on_forward(self, name: str, module: nn.Linear, args, kwargs, output) -> None:
        if not (module.training and torch.is_grad_enabled()) or self._last_update[name] == self._step:
            return
        x = args[0] if args else kwargs.get("input", kwargs.get("x"))
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            return
        self._last_update[name] = self._step
        if not self.stats_steps or self.stats_steps[-1] != self._step:
            self.stats_steps.append(self._step)
        site = self.sites[name]
        with torch.no_grad():
            x2d = x.detach().reshape(-1, site.in_features)
            rows = x2d.shape[0]
            site.tokens = max(site.tokens, rows)
            site.dtype = output.dtype
            idx = None
            if rows > self.config.max_rows_per_update:
                # random rows (with replacement) from the stats' own generator
                idx = torch.randint(rows, (self.config.max_rows_per_update,), device=x2d.device,
                                    generator=self._generator(x2d.device))
                x2d = x2d[idx]
            site.act.update(x2d)
            site.weight.observe(module.weight)
            if self.config.source == "captured":
                site.captured_x = x2d[: self._capture_rows].clone()
        if output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, name, idx))

    @property
    def _capture_rows(self) -> int:
        return max(self.config.sample_rows or 4096, 2 * 16)

    def _on_grad(self, name: str, idx: Optional[torch.Tensor], grad: torch.Tensor) -> None:
        site = self.sites[name]
        with torch.no_grad():
            g = grad.detach().reshape(-1, site.out_features)
            if idx is not None:
                g = g[idx]
            site.grad.update(g)
            if self.config.source == "captured":
                site.captured_dy = g[: self._capture_rows].clone()

    # -- measurement -----------------------------------------------------------------
    def report(self, device: "torch.device | str | None" = None) -> ProbeReport:
        """Measure every available kernel at every observed site and role.

        Args:
            device: where to measure (default: each site's weight device).

        Returns:
            :class:`~loka.probe.report.ProbeReport`.
        """
        from tqdm import tqdm

        cfg = self.config
        start = time.perf_counter()
        self._phases: Dict[str, float] = {}
        timings: Dict[tuple, TimingResult] = {}
        sites: Dict[str, SiteReport] = {}
        unobserved, used = [], None
        for name in tqdm(self.sites, desc="probe", unit="site", disable=not cfg.progress):
            site, module = self.sites[name], self.modules[name]
            if site.act.updates == 0:
                unobserved.append(name)
                continue
            dev = torch.device(device) if device is not None else module.weight.device
            used = used or dev
            dtype = site.dtype or module.weight.dtype
            stats = site.summary()
            sr = SiteReport(name, site.in_features, site.out_features, site.tokens,
                            str(dtype).replace("torch.", ""), stats)
            skipped = {}
            for role in cfg.roles:
                if role in GRAD_ROLES and site.grad.updates == 0:
                    skipped[role.value] = "no output gradient observed"
                    continue
                rr, why = self._measure_role(site, module, role, dev, dtype, timings)
                if rr is None:
                    skipped[role.value] = why
                else:
                    sr.roles[role] = rr
            if skipped:
                stats["skipped_roles"] = skipped
            sites[name] = sr
        used = used or torch.device(device or "cpu")
        meta = {"steps": self.steps, "stats_steps": len(self.stats_steps),
                "counting": "manual" if self._manual else "auto",
                "reference": "float64" if used.type == "cpu" else "float32 (TF32 off)",
                "baseline": BASELINE, "unobserved_sites": unobserved,
                "report_s": time.perf_counter() - start, "phases_s": dict(self._phases)}
        return ProbeReport(sites=sites, device=str(used), device_name=_device_name(used),
                           torch_version=torch.__version__, config=config_to_dict(cfg), meta=meta)

    def _measure_role(self, site: SiteStats, module: nn.Linear, role: Role, dev: torch.device,
                      dtype: torch.dtype, timings: Dict[tuple, TimingResult]
                      ) -> Tuple[Optional[RoleReport], str]:
        cfg = self.config
        k_in, n_out = site.in_features, site.out_features
        m_time = cfg.timing_rows or site.tokens
        m_err = error_rows(site, cfg.source, cfg.sample_rows)
        if m_err == 0:
            return None, "nothing captured"
        shape = role_shape(role, m_time, k_in, n_out)
        err_shape = role_shape(role, m_err, k_in, n_out)

        def timed_shape(kern) -> Tuple[int, int, int]:
            # the weight gradient runs at the kernel's padded token count, as loka.Linear runs it
            return (role_shape(role, kern.padded_tokens(m_time), k_in, n_out)
                    if role is Role.WGRAD else shape)

        kernels = [k for k in registry.available(dev, role=role, names=cfg.kernels)
                   if k.supports(dev, *timed_shape(k), role=role)
                   and k.supports(dev, *err_shape, role=role)]
        if cfg.kernels is None and dev.type != "cpu":
            # off the CPU the reference *is* the fp32 kernel: measuring it would say nothing
            kernels = [k for k in kernels if k.name != REFERENCE_KERNEL]
            if cfg.skip_emulated_twins:
                real = {k.name for k in kernels}
                kernels = [k for k in kernels if not (k.is_emulated and k.emulates in real)]
        if not kernels:
            return None, "no kernel supports this shape"
        try:
            with self._phase("errors", dev):
                errors = self._errors(site, module, role, dev, dtype, kernels, m_err)
        except ValueError as e:  # too little data to build the sampler
            return None, _one_line(e)
        with self._phase("naive", dev):
            naive = self._naive(site, role, dev, dtype, kernels, m_err) if cfg.compare_naive else {}
        with self._phase("timing", dev):
            baseline = self._time(BASELINE, role, shape, dev, dtype, timings) if cfg.timing else None
        base_us = None if baseline is None or isinstance(baseline, str) else baseline.median_us
        rr = RoleReport(role, shape, base_us)
        seed = seed_for(cfg.seed, site.name, role.value, "bootstrap")
        for k in kernels:
            kr = KernelResult(k.name)
            vals = errors[k.name]
            if isinstance(vals, str):
                kr.error = vals
            else:
                kr.mere, kr.sqnr, kr.relfro = (bootstrap_stat(vals[i], cfg.bootstrap, seed)
                                               for i in range(3))
            if isinstance(naive.get(k.name), list):
                kr.naive_mere = bootstrap_stat(naive[k.name], cfg.bootstrap, seed)
            if cfg.timing and kr.error is None:
                with self._phase("timing", dev):
                    t = self._time(k.name, role, timed_shape(k), dev, dtype, timings)
                if isinstance(t, str):
                    kr.error = t
                else:
                    kr.time_us, kr.timing = t.median_us, t.method
                    if base_us is not None and t.median_us > 0:
                        kr.speedup = base_us / t.median_us
                    if role is Role.FWD and k.is_fp8 and k.quantize_b is not None:
                        with self._phase("timing", dev):
                            tq = self._time(k.name, role, timed_shape(k), dev, dtype, timings,
                                            weight_q=True)
                        if not isinstance(tq, str):
                            kr.time_us_weight_q = tq.median_us
                            if base_us is not None and tq.median_us > 0:
                                kr.speedup_weight_q = base_us / tq.median_us
            kr.safe = (kr.error is None and kr.mere is not None and math.isfinite(kr.mere.hi)
                       and kr.mere.hi < cfg.max_error)
            kr.fast = kr.speedup is not None and kr.speedup > cfg.min_speedup
            rr.kernels[k.name] = kr
        return rr, ""

    @contextlib.contextmanager
    def _phase(self, name: str, dev: torch.device):
        """Accumulate wall time per phase of :meth:`report` (in its ``meta``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def _errors(self, site, module, role, dev, dtype, kernels, rows):
        """{kernel: ([mere...], [sqnr...], [relfro...]) or a failure message}."""
        cfg = self.config
        sampler = OperandSampler(site, role, dev, dtype, source=cfg.source,
                                 weight_source=cfg.weight_source, weight=module.weight,
                                 seed=cfg.seed)
        return self._run_samples(sampler.pairs(cfg.num_samples, rows), kernels, dtype)

    @staticmethod
    def _run_samples(pairs, kernels, dtype) -> Dict[str, object]:
        """Every kernel on every pair against one reference per pair: {kernel: ([MERE],
        [SQNR], [relfro]) per sample, or the failure message}. One host sync per kernel."""
        acc: Dict[str, object] = {k.name: [] for k in kernels}
        signals = []
        with torch.no_grad():
            for a, b in pairs:
                ref = _Reference(_reference(a, b))
                signals.append(ref.signal)
                for k in kernels:
                    if isinstance(acc[k.name], str):
                        continue
                    try:
                        acc[k.name].append(ref.measure(k(a, b, dtype)))
                    except Exception as e:  # noqa: BLE001 - a failing kernel is a result
                        acc[k.name] = _one_line(e)
        signal = torch.stack(signals).tolist() if signals else []
        out: Dict[str, object] = {}
        for name, vals in acc.items():
            if isinstance(vals, str):
                out[name] = vals
                continue
            meres, noises = torch.stack(vals).t().tolist()
            sq, rf = zip(*(_sqnr_relfro(s, n) for s, n in zip(signal, noises)))
            out[name] = (meres, list(sq), list(rf))
        return out

    def _naive(self, site, role, dev, dtype, kernels, rows):
        """{kernel: [mere...]} on N(0, 1) operands of the same shapes."""
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed_for(self.config.seed, site.name, role.value, "naive"))
        pairs = (naive_pair(role, rows, site.in_features, site.out_features, dev, dtype, gen)
                 for _ in range(self.config.naive_samples))
        out = self._run_samples(pairs, kernels, dtype)
        return {k: v if isinstance(v, str) else v[0] for k, v in out.items()}

    def _time(self, kernel: str, role: Role, shape, dev, dtype, cache, weight_q: bool = False):
        """TimingResult (cached per role, shape, dtype, device) or a failure message.
        ``weight_q``: the b operand (the weight) is quantized before timing (inference)."""
        key = (kernel, role, tuple(shape), dtype, str(dev), weight_q)
        if key in cache:
            return cache[key]
        okey = ("operands", role, tuple(shape), dtype, str(dev))
        if okey not in cache:
            gen = torch.Generator(device=dev)
            gen.manual_seed(self.config.seed)
            cache[okey] = naive_pair(role, *_linear_dims(role, shape), dev, dtype, gen)
        a, b = cache[okey]
        kern = registry.get(kernel)
        try:
            if weight_q:
                with torch.no_grad():
                    b = kern.quantize_b(b)
            timed = functools.partial(time_fn, device=dev, warmup=self.config.timing_warmup,
                                      iters=self.config.timing_iters,
                                      budget_ms=self.config.timing_budget_ms)
            with torch.no_grad():
                if not _compile_for_timing(kern, dev, self.config.timing_compile):
                    result = timed(lambda: kern(a, b, dtype))
                else:
                    call = self._compiled_call(kern, dtype, cache)
                    try:
                        result = timed(lambda: call(a, b))
                        result = dataclasses.replace(result, method=result.method + "+compiled")
                    except Exception as e:  # noqa: BLE001 - compilation failed: time eagerly
                        result = timed(lambda: kern(a, b, dtype))
                        result = dataclasses.replace(
                            result, note=f"torch.compile failed, timed eagerly: {_one_line(e)}")
        except Exception as e:  # noqa: BLE001
            result = f"timing failed: {_one_line(e)}"
        cache[key] = result
        return result

    def _compiled_call(self, kern, dtype, cache) -> Callable:
        """:func:`compiled_call` of ``kern`` and ``dtype``, made once per Probe report."""
        key = ("compiled", kern.name, dtype)
        if key not in cache:
            cache[key] = compiled_call(kern, dtype)
        return cache[key]


def compiled_call(kern, dtype: torch.dtype) -> Callable:
    """``call(a, b)``: the kernel under ``torch.compile``, as it runs inside a compiled
    model, where Inductor fuses its PyTorch quantization; one compiled function, specialized
    to each shape as a compiled model is (compiled once with dynamic shapes, the same
    kernels timed up to 31x slower on the H200: compare the reports in
    bench/results/2026-12-03-h200-wukong/ and bench/results/2026-12-03-h200-wukong-merge/)."""
    compiled = torch.compile(lambda a, b: kern(a, b, dtype), dynamic=False)

    def call(a, b):
        # one code object serves every shape, role layout and weight-q variant: each is a
        # guarded entry of its own, more than Dynamo's default limit
        with torch._dynamo.config.patch(recompile_limit=COMPILE_ENTRIES):
            return compiled(a, b)
    return call


def _compile_for_timing(kern, dev: torch.device, mode: str) -> bool:
    """Whether :meth:`Probe._time` times ``kern`` under ``torch.compile``."""
    if mode == "off" or (mode == "auto" and dev.type != "cuda"):
        return False

    # own quantization kernels (Triton custom ops, C++ libraries) gain nothing from
    # Inductor; emulated kernels are references, not candidates for speed
    return kern.is_fp8 and kern.library in COMPILED_LIBRARIES and not ops.is_opaque(kern)


COMPILE_ENTRIES = 256
"""Dynamo's recompile limit while the Probe times compiled kernels"""
COMPILED_LIBRARIES = ("cublas", "torchao")
"""kernel libraries whose quantization is plain PyTorch, fused by Inductor when compiled"""


def probe(model: nn.Module, batches: Iterable, loss_fn: Callable, *,
          config: ProbeConfig = ProbeConfig(), optimizer: Optional[torch.optim.Optimizer] = None,
          steps: Optional[int] = None, device: "torch.device | str | None" = None) -> ProbeReport:
    """Run training steps under a :class:`Probe` and return its report.

    Each step is ``loss_fn(model, batch).backward()``, then ``optimizer.step()`` and
    ``zero_grad`` if an optimizer is given (else the gradients are dropped). Steps are
    counted by :meth:`Probe.step`, one per batch.

    Args:
        model: the model to probe (put in training mode for the run, then restored).
        batches: any iterable of batches.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        config: the Probe's settings.
        optimizer: optional; without it the weights do not change.
        steps: stop after this many batches (None: all of ``batches``).
        device: where :meth:`Probe.report` measures.
    """
    was_training = model.training
    model.train()
    try:
        with Probe(model, config) as p:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                loss = loss_fn(model, batch)
                loss.backward()
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                else:
                    model.zero_grad(set_to_none=True)
                p.step()
    finally:
        model.train(was_training)
    return p.report(device)
