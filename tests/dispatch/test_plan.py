import json
import math
import random

import pytest
import torch
from torch import nn

import loka
from loka.config import DispatchConfig, LinearConfig, Role
from loka.dispatch import Plan, plan
from loka.dispatch.plan import resolve_budget, tighten_end_to_end
from loka.kernels import Kernel, get, register, unregister
from loka.probe.report import (ErrorStat, KernelResult, ProbeReport, ReportError, RoleReport,
                               SiteReport)

# Test kernels: real (not emulated) entries that run on any device, so that reports
# "measured on a GPU" can be planned on this CPU machine.
FAKE = ["t-slow-exact", "t-mid", "t-fast-coarse", "t-faster"]


@pytest.fixture(scope="module", autouse=True)
def fake_kernels():
    base = get("emulated-tensorwise-e4m3")
    for name in FAKE:
        register(Kernel(name, base.fn, library="custom", scaling="tensorwise",
                        formats=("e4m3", "e4m3"), align=16, quantize_a=base.quantize_a,
                        quantize_b=base.quantize_b), override=True)
    yield
    for name in FAKE:
        unregister(name)


def stat(hi, mean=None, n=64):
    mean = hi * 0.8 if mean is None else mean
    return ErrorStat(mean, mean * 0.9, hi, n, 0.01)


def make_report(sites, device="cuda:0", timing="cuda-graph"):
    """sites: {name: (in, out, tokens, {role: {kernel: (mere_hi, speedup)}})}."""
    out = {}
    for name, (k, n, m, roles) in sites.items():
        rr = {}
        for role, kernels in roles.items():
            role = Role.parse(role)
            results = {"bf16": KernelResult("bf16", mere=stat(0.01), speedup=1.0, timing=timing)}
            for kname, (hi, speed) in kernels.items():
                results[kname] = KernelResult(
                    kname, mere=None if hi is None else stat(hi),
                    relfro=None if hi is None else stat(hi / 4),
                    sqnr=None if hi is None else ErrorStat(30 - 40 * hi, 29 - 40 * hi, 31 - 40 * hi, 64),
                    speedup=speed, timing="none" if speed is None else timing,
                    time_us=None if speed is None else 10.0 / speed)
            rr[role] = RoleReport(role, loka.config.role_shape(role, m, k, n), 10.0, results)
        out[name] = SiteReport(name, k, n, m, roles=rr)
    return ProbeReport(sites=out, device=device, device_name="test", torch_version=torch.__version__)


THREE = {"t-slow-exact": (0.05, 1.10), "t-mid": (0.15, 1.40), "t-fast-coarse": (0.30, 1.80)}


@pytest.mark.parametrize("budget, want", [(0.01, "bf16"), (0.05, "t-slow-exact"),
                                          (0.2, "t-mid"), (0.3, "t-fast-coarse"),
                                          (1.0, "t-fast-coarse")])
@pytest.mark.parametrize("role", list(Role))
def test_fastest_kernel_within_the_budget(budget, want, role):
    report = make_report({"enc": (64, 128, 256, {role: THREE})})
    p = plan(report, max_error=budget, min_speedup=1.05)
    choice = p.sites["enc"].roles[role]
    assert choice.kernel == want
    if want != "bf16":
        assert choice.error <= budget and choice.speedup == THREE[want][1]
    other = [r for r in Role if r != role]
    assert all(p.sites["enc"].kernel(r) == "bf16" for r in other)  # not measured: baseline


@pytest.mark.parametrize("min_speedup, want", [(1.0, "t-mid"), (1.4, "t-mid"),
                                               (1.5, "bf16"), (2.0, "bf16")])
def test_speedup_threshold(min_speedup, want):
    report = make_report({"s": (64, 64, 128, {"fwd": THREE})})
    assert plan(report, max_error=0.2, min_speedup=min_speedup).sites["s"].kernel("fwd") == want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("metric", ["mere", "relfro"])
def test_random_reports_match_brute_force(seed, metric):
    rng = random.Random(seed)
    sites = {}
    for i in range(12):
        roles = {}
        for role in Role:
            roles[role] = {k: (rng.uniform(0.0, 0.4), rng.choice([None, rng.uniform(0.6, 2.0)]))
                           for k in rng.sample(FAKE, rng.randint(1, len(FAKE)))}
        sites[f"layer{i}.proj"] = (64, 32, 4096, roles)
    report = make_report(sites)
    budget, min_speed = rng.uniform(0.05, 0.35), rng.uniform(1.0, 1.5)
    p = plan(report, max_error=budget, min_speedup=min_speed, metric=metric)
    scale = 1.0 if metric == "mere" else 0.25
    chosen_fp8 = 0
    for name, (_, _, _, roles) in sites.items():
        for role, kernels in roles.items():
            ok = {k: s for k, (hi, s) in kernels.items()
                  if hi * scale <= budget and s is not None and s >= min_speed}
            want = max(ok, key=lambda k: (ok[k], -kernels[k][0])) if ok else "bf16"
            choice = p.sites[name].roles[role]
            assert choice.kernel == want, (name, role, kernels)
            if want != "bf16":
                chosen_fp8 += 1
                assert choice.error <= budget and choice.speedup >= min_speed
    assert chosen_fp8 > 0  # the draw exercises the selection, not only the fallback


def test_per_role_budget_makes_wgrad_stricter():
    report = make_report({"s": (64, 64, 128, {r: THREE for r in Role})})
    p = plan(report, max_error=0.2, role_budgets={"wgrad": 0.06})
    assert p.config("s") == LinearConfig("t-mid", "t-mid", "t-slow-exact")
    assert p.sites["s"].roles[Role.WGRAD].budget == 0.06
    assert resolve_budget(DispatchConfig(role_budgets={Role.DGRAD: 0.1}), "x", "dgrad") == 0.1


