"""loka/probe/measure.py: error metrics, samples, bootstrap, timing, failures as report strings."""

import math

import numpy as np
import pytest
import torch
from torch import nn

import loka
from loka.config import BASELINE, ProbeConfig, Role
from loka.kernels import Kernel, register, registry, unregister
from loka.numerics import mere, relative_frobenius, sqnr
from loka.probe.measure import (Failure, KernelTimer, SampleErrors, bootstrap_stat,
                                compiles_for_timing, error_metrics, run_samples)
from loka.timing import TimingResult

TIMING = dict(timing=True, timing_iters=2, timing_warmup=0, timing_budget_ms=None)


@pytest.mark.parametrize("case", ["random", "exact", "zero-signal", "nan", "inf"])
def test_error_metrics_match_numerics(case):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(16, 8, generator=g, dtype=torch.float64)
    approx = (ref + 0.01 * torch.randn(16, 8, generator=g, dtype=torch.float64)).float()
    if case == "exact":
        approx = ref.clone()
    elif case == "zero-signal":
        ref = torch.zeros_like(ref)
    elif case == "nan":
        approx[2, 3] = float("nan")
    elif case == "inf":
        approx[0, 0] = float("inf")
    got = list(error_metrics(approx, ref))
    want = [mere(approx, ref), sqnr(approx, ref), relative_frobenius(approx, ref)]
    for g_, w_ in zip(got, want):
        assert (math.isnan(g_) and math.isnan(w_)) or g_ == pytest.approx(w_, rel=1e-12)
    with pytest.raises(ValueError, match="shape mismatch"):
        error_metrics(approx, ref[:, :4])


def test_bootstrap_stat_ci_and_shrinkage_with_n():
    rng = np.random.default_rng(0)
    values = rng.normal(0.1, 0.02, 400)
    small = bootstrap_stat(values[:10], 2000, seed=1)
    large = bootstrap_stat(values, 2000, seed=1)
    for st, v in ((small, values[:10]), (large, values)):
        assert st.mean == pytest.approx(v.mean())
        assert st.lo < st.mean < st.hi
        assert st.std == pytest.approx(v.std(ddof=1))
        assert st.n == len(v)
    assert large.width < small.width / 3  # ~ 1/sqrt(n): sqrt(40) = 6.3
    # the bootstrap interval of the mean is close to the normal one at this n
    assert large.width == pytest.approx(2 * 1.96 * values.std(ddof=1) / 20, rel=0.15)
    normal = bootstrap_stat(values, 0)
    assert normal.width == pytest.approx(2 * 1.959964 * values.std(ddof=1) / 20, rel=1e-6)
    assert bootstrap_stat(values, 500, seed=3) == bootstrap_stat(values, 500, seed=3)


def test_bootstrap_stat_nonfinite_and_empty():
    st = bootstrap_stat([0.1, float("nan"), 0.2], 100)
    assert math.isnan(st.mean) and math.isnan(st.hi)
    st = bootstrap_stat([0.1, float("inf")], 100)
    assert st.hi == math.inf
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_stat([], 10)


@pytest.fixture
def flaky():
    """A kernel that computes the bf16 GEMM but raises on inputs of ``rows`` rows; calls
    counted."""
    calls = []

    def make(rows):
        def fn(a, b, out):
            calls.append(a.shape[0])
            if a.shape[0] == rows:
                raise RuntimeError(f"no kernel image for {rows} rows\nsecond line")
            return registry.get(BASELINE)(a, b, out)
        register(Kernel("test-flaky", fn, library="custom"))
        return "test-flaky", calls

    yield make
    unregister("test-flaky")


def test_run_samples_types_a_failure_and_stops_calling_the_kernel(flaky):
    name, calls = flaky(rows=32)
    kernels = [registry.get(name), registry.get(BASELINE)]
    pairs = [(torch.randn(m, 16), torch.randn(16, 8)) for m in (16, 32, 16)]
    out = run_samples(pairs, kernels, torch.float32)
    assert out[name] == Failure("RuntimeError: no kernel image for 32 rows")
    assert calls == [16, 32]  # not called again after it failed
    base = out[BASELINE]
    assert isinstance(base, SampleErrors) and len(base.mere) == len(base.sqnr) == 3
    assert list(out) == [name, BASELINE]


def test_timer_returns_and_caches_a_failure(flaky):
    name, calls = flaky(rows=64)
    timer = KernelTimer(ProbeConfig(**TIMING))
    shape, dev = (64, 16, 16), torch.device("cpu")
    t = timer.time(name, Role.FWD, shape, dev, torch.float32)
    assert t == Failure("timing failed: RuntimeError: no kernel image for 64 rows")
    n = len(calls)
    assert timer.time(name, Role.FWD, shape, dev, torch.float32) is t and len(calls) == n
    ok = timer.time(BASELINE, Role.FWD, shape, dev, torch.float32)
    assert isinstance(ok, TimingResult) and ok.method == "cpu-wallclock" and ok.median_us > 0


