"""Static serving scales as a plan option: priced by the Probe's timings
(``loka.probe.pricing.serve_static_time_us``), chosen by ``loka.plan(..., inference=True,
static_scales=True)``, carried by the plan's JSON, set by ``loka.apply`` and predicted by
``loka.dispatch.predict_step``."""

import json
import math

import pytest
import torch
from torch import nn

import loka
from loka.config import BASELINE, Role
from loka.dispatch import Plan, RoleChoice, SitePlan, predict_step
from loka.dispatch.select import audit
from loka.jsonio import ReportError
from loka.kernels import get
from loka.probe.pricing import serve_static_time_us
from loka.probe.report import ErrorStat, KernelResult, ProbeReport, RoleReport, SiteReport

TW, RW = "cublas-tensorwise", "cublas-rowwise"
SAFE = ErrorStat(0.01, 0.009, 0.011, 16, 0.001)


def test_the_static_price_by_producer_and_readers():
    """A fused cast replaces the producer's bf16 write (nothing left) unless x has other
    readers (one byte of the separate passes' five, tensorwise; of three, rowwise); a cast
    of its own reads 2 bytes and writes 1 (3/5 of tensorwise's passes, all of rowwise's)."""
    def t(kernel, x, users="single", compiled=True, tq=13.0, tg=10.0):
        return serve_static_time_us(get(kernel), time_us_weight_q=tq, time_us_gemm=tg,
                                    producers={"x": x, "x_users": users}, compiled=compiled)

    assert t(TW, "pointwise") == t(TW, "blocked") == t(RW, "blocked") == 10.0
    assert t(TW, "pointwise", "shared") == pytest.approx(10 + 3 / 5)
    assert t(RW, "pointwise", "shared") == pytest.approx(10 + 3 / 3)
    assert t(TW, "gemm") == pytest.approx(10 + 3 * 3 / 5)
    assert t(RW, "gemm") == 13.0  # the rowwise pass already reads once and writes once
    assert t(TW, "pointwise", compiled=False) == pytest.approx(10 + 3 * 3 / 5)  # not fused
    assert t(TW, "pointwise", tq=9.0) == 10.0  # noise below the GEMM: the GEMM
    assert t(TW, "pointwise", tq=None) is None and t(TW, "pointwise", tg=None) is None


def _report(amax=4.0, x="pointwise", dyn=1.0):
    """One site whose forward on cublas-tensorwise is 1.0x dynamic (serve_us) and whose GEMM
    alone is 1.6x the baseline."""
    kr = KernelResult(TW, mere=SAFE, time_us=120.0, speedup=100 / 120,
                      timing="cuda-graph+compiled", time_us_weight_q=110.0,
                      speedup_weight_q=100 / 110, time_us_gemm=62.5, serve_us=100.0 / dyn,
                      serve_speedup=dyn, safe=True)
    base = KernelResult(BASELINE, mere=SAFE, time_us=100.0, speedup=1.0, timing="cuda-graph",
                        safe=True)
    stats = {"act": {"amax": amax}} if amax is not None else {}
    sr = SiteReport("s", 32, 32, 64, stats=stats, producers={"x": x, "x_users": "single"},
                    roles={Role.FWD: RoleReport(Role.FWD, (64, 32, 32), 100.0,
                                                {BASELINE: base, TW: kr})})
    return ProbeReport(sites={"s": sr}, device="cuda:0")


@pytest.fixture
def on_gpu(monkeypatch):
    """Plan as on the GPU the report was made on (this machine need not have one)."""
    from loka.kernels import registry

    real = registry.Kernel.device_ok
    monkeypatch.setattr(registry.Kernel, "device_ok", lambda self, d: registry.YES
                        if torch.device(d).type in self.devices else real(self, d))


def test_static_scales_choose_what_dynamic_ones_leave_and_carry_the_amax(on_gpu):
    report = _report()
    dynamic = loka.plan(report, inference=True, allowed_kernels=[TW])
    assert dynamic.sites["s"].roles[Role.FWD].kernel == BASELINE and not dynamic.static_scales
    static = loka.plan(report, inference=True, allowed_kernels=[TW], static_scales=True,
                       static_margin=1.5)
    choice = static.sites["s"].roles[Role.FWD]
    assert choice.kernel == TW and choice.speedup == pytest.approx(100 / 62.5)
    assert static.static_scales == {"s": pytest.approx(6.0)}
    assert static.budget["static_scales"] is True and static.budget["static_margin"] == 1.5
    assert "static input scales at 1 site" in static.summary()
    assert audit(static, report)["ok"]
    # the audit judges by the plan's own prices: the dynamic plan is right for dynamic ones
    assert audit(dynamic, report)["ok"]
    # the prediction prices the static cast
    pred = predict_step(static, report, baseline_step_ms=1.0, inference=True)
    assert pred.predicted_step_ms == pytest.approx(1.0 - (100 - 62.5) / 1e3)
    # no observed amax: no static price, no scale, and the plan says why
    none = loka.plan(_report(amax=None), inference=True, allowed_kernels=[TW],
                     static_scales=True)
    assert none.sites["s"].roles[Role.FWD].kernel == BASELINE and not none.static_scales
    # chosen on its dynamic price but without an amax: kept dynamic, with a note
    kept = loka.plan(_report(amax=None, dyn=1.3), inference=True, allowed_kernels=[TW],
                     static_scales=True)
    assert kept.sites["s"].roles[Role.FWD].kernel == TW and not kept.static_scales
    assert any("keep dynamic scales" in n and "s" in n for n in kept.notes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(static_scales=True), "static_scales is for serving"),
    (dict(inference=True, static_scales=True, static_margin=0.0), "static_margin"),
    (dict(inference=True, static_scales=True, static_margin=math.inf), "static_margin"),
    (dict(inference=True, static_scales=True, static_margin=True), "static_margin"),
])
def test_bad_static_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        loka.plan(_report(), **kwargs)


