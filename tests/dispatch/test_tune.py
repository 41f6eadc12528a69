"""Whole-step speed (loka/dispatch/tune.py): tune_speed keeps the groups of sites that pay
in the whole step, search_speed finds the best fixed choice per group; both with a fake
step time, so no GPU and no compiler is needed."""

import inspect

import pytest
from torch import nn

import loka
import loka.dispatch
from loka.config import LinearConfig, Role
from loka.dispatch import Plan, select, tighten, tune
from loka.kernels import Library, get

pytestmark = pytest.mark.usefixtures("fake_kernels")


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


def test_paired_trials_see_through_a_host_that_slows_down_after_the_first_timing():
    """The host gets 5 ms slower after the first timing and stays so: unpaired, every
    plan looks slower than the baseline timed before the drift; paired, each trial is
    weighed against a baseline timed beside it, and the paying site is kept."""
    costs = {"fm0": 0.4, "fm1": 0.4, "top": -1.0, "head": 0.1}

    def drifting(calls):
        inner = _fake_step(costs, calls)
        return lambda model: inner(model) + (5.0 if len(calls) > 1 else 0.0)  # inner counted it

    plan = Plan.uniform(Tower(), "t-mid")
    unpaired, _ = loka.dispatch.tune_speed(plan, Tower(), drifting([]))
    assert unpaired.fp8_sites() == []
    calls = []
    paired, log = loka.dispatch.tune_speed(plan, Tower(), drifting(calls), paired=True)
    assert paired.fp8_sites() == ["top"]
    assert paired.budget["speed_tuned"]["time"] == pytest.approx(14.0 * 10.0 / 15.0)
    # every FP8 trial after the first timing: a baseline timing, then the plan's
    assert calls[0] == [] and calls[1] == [] and calls[2] == ["fm0", "fm1", "head", "top"]
    assert all(("baseline_time" in e) == bool(e["sites"]) for e in log)
    assert len(calls) == sum(2 if e["sites"] else 1 for e in log)
    second = log[1]
    assert second["baseline_time"] == 15.0 and second["raw_time"] == pytest.approx(14.9)
    assert second["time"] == pytest.approx(14.9 * 10.0 / 15.0)
    assert "raw_time" not in log[0]  # the baseline trial is timed once


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


def test_tune_speed_twins_from_a_report_must_meet_the_budget(make_report):
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