def test_per_site_budget_by_regex_strictest_match_wins():
    sites = {name: (64, 64, 128, {r: THREE for r in Role})
             for name in ("over.0", "over.1", "inter.proj", "top")}
    report = make_report(sites)
    p = plan(report, max_error=0.35, role_budgets={"wgrad": 0.2},
             site_budgets={r"^over\.": 0.16, r"over\.1$": 0.06, "proj": 0.02})
    assert p.config("over.0") == LinearConfig.uniform("t-mid")          # site beats role
    assert p.config("over.1") == LinearConfig.uniform("t-slow-exact")   # strictest of two
    assert p.config("inter.proj") == LinearConfig.uniform("bf16")
    assert p.config("top") == LinearConfig("t-fast-coarse", "t-fast-coarse", "t-mid")


def test_failed_nan_and_unmeasured_kernels_are_never_chosen():
    report = make_report({"s": (64, 64, 128, {"fwd": {"t-faster": (0.01, 3.0),
                                                      "t-mid": (math.nan, 2.5),
                                                      "t-fast-coarse": (None, 2.0),
                                                      "t-slow-exact": (0.05, 1.2)}})})
    report.sites["s"].roles[Role.FWD].kernels["t-faster"].error = "CUDA error: illegal address"
    assert plan(report).sites["s"].kernel("fwd") == "t-slow-exact"


def test_misaligned_site_keeps_the_baseline_for_the_roles_that_need_alignment():
    # 48 -> 1: fwd needs N=1 aligned, dgrad K=1; wgrad's K is the (padded) token count, N=48
    report = make_report({"logit": (48, 1, 100, {r: {"t-mid": (0.1, 1.5)} for r in Role})})
    p = plan(report)
    assert p.config("logit") == LinearConfig("bf16", "bf16", "t-mid")


def test_unavailable_and_unregistered_kernels_are_excluded_with_a_note():
    kernels = {"cublas-tensorwise-fastacc": (0.01, 3.0), "some-future-kernel": (0.01, 3.0),
               "cublas-rowwise": (0.05, 1.2)}
    report = make_report({"s": (64, 64, 128, {"fwd": kernels})}, device="cpu")
    p = plan(report, assume_fast=True)
    assert p.sites["s"].kernel("fwd") == "cublas-rowwise"
    notes = "\n".join(p.notes)
    assert "'cublas-tensorwise-fastacc' excluded: unavailable on cpu: fast accumulation" in notes
    assert "'some-future-kernel' excluded: not registered" in notes
    p = plan(report, assume_fast=True, allowed_kernels=["emulated-rowwise-e4m3"])
    assert p.sites["s"].kernel("fwd") == "bf16"


# -- reports without decisive timings ------------------------------------------------
CPU_KERNELS = {"emulated-rowwise-e4m3": (0.08, None), "cublas-rowwise": (0.08, None),
               "emulated-tensorwise-e4m3": (0.12, None), "emulated-blockwise-e4m3": (0.5, None)}


@pytest.mark.parametrize("timing, speed", [("none", None), ("cpu-wallclock", 0.3),
                                           ("cpu-wallclock", 1.5)])
def test_cpu_reports_plan_the_baseline_unless_assume_fast(timing, speed):
    kernels = {k: (hi, speed) for k, (hi, _) in CPU_KERNELS.items()}
    report = make_report({"s": (256, 256, 64, {r: kernels for r in Role})}, device="cpu",
                         timing=timing)
    p = plan(report)
    assert p.config("s") == LinearConfig.uniform("bf16")
    assert any("assume_fast=True" in n for n in p.notes)
    assert p.sites["s"].roles[Role.FWD].reason == "safe kernels have no decisive timing"
    p = plan(report, assume_fast=True)
    # a real kernel before emulated ones (references, never fast), then the lowest error
    assert p.config("s") == LinearConfig.uniform("cublas-rowwise")
    assert p.sites["s"].roles[Role.FWD].speedup is None
    assert plan(report, assume_fast=True, max_error=0.1,
                allowed_kernels=["emulated-tensorwise-e4m3"]).config("s").fwd == "bf16"
    emulated_only = plan(report, assume_fast=True, allowed_kernels=[
        "emulated-rowwise-e4m3", "emulated-tensorwise-e4m3"])
    assert emulated_only.config("s") == LinearConfig.uniform("emulated-rowwise-e4m3")


def test_assume_fast_prefers_a_real_kernel_to_a_more_accurate_emulated_one():
    kernels = {"emulated-rowwise-e4m3": (0.05, None), "cublas-tensorwise": (0.15, None),
               "cublas-rowwise": (0.25, None)}
    report = make_report({"s": (256, 256, 64, {"fwd": kernels})}, device="cpu", timing="none")
    assert plan(report, assume_fast=True).sites["s"].kernel("fwd") == "cublas-tensorwise"
    assert plan(report, assume_fast=True, max_error=0.1).sites["s"].kernel("fwd") == \
        "emulated-rowwise-e4m3"


def test_gpu_timings_do_not_decide_for_another_device_type():
    report = make_report({"s": (64, 64, 128, {"fwd": THREE})}, device="cuda:0")
    assert plan(report, device="cpu").sites["s"].kernel("fwd") == "bf16"
    assert plan(report, device="cpu", assume_fast=True).sites["s"].kernel("fwd") == "t-slow-exact"
    assert plan(report, device="cuda").sites["s"].kernel("fwd") == "t-mid"


def test_timed_kernels_win_over_untimed_ones_under_assume_fast():
    report = make_report({"s": (64, 64, 128, {"fwd": {"t-mid": (0.15, 1.3),
                                                      "t-slow-exact": (0.01, None)}})})
    assert plan(report, assume_fast=True).sites["s"].kernel("fwd") == "t-mid"


