import warnings

import pytest
import torch
from torch import nn

import loka
from loka.config import ProbeConfig, Role
from loka.kernels import Kernel, register, registry, unregister
from loka.kernels.emulated import emulated_gemm
from loka.kernels.recipes import Recipe
from loka.numerics import Granularity
from loka.probe import Probe, ProbeReport
from loka.probe.measure import compiles_for_timing

TW = "emulated-tensorwise-e4m3"
KERNELS = ("bf16", "fp32", TW, "cublas-tensorwise", "emulated-rowwise-e4m3")
FAST = dict(num_samples=8, naive_samples=6, bootstrap=200, sample_rows=64, timing=False,
            compare_naive=True, progress=False, kernels=KERNELS)
OUTLIER_CHANNELS = [3, 17]
OUTLIER_SCALE = 1e5
"""Outlier channels 1e5 larger than the rest set the tensorwise scale so that the other
channels land below e4m3's smallest subnormal (2^-9 after scaling): they flush to zero.
Their weight columns are 1e-5 smaller, so every channel contributes alike to the output
and the loss is visible; on N(0, 1) inputs the same kernel scores MERE ~0.1."""


class TwoSites(nn.Module):
    """One Linear fed well-behaved inputs, one fed inputs with outlier channels."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.good = nn.Linear(dim, dim)
        self.bad = nn.Linear(dim, dim)
        with torch.no_grad():
            self.bad.weight[:, OUTLIER_CHANNELS] /= OUTLIER_SCALE

    def forward(self, batch):
        good_x, bad_x = batch
        return self.good(good_x) + self.bad(bad_x)


def two_site_batches(n: int, rows: int = 128, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        bad = torch.randn(rows, dim, generator=g)
        bad[:, OUTLIER_CHANNELS] *= OUTLIER_SCALE
        yield torch.randn(rows, dim, generator=g), bad


def loss_fn(model, batch):
    return model(batch).square().mean()


@pytest.fixture(scope="module")
def outlier_report():
    torch.manual_seed(0)
    return loka.probe(TwoSites(), two_site_batches(3), loss_fn,
                      config=ProbeConfig(every_n_steps=1, **FAST))


def test_probe_finds_the_outlier_site_that_naive_inputs_miss(outlier_report):
    rep = outlier_report
    assert set(rep.sites) == {"good", "bad"}
    good = rep.sites["good"].roles[Role.FWD].kernels[TW]
    bad = rep.sites["bad"].roles[Role.FWD].kernels[TW]
    assert bad.mere.mean >= 5 * good.mere.mean
    assert good.safe and good.mere.hi < 0.2
    assert not bad.safe and bad.mere.lo > 0.2
    # N(0, 1) operands of the same shape would have called the outlier site safe
    assert bad.naive_mere.hi < 0.2
    assert bad.naive_mere.mean == pytest.approx(good.naive_mere.mean, rel=0.3)
    # the real torch._scaled_mm kernel agrees with its emulated twin
    real = rep.sites["bad"].roles[Role.FWD].kernels["cublas-tensorwise"]
    assert not real.safe and real.mere.mean == pytest.approx(bad.mere.mean, rel=0.05)
    # the statistics that explain it
    act = rep.sites["bad"].stats["act"]
    assert act["channel_amax_ratio"] > 1e4 and act["underflow_frac_e4m3"] > 0.9
    assert rep.sites["good"].stats["act"]["underflow_frac_e4m3"] < 0.01


def test_report_fields(outlier_report):
    rep = outlier_report
    site = rep.sites["good"]
    assert (site.in_features, site.out_features, site.tokens) == (64, 64, 128)
    assert site.dtype == "float32"
    assert set(site.roles) == {Role.FWD, Role.DGRAD, Role.WGRAD}
    assert site.roles[Role.WGRAD].shape == (64, 128, 64)
    for rr in site.roles.values():
        assert set(rr.kernels) == set(KERNELS)
        for kr in rr.kernels.values():
            assert kr.error is None and kr.mere.n == 8 and kr.naive_mere.n == 6
            assert kr.mere.lo <= kr.mere.mean <= kr.mere.hi
            assert kr.time_us is None and kr.timing == "none" and not kr.fast
        fp32 = rr.kernels["fp32"]
        assert fp32.mere.mean < 1e-5 and fp32.sqnr.mean > 100 and fp32.relfro.mean < 1e-5
    assert rep.meta["steps"] == 3 and rep.meta["stats_steps"] == 3
    assert rep.meta["reference"] == "float64" and rep.config["num_samples"] == 8
    lines = rep.summary_table().splitlines()
    assert len(lines) == 2 + 6 and lines[2].split()[:3] == ["good", "128x64x64", "fwd"]
    # without timings the best safe kernel is the most accurate one
    assert all(line.split()[3] in ("bf16", "fp32") for line in lines[2:])


def test_report_round_trips_through_json(outlier_report, tmp_path):
    path = tmp_path / "report.json"
    outlier_report.save(path)
    again = ProbeReport.load(path)
    assert again.to_dict() == outlier_report.to_dict()


@pytest.fixture
def wrong_kernel():
    recipe = Recipe(Granularity.TENSORWISE)
    name = "test-wrong-scale-2x"
    register(Kernel(name, lambda a, b, out: 2 * emulated_gemm(recipe, a, b, out),
                    library="emulated", formats=("e4m3", "e4m3"), scaling="tensorwise",
                    description="mis-scales its output by 2"))
    yield name
    unregister(name)


def test_a_wrong_kernel_is_unsafe_everywhere(wrong_kernel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32), nn.Tanh(),
                          nn.Linear(32, 16))
    batches = [torch.randn(96, 32) for _ in range(2)]
    rep = loka.probe(model, batches, lambda m, x: m(x).square().mean(), config=ProbeConfig(
        **{**FAST, "kernels": (wrong_kernel, TW)}))
    seen = 0
    for site in rep.sites.values():
        for rr in site.roles.values():
            kr = rr.kernels[wrong_kernel]
            assert not kr.safe and kr.mere.lo > 0.9 and kr.naive_mere.lo > 0.9
            seen += 1
    assert seen == 9
    assert rep.geomean_error(wrong_kernel) > 5 * rep.geomean_error(TW)


def test_a_failing_kernel_is_recorded_and_never_safe():
    def boom(a, b, out):
        raise RuntimeError("no kernel image\nsecond line")

    register(Kernel("test-raises", boom, library="emulated", scaling="tensorwise"))
    try:
        rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
            **{**FAST, "kernels": ("test-raises", "bf16"), "timing": True, "timing_iters": 2,
               "timing_warmup": 0}))
    finally:
        unregister("test-raises")
    for site in rep.sites.values():
        for rr in site.roles.values():
            kr = rr.kernels["test-raises"]
            assert kr.error == "RuntimeError: no kernel image" and not kr.safe
            assert kr.mere is None and kr.time_us is None
            assert rr.kernels["bf16"].safe and rr.kernels["bf16"].timing == "cpu-wallclock"


def test_confidence_interval_shrinks_with_more_samples():
    def run(n):
        torch.manual_seed(0)
        rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
            **{**FAST, "num_samples": n, "kernels": (TW,), "roles": ("fwd",),
               "compare_naive": False, "module_filter": "^good$"}))
        return rep.sites["good"].roles[Role.FWD].kernels[TW].mere

    few, many = run(4), run(48)
    assert (few.n, many.n) == (4, 48)
    assert many.width < few.width / 2  # ~ 1 / sqrt(n): sqrt(12) = 3.5
    assert abs(many.mean - few.mean) < few.width


def test_timing_is_shared_by_identical_shapes_and_gives_speedups():
    rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
        **{**FAST, "kernels": ("bf16", TW), "timing": True, "timing_iters": 3,
           "timing_warmup": 1, "roles": ("fwd",),
           "time_unsafe": True}))  # the 'bad' site's TW is over budget: time it all the same
    g, b = rep.sites["good"].roles[Role.FWD], rep.sites["bad"].roles[Role.FWD]
    assert g.baseline_us == b.baseline_us > 0          # timed once for both sites
    for name in ("bf16", TW):
        kg = g.kernels[name]
        assert kg.time_us == b.kernels[name].time_us
        assert kg.timing == "cpu-wallclock"
        assert kg.speedup == pytest.approx(g.baseline_us / kg.time_us)
        # a CPU wall clock says nothing of FP8 speed on a GPU: never fast, whatever the
        # timing (a stalled baseline once made an emulated kernel 29x "faster")
        assert kg.fast is False
    assert g.kernels["bf16"].speedup == 1.0
    # the forward is timed again with the weight quantized beforehand (inference); the
    # baseline has no weight quantizer
    kq = g.kernels[TW]
    assert kq.time_us_weight_q > 0 and kq.time_us_weight_q == b.kernels[TW].time_us_weight_q
    assert kq.speedup_weight_q == pytest.approx(g.baseline_us / kq.time_us_weight_q)
    assert g.kernels["bf16"].time_us_weight_q is None and g.kernels["bf16"].speedup_weight_q is None


def test_nonfinite_inputs_are_skipped_and_reported(counting):
    model = counting()
    with Probe(model, ProbeConfig(every_n_steps=1, progress=False, num_samples=4,
                                  bootstrap=50, kernels=("bf16",), timing=False)) as p:
        x = torch.randn(64, 16)
        x[3, 0] = float("nan")
        model(x)  # no backward: gradients unobserved
    rep = p.report()
    a = rep.sites["a"]
    assert a.stats["act"]["nonfinite_rows"] == 1 and a.stats["act"]["rows"] == 63
    assert a.stats["act"]["channel_amax_ratio"] < 10  # the NaN row did not poison the range
    assert set(a.roles) == {Role.FWD}
    assert set(a.stats["skipped_roles"]) == {"dgrad", "wgrad"}


def test_unobserved_sites_and_misaligned_shapes():
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 10), nn.Linear(10, 3))
    cfg = ProbeConfig(every_n_steps=1, progress=False, num_samples=4, bootstrap=50, timing=False)
    with Probe(model, cfg) as p:
        model[0](torch.randn(32, 16)).sum().backward()  # only the first Linear runs
    rep = p.report()
    assert rep.meta["unobserved_sites"] == ["1", "2"] and set(rep.sites) == {"0"}
    # 16 -> 24: FP8 kernels need K, N multiples of 16; fwd N = 24 rules them out
    names = set(rep.sites["0"].roles[Role.FWD].kernels)
    assert "bf16" in names and not any(n.startswith(("emulated", "cublas")) for n in names)


def test_captured_source_also_flags_the_outlier_site():
    torch.manual_seed(0)
    rep = loka.probe(TwoSites(), two_site_batches(2, rows=128), loss_fn, config=ProbeConfig(
        **{**FAST, "source": "captured", "kernels": (TW,), "compare_naive": False}))
    good = rep.sites["good"].roles[Role.FWD].kernels[TW]
    bad = rep.sites["bad"].roles[Role.FWD].kernels[TW]
    assert good.safe and not bad.safe and bad.mere.mean > 5 * good.mere.mean
    assert rep.sites["bad"].roles[Role.WGRAD].shape == (64, 128, 64)


def test_bf16_model_reports_bf16_dtype_and_errors(counting):
    model = counting().to(torch.bfloat16)
    with Probe(model, ProbeConfig(every_n_steps=1, progress=False, num_samples=4, bootstrap=50,
                                  timing=False, kernels=("bf16", TW))) as p:
        model(torch.randn(64, 16, dtype=torch.bfloat16)).sum().backward()
    rep = p.report()
    assert [s.dtype for s in rep.sites.values()] == ["bfloat16", "bfloat16"]
    fwd = rep.sites["a"].roles[Role.FWD].kernels
    assert 1e-4 < fwd["bf16"].mere.mean < 0.05 < fwd[TW].mere.mean < 0.2
    assert TW not in rep.sites["b"].roles[Role.FWD].kernels  # N = 8 is no multiple of 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_probe_on_cuda_bf16():
    torch.manual_seed(0)
    model = TwoSites().cuda().to(torch.bfloat16)
    batches = [tuple(t.cuda().to(torch.bfloat16) for t in b) for b in two_site_batches(2)]
    rep = loka.probe(model, batches, loss_fn, config=ProbeConfig(
        every_n_steps=1, num_samples=8, bootstrap=200, sample_rows=64, timing_iters=5,
        progress=False))
    assert rep.device.startswith("cuda") and rep.meta["reference"] == "float32 (TF32 off)"
    good, bad = (rep.sites[n].roles[Role.FWD].kernels for n in ("good", "bad"))
    assert good["cublas-tensorwise"].safe and not bad["cublas-tensorwise"].safe
    assert TW not in good  # its real twin runs here
    for name, kr in good.items():
        assert kr.error is None, (name, kr.error)
        # timing_compile='auto': kernels with PyTorch quantization are timed compiled here
        compiled = compiles_for_timing(registry.get(name), torch.device("cuda"), "auto")
        assert kr.timing.endswith("+compiled") == compiled
        # (a fast-accumulation twin's time is derived from its twin's compiled call)
        if kr.timing.endswith("+derived+compiled"):
            assert registry.get(name).quantizes_as is not None, (name, kr.timing)
        assert kr.timing.removesuffix("+compiled").removesuffix("+derived") in (
            "cuda-graph", "cuda-events")
        assert kr.time_us > 0
    assert good["bf16"].speedup == 1.0 and good["bf16"].timing == "cuda-graph"


def _fwd_timing(config_kw):
    rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
        **{**FAST, "kernels": ("bf16", "cublas-tensorwise"), "timing": True, "timing_iters": 3,
           "timing_warmup": 1, "roles": ("fwd",), **config_kw}))
    return rep.sites["good"].roles[Role.FWD].kernels


def test_kernels_with_pytorch_quantization_are_timed_compiled_when_asked():
    ks = _fwd_timing({"timing_compile": "on"})
    assert ks["cublas-tensorwise"].timing == "cpu-wallclock+compiled"
    assert ks["cublas-tensorwise"].time_us > 0 and ks["cublas-tensorwise"].time_us_weight_q > 0
    assert ks["bf16"].timing == "cpu-wallclock"  # the baseline is never compiled
    # 'auto' compiles on CUDA only; 'off' never
    assert _fwd_timing({"timing_compile": "auto"})["cublas-tensorwise"].timing == "cpu-wallclock"
    assert _fwd_timing({"timing_compile": "off"})["cublas-tensorwise"].timing == "cpu-wallclock"


def test_the_report_says_what_compiling_and_autotuning_cost():
    """meta['spent']: the seconds Dynamo and Inductor spent compiling during the report, and
    LoKA's Triton autotuners (none here: no Triton kernel is measured)."""
    def spent(mode):
        torch._dynamo.reset()  # a compile cached by an earlier test would cost nothing
        rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
            **{**FAST, "kernels": ("bf16", "cublas-tensorwise"), "timing": True,
               "timing_iters": 3, "timing_warmup": 1, "roles": ("fwd",),
               "timing_compile": mode}))
        return rep.meta["spent"]
    on, off = spent("on"), spent("off")
    assert set(on) == set(off) == {"compile_s", "autotune_s", "autotune_configs",
                                   "fxgraph_hits", "fxgraph_misses", "fxgraph_bypasses",
                                   "aot_hits", "aot_misses", "aot_bypasses"}
    assert on["compile_s"] > 0.05 and off["compile_s"] == 0.0
    # one graph per distinct timed call (the two Linears share a shape: the forward with
    # the weight quantized or not), compiled or loaded from the FX graph cache; none
    # without compiling
    assert on["fxgraph_hits"] + on["fxgraph_misses"] == 2 and on["fxgraph_bypasses"] == 0
    assert off["fxgraph_hits"] == off["fxgraph_misses"] == off["fxgraph_bypasses"] == 0
    # AOTAutograd's cache is asked first, once per graph here (it loads a hit's compiled
    # graph through Inductor's FX graph cache, which counts it too)
    assert on["aot_hits"] + on["aot_misses"] + on["aot_bypasses"] == 2
    assert off["aot_hits"] == off["aot_misses"] == off["aot_bypasses"] == 0
    assert on["autotune_configs"] == off["autotune_configs"] == 0 and off["autotune_s"] == 0