def test_tune_speed_tries_each_family_as_the_one_kernel_of_a_mixed_plan(make_report):
    """A plan whose sites mix kernels pays for every operand's quantization separately;
    the step (here: a penalty for each extra kernel in use) decides whether one kernel
    for all is faster. Families outside the budget anywhere are never tried."""
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    # alone, t-faster wins at fm and t-mid at top and head: the plan mixes the two
    speeds = {"fm0": (1.2, 1.5), "fm1": (1.2, 1.5), "top": (1.5, 1.2), "head": (1.5, 1.2)}

    def report(faster_error):
        return make_report({n: (k, o, 8, {"fwd": {"t-mid": (0.1, speeds[n][0]),
                                                  "t-faster": (faster_error, speeds[n][1])}})
                            for n, (k, o) in shapes.items()})

    plan = loka.plan(report(0.1), max_error=0.2, head_sites=0)
    assert {s: plan.config(s).fwd for s in plan.fp8_sites()} == {
        "fm0": "t-faster", "fm1": "t-faster", "top": "t-mid", "head": "t-mid"}
    assert loka.dispatch.plan_families(plan) == ["t-faster", "t-mid"]  # ties by name

    def time_step(m):
        used = {mod.config.fwd for mod in m.modules()
                if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16"}
        n = sum(isinstance(mod, loka.Linear) and mod.config.fwd != "bf16" for mod in m.modules())
        return 10.0 - 0.3 * n + 1.0 * max(0, len(used) - 1)  # mixing costs 1.0 per extra kernel

    tuned, log = loka.dispatch.tune_speed(plan, model, time_step, report=report(0.1),
                                          families=["t-faster", "t-mid"])
    tried = [e["family"] for e in log if "family" in e]
    assert tried == ["t-faster", "t-mid"]
    assert log[1]["time"] == pytest.approx(10.0 - 1.2 + 1.0)  # the mixed plan
    assert all(e["time"] == pytest.approx(10.0 - 1.2) for e in log if "family" in e)
    assert len(tuned.fp8_sites()) == 4
    assert len({tuned.config(s).fwd for s in tuned.fp8_sites()}) == 1  # one kernel for all
    assert tuned.budget["speed_tuned"]["time"] == pytest.approx(8.8)
    # t-faster over the budget everywhere: only t-mid is tried (it is in the plan, so the
    # report measured it at every site)
    plan2 = loka.plan(report(0.1), max_error=0.2)
    _, log = loka.dispatch.tune_speed(plan2, model, time_step, report=report(0.25),
                                      families=["t-faster", "t-mid"])
    assert [e["family"] for e in log if "family" in e] == ["t-mid"]
    # without a report no family is tried: their errors would be unknown
    _, log = loka.dispatch.tune_speed(plan, model, time_step, families=["t-faster", "t-mid"])
    assert not any("family" in e for e in log)


def test_plan_families_needs_a_mix():
    model = Tower()
    assert loka.dispatch.plan_families(Plan.uniform(model, "t-mid")) == []
    plan = Plan.uniform(model, "t-mid")
    plan.sites["top"].roles[Role.FWD] = loka.dispatch.RoleChoice("t-faster")
    plan.sites["head"].roles[Role.FWD] = loka.dispatch.RoleChoice("t-slow-exact")
    # most used first, then by name; at most `limit`
    assert loka.dispatch.plan_families(plan) == ["t-mid", "t-faster", "t-slow-exact"]
    assert loka.dispatch.plan_families(plan, limit=1) == ["t-mid"]


def test_plan_families_add_the_reports_sharing_kernels_measured_everywhere(make_report):
    """With a report: tensorwise kernels with quantizers (their FP8 x and W serve the
    gradient GEMMs) measured at every FP8 site-role, fastest first; a kernel missing at one
    site-role, a rowwise one, or the plan's only kernel is not proposed."""
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    kernels = {"cublas-rowwise": (0.1, 1.5), "cublas-tensorwise": (0.1, 1.3),
               "t-mid": (0.1, 1.1), "t-faster": (0.1, 1.4)}
    sites = {}
    for n, (k, o) in shapes.items():
        fwd = dict(kernels)
        if n == "head":
            del fwd["t-faster"]  # not measured at one site-role: never everywhere
        sites[n] = (k, o, 8, {"fwd": fwd})
    report = make_report(sites)
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    plan = Plan.uniform(Tower(), rw)
    for sp in plan.sites.values():
        for role in (Role.DGRAD, Role.WGRAD):
            sp.roles[role] = loka.dispatch.RoleChoice(plan.baseline)
    assert get("cublas-rowwise").scaling == "rowwise"
    assert loka.dispatch.plan_families(plan, report) == ["cublas-tensorwise", "t-mid"]
    assert loka.dispatch.plan_families(plan, report, limit=1) == ["cublas-tensorwise"]
    # a plan already all on a sharing kernel: the others are still proposed, not itself
    tw = Plan.uniform(Tower(), "cublas-tensorwise")
    for sp in tw.sites.values():
        for role in (Role.DGRAD, Role.WGRAD):
            sp.roles[role] = loka.dispatch.RoleChoice(tw.baseline)
    assert loka.dispatch.plan_families(tw, report) == ["t-mid"]


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


def test_search_speed_finds_the_best_fixed_choice_per_group(make_report, three):
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


def test_search_speed_keeps_the_best_single_group_when_together_is_slower_and_survives_failures(make_report):
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
    d = loka.dispatch
    homes = {"tune_speed": tune, "search_speed": tune, "FUSIBLE_TWINS": tune,
             "override": select, "tighten_end_to_end": tighten}
    for name, module in homes.items():
        assert name in d.__all__
        # one object, defined in its module and exported by the package
        assert getattr(d, name) is getattr(module, name)
    # loka.dispatch.plan is the selection function, carrying nothing else
    assert inspect.isfunction(d.plan) and d.plan is select.plan and loka.plan is d.plan
    assert not any(hasattr(d.plan, name) for name in homes)
    for kernel, twin in d.FUSIBLE_TWINS.items():  # same numerics: same formats and scaling
        a, b = get(kernel), get(twin)
        assert (a.formats, a.scaling, a.fast_accum) == (b.formats, b.scaling, b.fast_accum)
        assert a.library is Library.TRITON and b.library is Library.CUBLAS
        assert a.same_bits_as == twin  # the Probe samples their errors once
    from loka.kernels import registry
    assert {k.name: k.same_bits_as for k in registry.all_kernels()
            if k.same_bits_as} == d.FUSIBLE_TWINS


def test_optimize_tries_the_plans_kernels_as_families_and_keeps_the_faster_one(make_report):
    """loka.optimize passes the mixed plan's kernels to tune_speed as families; the final
    A/B rounds confirm the one-kernel plan against the baseline."""
    import torch
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    speeds = {"fm0": (1.2, 1.5), "fm1": (1.2, 1.5), "top": (1.5, 1.2), "head": (1.5, 1.2)}
    report = make_report({n: (k, o, 8, {"fwd": {"t-mid": (0.1, speeds[n][0]),
                                                "t-faster": (0.1, speeds[n][1])}})
                          for n, (k, o) in shapes.items()})

    def time_step(m):
        fp8 = [mod.config.fwd for mod in m.modules()
               if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16"]
        return 10.0 - 0.3 * len(fp8) + 1.0 * max(0, len(set(fp8)) - 1)

    batches = [torch.randn(8, 32) for _ in range(2)]
    result = loka.optimize(model, batches, lambda m, b: m(b).pow(2).mean(), report=report,
                           max_error=0.2, head_sites=0, time_step=time_step, rounds=2)
    assert {result.untuned.config(s).fwd for s in result.untuned.fp8_sites()} == {"t-mid", "t-faster"}
    assert [e["family"] for e in result.trials if "family" in e] == ["t-faster", "t-mid"]
    assert len(result.plan.fp8_sites()) == 4
    assert len({result.plan.config(s).fwd for s in result.plan.fp8_sites()}) == 1
    assert result.rounds == [{"baseline": 10.0, "plan": pytest.approx(8.8), "first": first}
                             for first in ("baseline", "plan")]


def test_plan_families_keep_a_slot_for_sharing_and_respect_allowed_kernels_and_budgets(make_report):
    """A mix of four kernels fills at most three slots, the fourth goes to the fastest
    tensorwise kernel in the budget; allowed_kernels limits both kinds; a kernel and its
    fast-accumulation twin count once."""
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    own = ["t-mid", "t-faster", "t-slow-exact", "t-fast-coarse"]
    kernels = {k: (0.1, 1.2) for k in own}
    kernels.update({"cublas-tensorwise": (0.1, 1.3), "cublas-tensorwise-fastacc": (0.1, 1.4),
                    "cublas-rowwise": (0.1, 1.5)})
    report = make_report({n: (k, o, 8, {"fwd": dict(kernels)}) for n, (k, o) in shapes.items()})
    plan = Plan.uniform(Tower(), "t-mid")
    for sp, k in zip(plan.sites.values(), own):
        sp.roles[Role.FWD] = loka.dispatch.RoleChoice(k, budget=0.2)
        for role in (Role.DGRAD, Role.WGRAD):
            sp.roles[role] = loka.dispatch.RoleChoice(plan.baseline)
    fams = loka.dispatch.plan_families(plan, report)
    assert len(fams) == 4 and fams[-1] == "cublas-tensorwise-fastacc", fams
    assert "cublas-tensorwise" not in fams  # its fast-accumulation twin stands for it
    assert set(fams[:3]) <= set(own)
    got = loka.dispatch.plan_families(plan, report, allowed_kernels=["t-mid", "t-faster",
                                                                     "cublas-tensorwise"])
    assert got == ["t-faster", "t-mid", "cublas-tensorwise"]
    # over the budget at one site-role: not proposed
    tight = make_report({n: (k, o, 8, {"fwd": dict(kernels, **(
        {"cublas-tensorwise-fastacc": (0.3, 1.4), "cublas-tensorwise": (0.3, 1.3)}
        if n == "top" else {}))}) for n, (k, o) in shapes.items()})
    assert not any(k.startswith("cublas-tensorwise")
                   for k in loka.dispatch.plan_families(plan, tight))


def test_plan_families_give_up_to_half_the_slots_to_distinct_sharing_kernels(make_report):
    """Two tensorwise kernels of different quantizers measured everywhere: with four slots
    they take two, the mix's two most used kernels the other two; one slot only: the
    fastest sharing kernel."""
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    own = ["t-mid", "t-faster", "t-slow-exact", "t-fast-coarse"]
    kernels = {k: (0.1, 1.2) for k in own}
    kernels.update({"cublas-tensorwise": (0.1, 1.3), "triton-tensorwise": (0.1, 1.25)})
    report = make_report({n: (k, o, 8, {"fwd": dict(kernels)}) for n, (k, o) in shapes.items()})
    plan = Plan.uniform(Tower(), "t-mid")
    for sp, k in zip(plan.sites.values(), ["t-mid", "t-mid", "t-faster", "t-fast-coarse"]):
        sp.roles[Role.FWD] = loka.dispatch.RoleChoice(k, budget=0.2)
        for role in (Role.DGRAD, Role.WGRAD):
            sp.roles[role] = loka.dispatch.RoleChoice(plan.baseline)
    assert get("triton-tensorwise").scaling == get("cublas-tensorwise").scaling == "tensorwise"
    fams = loka.dispatch.plan_families(plan, report)
    assert fams == ["t-mid", "t-fast-coarse", "cublas-tensorwise", "triton-tensorwise"], fams
    assert loka.dispatch.plan_families(plan, report, limit=1) == ["cublas-tensorwise"]
    assert loka.dispatch.plan_families(plan, report, limit=3) == [
        "t-mid", "t-fast-coarse", "cublas-tensorwise"]


def test_optimize_never_returns_a_kernel_outside_allowed_kernels(make_report):
    import torch
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    report = make_report({n: (k, o, 8, {"fwd": {"t-mid": (0.1, 1.2), "t-faster": (0.1, 1.5)}})
                          for n, (k, o) in shapes.items()})

    def time_step(m):  # t-faster would win anywhere
        return 10.0 - sum(0.1 if mod.config.fwd == "t-mid" else 0.5 for mod in m.modules()
                          if isinstance(mod, loka.Linear) and mod.config.fwd != "bf16")

    result = loka.optimize(Tower(), [torch.randn(8, 32)], lambda m, b: m(b).pow(2).mean(),
                           report=report, max_error=0.2, time_step=time_step, rounds=1,
                           allowed_kernels=["t-mid"])
    assert {result.plan.config(s).fwd for s in result.plan.fp8_sites()} == {"t-mid"}
    assert not any("family" in e for e in result.trials)


def test_a_family_that_equals_the_plan_or_its_twins_is_not_timed_again(make_report):
    model = Tower()
    shapes = {"fm0": (32, 64), "fm1": (32, 64), "top": (64, 32), "head": (32, 16)}
    report = make_report({n: (k, o, 8, {"fwd": {"t-mid": (0.1, 1.2), "t-faster": (0.1, 1.5)}})
                          for n, (k, o) in shapes.items()})
    plan = loka.plan(report, max_error=0.2)  # all on t-faster (the faster)
    plan = loka.dispatch.override(plan, assign={"fm0:fwd": "t-mid", "fm1:fwd": "t-mid",
                                                "head:fwd": "t-mid"}, report=report)
    assert {plan.config(s).fwd for s in plan.fp8_sites()} == {"t-mid", "t-faster"}
    # the twins (t-mid -> t-faster) give the t-faster family's plan: timed once, as twins
    _, log = loka.dispatch.tune_speed(plan, model, lambda m: 10.0, report=report,
                                      twins={"t-mid": "t-faster"},
                                      families=["t-faster", "t-mid"], max_trials=8)
    assert [e.get("twins", False) for e in log[:3]] == [False, False, True]
    assert [e["family"] for e in log if "family" in e] == ["t-mid"]
    # max_trials stops the families too
    _, log = loka.dispatch.tune_speed(plan, model, lambda m: 10.0, report=report,
                                      families=["t-faster", "t-mid"], max_trials=3)
    assert len(log) == 3 and [e["family"] for e in log if "family" in e] == ["t-faster"]