def test_a_failed_timing_is_recorded_as_its_report_string(flaky):
    """Errors are measured on 32-row samples, timings at the site's 64 rows: the kernel is
    measured but its timing fails, recorded as before the typed Failure (one line)."""
    name, _ = flaky(rows=64)
    model = nn.Linear(16, 16)
    rep = loka.probe(model, [torch.randn(64, 16)], lambda m, x: m(x).square().mean(),
                     config=ProbeConfig(num_samples=4, naive_samples=4, bootstrap=50,
                                        sample_rows=32, progress=False, roles=("fwd",),
                                        kernels=(name, BASELINE), compare_naive=True, **TIMING))
    ks = rep.sites[""].roles[Role.FWD].kernels
    kr = ks[name]
    assert kr.error == "timing failed: RuntimeError: no kernel image for 64 rows"
    assert kr.mere is not None and kr.naive_mere is not None  # the errors were measured
    assert not kr.safe and not kr.fast and kr.time_us is None and kr.timing == "none"
    assert ks[BASELINE].error is None and ks[BASELINE].timing == "cpu-wallclock"
    assert rep.to_dict()["sites"][""]["roles"]["fwd"]["kernels"][name]["error"] == kr.error


def test_a_role_that_cannot_be_measured_is_skipped_with_its_reason():
    model = nn.Linear(16, 24)
    rep = loka.probe(model, [torch.randn(32, 16)], lambda m, x: m(x).square().mean(),
                     config=ProbeConfig(num_samples=4, bootstrap=50, timing=False, progress=False,
                                        compare_naive=False,
                                        kernels=("emulated-tensorwise-e4m3",)))
    # 24 is no multiple of 16: the forward's N and dgrad's K (wgrad's 24 is its free M)
    assert set(rep.sites[""].roles) == {Role.WGRAD}
    assert rep.sites[""].stats["skipped_roles"] == {r: "no kernel supports this shape"
                                                    for r in ("fwd", "dgrad")}


@pytest.mark.parametrize("mode,device,compiled", [
    ("on", "cpu", True), ("auto", "cpu", False), ("off", "cpu", False),
    ("auto", "cuda", True), ("off", "cuda", False)])
def test_compiles_for_timing_only_pytorch_quantization(mode, device, compiled):
    dev = torch.device(device)
    assert compiles_for_timing(registry.get("cublas-tensorwise"), dev, mode) is compiled
    # the baseline and emulated kernels are never compiled
    assert not compiles_for_timing(registry.get(BASELINE), dev, mode)
    assert not compiles_for_timing(registry.get("emulated-tensorwise-e4m3"), dev, mode)


def test_cpu_wallclock_timings_are_never_flagged_fast():
    """A CPU wall clock of emulated and CPU kernels says nothing of FP8 speed on a GPU."""
    model = nn.Linear(16, 16)
    rep = loka.probe(model, [torch.randn(64, 16)], lambda m, x: m(x).square().mean(),
                     config=ProbeConfig(num_samples=4, naive_samples=4, bootstrap=20,
                                        progress=False, roles=("fwd",), min_speedup=1e-6,
                                        kernels=(BASELINE, "fp32", "emulated-rowwise-e4m3"),
                                        **TIMING))
    ks = rep.sites[""].roles[Role.FWD].kernels
    assert all(kr.timing == "cpu-wallclock" and kr.speedup > 0 for kr in ks.values())
    assert not any(kr.fast for kr in ks.values())


@pytest.fixture
def bit_twin():
    """Kernels registered with ``same_bits_as`` naming the emulated rowwise kernel: one
    whose output is that kernel's (its ``fn``), and ``make(name, how, twin)`` for others
    (``how``: 'same', 'differs' (off by one ulp somewhere), 'raises'); calls counted."""
    calls = {}
    real = registry.get("emulated-rowwise-e4m3")

    def make(name, how="same", twin=real.name):
        calls[name] = []

        def fn(a, b, out):
            calls[name].append(tuple(a.shape))
            if how == "raises":
                raise RuntimeError("no kernel image")
            y = real.fn(a, b, out)
            if how == "differs":
                y = y.clone()
                y.view(-1)[0] = torch.nextafter(y.view(-1)[0], torch.tensor(math.inf))
            return y
        register(Kernel(name, fn, library="custom", formats=real.formats,
                        scaling=real.scaling, same_bits_as=twin))
        return name
    make("test-bit-twin")
    yield "test-bit-twin", real.name, calls, make
    for name in calls:
        unregister(name)


def _twin_probe(kernels, **kw):
    torch.manual_seed(0)
    model = nn.Linear(32, 16)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(64, 32, generator=g) for _ in range(2)]
    return loka.probe(model, batches, lambda m, x: m(x).square().mean(),
                      config=ProbeConfig(num_samples=4, naive_samples=3, bootstrap=50,
                                         progress=False, timing=False, compare_naive=True,
                                         kernels=kernels, **kw))