def _plan_dict():
    static = Plan(sites={"s": SitePlan("s", 32, 32, 64, {r: RoleChoice(TW if r is Role.FWD
                                                                      else BASELINE)
                                                          for r in Role})},
                  device="cuda", static_scales={"s": 4.0})
    return static.to_dict()


@pytest.mark.parametrize("bad, match", [
    ({"s": -1.0}, "finite positive"), ({"s": 0}, "finite positive"),
    ({"s": "nan"}, "finite positive"), ({"s": "inf"}, "finite positive"),
    ({"s": "x"}, "expected a number"), ({"s": None}, "finite positive"),
    ({"t": 1.0}, "not in the plan"), ([1.0], "static_scales"),
])
def test_the_plan_json_carries_static_scales_and_refuses_bad_ones(bad, match):
    d = _plan_dict()
    assert Plan.from_dict(json.loads(json.dumps(d))).static_scales == {"s": 4.0}
    assert "static_scales" not in Plan(sites={}).to_dict()
    d["static_scales"] = bad
    with pytest.raises(ReportError, match=match):
        Plan.from_dict(d)
    with pytest.raises(ValueError, match="finite positive"):
        Plan(sites=Plan.from_dict(_plan_dict()).sites, static_scales={"s": -1.0})


def test_apply_sets_the_plans_scales_unless_told_otherwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    plan = Plan(sites={"0": SitePlan("0", 32, 32, 8, {
        Role.FWD: RoleChoice("emulated-tensorwise-e4m3"), Role.DGRAD: RoleChoice(BASELINE),
        Role.WGRAD: RoleChoice(BASELINE)})}, device="cpu", static_scales={"0": 2.5})
    loka.apply(model, plan, inference=True)
    assert float(model[0].input_amax) == 2.5
    assert tuple(model[0]._input_scales.shape) == (1, 1)  # tensorwise: one scale
    x = torch.randn(8, 32)
    x[0, 0] = 100.0  # beyond the static amax: saturates to the format's largest, no Inf
    y = model(x)
    assert torch.isfinite(y).all()
    loka.apply(model, plan, inference=True, static_scales={})  # dynamic everywhere
    assert model[0].input_amax is None
    loka.apply(model, plan, inference=True, static_scales={"0": 7.0})  # the caller's
    assert float(model[0].input_amax) == 7.0
    loka.apply(model, plan)  # training ignores serving scales
    assert model[0].input_amax is None and model[0]._input_scales is None
    # rowwise: the scale table has a row for each of the plan's tokens (no kernel per call)
    plan.sites["0"].roles[Role.FWD] = RoleChoice("emulated-rowwise-e4m3")
    loka.apply(model, plan, inference=True)
    assert tuple(model[0]._input_scales.shape) == (8, 1)
    torch.testing.assert_close(model[0]._input_scales, torch.full((8, 1), 2.5 / 448))


def test_static_saturation_counts_each_sites_inputs_beyond_its_amax():
    """``loka.dispatch.static.static_saturation``: per site serving with a static scale, the
    largest share over the calls of its input elements beyond its amax, counted exactly
    (float64 reference below); sites without a static scale or never called are absent, and
    the counting hooks are gone after the run, even when it raises."""
    from loka.dispatch.static import static_saturation

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 16))
    plan = Plan.uniform(model, "emulated-tensorwise-e4m3")
    plan.static_scales = {"0": 1.5, "2": 0.25}
    loka.apply(model, plan, inference=True)
    xs = [torch.randn(64, 32), torch.randn(64, 32) * 3]
    got = static_saturation(model, lambda: [model(x) for x in xs])
    assert set(got) == {"0", "2"}

    def share(t, amax):
        return float((t.double().abs() > amax).double().mean())
    with torch.no_grad():
        hidden = [torch.relu(model[0](x)) for x in xs]
    assert got["0"] == pytest.approx(max(share(x, 1.5) for x in xs), abs=1e-12)
    assert got["2"] == pytest.approx(max(share(h, 0.25) for h in hidden), abs=1e-12)
    assert 0 < got["0"] < 1 and got["0"] > share(xs[0], 1.5)  # the larger batch decides
    assert all(not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"):
        static_saturation(model, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert static_saturation(model, lambda: None) == {}