def test_a_kernel_that_does_not_compile_is_timed_eagerly(monkeypatch):
    def broken_compile(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("inductor exploded")
        return run
    monkeypatch.setattr(torch, "compile", broken_compile)
    ks = _fwd_timing({"timing_compile": "on"})
    kr = ks["cublas-tensorwise"]
    assert kr.error is None and kr.timing == "cpu-wallclock" and kr.time_us > 0
    assert kr.speedup == pytest.approx(
        ks["bf16"].time_us / kr.time_us, rel=1e-9) if ks["bf16"].time_us else True


def test_timing_compile_is_validated():
    with pytest.raises(ValueError, match="timing_compile"):
        ProbeConfig(timing_compile="sometimes")


def test_the_kernels_a_probe_measures_by_default():
    """On a GPU the default set, every name of it registered; on the CPU, or with
    ``all_kernels``, every available kernel; a given list as it is."""
    from loka.kernels.registry import PROBE_DEFAULT
    from loka.probe.measure import kernel_names
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert kernel_names(ProbeConfig(), cuda) == PROBE_DEFAULT
    assert kernel_names(ProbeConfig(), cpu) is None
    assert kernel_names(ProbeConfig(all_kernels=True), cuda) is None
    assert kernel_names(ProbeConfig(kernels=("bf16", TW)), cuda) == ("bf16", TW)
    names = {k.name for k in registry.all_kernels()}
    assert set(PROBE_DEFAULT) <= names and "bf16" in PROBE_DEFAULT
    # every fast-accumulation kernel of the set comes with the kernel it derives from,
    # or quantizes in Triton (timed as it is)
    for name in PROBE_DEFAULT:
        twin = registry.get(name).quantizes_as
        assert twin is None or twin in PROBE_DEFAULT, name


def test_error_samples_run_untuned_and_only_triton_kernels_need_it(monkeypatch):
    """The error (and N(0, 1)) samples of every site-role run inside ``_untuned`` with the
    role's kernels; it enters the autotuners' ``untuned()`` only when a Triton kernel is
    among them."""
    import contextlib

    from loka.kernels.registry import Library
    from loka.probe import measure

    seen = []
    real = measure._untuned

    @contextlib.contextmanager
    def recorder(kernels):
        seen.append(tuple(k.name for k in kernels))
        with real(kernels):
            yield
    monkeypatch.setattr(measure, "_untuned", recorder)
    loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=ProbeConfig(
        **{**FAST, "kernels": ("bf16", TW), "roles": ("fwd",)}))
    assert len(seen) == 2 * 2 and all(set(s) == {"bf16", TW} for s in seen)  # 2 sites, 2 phases

    pytest.importorskip("triton")
    from loka.kernels.triton import common
    entered = []

    @contextlib.contextmanager
    def untuned():
        entered.append(True)
        yield
    monkeypatch.setattr(common, "untuned", untuned)
    with real([registry.get("bf16"), registry.get(TW)]):
        pass
    assert entered == []
    triton = next(k for k in registry.all_kernels() if k.library is Library.TRITON)
    with real([registry.get("bf16"), triton]):
        pass
    assert entered == [True]