def test_neg_sqnr_metric():
    report = make_report({"s": (64, 64, 128, {"fwd": THREE})})
    # SQNR bounds: t-slow-exact >= 27 dB, t-mid >= 23 dB, t-fast-coarse >= 17 dB
    assert plan(report, metric="neg_sqnr", max_error=-25.0).sites["s"].kernel("fwd") == "t-slow-exact"
    assert plan(report, metric="neg_sqnr", max_error=-20.0).sites["s"].kernel("fwd") == "t-mid"


@pytest.mark.parametrize("kwargs, match", [
    ({"max_error": math.nan}, "finite"),
    ({"site_budgets": {"(": 0.1}}, "regular expression"),
    ({"role_budgets": {"bwd": 0.1}}, "unknown role"),
    ({"metric": "l2"}, "unknown metric"),
    ({"min_speedup": 0.0}, "positive"),
])
def test_bad_budgets_are_refused(kwargs, match):
    report = make_report({"s": (64, 64, 128, {"fwd": THREE})})
    with pytest.raises(ValueError, match=match):
        plan(report, **kwargs)


def test_unknown_allowed_kernel_is_refused():
    with pytest.raises(KeyError, match="unregistered"):
        plan(make_report({}), allowed_kernels=["nope"])


def test_config_object_and_overrides():
    report = make_report({"s": (64, 64, 128, {"fwd": THREE})})
    cfg = DispatchConfig(max_error=0.3, min_speedup=1.05)
    assert plan(report, config=cfg).sites["s"].kernel("fwd") == "t-fast-coarse"
    assert plan(report, config=cfg, max_error=0.1).sites["s"].kernel("fwd") == "t-slow-exact"


# -- the plan as data ------------------------------------------------------------------
def test_json_round_trip(tmp_path):
    report = make_report({"a.b": (64, 64, 128, {r: THREE for r in Role}),
                          "c": (48, 1, 100, {"fwd": THREE})})
    p = plan(report, role_budgets={Role.WGRAD: 0.06}, site_budgets={"^c": 0.2})
    p.sites["c"].roles[Role.FWD].error = math.inf  # inf survives JSON as a string
    p.record_fallback("a.b", 17, "non-finite output")
    path = tmp_path / "plan.json"
    p.save(path)
    text = path.read_text()
    data = json.loads(text)
    assert data["schema"] == "loka.plan" and data["version"] == 1
    assert data["sites"]["a.b"]["roles"]["wgrad"]["kernel"] == "bf16"
    assert data["budget"]["role_budgets"] == {"wgrad": 0.06}
    q = Plan.load(path)
    assert q.to_dict() == p.to_dict()
    assert q.sites["c"].roles[Role.FWD].error == math.inf
    assert q.fallbacks[0].site == "a.b" and q.fallbacks[0].step == 17
    assert q.fallbacks[0].previous == {"fwd": "t-mid", "dgrad": "t-mid", "wgrad": "t-slow-exact"}
    assert q.config("a.b") == LinearConfig.uniform("bf16")
    assert "pickle" not in text


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"schema": "loka.probe-report", "version": 1, "sites": {}}), "not a loka.plan"),
    (json.dumps([1, 2]), "not a loka.plan"),
    (json.dumps({"schema": "loka.plan", "version": 2, "sites": {}}), "version 2 is not supported"),
    (json.dumps({"schema": "loka.plan", "version": 1}), "missing field"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {"name": "a"}}}),
     "missing field"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": 4, "out_features": 4, "tokens": 1,
        "roles": {"fwd": {"kernel": 3}}}}}), "kernel must be a name"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": -4, "out_features": 4, "tokens": 1, "roles": {}}}}),
     "non-negative integers"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "b", "in_features": 4, "out_features": 4, "tokens": 1, "roles": {}}}}),
     "holds site"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": 4, "out_features": 4, "tokens": 1,
        "roles": {"bwd": {"kernel": "bf16"}}}}}), "unknown role"),
])
def test_load_rejects_bad_files_with_one_line_errors(tmp_path, content, match):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=match) as info:
        Plan.load(path)
    assert "\n" not in str(info.value)


def test_summary_and_fp8_sites():
    report = make_report({"enc.0": (64, 64, 128, {r: THREE for r in Role}),
                          "logit": (64, 64, 128, {"fwd": {"t-mid": (0.9, 2.0)}})})
    p = plan(report)
    assert p.fp8_sites() == ["enc.0"]
    text = p.summary()
    assert "enc.0" in text and "logit" in text and "t-mid (e<=0.15, 1.40x)" in text
    assert "1/2 sites with FP8 (mere <= 0.2, speedup >= 1.05)" in text
    assert "uniform: fwd=cublas-rowwise" in Plan.uniform(nn.Linear(64, 64), "cublas-rowwise").summary()
    assert loka.dispatch.plan.tighten_end_to_end is tighten_end_to_end  # the documented spelling


def test_uniform_plan_falls_back_per_role_where_the_kernel_cannot_run():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    p = Plan.uniform(model, "cublas-rowwise")
    assert p.config("0") == LinearConfig.uniform("cublas-rowwise")
    assert p.config("2") == LinearConfig("bf16", "bf16", "cublas-rowwise")
    assert p.fp8_sites() == ["0", "2"]
    assert Plan.uniform(model, "cublas-rowwise", module_filter="^0$").fp8_sites() == ["0"]


# -- end-to-end budget -----------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, dims=(64, 128, 64, 32)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


@pytest.fixture
def skewed_kernel():
    """An FP8 kernel whose output is 10% off: a site that dominates the output change."""
    base = get("emulated-rowwise-e4m3")

    def fn(a, b, out_dtype):
        return base(a, b, out_dtype) * 1.1

    register(Kernel("t-skewed", fn, library="custom", scaling="rowwise", formats=("e4m3", "e4m3"),
                    align=16, quantize_a=base.quantize_a, quantize_b=base.quantize_b))
    yield "t-skewed"
    unregister("t-skewed")


