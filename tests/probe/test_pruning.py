"""What the Probe does not time, and why (issue 27, a Probe that fits in a minute): kernels
over the error budget, kernels whose roofline bound cannot reach ``min_speedup``, and the
bound on Triton autotuning while timing."""

import pytest
import torch
from torch import nn

import loka
from loka.config import BASELINE, ProbeConfig, Role
from loka.kernels import roofline
from loka.kernels.roofline import Peaks, fp8_time_lower_bound_us, max_speedup, peaks_for
from loka.probe import measure
from loka.probe.report import KernelResult, ProbeReport

TIMING = dict(timing=True, timing_iters=2, timing_warmup=0, timing_budget_ms=None,
              num_samples=4, naive_samples=4, bootstrap=20, progress=False, roles=("fwd",),
              compare_naive=False)
FP8 = "emulated-rowwise-e4m3"


def test_the_roofline_bound_is_the_hand_computed_one():
    p = Peaks(bf16_tflops=100.0, fp8_tflops=200.0, hbm_tbps=2.0)
    m, k, n = 4096, 512, 256
    gemm = max(2.0 * m * k * n / 200e12, (m * k + k * n + 2 * m * n) / 2e12)
    quant = (m * k + k * n) * 3 / 2e12
    assert fp8_time_lower_bound_us((m, k, n), p) == pytest.approx((gemm + quant) * 1e6, rel=1e-12)
    # a weight quantized beforehand: only the activation is read and cast
    only_a = (gemm + m * k * 3 / 2e12) * 1e6
    assert fp8_time_lower_bound_us((m, k, n), p, quantizes_b=False) == pytest.approx(only_a)
    assert max_speedup(10.0, (m, k, n), p) == pytest.approx(10.0 / ((gemm + quant) * 1e6))
    with pytest.raises(ValueError, match="positive dimensions"):
        fp8_time_lower_bound_us((0, k, n), p)


def test_device_names_find_their_peaks_and_unknown_devices_none():
    assert peaks_for("NVIDIA H200") == roofline.PEAKS["h200"]
    assert peaks_for("NVIDIA H100 PCIe") == roofline.PEAKS["h100 pcie"]
    assert peaks_for("NVIDIA H100 80GB HBM3") == roofline.PEAKS["h100"]
    assert peaks_for("Some Future GPU") is None
    assert roofline.device_peaks(torch.device("cpu")) is None


def _probe(monkeypatch, peaks, **cfg):
    monkeypatch.setattr(measure, "device_peaks", lambda dev: peaks)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    rep = loka.probe(model, [torch.randn(128, 64)], lambda m, x: m(x).square().mean(),
                     config=ProbeConfig(kernels=(BASELINE, FP8), **{**TIMING, **cfg}))
    return rep, rep.sites[""].roles[Role.FWD].kernels


def test_a_kernel_that_cannot_reach_min_speedup_at_peak_rates_is_not_timed(monkeypatch):
    # peak rates so low that any FP8 kernel takes longer than the measured baseline
    rep, ks = _probe(monkeypatch, Peaks(1e-6, 2e-6, 1e-6))
    kr = ks[FP8]
    assert kr.not_timed.startswith("roofline: at most ") and kr.time_us is None
    assert kr.mere is not None and kr.safe and not kr.fast  # errors still measured
    assert ks[BASELINE].time_us > 0 and ks[BASELINE].not_timed is None
    assert rep.meta["not_timed"] == {"roofline": 1}
    # peaks so high the bound never binds: timed
    _, ks = _probe(monkeypatch, Peaks(1e9, 2e9, 1e9))
    assert ks[FP8].not_timed is None and ks[FP8].time_us > 0
    # off: timed whatever the bound
    _, ks = _probe(monkeypatch, Peaks(1e-6, 2e-6, 1e-6), roofline_prune=False)
    assert ks[FP8].not_timed is None and ks[FP8].time_us > 0


def test_a_kernel_over_the_error_budget_is_not_timed_unless_asked(monkeypatch):
    rep, ks = _probe(monkeypatch, None, max_error=1e-12)
    kr = ks[FP8]
    assert not kr.safe and kr.time_us is None
    assert kr.not_timed == "unsafe: MERE upper bound over 1e-12"
    assert rep.meta["not_timed"] == {"unsafe": 1}
    _, ks = _probe(monkeypatch, None, max_error=1e-12, time_unsafe=True)
    assert ks[FP8].not_timed is None and ks[FP8].time_us > 0 and not ks[FP8].safe


