"""Selection (loka/dispatch/select.py): the fastest kernel within the budget per site and
role, reports without decisive timings, serving plans, hand edits (override) and the audit
of a plan against its report."""

import json
import math
import random

import pytest
import torch
from torch import nn

import loka
from loka.config import DispatchConfig, LinearConfig, Role
from loka.dispatch import Plan, plan
from loka.dispatch.select import resolve_budget
from loka.jsonio import ReportError
from loka.kernels.registry import get
from loka.probe.report import ProbeReport

pytestmark = pytest.mark.usefixtures("fake_kernels")
# a real FP8 kernel of the CPU (torch 2.11's build has no rowwise _scaled_mm there)
REAL = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "cublas-tensorwise"


@pytest.mark.parametrize("budget, want", [(0.01, "bf16"), (0.05, "t-slow-exact"),
                                          (0.2, "t-mid"), (0.3, "t-fast-coarse"),
                                          (1.0, "t-fast-coarse")])
@pytest.mark.parametrize("role", list(Role))
def test_fastest_kernel_within_the_budget(budget, want, role, make_report, three):
    report = make_report({"enc": (64, 128, 256, {role: three})})
    p = plan(report, max_error=budget, min_speedup=1.05)
    choice = p.sites["enc"].roles[role]
    assert choice.kernel == want
    if want != "bf16":
        assert choice.error <= budget and choice.speedup == three[want][1]
    other = [r for r in Role if r != role]
    assert all(p.sites["enc"].kernel(r) == "bf16" for r in other)  # not measured: baseline


@pytest.mark.parametrize("min_speedup, want", [(1.0, "t-mid"), (1.4, "t-mid"),
                                               (1.5, "bf16"), (2.0, "bf16")])
def test_speedup_threshold(min_speedup, want, make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})})
    assert plan(report, max_error=0.2, min_speedup=min_speedup).sites["s"].kernel("fwd") == want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("metric", ["mere", "relfro"])
def test_random_reports_match_brute_force(seed, metric, make_report, fake_kernels):
    rng = random.Random(seed)
    sites = {}
    for i in range(12):
        roles = {}
        for role in Role:
            roles[role] = {k: (rng.uniform(0.0, 0.4), rng.choice([None, rng.uniform(0.6, 2.0)]))
                           for k in rng.sample(fake_kernels, rng.randint(1, len(fake_kernels)))}
        sites[f"layer{i}.proj"] = (64, 32, 4096, roles)
    report = make_report(sites)
    budget, min_speed = rng.uniform(0.05, 0.35), rng.uniform(1.0, 1.5)
    p = plan(report, max_error=budget, min_speedup=min_speed, metric=metric)
    scale = 1.0 if metric == "mere" else 0.25
    # rule 0: the report records no forward order, so the head is the last quarter of
    # the sites in registration order (3 of 12, within the default head_sites)
    head = list(sites)[-3:]
    chosen_fp8 = 0
    for name, (_, _, _, roles) in sites.items():
        for role, kernels in roles.items():
            ok = {k: s for k, (hi, s) in kernels.items()
                  if hi * scale <= budget and s is not None and s >= min_speed}
            want = max(ok, key=lambda k: (ok[k], -kernels[k][0])) if ok and name not in head \
                else "bf16"
            choice = p.sites[name].roles[role]
            assert choice.kernel == want, (name, role, kernels)
            if want != "bf16":
                chosen_fp8 += 1
                assert choice.error <= budget and choice.speedup >= min_speed
    assert chosen_fp8 > 0  # the draw exercises the selection, not only the fallback


def test_per_role_budget_makes_wgrad_stricter(make_report, three):
    report = make_report({"s": (64, 64, 128, {r: three for r in Role})})
    p = plan(report, max_error=0.2, role_budgets={"wgrad": 0.06})
    assert p.config("s") == LinearConfig("t-mid", "t-mid", "t-slow-exact")
    assert p.sites["s"].roles[Role.WGRAD].budget == 0.06
    assert resolve_budget(DispatchConfig(role_budgets={Role.DGRAD: 0.1}), "x", "dgrad") == 0.1


