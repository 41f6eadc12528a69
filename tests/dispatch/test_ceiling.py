"""loka.dispatch.fp8_ceiling: the most FP8 GEMMs could give a step, at the device's roofline
and on the fastest kernels the report timed, whatever their error."""

import math

import pytest

from loka.config import Role
from loka.dispatch import fp8_ceiling
from loka.kernels.roofline import Peaks, fp8_time_lower_bound_us
from loka.probe.report import KernelResult, ProbeReport, RoleReport, SiteReport

K, T = "cublas-rowwise", "cublas-tensorwise"
SHAPE = (4096, 256, 256)
PEAKS = Peaks(bf16_tflops=100.0, fp8_tflops=200.0, hbm_tbps=2.0)


def _report(n_sites=4):
    """Sites s0..s{n-1} in forward order; s0 gains 2x on K in every role, the others lose."""
    rep = ProbeReport(device="cuda", device_name="Some Future GPU")
    for i in range(n_sites):
        name = f"s{i}"
        sr = SiteReport(name, 256, 256, 4096, order=i)
        for role in Role:
            rr = RoleReport(role, SHAPE, baseline_us=100.0)
            fp8, t = (50.0 if i == 0 else 120.0), (80.0 if i == 1 else 130.0)
            wq = fp8 - 10 if role is Role.FWD else None
            rr.kernels[K] = KernelResult(K, time_us=fp8, timing="cuda-graph", speedup=100 / fp8,
                                         time_us_weight_q=wq,
                                         speedup_weight_q=wq and 100 / wq)
            rr.kernels[T] = KernelResult(T, time_us=t, timing="cuda-graph", speedup=100 / t)
            sr.roles[role] = rr
        rep.sites[name] = sr
    return rep


def test_the_measured_ceiling_takes_each_role_to_its_fastest_timed_kernel():
    c = fp8_ceiling(_report(), 10.0, head_sites=1)
    # s0 saves 50 us per role (K), s1 20 us (T), s2 and s3 nothing: their kernels are slower
    saved_us = 3 * 50.0 + 3 * 20.0
    assert c.measured_speedup == pytest.approx(10.0 / (10.0 - saved_us / 1e3), rel=1e-12)
    assert c.head == ["s3"]  # the last in forward order; it saves nothing either way
    assert c.measured_speedup_eligible == pytest.approx(c.measured_speedup, rel=1e-12)
    assert c.gemm_ms == pytest.approx(12 * 100.0 / 1e3) and c.gemm_share == pytest.approx(0.12)
    assert c.roofline_speedup is None  # a device without known peaks
    assert c.untimed == []


def test_head_sites_leave_the_eligible_ceiling():
    rep = _report()
    rep.sites["s0"].order, rep.sites["s3"].order = 3, 0  # s0, the fast one, is now the head
    c = fp8_ceiling(rep, 10.0, head_sites=1)
    assert c.head == ["s0"]
    assert c.measured_speedup_eligible == pytest.approx(10.0 / (10.0 - 0.060), rel=1e-12)
    assert c.measured_speedup == pytest.approx(10.0 / (10.0 - 0.210), rel=1e-12)


def test_serving_counts_forwards_with_the_weight_quantized_once_and_keeps_no_head():
    c = fp8_ceiling(_report(), 2.0, inference=True, head_sites=1)
    # s0's forward: 40 us with its weight quantized once (60 saved); s1's: T at 80 (20)
    assert c.measured_speedup == pytest.approx(2.0 / (2.0 - 0.080), rel=1e-12)
    assert c.head == [] and c.measured_speedup_eligible == c.measured_speedup
    assert c.gemm_ms == pytest.approx(0.4)


def test_the_roofline_ceiling_is_every_role_at_its_fp8_lower_bound():
    lb = fp8_time_lower_bound_us(SHAPE, PEAKS, quantizes_a=False, quantizes_b=False)
    gemm = max(2.0 * 4096 * 256 * 256 / 200e12, (4096 * 256 + 256 * 256 + 2 * 4096 * 256) / 2e12)
    assert lb == pytest.approx(gemm * 1e6, rel=1e-12)  # no quantization at all
    c = fp8_ceiling(_report(), 10.0, head_sites=1, peaks=PEAKS)
    saved = 12 * (100.0 - lb)
    assert c.roofline_speedup == pytest.approx(10.0 / (10.0 - saved / 1e3), rel=1e-12)
    assert c.roofline_speedup_eligible == pytest.approx(10.0 / (10.0 - 9 * (100.0 - lb) / 1e3),
                                                        rel=1e-12)
    # the device's own peaks come from its name where it is known
    rep = _report()
    rep.device_name = "NVIDIA H100 80GB HBM3"
    assert fp8_ceiling(rep, 10.0).roofline_speedup > fp8_ceiling(rep, 10.0).measured_speedup


def test_untrusted_timings_emulated_kernels_and_failures_count_for_nothing():
    rep = _report()
    s0 = rep.sites["s0"]
    for role in Role:
        kr = s0.roles[role].kernels[K]
        kr.timing = "cpu-wallclock"
    s0.roles[Role.FWD].kernels["emulated-rowwise-e4m3"] = KernelResult(
        "emulated-rowwise-e4m3", time_us=1.0, timing="cuda-graph", speedup=100.0)
    s0.roles[Role.DGRAD].kernels[T].error = "RuntimeError: boom"
    s0.roles[Role.DGRAD].kernels[T].speedup = 100.0
    s0.roles[Role.WGRAD].kernels = {}
    c = fp8_ceiling(rep, 10.0, head_sites=0)
    assert c.measured_speedup == pytest.approx(10.0 / (10.0 - 0.060), rel=1e-12)
    # the forward's tensorwise kernel was timed on the GPU (slower): decisive; the input
    # gradient's kernels were timed on a CPU or failed, the weight gradient's not at all
    assert c.untimed == ["s0:dgrad", "s0:wgrad"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), None, True])
def test_bad_baselines_and_impossible_savings_are_refused(bad):
    with pytest.raises(ValueError, match="positive number"):
        fp8_ceiling(_report(), bad)
    with pytest.raises(ValueError, match="exceed the baseline step"):
        fp8_ceiling(_report(), 0.1)
    assert math.isfinite(fp8_ceiling(_report(), 0.3).measured_speedup)