def test_a_cpu_probe_warns_where_the_cpu_scaled_mm_is_slow(monkeypatch):
    """On a CPU whose ``_scaled_mm`` is far slower than a float32 matmul the Probe warns
    before measuring, naming the kernels that call it (measured anyway, as asked), and the
    report records them; at a fast ``_scaled_mm``, or with no such kernel, it says nothing."""
    from loka.kernels import capabilities as caps

    if not registry.available("cpu", names=("cublas-tensorwise",)):
        pytest.skip("this torch build has no CPU torch._scaled_mm")
    config = ProbeConfig(**{**FAST, "kernels": ("bf16", TW, "cublas-tensorwise")})

    def probe(cfg):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rep = loka.probe(TwoSites(), two_site_batches(1), loss_fn, config=cfg)
        return rep, [str(w.message) for w in seen if "_scaled_mm takes" in str(w.message)]

    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: 1613.0)
    rep, said = probe(config)
    assert said == ["loka.probe: this CPU's torch._scaled_mm takes 1613x a float32 matmul's "
                    "time, so measuring cublas-tensorwise will be slow; their emulated twins "
                    "(emulated-*) compute the same FP8 numbers: leave them out with "
                    "ProbeConfig(kernels=...) or the CLI's --kernels"]
    assert rep.meta["slow_cpu_kernels"] == {"cublas-tensorwise": 1613.0}
    for site in rep.sites.values():  # measured as asked
        assert site.roles[Role.FWD].kernels["cublas-tensorwise"].mere is not None
    assert ProbeReport.from_dict(rep.to_dict()).meta["slow_cpu_kernels"] == \
        {"cublas-tensorwise": 1613.0}
    # the same kernels where _scaled_mm is fast, and a slow host without such a kernel
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: 3.0)
    rep_fast, said_fast = probe(config)
    assert said_fast == [] and rep_fast.meta["slow_cpu_kernels"] == {}
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: 1613.0)
    rep_none, said_none = probe(ProbeConfig(**{**FAST, "kernels": ("bf16", TW)}))
    assert said_none == [] and rep_none.meta["slow_cpu_kernels"] == {}
    # a GPU Probe never asks (its kernels do not call the CPU _scaled_mm)
    from loka.probe.measure import _warn_slow_cpu
    assert _warn_slow_cpu(config, torch.device("cuda")) == {}
    assert _warn_slow_cpu(config, None) == {}


def test_slow_cpu_kernels_names_every_kernel_that_calls_the_cpu_scaled_mm(monkeypatch):
    """cuBLAS and torchao kernels call ``torch._scaled_mm``; emulated and bf16 ones do not;
    below the threshold, none is named."""
    from loka.kernels import capabilities as caps

    def fake(name, library):
        return Kernel(name, emulated_gemm, library=library, scaling="tensorwise")
    kernels = [fake("a", "cublas"), fake("b", "torchao"), fake("c", "emulated"),
               registry.get("bf16")]
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: caps.SLOW_CPU_FP8)
    assert registry.slow_cpu_kernels(kernels) == (["a", "b"], caps.SLOW_CPU_FP8)
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: caps.SLOW_CPU_FP8 - 1)
    assert registry.slow_cpu_kernels(kernels) == ([], None)
    calls = []
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: calls.append(1) or 1e4)
    assert registry.slow_cpu_kernels(kernels[2:]) == ([], None) and calls == []