def _rel_change(model, p, xs):
    with torch.no_grad():
        ref = torch.cat([model(x) for x in xs]).double()
        loka.apply(model, p)
        got = torch.cat([model(x) for x in xs]).double()
        loka.unapply(model)
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("use_loss", [False, True])
def test_tighten_end_to_end_reverts_the_largest_contributor_first(skewed_kernel, use_loss):
    model = MLP()
    xs = [torch.randn(32, 64) for _ in range(3)]
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    p.sites["layers.1"].roles[Role.FWD].kernel = skewed_kernel
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = (lambda m, x: (m(x) ** 2).mean()) if use_loss else None
    initial = _rel_change(model, p, xs)
    assert initial > 0.05  # the skewed site dominates
    bound = 0.03 if not use_loss else 0.05
    new, log = tighten_end_to_end(p, model, xs, max_output_change=bound, loss_fn=loss_fn)
    reverts = [e["site"] for e in log if e["action"] == "revert"]
    assert reverts[0] == "layers.1"
    assert new.config("layers.1") == LinearConfig.uniform("bf16")
    assert [e["change"] for e in log if e["action"] == "revert"][-1] <= bound
    assert "end-to-end budget" in new.sites["layers.1"].roles[Role.FWD].reason
    assert new.budget["max_output_change"] == bound
    if not use_loss:
        assert _rel_change(model, new, xs) <= bound  # measured independently
    assert p.config("layers.1").fwd == skewed_kernel  # the input plan is untouched
    # the model is left as found: plain nn.Linear, same state
    assert all(type(m) is nn.Linear for m in model.layers)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_tighten_keeps_a_plan_that_already_meets_the_bound():
    model = MLP()
    xs = [torch.randn(16, 64)]
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    new, log = tighten_end_to_end(p, model, xs, max_output_change=0.5)
    assert [e["action"] for e in log] == ["measure"] and 0 < log[0]["change"] < 0.5
    assert new.fp8_sites() == p.fp8_sites()


def test_tighten_to_zero_reverts_every_forward_and_restores_an_applied_model():
    model = MLP()
    xs = [torch.randn(16, 64)]
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    loka.apply(model, p)
    new, log = tighten_end_to_end(p, model, xs, max_output_change=0.0)
    assert log[-1]["change"] == 0.0
    assert all(new.sites[s].kernel("fwd") == "bf16" for s in new.sites)
    assert all(isinstance(m, loka.Linear) for m in model.layers)  # re-applied as found
    assert loka.dispatch.applied_plan(model) is p


def test_tighten_rejects_bad_input():
    model = MLP()
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    with pytest.raises(ValueError, match="max_output_change"):
        tighten_end_to_end(p, model, [torch.randn(4, 64)], max_output_change=-1)
    with pytest.raises(ValueError, match="at least one"):
        tighten_end_to_end(p, model, [], max_output_change=0.1)


def test_probe_plan_apply_guard_end_to_end():
    """A real (CPU, untimed) Probe report through the whole Dispatch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    batches = [(torch.randn(64, 64), torch.randn(64, 1)) for _ in range(3)]

    def loss_fn(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    config = loka.ProbeConfig(timing=False, num_samples=8, bootstrap=50, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3", "cublas-rowwise"))
    report = loka.probe(model, batches, loss_fn, config=config)
    assert plan(report).fp8_sites() == []  # untimed: the baseline, with a note
    p = plan(report, assume_fast=True)
    assert p.config("0") == LinearConfig.uniform("cublas-rowwise")
    assert p.config("4") == LinearConfig("bf16", "bf16", "cublas-rowwise")  # N = 1
    assert all(c.error <= 0.2 for s in p.sites.values() for c in s.roles.values()
               if c.kernel != "bf16")
    loka.apply(model, p)
    guard = loka.dispatch.Guard(model, p, check_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for b in batches * 2:
        loss = loss_fn(model, b)
        loss.backward()
        assert guard.step(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert guard.events == [] and losses[3] < losses[0]  # batch 0 again, after 3 updates


def test_inference_plan_judges_the_forward_by_its_weight_quantized_once_speed():
    # t-mid: 0.95x when both operands are quantized per call (training), 1.30x with the
    # weight quantized beforehand (serving); t-fast-coarse has no weight-q timing
    roles = {r: {"t-mid": (0.15, 0.95), "t-fast-coarse": (0.15, 1.10)} for r in Role}
    report = make_report({"enc": (64, 128, 256, roles)})
    report.sites["enc"].roles[Role.FWD].kernels["t-mid"].speedup_weight_q = 1.30
    train = plan(report, max_error=0.2, min_speedup=1.05)
    assert [train.sites["enc"].kernel(r) for r in Role] == ["t-fast-coarse"] * 3
    serve = plan(report, max_error=0.2, min_speedup=1.05, inference=True)
    assert serve.sites["enc"].kernel(Role.FWD) == "t-mid"
    assert serve.sites["enc"].roles[Role.FWD].speedup == 1.30
    assert serve.sites["enc"].kernel(Role.DGRAD) == serve.sites["enc"].kernel(Role.WGRAD) == "bf16"
    assert serve.sites["enc"].roles[Role.WGRAD].reason == "inference plan: forward only"
    assert serve.budget["inference"] is True and train.budget["inference"] is False
    # above the weight-q speed nothing qualifies; without weight-q timings the training
    # speed decides
    assert plan(report, max_error=0.2, min_speedup=1.35, inference=True).sites["enc"].kernel(
        Role.FWD) == "bf16"
    report.sites["enc"].roles[Role.FWD].kernels["t-mid"].speedup_weight_q = None
    assert plan(report, max_error=0.2, min_speedup=1.05, inference=True).sites["enc"].kernel(
        Role.FWD) == "t-fast-coarse"


def test_weight_q_timings_round_trip_through_the_report_json(tmp_path):
    report = make_report({"enc": (64, 128, 256, {"fwd": THREE})})
    kr = report.sites["enc"].roles[Role.FWD].kernels["t-mid"]
    kr.time_us_weight_q, kr.speedup_weight_q = 5.0, 2.0
    path = tmp_path / "r.json"
    report.save(str(path))
    back = ProbeReport.load(str(path)).sites["enc"].roles[Role.FWD].kernels
    assert (back["t-mid"].time_us_weight_q, back["t-mid"].speedup_weight_q) == (5.0, 2.0)
    assert back["t-slow-exact"].time_us_weight_q is None
    assert "time_us_weight_q" not in json.loads(path.read_text())["sites"]["enc"]["roles"][
        "fwd"]["kernels"]["t-slow-exact"]
    data = json.loads(path.read_text())
    data["sites"]["enc"]["roles"]["fwd"]["kernels"]["t-mid"]["speedup_weight_q"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match="speedup_weight_q"):
        ProbeReport.load(str(path))


class Tower(nn.Module):
    """Two identical 'fm' Linears (one group), one 'top' Linear, one odd 'head'."""

    def __init__(self):
        super().__init__()
        self.fm0, self.fm1 = nn.Linear(32, 64), nn.Linear(32, 64)
        self.top = nn.Linear(64, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return self.head(self.top(self.fm0(x) + self.fm1(x)))


def _fake_step(costs, calls):
    """A 'step time' of 10 plus each FP8 site's cost (negative: FP8 pays there)."""
    def time_step(model):
        fp8 = sorted(n for n, m in model.named_modules()
                     if isinstance(m, loka.Linear) and m.config.fwd != "bf16")
        calls.append(fp8)
        return 10.0 + sum(costs[n] for n in fp8)
    return time_step