def test_not_timed_survives_the_report_round_trip(monkeypatch, tmp_path):
    rep, _ = _probe(monkeypatch, None, max_error=1e-12)
    rep.save(tmp_path / "r.json")
    back = ProbeReport.load(tmp_path / "r.json")
    assert back.sites[""].roles[Role.FWD].kernels[FP8].not_timed.startswith("unsafe")
    # older reports have no such field: None, and a timed kernel writes none
    d = KernelResult("k", time_us=1.0, timing="cuda-graph").to_dict()
    assert "not_timed" not in d and KernelResult.from_dict(d).not_timed is None
    with pytest.raises(Exception, match="not_timed"):
        KernelResult.from_dict({**d, "not_timed": 3})


def test_probe_config_refuses_a_zero_autotune_bound():
    with pytest.raises(ValueError, match="autotune_configs"):
        ProbeConfig(autotune_configs=0)
    with pytest.raises(ValueError, match="at least one config"):
        with roofline.autotune_limit(0):
            pass


def test_the_autotune_bound_keeps_the_largest_tiles_that_fit(monkeypatch):
    triton = pytest.importorskip("triton")
    from loka.kernels.triton import common, quantize

    if common.interpreted():
        pytest.skip("the interpreter keeps one config whatever the bound")
    monkeypatch.delenv("LOKA_TRITON_AUTOTUNE", raising=False)
    tuner = quantize.rowwise_quant_kernel
    args, kw = {"R": 4096, "C": 256}, {"BLOCK_C": 256}
    every = tuner.early_config_prune(tuner.configs, args, **kw)
    assert len(every) > 2
    with roofline.autotune_limit(2):
        two = tuner.early_config_prune(tuner.configs, args, **kw)
    assert roofline.max_autotune_configs() is None  # restored on exit
    area = common._tile_area  # noqa: SLF001 - the order the bound keeps
    assert len(two) == 2 and [area(c) for c in two] == sorted(map(area, every), reverse=True)[:2]
    assert all(c in every for c in two)


def test_autotune_choices_lists_what_the_autotuners_chose():
    pytest.importorskip("triton")
    from loka.kernels.triton import common, quantize

    tuner = quantize.rowwise_quant_kernel
    saved = dict(tuner.cache)
    try:
        tuner.cache[(4096, 256, "torch.bfloat16")] = tuner.configs[0]
        choices = common.autotune_choices()
        assert choices["rowwise_quant_kernel"]["4096,256,torch.bfloat16"] == str(tuner.configs[0])
    finally:
        tuner.cache.clear()
        tuner.cache.update(saved)


def test_seeded_autotune_choices_are_what_a_later_run_launches(tmp_path):
    """A report's ``meta['autotuned']`` loaded into the autotuners (``autotune_from``):
    the recorded config is in the cache under the recorded key (no benchmark for that
    shape), configs the autotuner does not offer and unknown kernels are skipped, and
    malformed choices are refused."""
    pytest.importorskip("triton")
    from loka.kernels.triton import common, quantize

    tuner = quantize.rowwise_quant_kernel
    saved = dict(tuner.cache)
    try:
        tuner.cache.clear()
        want = tuner.configs[-1]
        choices = {"rowwise_quant_kernel": {"4096,256,torch.bfloat16": str(want),
                                            "8,16,torch.float32": "BLOCK_R: 3, num_warps: 99"},
                   "no_such_kernel": {"1": "x"}}
        seeded, skipped = common.seed_autotune(choices)
        assert seeded == 1 and len(skipped) == 2
        assert tuner.cache[(4096, 256, "torch.bfloat16")] is want
        assert common.autotune_choices() == {"rowwise_quant_kernel":
                                             {"4096,256,torch.bfloat16": str(want)}}
        assert common._key_part("True") is True and common._key_part("12") == 12
        for bad in ([], {"rowwise_quant_kernel": ["x"]}, {"rowwise_quant_kernel": {"k": 3}}):
            with pytest.raises(ValueError, match="autotune choices"):
                common.seed_autotune(bad)
        # through the Probe: a report's choices, then the count in the new report's meta
        tuner.cache.clear()
        old = ProbeReport(meta={"autotuned": {"rowwise_quant_kernel":
                                              {"64,32,torch.float32": str(want)}}})
        old.save(tmp_path / "old.json")
        model = nn.Linear(32, 32)
        rep = loka.probe(model, [torch.randn(64, 32)], lambda m, x: m(x).square().mean(),
                         config=ProbeConfig(**{**TIMING, "timing": False},
                                            kernels=(BASELINE, FP8),
                                            autotune_from=str(tmp_path / "old.json")))
        assert rep.meta["autotune_seeded"] == {"from": str(tmp_path / "old.json"),
                                               "seeded": 1, "skipped": []}
        assert tuner.cache[(64, 32, "torch.float32")] is want
        bad = ProbeReport(meta={"autotuned": {"rowwise_quant_kernel": ["x"]}})
        bad.save(tmp_path / "bad.json")
        with pytest.raises(loka.jsonio.ReportError, match="bad.json: meta.autotuned"):
            loka.probe(model, [torch.randn(64, 32)], lambda m, x: m(x).square().mean(),
                       config=ProbeConfig(**{**TIMING, "timing": False},
                                          kernels=(BASELINE, FP8),
                                          autotune_from=str(tmp_path / "bad.json")))
    finally:
        tuner.cache.clear()
        tuner.cache.update(saved)


