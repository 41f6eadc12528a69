"""loka.dispatch.predict_step: the step a report's isolated timings predict for a plan."""

import pytest

from loka.config import Role
from loka.dispatch import Plan, RoleChoice, SitePlan, predict_step
from loka.probe.report import KernelResult, ProbeReport, RoleReport, SiteReport

K = "cublas-rowwise"


def _report():
    rep = ProbeReport(device="cuda")
    for name, (base, fp8, fp8_wq) in {"a": (100.0, 60.0, 50.0), "b": (40.0, 55.0, 45.0)}.items():
        sr = SiteReport(name, 256, 256, 4096)
        for role in Role:
            rr = RoleReport(role, (4096, 256, 256), baseline_us=base)
            rr.kernels[K] = KernelResult(K, time_us=fp8, timing="cuda-graph",
                                         time_us_weight_q=fp8_wq if role is Role.FWD else None)
            sr.roles[role] = rr
        rep.sites[name] = sr
    return rep


def _plan(roles):
    sites = {}
    for name, rs in roles.items():
        sites[name] = SitePlan(name, 256, 256, 4096,
                               roles={Role.parse(r): RoleChoice(k) for r, k in rs.items()})
    return Plan(sites=sites, device="cuda")


def test_savings_are_summed_per_fp8_site_role_in_float64():
    plan = _plan({"a": {"fwd": K, "dgrad": K, "wgrad": "bf16"}, "b": {"fwd": K}})
    pred = predict_step(plan, _report(), 10.0)
    # a: fwd and dgrad save 40 us each; b's forward loses 15 us; baselines save nothing
    assert pred.per_role_us == {"a:fwd": 40.0, "a:dgrad": 40.0, "b:fwd": -15.0}
    assert pred.saved_ms == pytest.approx(0.065, abs=1e-15)
    assert pred.predicted_step_ms == pytest.approx(10.0 - 0.065, abs=1e-12)
    assert pred.speedup == pytest.approx(10.0 / 9.935, rel=1e-12)
    assert pred.untimed == [] and pred.to_dict()["predicted_speedup"] == pred.speedup


def test_serving_counts_the_forward_with_the_weight_quantized_once():
    plan = _plan({"a": {"fwd": K, "dgrad": K}, "b": {"fwd": K}})
    pred = predict_step(plan, _report(), 2.0, inference=True)
    assert pred.per_role_us == {"a:fwd": 50.0, "b:fwd": -5.0}
    assert pred.predicted_step_ms == pytest.approx(2.0 - 0.045, abs=1e-12)


def test_untimed_site_roles_save_nothing_and_are_listed():
    rep = _report()
    rep.sites["b"].roles[Role.FWD].kernels[K].time_us = None
    plan = _plan({"a": {"fwd": K}, "b": {"fwd": K}, "c": {"fwd": K}})
    pred = predict_step(plan, rep, 5.0)
    assert pred.untimed == ["b:fwd", "c:fwd"] and pred.per_role_us == {"a:fwd": 40.0}


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), None])
def test_bad_baselines_and_impossible_savings_are_refused(bad):
    plan = _plan({"a": {"fwd": K}})
    with pytest.raises(ValueError, match="positive number"):
        predict_step(plan, _report(), bad)
    with pytest.raises(ValueError, match="exceed the baseline step"):
        predict_step(plan, _report(), 0.04)