def test_tune_speed_keeps_exactly_the_groups_that_pay_in_the_whole_step():
    model = Tower()
    plan = Plan.uniform(model, "t-mid")
    assert plan.fp8_sites() == ["fm0", "fm1", "top", "head"]
    costs = {"fm0": 0.4, "fm1": 0.4, "top": -1.0, "head": 0.1}  # fm and head lose in-model
    calls = []
    tuned, log = loka.dispatch.tune_speed(plan, model, _fake_step(costs, calls))
    assert tuned.fp8_sites() == ["top"]
    assert [e["time"] for e in log][:2] == [10.0, pytest.approx(10.0 - 1.0 + 0.9)]
    assert calls[0] == [] and calls[1] == ["fm0", "fm1", "head", "top"]
    # the fm pair is removed together (one shape, one kernel choice), before head
    removed = [e["removed"] for e in log if e["removed"]]
    assert ["fm0", "fm1"] in removed and ["head"] in removed
    assert tuned.budget["speed_tuned"]["time"] == pytest.approx(9.0)
    assert tuned.budget["speed_tuned"]["baseline_time"] == 10.0
    assert tuned.sites["fm0"].roles[Role.FWD].reason.startswith("end-to-end speed")
    assert plan.fp8_sites() == ["fm0", "fm1", "top", "head"]  # the input plan is untouched
    assert not any(isinstance(m, loka.Linear) for m in model.modules())  # model as found


def test_tune_speed_falls_back_to_the_baseline_when_no_plan_beats_it():
    model = Tower()
    plan = Plan.uniform(model, "t-mid")
    costs = {"fm0": 0.4, "fm1": 0.4, "top": -0.05, "head": 0.1}
    tuned, log = loka.dispatch.tune_speed(plan, model, _fake_step(costs, []), min_gain=1.01)
    assert tuned.fp8_sites() == []  # 10 / 9.95 < 1.01
    assert tuned.budget["speed_tuned"]["time"] == tuned.budget["speed_tuned"]["baseline_time"]
    # a plan applied before tuning is restored afterwards
    loka.apply(model, plan)
    loka.dispatch.tune_speed(plan, model, _fake_step(costs, []))
    assert isinstance(model.fm0, loka.Linear) and model.fm0.config.fwd == "t-mid"


def test_tune_speed_respects_its_trial_budget_and_checks_its_inputs():
    model = Tower()
    plan = Plan.uniform(model, "t-mid")
    costs = {"fm0": 0.4, "fm1": 0.4, "top": 0.2, "head": 0.1}
    calls = []
    tuned, log = loka.dispatch.tune_speed(plan, model, _fake_step(costs, calls), max_trials=3)
    assert len(calls) == len(log) == 3
    with pytest.raises(ValueError, match="max_trials"):
        loka.dispatch.tune_speed(plan, model, _fake_step(costs, []), max_trials=1)
    with pytest.raises(ValueError, match="min_gain"):
        loka.dispatch.tune_speed(plan, model, _fake_step(costs, []), min_gain=0)
    with pytest.raises(ValueError, match="positive time"):
        loka.dispatch.tune_speed(plan, model, lambda m: float("nan"))
    assert not any(isinstance(m, loka.Linear) for m in model.modules())