def test_per_site_budget_by_regex_strictest_match_wins(make_report, three):
    sites = {name: (64, 64, 128, {r: three for r in Role})
             for name in ("over.0", "over.1", "inter.proj", "top")}
    report = make_report(sites)
    p = plan(report, max_error=0.35, role_budgets={"wgrad": 0.2},
             site_budgets={r"^over\.": 0.16, r"over\.1$": 0.06, "proj": 0.02}, head_sites=0)
    assert p.config("over.0") == LinearConfig.uniform("t-mid")          # site beats role
    assert p.config("over.1") == LinearConfig.uniform("t-slow-exact")   # strictest of two
    assert p.config("inter.proj") == LinearConfig.uniform("bf16")
    assert p.config("top") == LinearConfig("t-fast-coarse", "t-fast-coarse", "t-mid")


def test_failed_nan_and_unmeasured_kernels_are_never_chosen(make_report):
    report = make_report({"s": (64, 64, 128, {"fwd": {"t-faster": (0.01, 3.0),
                                                      "t-mid": (math.nan, 2.5),
                                                      "t-fast-coarse": (None, 2.0),
                                                      "t-slow-exact": (0.05, 1.2)}})})
    report.sites["s"].roles[Role.FWD].kernels["t-faster"].error = "CUDA error: illegal address"
    assert plan(report).sites["s"].kernel("fwd") == "t-slow-exact"


def test_misaligned_site_keeps_the_baseline_for_the_roles_that_need_alignment(make_report):
    # 48 -> 1: fwd needs N=1 aligned, dgrad K=1; wgrad's K is the (padded) token count, N=48
    report = make_report({"logit": (48, 1, 100, {r: {"t-mid": (0.1, 1.5)} for r in Role})})
    p = plan(report)
    assert p.config("logit") == LinearConfig("bf16", "bf16", "t-mid")


def test_unavailable_and_unregistered_kernels_are_excluded_with_a_note(make_report):
    kernels = {"cublas-tensorwise-fastacc": (0.01, 3.0), "some-future-kernel": (0.01, 3.0),
               REAL: (0.05, 1.2)}
    report = make_report({"s": (64, 64, 128, {"fwd": kernels})}, device="cpu")
    p = plan(report, assume_fast=True)
    assert p.sites["s"].kernel("fwd") == REAL
    notes = "\n".join(p.notes)
    assert "'cublas-tensorwise-fastacc' excluded: unavailable on cpu: fast accumulation" in notes
    assert "'some-future-kernel' excluded: not registered" in notes
    p = plan(report, assume_fast=True, allowed_kernels=["emulated-rowwise-e4m3"])
    assert p.sites["s"].kernel("fwd") == "bf16"


# -- reports without decisive timings ------------------------------------------------
CPU_KERNELS = {"emulated-rowwise-e4m3": (0.08, None), REAL: (0.08, None),
               "emulated-tensorwise-e4m3": (0.12, None), "emulated-blockwise-e4m3": (0.5, None)}


@pytest.mark.parametrize("timing, speed", [("none", None), ("cpu-wallclock", 0.3),
                                           ("cpu-wallclock", 1.5)])
def test_cpu_reports_plan_the_baseline_unless_assume_fast(timing, speed, make_report):
    kernels = {k: (hi, speed) for k, (hi, _) in CPU_KERNELS.items()}
    report = make_report({"s": (256, 256, 64, {r: kernels for r in Role})}, device="cpu",
                         timing=timing)
    p = plan(report)
    assert p.config("s") == LinearConfig.uniform("bf16")
    assert any("assume_fast=True" in n for n in p.notes)
    assert p.sites["s"].roles[Role.FWD].reason == "safe kernels have no decisive timing"
    p = plan(report, assume_fast=True)
    # a real kernel before emulated ones (references, never fast), then the lowest error
    assert p.config("s") == LinearConfig.uniform(REAL)
    assert p.sites["s"].roles[Role.FWD].speedup is None
    assert plan(report, assume_fast=True, max_error=0.1,
                allowed_kernels=["emulated-tensorwise-e4m3"]).config("s").fwd == "bf16"
    emulated_only = plan(report, assume_fast=True, allowed_kernels=[
        "emulated-rowwise-e4m3", "emulated-tensorwise-e4m3"])
    assert emulated_only.config("s") == LinearConfig.uniform("emulated-rowwise-e4m3")