def test_seeding_in_a_fresh_process_loads_the_kernels_it_seeds():
    """On a fresh machine no Triton kernel module is loaded yet when the Probe starts:
    seeding must load them, or every choice would be skipped."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    from loka.kernels.triton import quantize

    cfg = str(quantize.rowwise_quant_kernel.configs[0])
    code = ("import json, sys\n"
            "from loka.kernels.triton import common\n"
            "assert 'loka.kernels.triton.quantize' not in sys.modules\n"
            "print(json.dumps(common.seed_autotune({'rowwise_quant_kernel': "
            "{'64,32,torch.float32': sys.argv[1]}})))")
    out = subprocess.run([sys.executable, "-c", code, cfg], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1, []]


def test_a_forward_whose_input_takes_a_static_cast_is_bounded_with_x_in_fp8(monkeypatch):
    """A memory-bound forward (the Wukong's 64-to-32 projection over 1M rows) cannot gain
    when it reads and casts x itself, but can when x arrives in FP8 from a producer that
    takes a static cast: the bound that rules kernels out must be that kinder one there."""
    peaks = Peaks(989.4, 1978.9, 3.35)
    monkeypatch.setattr(measure, "device_peaks", lambda dev: peaks)
    m = measure._Measurement(ProbeConfig(**TIMING, timing_compile="on"))
    shape, dev, dtype = (1 << 20, 64, 32), torch.device("cuda"), torch.bfloat16
    base_us = 74.3  # the H100's bf16 time of that GEMM (bench/results/2026-12-06-h100-static-table)
    compiled = loka.kernels.registry.get("cublas-tensorwise")
    triton = loka.kernels.registry.get("triton-rowwise-cublas-fastacc")
    blocked = {"x": "blocked", "x_users": "shared"}
    with_cast = max_speedup(base_us, shape, peaks, quantizes_b=False)
    x_free = max_speedup(base_us, shape, peaks, quantizes_a=False, quantizes_b=False)
    assert with_cast < 1.0 < 1.05 < x_free  # the case the rule is for
    # input of the model: x's cast is a pass of its own, ruled out
    assert m._roofline_bound(compiled, Role.FWD, shape, dev, dtype, base_us,
                             {"x": "input"}) == pytest.approx(with_cast)
    # a block norm makes x: the static cast rides in it, timed
    assert m._roofline_bound(compiled, Role.FWD, shape, dev, dtype, base_us, blocked) is None
    # a Triton quantizer reads x itself whatever made it; gradient roles unchanged
    assert m._roofline_bound(triton, Role.FWD, shape, dev, dtype, base_us,
                             blocked) == pytest.approx(with_cast)
    dgrad = (1 << 20, 32, 64)
    assert m._roofline_bound(compiled, Role.DGRAD, dgrad, dev, dtype, 78.4, blocked) == \
        pytest.approx(max_speedup(78.4, dgrad, peaks))
    # a Probe that times nothing compiled (CPU default 'auto' off a GPU) never frees x
    m_off = measure._Measurement(ProbeConfig(**TIMING, timing_compile="off"))
    assert m_off._roofline_bound(compiled, Role.FWD, shape, dev, dtype, base_us,
                                 blocked) == pytest.approx(with_cast)