def test_tune_speed_tries_the_fusible_twins_and_keeps_them_where_they_pay():
    model = Tower()
    plan = Plan.uniform(model, "t-mid")
    for sp in plan.sites.values():  # the errors the Probe measured stay with the twin
        sp.roles[Role.FWD].error = 0.1
    # per-kernel in-model costs: the twin t-faster pays at fm and top, t-mid nowhere
    costs = {"t-mid": {"fm0": 0.3, "fm1": 0.3, "top": 0.2, "head": 0.1},
             "t-faster": {"fm0": -0.2, "fm1": -0.2, "top": -0.5, "head": 0.2}}
    calls = []

    def time_step(m):
        fp8 = {n: mod.config.fwd for n, mod in m.named_modules()
               if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16"}
        calls.append(sorted(fp8.items()))
        return 10.0 + sum(costs[k][n] for n, k in fp8.items())

    tuned, log = loka.dispatch.tune_speed(plan, model, time_step, twins={"t-mid": "t-faster"})
    assert log[2]["twins"] and log[2]["time"] == pytest.approx(10.0 - 0.9 + 0.2)
    assert tuned.fp8_sites() == ["fm0", "fm1", "top"]  # head removed: its twin loses
    assert {tuned.config(s).fwd for s in tuned.fp8_sites()} == {"t-faster"}
    assert tuned.sites["top"].roles[Role.FWD].error == 0.1
    assert "twin of t-mid" in tuned.sites["top"].roles[Role.FWD].reason
    assert tuned.budget["speed_tuned"]["time"] == pytest.approx(10.0 - 0.9)
    # no twin for any chosen kernel: no extra trial
    _, log = loka.dispatch.tune_speed(plan, model, time_step, twins={"t-slow-exact": "t-mid"})
    assert not any(e.get("twins") for e in log)


def test_tune_speed_twins_from_a_report_must_meet_the_budget():
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}

    def report(twin_error):
        return make_report({n: (k, o, 8, {"fwd": {"t-mid": (0.1, 1.5), "t-faster": (twin_error, 1.2)}})
                            for n, (k, o) in shapes.items()})

    plan = loka.plan(report(0.1), max_error=0.2)
    assert {plan.config(s).fwd for s in plan.fp8_sites()} == {"t-mid"}
    costs = {"t-mid": 0.2, "t-faster": -0.3}

    def time_step(m):
        return 10.0 + sum(costs[mod.config.fwd] for mod in m.modules()
                          if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16")

    tuned, log = loka.dispatch.tune_speed(plan, model, time_step, twins={"t-mid": "t-faster"},
                                          report=report(0.15))
    assert log[2].get("twins") and {tuned.config(s).fwd for s in tuned.fp8_sites()} == {"t-faster"}
    assert tuned.sites["top"].roles[Role.FWD].error == pytest.approx(0.15)  # the twin's own
    # the twin's measured error exceeds the budget: never tried, the plan's kernel stays
    tuned, log = loka.dispatch.tune_speed(plan, model, time_step, twins={"t-mid": "t-faster"},
                                          report=report(0.25))
    assert not any(e.get("twins") for e in log) and tuned.fp8_sites() == []


def test_override_moves_roles_and_checks_them_against_the_report():
    rep = make_report({"a.fm": (64, 64, 128, {"fwd": {"t-mid": (0.1, 1.5), "t-faster": (0.3, 2.0)},
                                               "dgrad": {"t-mid": (0.1, 1.5)}}),
                       "b.fm": (64, 64, 128, {"fwd": {"t-mid": (0.12, 1.4)}})})
    p = plan(rep, max_error=0.2)
    assert p.config("a.fm").fwd == "t-mid" and p.config("a.fm").dgrad == "t-mid"
    out = loka.dispatch.override(p, replace={"t-mid": "t-slow-exact"})  # no report: no check
    assert out.config("a.fm") == LinearConfig("t-slow-exact", "t-slow-exact", "bf16")
    assert out.sites["a.fm"].roles[Role.FWD].reason == "override (was t-mid)"
    assert p.config("a.fm").fwd == "t-mid"  # the input plan is untouched
    out = loka.dispatch.override(p, assign={"*.fm:dgrad": "bf16", "a.*:fwd": "t-mid"}, report=rep)
    assert out.config("a.fm") == LinearConfig("t-mid", "bf16", "bf16")
    assert out.sites["a.fm"].roles[Role.FWD].error == pytest.approx(0.1)
    with pytest.raises(ValueError, match="above the budget"):  # t-faster: 0.3 > 0.2
        loka.dispatch.override(p, assign={"a.fm:fwd": "t-faster"}, report=rep)
    with pytest.raises(ValueError, match="not measured"):
        loka.dispatch.override(p, assign={"b.fm:dgrad": "t-mid"}, report=rep)
    rep.sites["b.fm"].roles[Role.FWD].kernels["t-mid"].mere = stat(math.nan)
    with pytest.raises(ValueError, match="not measured"):  # a NaN bound is no measurement
        loka.dispatch.override(p, assign={"b.fm:fwd": "t-mid"}, report=rep)
    with pytest.raises(ValueError, match="matches no site"):
        loka.dispatch.override(p, assign={"nothing.*:fwd": "t-mid"})
    with pytest.raises(ValueError, match="site glob"):
        loka.dispatch.override(p, assign={"fwd": "t-mid"})
    with pytest.raises(KeyError):
        loka.dispatch.override(p, replace={"t-mid": "no-such-kernel"})


def test_search_speed_finds_the_best_fixed_choice_per_group():
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    rep = make_report({n: (k, o, 8, {r: {"t-mid": (0.1, 1.5), "t-faster": (0.1, 2.0),
                                         "t-fast-coarse": (0.3, 3.0)} for r in ("fwd", "dgrad", "wgrad")})
                       for n, (k, o) in shapes.items()})
    plan = loka.plan(rep, max_error=0.2)
    # in-model cost of each site per forward kernel: fm pays with t-faster, top with t-mid,
    # head with nothing; t-fast-coarse would pay most but breaks the budget (0.3 > 0.2)
    costs = {"t-mid": {"fm0": 0.1, "fm1": 0.1, "top": -0.4, "head": 0.2},
             "t-faster": {"fm0": -0.3, "fm1": -0.3, "top": -0.2, "head": 0.1},
             "t-fast-coarse": {"fm0": -1.0, "fm1": -1.0, "top": -1.0, "head": -1.0}}

    def time_step(m):
        return 10.0 + sum(costs[mod.config.fwd][n] for n, mod in m.named_modules()
                          if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16")

    found, log = loka.dispatch.search_speed(
        plan, model, time_step, ["t-mid", "t-faster", "t-fast-coarse",
                                 LinearConfig(fwd="t-faster")], report=rep)
    assert {s: found.config(s).fwd for s in found.fp8_sites()} == {
        "fm0": "t-faster", "fm1": "t-faster", "top": "t-mid"}
    assert found.config("fm0").dgrad == "t-faster"  # uniform candidate: every role
    assert found.budget["speed_searched"]["time"] == pytest.approx(10.0 - 0.6 - 0.4)
    assert log[-1]["group"] == "all chosen" and log[0]["candidate"] is None
    skipped = [e for e in log if "skipped" in e]
    assert skipped and all("above the budget" in e["skipped"] for e in skipped)
    assert len(skipped) == 3  # t-fast-coarse at each of the three shape groups
    assert not any(isinstance(m, loka.Linear) for m in model.modules())  # model as found
    # a budget of trials cuts the search; nothing that pays: all on the baseline
    # (the last trial is kept for the chosen groups together: baseline + 1 group here)
    found, log = loka.dispatch.search_speed(plan, model, lambda m: 10.0, ["t-mid"], max_trials=3)
    assert found.fp8_sites() == [] and sum("time" in e for e in log) == 2
    with pytest.raises(ValueError, match="at least one candidate"):
        loka.dispatch.search_speed(plan, model, time_step, [])
    with pytest.raises(TypeError, match="LinearConfigs or kernel names"):
        loka.dispatch.search_speed(plan, model, time_step, [3])


def test_search_speed_keeps_the_best_single_group_when_together_is_slower_and_survives_failures():
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    rep = make_report({n: (k, o, 8, {r: {"t-mid": (0.1, 1.5), "t-faster": (0.1, 2.0)}
                                     for r in ("fwd", "dgrad", "wgrad")})
                       for n, (k, o) in shapes.items()})
    plan = loka.plan(rep, max_error=0.2)

    def time_step(m):
        on = {n: mod.config.fwd for n, mod in m.named_modules()
              if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16"}
        if on.get("top") == "t-faster":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if set(on) == {"fm0", "fm1"}:
            return 9.0  # the fm group alone pays most
        if set(on) == {"top"}:
            return 9.5
        return 10.0 if not on else 11.0  # together (fusion lost) is slower than either

    found, log = loka.dispatch.search_speed(plan, model, time_step, ["t-mid", "t-faster"],
                                            report=rep, inference=True)
    assert sorted(found.fp8_sites()) == ["fm0", "fm1"]
    assert found.budget["speed_searched"]["time"] == 9.0
    failed = [e for e in log if "failed" in e]
    assert len(failed) == 1 and failed[0]["group"] == ["top"] and "illegal memory" in failed[0]["failed"]
    together = [e for e in log if e.get("group") == "all chosen"]
    assert len(together) == 1 and together[0]["time"] == 11.0
    assert not any(isinstance(m, loka.Linear) for m in model.modules())


def test_whole_step_helpers_are_exported_where_the_docs_name_them():
    import loka.dispatch as d

    for name in ("tune_speed", "search_speed", "override", "FUSIBLE_TWINS", "tighten_end_to_end"):
        assert name in d.__all__
        # loka.dispatch.plan is the function; it carries its module's helpers
        assert getattr(d.plan, name) is getattr(d, name)
    for kernel, twin in d.FUSIBLE_TWINS.items():  # same numerics: same formats and scaling
        a, b = get(kernel), get(twin)
        assert (a.formats, a.scaling, a.fast_accum) == (b.formats, b.scaling, b.fast_accum)
        assert a.library == "triton" and b.library == "cublas"


def test_tune_speed_per_role_keeps_a_paying_forward_of_a_losing_group():
    model = Tower()
    plan = Plan.uniform(model, "t-mid")  # every role of every site on FP8
    # in-model cost per (site, role): forwards pay at fm and top, every gradient GEMM loses
    costs = {"fwd": {"fm0": -0.3, "fm1": -0.3, "top": -0.2, "head": 0.1},
             "dgrad": {"fm0": 0.2, "fm1": 0.2, "top": 0.15, "head": 0.1},
             "wgrad": {"fm0": 0.2, "fm1": 0.2, "top": 0.15, "head": 0.1}}

    def time_step(m):
        t = 10.0
        for n, mod in m.named_modules():
            if isinstance(mod, loka.Linear):
                t += sum(costs[r][n] for r in costs if getattr(mod.config, r) != "bf16")
        return t

    whole, _ = loka.dispatch.tune_speed(plan, model, time_step, max_trials=64)
    assert whole.fp8_sites() == []  # every group loses as a whole: nothing kept
    tuned, log = loka.dispatch.tune_speed(plan, model, time_step, per_role=True, max_trials=64)
    assert {s: tuned.config(s) for s in tuned.fp8_sites()} == {
        s: LinearConfig(fwd="t-mid") for s in ("fm0", "fm1", "top")}
    assert tuned.budget["speed_tuned"]["time"] == pytest.approx(10.0 - 0.8)
    assert {"fwd", "dgrad", "wgrad"} <= {e["role"] for e in log if e.get("removed")}
    assert "with dgrad on the baseline" in tuned.sites["fm0"].roles[Role.DGRAD].reason
    # serving runs forwards only: a group whose forward loses leaves whole, so the plan
    # never keeps a site for its (unused) gradient roles
    served, slog = loka.dispatch.tune_speed(plan, model, time_step, per_role=True, max_trials=64,
                                            inference=True)
    assert sorted(served.fp8_sites()) == ["fm0", "fm1", "top"]
    assert all(e.get("role") is None for e in slog if e.get("removed"))
    assert served.config("head") == LinearConfig()
    assert all(served.config(s) == LinearConfig(fwd="t-mid") for s in served.fp8_sites())


# -- audit: the plan checked against its report, independently of plan() ------------------
def test_audit_accepts_the_plans_own_choices_for_every_budget():
    report = make_report({"enc": (64, 128, 256, {r: THREE for r in ("fwd", "dgrad", "wgrad")}),
                          "dec": (128, 64, 256, {"fwd": {"t-mid": (0.1, 1.02)}})})
    for budget in (0.01, 0.05, 0.2, 0.3):
        p = plan(report, max_error=budget, min_speedup=1.05)
        res = loka.dispatch.audit(p, report)
        assert res == {"site_roles": 4, "violations": [], "ok": True}


def test_audit_flags_a_slower_choice_and_an_over_budget_choice():
    report = make_report({"enc": (64, 128, 256, {"fwd": THREE, "dgrad": THREE})})
    p = plan(report, max_error=0.2, min_speedup=1.05)
    assert p.sites["enc"].roles[Role.FWD].kernel == "t-mid"
    slow = loka.dispatch.override(p, assign={"enc:fwd": "t-slow-exact"})
    res = loka.dispatch.audit(slow, report)
    assert not res["ok"] and len(res["violations"]) == 1
    v = res["violations"][0]
    assert (v["site"], v["role"], v["chosen"], v["best"]) == ("enc", "fwd", "t-slow-exact", "t-mid")
    assert v["chosen_speedup"] == pytest.approx(1.10) and v["best_speedup"] == pytest.approx(1.40)
    # the baseline where a kernel within the budget pays is a violation too
    base = loka.dispatch.override(p, assign={"enc:dgrad": "bf16"})
    assert [x["role"] for x in loka.dispatch.audit(base, report)["violations"]] == ["dgrad"]
    # a kernel outside the budget (a hand edit of the JSON) is caught by its error bound
    d = p.to_dict()
    d["sites"]["enc"]["roles"]["fwd"]["kernel"] = "t-fast-coarse"
    res = loka.dispatch.audit(Plan.from_dict(d), report)
    assert [x["why"][:28] for x in res["violations"]] == ["chosen kernel's error bound "]


def test_audit_of_an_inference_plan_uses_weight_quantized_speeds():
    report = make_report({"enc": (64, 128, 256, {"fwd": {"t-mid": (0.1, 1.02),
                                                        "t-faster": (0.1, 1.01)}})})
    kr = report.sites["enc"].roles[Role.FWD].kernels
    kr["t-mid"].speedup_weight_q, kr["t-faster"].speedup_weight_q = 1.3, 1.6
    p = plan(report, max_error=0.2, inference=True)
    assert p.sites["enc"].roles[Role.FWD].kernel == "t-faster"
    assert loka.dispatch.audit(p, report)["ok"]
    worse = loka.dispatch.override(p, assign={"enc:fwd": "t-mid"})
    assert loka.dispatch.audit(worse, report)["violations"][0]["best_speedup"] == pytest.approx(1.6)


def test_a_role_no_kernel_fits_says_so():
    # out_features 8: no kernel aligned to 16 takes the forward (N = 8) or dgrad (K = 8)
    report = make_report({"proj": (16, 8, 64, {"fwd": THREE, "dgrad": THREE, "wgrad": THREE}),
                          "mlp": (64, 64, 64, {"fwd": {"t-mid": (0.5, 1.4)},
                                               "dgrad": {"t-mid": (0.1, 1.01)}})})
    p = plan(report, max_error=0.2, min_speedup=1.05)
    assert p.sites["proj"].roles[Role.FWD].reason == "no kernel fits the GEMM shape (alignment) on cuda"
    assert p.sites["proj"].roles[Role.DGRAD].reason == "no kernel fits the GEMM shape (alignment) on cuda"
    assert p.sites["proj"].roles[Role.WGRAD].kernel == "t-mid"  # (8, 64, 16): K = M, N = 16 fit
    assert p.sites["mlp"].roles[Role.FWD].reason == "no kernel meets the budget"  # over budget
    assert p.sites["mlp"].roles[Role.DGRAD].reason == \
        "no kernel within the budget is 1.05x faster (best 1.01x)"  # too slow


def test_real_kernels_timed_slower_than_bf16_are_reported_as_slow():
    """A GPU report where every real FP8 kernel was timed slower than bf16 and only the
    emulated reference is untimed (DCNv2's shapes on an H200): bf16 for the measured reason
    (the best speedup named), not 'no decisive timing', and assume_fast does not override
    the decisive timings with an emulated kernel."""
    kernels = {"t-mid": (0.05, 0.68), "t-faster": (0.05, 0.91),
               "emulated-rowwise-e4m3": (0.05, None)}
    report = make_report({"s": (3456, 1024, 4096, {"fwd": kernels})})
    for fast in (False, True):
        p = plan(report, device="cuda", assume_fast=fast)
        choice = p.sites["s"].roles[Role.FWD]
        assert choice.kernel == "bf16"
        assert choice.reason == "no kernel within the budget is 1.05x faster (best 0.91x)"
        assert not any("no decisive timing" in n for n in p.notes)
    # one real kernel fast enough: it is chosen as before
    kernels["t-faster"] = (0.05, 1.3)
    report = make_report({"s": (3456, 1024, 4096, {"fwd": kernels})})
    assert plan(report, device="cuda").sites["s"].kernel("fwd") == "t-faster"