def test_assume_fast_prefers_a_real_kernel_to_a_more_accurate_emulated_one(make_report):
    kernels = {"emulated-rowwise-e4m3": (0.05, None), "cublas-tensorwise": (0.15, None),
               "cublas-rowwise": (0.25, None)}
    report = make_report({"s": (256, 256, 64, {"fwd": kernels})}, device="cpu", timing="none")
    assert plan(report, assume_fast=True).sites["s"].kernel("fwd") == "cublas-tensorwise"
    assert plan(report, assume_fast=True, max_error=0.1).sites["s"].kernel("fwd") == \
        "emulated-rowwise-e4m3"


def test_gpu_timings_do_not_decide_for_another_device_type(make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})}, device="cuda:0")
    assert plan(report, device="cpu").sites["s"].kernel("fwd") == "bf16"
    assert plan(report, device="cpu", assume_fast=True).sites["s"].kernel("fwd") == "t-slow-exact"
    assert plan(report, device="cuda").sites["s"].kernel("fwd") == "t-mid"


def test_timed_kernels_win_over_untimed_ones_under_assume_fast(make_report):
    report = make_report({"s": (64, 64, 128, {"fwd": {"t-mid": (0.15, 1.3),
                                                      "t-slow-exact": (0.01, None)}})})
    assert plan(report, assume_fast=True).sites["s"].kernel("fwd") == "t-mid"


def _pruned(make_report, bound):
    """A report whose FP8 kernels the Probe left untimed for their roofline bound."""
    report = make_report({"s": (64, 32, 1 << 20, {"fwd": {"t-mid": (0.15, None),
                                                         "t-slow-exact": (0.01, None)}})})
    for kr in report.sites["s"].roles[Role.FWD].kernels.values():
        if kr.kernel != "bf16":
            kr.timing, kr.roofline_bound = "none", bound
            kr.not_timed = f"roofline: at most {bound:.2f}x at the device's peak rates"
    return report


def test_a_roofline_pruned_kernel_counts_as_slow_under_assume_fast(make_report):
    """The Probe leaves untimed a kernel whose roofline bound cannot reach ``min_speedup``:
    on that device type it is slow, so ``assume_fast`` must not pick it; on another device
    type, or for a plan whose ``min_speedup`` is not above the bound, it is untimed."""
    report = _pruned(make_report, 0.79)
    p = plan(report, assume_fast=True)
    assert p.sites["s"].kernel("fwd") == "bf16"
    assert "best 0.79x" in p.sites["s"].roles[Role.FWD].reason
    assert plan(report, assume_fast=True, min_speedup=0.5).sites["s"].kernel("fwd") == \
        "t-slow-exact"
    assert plan(report, assume_fast=True, min_speedup=0.79).sites["s"].kernel("fwd") == \
        "t-slow-exact"  # equal: not slow
    assert plan(report, assume_fast=True, device="cpu").sites["s"].kernel("fwd") == \
        "t-slow-exact"
    # a bound just under min_speedup that its text rounds up to it is slow all the same
    close = _pruned(make_report, 1.046)
    assert "at most 1.05x" in close.sites["s"].roles[Role.FWD].kernels["t-mid"].not_timed
    again = ProbeReport.from_dict(json.loads(json.dumps(close.to_dict())))
    assert again.sites["s"].roles[Role.FWD].kernels["t-mid"].roofline_bound == 1.046
    assert plan(again, assume_fast=True, min_speedup=1.05).sites["s"].kernel("fwd") == "bf16"


def test_a_report_without_the_bound_field_reads_it_from_its_reason(make_report):
    d = _pruned(make_report, 0.79).to_dict()
    for kr in d["sites"]["s"]["roles"]["fwd"]["kernels"].values():
        kr.pop("roofline_bound", None)
    old = ProbeReport.from_dict(json.loads(json.dumps(d)))
    assert old.sites["s"].roles[Role.FWD].kernels["t-mid"].roofline_bound == 0.79
    assert plan(old, assume_fast=True).sites["s"].kernel("fwd") == "bf16"
    for text in (None, "unsafe: MERE upper bound over 0.2", "roofline",
                 "roofline: at most x at the device's peak rates"):
        for kr in d["sites"]["s"]["roles"]["fwd"]["kernels"].values():
            if kr["kernel"] != "bf16":
                kr["not_timed"] = text
        other = ProbeReport.from_dict(json.loads(json.dumps(d)))
        assert other.sites["s"].roles[Role.FWD].kernels["t-mid"].roofline_bound is None
    d["sites"]["s"]["roles"]["fwd"]["kernels"]["t-mid"]["roofline_bound"] = -1.0
    with pytest.raises(ReportError, match="roofline_bound"):
        ProbeReport.from_dict(d)