def test_a_bit_identical_twin_takes_its_twins_error_samples(bit_twin):
    """``ProbeConfig.twin_errors``: the twin runs once per role, on the first sample beside
    the kernel it copies (their outputs compared), never for the other samples or the
    naive errors; its statistics are the measured kernel's; the report names where they
    came from and reads it back. Off, it samples its own: the same numbers."""
    from loka.probe import ProbeReport
    name, real, calls, _ = bit_twin
    shared = _twin_probe((real, name))
    assert len(calls[name]) == 3  # the check on each role's first sample
    assert shared.meta["twin_errors"] == 3 and shared.meta["twin_mismatches"] == []
    roles = shared.sites[""].roles
    assert set(roles) == {Role.FWD, Role.DGRAD, Role.WGRAD}
    for rr in roles.values():
        twin, measured = rr.kernels[name], rr.kernels[real]
        assert twin.errors_from == real and measured.errors_from is None
        assert twin.mere == measured.mere and twin.sqnr == measured.sqnr
        assert twin.naive_mere == measured.naive_mere and twin.safe == measured.safe
        assert 0 < measured.mere.mean < 0.2
    back = ProbeReport.from_dict(shared.to_dict())
    assert back.sites[""].roles[Role.FWD].kernels[name].errors_from == real
    calls[name].clear()
    own = _twin_probe((real, name), twin_errors=False)
    assert len(calls[name]) == 3 * (4 + 3) and own.meta["twin_errors"] == 0
    for role, rr in own.sites[""].roles.items():
        assert rr.kernels[name].errors_from is None
        assert rr.kernels[name].mere.mean == shared.sites[""].roles[role].kernels[name].mere.mean
    # the report refuses an errors_from that names itself, no kernel of the role, or a copy
    for bad_value, message in ((name, "names itself"), ("no-such", "no kernel 'no-such'"),):
        bad = shared.to_dict()
        bad["sites"][""]["roles"]["fwd"]["kernels"][name]["errors_from"] = bad_value
        with pytest.raises(loka.probe.ReportError, match=message):
            ProbeReport.from_dict(bad)
    bad = shared.to_dict()
    bad["sites"][""]["roles"]["fwd"]["kernels"][real]["errors_from"] = name
    with pytest.raises(loka.probe.ReportError, match="itself copied"):
        ProbeReport.from_dict(bad)


def test_a_twin_that_fails_or_differs_is_sampled_itself(bit_twin):
    """A kernel whose output differs from its twin's on the first sample, or that raises,
    or whose twin raised, samples its own errors (the pairs are the same: the sampler
    restarts from its seed); the report's meta lists each case."""
    name, real, calls, make = bit_twin
    differs, raises = make("test-differs", "differs"), make("test-raises", "raises")
    broken = make("test-broken-twin", "raises", twin=None)
    copies_broken = make("test-copies-broken", "same", twin=broken)
    rep = _twin_probe((real, name, differs, raises, broken, copies_broken))
    fwd = rep.sites[""].roles[Role.FWD].kernels
    assert fwd[name].errors_from == real  # the good twin still copies
    assert fwd[differs].errors_from is None
    assert fwd[differs].mere.mean == pytest.approx(fwd[real].mere.mean, rel=1e-3)
    assert fwd[differs].mere != fwd[real].mere  # its own samples: one value moved
    assert fwd[raises].errors_from is None
    assert fwd[raises].error == "RuntimeError: no kernel image" and not fwd[raises].safe
    assert fwd[copies_broken].errors_from is None and fwd[copies_broken].error is None
    assert fwd[copies_broken].mere == fwd[real].mere  # its own samples, the real numerics
    reasons = rep.meta["twin_mismatches"]
    assert f" fwd {differs}: its output differs from its twin's" in "".join(reasons)
    assert f" fwd {raises}: it raised RuntimeError: no kernel image" in "".join(reasons)
    assert f" fwd {copies_broken}: its twin failed" in "".join(reasons)
    assert len(reasons) == 3 * 3 and rep.meta["twin_errors"] == 3  # only the good twin


def test_twin_sources_copy_only_from_kernels_sampled_themselves(bit_twin):
    from loka.probe.measure import twin_sources
    name, real, _, make = bit_twin
    k = registry.get
    assert twin_sources([k(name)]) == {}  # the twin must be measured too
    assert twin_sources([k(name), k(real)]) == {name: real}
    chain = make("test-chain", twin=name)  # chain -> test-bit-twin -> real
    assert twin_sources([k(chain), k(name), k(real)]) == {name: real}
    assert twin_sources([k(chain), k(name)]) == {chain: name}
    a, b = make("test-cycle-a", twin="test-cycle-b"), make("test-cycle-b", twin="test-cycle-a")
    assert twin_sources([k(a), k(b)]) == {}  # both sampled
    rep = _twin_probe((real, name, chain))
    fwd = rep.sites[""].roles[Role.FWD].kernels
    assert fwd[chain].errors_from is None and fwd[name].errors_from == real
    assert fwd[chain].mere == fwd[real].mere
