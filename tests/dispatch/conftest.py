"""Probe reports made by hand and test kernels for the planning tests (test_schema,
test_select, test_tune): ``usefixtures("fake_kernels")`` registers the kernels for a module."""

import pytest
import torch

from loka.config import Role, role_shape
from loka.kernels import Kernel, Library, Scaling, get, register, unregister
from loka.probe.report import ErrorStat, KernelResult, ProbeReport, RoleReport, SiteReport

# Test kernels: real (not emulated) entries that run on any device, so that reports
# "measured on a GPU" can be planned on this CPU machine.
FAKE = ["t-slow-exact", "t-mid", "t-fast-coarse", "t-faster"]

THREE = {"t-slow-exact": (0.05, 1.10), "t-mid": (0.15, 1.40), "t-fast-coarse": (0.30, 1.80)}
"""three test kernels: error bound and speedup, the more accurate the slower"""


@pytest.fixture(scope="module")
def fake_kernels():
    """Registers :data:`FAKE` for the module; the value is their names."""
    base = get("emulated-tensorwise-e4m3")
    for name in FAKE:
        register(Kernel(name, base.fn, library=Library.CUSTOM, scaling=Scaling.TENSORWISE,
                        formats=("e4m3", "e4m3"), align=16, quantize_a=base.quantize_a,
                        quantize_b=base.quantize_b), override=True)
    yield list(FAKE)
    for name in FAKE:
        unregister(name)


def _stat(hi, mean=None, n=64):
    mean = hi * 0.8 if mean is None else mean
    return ErrorStat(mean, mean * 0.9, hi, n, 0.01)


def _make_report(sites, device="cuda:0", timing="cuda-graph"):
    """sites: {name: (in, out, tokens, {role: {kernel: (mere_hi, speedup)}})}."""
    out = {}
    for name, (k, n, m, roles) in sites.items():
        rr = {}
        for role, kernels in roles.items():
            role = Role.parse(role)
            results = {"bf16": KernelResult("bf16", mere=_stat(0.01), speedup=1.0, timing=timing)}
            for kname, (hi, speed) in kernels.items():
                results[kname] = KernelResult(
                    kname, mere=None if hi is None else _stat(hi),
                    relfro=None if hi is None else _stat(hi / 4),
                    sqnr=None if hi is None else ErrorStat(30 - 40 * hi, 29 - 40 * hi, 31 - 40 * hi, 64),
                    speedup=speed, timing="none" if speed is None else timing,
                    time_us=None if speed is None else 10.0 / speed)
            rr[role] = RoleReport(role, role_shape(role, m, k, n), 10.0, results)
        out[name] = SiteReport(name, k, n, m, roles=rr)
    return ProbeReport(sites=out, device=device, device_name="test", torch_version=torch.__version__)


@pytest.fixture
def stat():
    """``stat(hi, mean=None, n=64)``: an error statistic with upper bound ``hi``."""
    return _stat


@pytest.fixture
def make_report():
    """``make_report(sites, device="cuda:0", timing="cuda-graph")``: a Probe report of the
    given sites, every role with the baseline at speed 1."""
    return _make_report


@pytest.fixture
def three():
    """:data:`THREE`"""
    return THREE