def test_neg_sqnr_metric(make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})})
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
def test_bad_budgets_are_refused(kwargs, match, make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})})
    with pytest.raises(ValueError, match=match):
        plan(report, **kwargs)


def test_unknown_allowed_kernel_is_refused(make_report):
    with pytest.raises(KeyError, match="unregistered"):
        plan(make_report({}), allowed_kernels=["nope"])


def test_config_object_and_overrides(make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})})
    cfg = DispatchConfig(max_error=0.3, min_speedup=1.05)
    assert plan(report, config=cfg).sites["s"].kernel("fwd") == "t-fast-coarse"
    assert plan(report, config=cfg, max_error=0.1).sites["s"].kernel("fwd") == "t-slow-exact"


# -- serving plans ----------------------------------------------------------------------
def test_inference_plan_judges_the_forward_by_its_weight_quantized_once_speed(make_report):
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


def test_weight_q_timings_round_trip_through_the_report_json(tmp_path, make_report, three):
    report = make_report({"enc": (64, 128, 256, {"fwd": three})})
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


# -- why a role stays on the baseline ----------------------------------------------------
def test_a_role_no_kernel_fits_says_so(make_report, three):
    # out_features 8: no kernel aligned to 16 takes the forward (N = 8) or dgrad (K = 8)
    report = make_report({"proj": (16, 8, 64, {"fwd": three, "dgrad": three, "wgrad": three}),
                          "mlp": (64, 64, 64, {"fwd": {"t-mid": (0.5, 1.4)},
                                               "dgrad": {"t-mid": (0.1, 1.01)}})})
    p = plan(report, max_error=0.2, min_speedup=1.05)
    assert p.sites["proj"].roles[Role.FWD].reason == "no kernel fits the GEMM shape (alignment) on cuda"
    assert p.sites["proj"].roles[Role.DGRAD].reason == "no kernel fits the GEMM shape (alignment) on cuda"
    assert p.sites["proj"].roles[Role.WGRAD].kernel == "t-mid"  # (8, 64, 16): K = M, N = 16 fit
    assert p.sites["mlp"].roles[Role.FWD].reason == "no kernel meets the budget"  # over budget
    assert p.sites["mlp"].roles[Role.DGRAD].reason == \
        "no kernel within the budget is 1.05x faster (best 1.01x)"  # too slow


def test_real_kernels_timed_slower_than_bf16_are_reported_as_slow(make_report):
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


# -- a real Probe report through the whole Dispatch ------------------------------------
def test_probe_plan_apply_guard_end_to_end():
    """A real (CPU, untimed) Probe report through the whole Dispatch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 1))
    batches = [(torch.randn(64, 64), torch.randn(64, 1)) for _ in range(3)]

    def loss_fn(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    config = loka.ProbeConfig(timing=False, num_samples=8, bootstrap=50, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3", REAL))
    report = loka.probe(model, batches, loss_fn, config=config)
    assert plan(report).fp8_sites() == []  # untimed: the baseline, with a note
    p = plan(report, assume_fast=True)
    assert p.config("0") == LinearConfig.uniform(REAL)
    assert p.config("4") == LinearConfig("bf16", "bf16", REAL)  # N = 1
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


# -- editing a plan by hand ------------------------------------------------------------
def test_override_moves_roles_and_checks_them_against_the_report(make_report, stat):
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


# -- audit: the plan checked against its report, independently of plan() ------------------
def test_audit_accepts_the_plans_own_choices_for_every_budget(make_report, three):
    report = make_report({"enc": (64, 128, 256, {r: three for r in ("fwd", "dgrad", "wgrad")}),
                          "dec": (128, 64, 256, {"fwd": {"t-mid": (0.1, 1.02)}})})
    for budget in (0.01, 0.05, 0.2, 0.3):
        p = plan(report, max_error=budget, min_speedup=1.05)
        res = loka.dispatch.audit(p, report)
        assert res == {"site_roles": 4, "violations": [], "ok": True}


def test_audit_flags_a_slower_choice_and_an_over_budget_choice(make_report, three):
    report = make_report({"enc": (64, 128, 256, {"fwd": three, "dgrad": three})})
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


def test_audit_of_an_inference_plan_uses_weight_quantized_speeds(make_report):
    report = make_report({"enc": (64, 128, 256, {"fwd": {"t-mid": (0.1, 1.02),
                                                        "t-faster": (0.1, 1.01)}})})
    kr = report.sites["enc"].roles[Role.FWD].kernels
    kr["t-mid"].speedup_weight_q, kr["t-faster"].speedup_weight_q = 1.3, 1.6
    p = plan(report, max_error=0.2, inference=True)
    assert p.sites["enc"].roles[Role.FWD].kernel == "t-faster"
    assert loka.dispatch.audit(p, report)["ok"]
    worse = loka.dispatch.override(p, assign={"enc:fwd": "t-mid"})
    assert loka.dispatch.audit(worse, report)["violations"][0]["best_speedup"] == pytest.approx(1.6)


# -- reference kernels and what a plan says it was chosen on -----------------------------
def test_reference_kernels_are_never_candidates_unless_named(make_report):
    """fp32 is what errors are measured against: its error is the lowest, so the
    lowest-error rule of assume_fast must not let it win over FP8 (nor a GPU timing)."""
    kernels = {"fp32": (1e-7, None), "emulated-rowwise-e4m3": (0.05, None)}
    report = make_report({"s": (256, 256, 64, {r: kernels for r in Role})}, device="cpu",
                         timing="none")
    assert plan(report, assume_fast=True).config("s") == LinearConfig.uniform("emulated-rowwise-e4m3")
    assert plan(report, assume_fast=True, allowed_kernels=["fp32"]).config("s") == \
        LinearConfig.uniform("fp32")
    gpu = make_report({"s": (256, 256, 64, {"fwd": {"fp32": (1e-7, 3.0), "t-mid": (0.15, 1.4)}})})
    assert plan(gpu).sites["s"].kernel("fwd") == "t-mid"
    assert plan(gpu, allowed_kernels=["fp32", "t-mid"]).sites["s"].kernel("fwd") == "fp32"


def test_the_summary_says_a_plan_was_chosen_on_error_alone(make_report, three):
    report = make_report({"s": (256, 256, 64, {r: CPU_KERNELS for r in Role})}, device="cpu",
                         timing="cpu-wallclock")
    report.sites["s"].dtype = "float32"
    head = plan(report, assume_fast=True).summary().splitlines()[0]
    assert head == ("plan for cpu: 1/1 sites with FP8 (mere <= 0.2, chosen on error alone; "
                    "baseline bf16 ran fp32)")
    assert "--assume-fast" in " ".join(plan(report).notes)  # the CLI's flag, beside the API's
    timed = make_report({"g": (64, 64, 128, {"fwd": three}),
                         "u": (64, 64, 128, {"fwd": {"t-slow-exact": (0.01, None)}})})
    assert "(mere <= 0.2, speedup >= 1.05 where timed, else chosen on error alone)" in \
        plan(timed, assume_fast=True).summary()
    assert "(mere <= 0.2, speedup >= 1.05)" in plan(timed).summary()


def test_cpu_wallclock_timings_under_torch_compile_do_not_decide(make_report, three):
    report = make_report({"s": (64, 64, 128, {"fwd": three})}, device="cpu",
                         timing="cpu-wallclock+compiled")
    assert plan(report).sites["s"].kernel("fwd") == "bf16"


# -- reliability (issue 29): budgets that bound nothing, a report of another model ------------
def _audited(make_report, three):
    report = make_report({"enc": (64, 128, 256, {r: three for r in ("fwd", "dgrad", "wgrad")}),
                          "dec": (128, 64, 256, {"fwd": three})})
    return report, plan(report, max_error=0.2, role_budgets={"wgrad": 0.1})


@pytest.mark.parametrize("edit", [
    lambda d: d["sites"]["enc"]["roles"]["fwd"].update(budget=None),
    lambda d: d["sites"]["enc"]["roles"]["fwd"].update(budget=1e308),
    lambda d: d["sites"]["enc"]["roles"]["fwd"].update(budget="inf"),
    lambda d: d["budget"]["role_budgets"].update(wgrad=None),
    lambda d: d["budget"]["role_budgets"].update(wgrad=1e308),
    lambda d: d["budget"].update(max_error=1e308),
    lambda d: d["budget"].update(max_error=1.0),
    lambda d: d["budget"].update(site_budgets={"^enc$": "inf"}),
    lambda d: d["budget"].update(site_budgets={"(": 0.2}),
    lambda d: d["budget"].pop("max_error"),
], ids=["choice-null", "choice-1e308", "choice-inf", "role-null", "role-1e308", "max-1e308",
        "max-1", "site-inf", "site-bad-regex", "no-budget"])
def test_audit_flags_budgets_that_bound_nothing(make_report, three, edit):
    # issue 29: a null or 1e308 budget passed as "every choice within its budget"
    report, p = _audited(make_report, three)
    assert loka.dispatch.audit(p, report)["ok"]
    d = p.to_dict()
    if d["budget"].get("site_budgets") is None:
        d["budget"]["site_budgets"] = {}
    edit(d)
    # a budget that bounds nothing may come with a kernel that needs it
    for site in d["sites"].values():
        for choice in site["roles"].values():
            if choice["kernel"] != "bf16":
                choice["kernel"] = "t-fast-coarse"
    res = loka.dispatch.audit(Plan.from_dict(d), report)
    assert not res["ok"]
    budget = [v for v in res["violations"] if v["kind"] == "budget"]
    assert budget and all("budget" in v["why"] for v in budget)
    seen = [(v["site"], v["role"]) for v in res["violations"]]
    assert len(seen) == len(set(seen))  # one violation per site and role


def test_budget_problem_names_the_budgets_that_bound_nothing():
    from loka.dispatch import budget_problem
    assert budget_problem("mere", 0.2) is None and budget_problem("neg_sqnr", -20.0) is None
    for metric, bad in (("mere", None), ("mere", math.inf), ("mere", math.nan), ("mere", 1.0),
                        ("relfro", 1e308), ("mere", -0.5), ("neg_sqnr", 0.0), ("mere", True)):
        assert budget_problem(metric, bad), (metric, bad)


def test_audit_flags_a_report_of_another_model(make_report, three):
    # issue 29: a plan audited against another model's report passed
    report, p = _audited(make_report, three)
    other = make_report({"enc": (64, 128, 512, {r: three for r in ("fwd", "dgrad", "wgrad")}),
                         "dec": (128, 64, 256, {"fwd": three}),
                         "extra": (64, 64, 64, {"fwd": three})})
    res = loka.dispatch.audit(p, other)
    assert not res["ok"]
    mismatch = {(v["site"], v["role"]): v["why"] for v in res["violations"] if v["kind"] == "mismatch"}
    assert set(mismatch) == {("enc", "*"), ("extra", "*")}
    assert "tokens" in mismatch[("enc", "*")] and "not in the plan" in mismatch[("extra", "*")]
    fewer = make_report({"enc": (64, 128, 256, {r: three for r in ("fwd", "dgrad", "wgrad")})})
    res = loka.dispatch.audit(p, fewer)
    assert [(v["site"], v["kind"], v["why"]) for v in res["violations"]] == [
        ("dec", "mismatch", "in the plan but not in the report")]
    assert loka.dispatch.plan_report_mismatches(p, report) == []


def test_audit_of_a_uniform_plan_says_it_has_no_budget(make_report, three):
    report, _ = _audited(make_report, three)
    uniform = Plan.from_dict(_audited(make_report, three)[1].to_dict())
    uniform.budget = {"baseline": "bf16", "uniform": LinearConfig.uniform("t-mid").to_dict()}
    res = loka.dispatch.audit(uniform, report)
    assert not res["ok"] and all("no error budget" in v["why"] for v in res["violations"])
