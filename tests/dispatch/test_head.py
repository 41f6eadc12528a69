"""Rule 0 of the selection: the sites nearest the loss (the last to run in the Probe's
forward order) stay on the baseline (``DispatchConfig.head_sites``)."""

import json

import pytest
import torch
import torch.nn as nn

import loka
from loka.config import DispatchConfig, Role
from loka.dispatch.select import audit, head_of, plan
from loka.probe.report import ProbeReport, ReportError

pytestmark = pytest.mark.usefixtures("fake_kernels")


class Gelu2(nn.Module):
    """An activation of the model's own."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(0.8 * x))


class OutOfOrder(nn.Module):
    """Eight Linears whose registration order is not the order they run in: the head is
    registered first and runs last; a shared Linear runs twice."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 1)          # registered first, runs last
        self.pre_head = nn.Linear(64, 32)     # runs second to last
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.shared = nn.Linear(64, 64)       # runs first (and again later)
        self.embed = nn.Linear(16, 64)        # registered last, runs second
        self.act = Gelu2()

    def forward(self, x):
        h = self.act(self.shared(self.act(self.embed(x)) * 0 + 1) * 0 + self.embed(x))
        for b in self.blocks:
            h = self.act(b(h)) + h
        h = self.shared(h)
        return self.head(self.act(self.pre_head(h)))


RUN_ORDER = ["embed", "shared", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "pre_head", "head"]


@pytest.fixture(scope="module")
def probed():
    torch.manual_seed(0)
    model = OutOfOrder()
    batches = [(torch.randn(64, 16), torch.randn(64, 1)) for _ in range(2)]

    def loss_fn(m, b):
        return ((m(b[0]) - b[1]) ** 2).mean()

    config = loka.ProbeConfig(timing=False, num_samples=4, bootstrap=20, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3"))
    return model, loka.probe(model, batches, loss_fn, config=config)


def test_the_probe_records_the_forward_order_not_the_registration_order(probed):
    _, report = probed
    assert list(report.sites) != RUN_ORDER  # registration order differs
    assert sorted(report.sites, key=lambda n: report.sites[n].order) == RUN_ORDER
    assert [report.sites[n].order for n in RUN_ORDER] == list(range(8))
    # the order survives the JSON round trip
    again = ProbeReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert {n: s.order for n, s in again.sites.items()} == {n: i for i, n in enumerate(RUN_ORDER)}


def test_the_last_sites_to_run_stay_on_the_baseline(probed):
    _, report = probed
    assert head_of(report, 3) == (["pre_head", "head"], True)  # a quarter of 8 sites: 2
    assert head_of(report, 1) == (["head"], True)
    assert head_of(report, 0) == ([], True)
    p = plan(report, assume_fast=True)  # the default: DispatchConfig().head_sites == 3
    assert DispatchConfig().head_sites == 3
    assert p.budget["head_sites"] == 3
    for name in ("pre_head", "head"):
        for role in Role:
            choice = p.sites[name].roles[role]
            assert choice.kernel == "bf16" and choice.reason.startswith("head:")
    assert set(p.fp8_sites()) == set(RUN_ORDER[:6])
    assert any("head_sites=3: pre_head, head stay on bf16" in n for n in p.notes)
    none_back = plan(report, assume_fast=True, head_sites=0)
    assert "pre_head" in none_back.fp8_sites()  # 64 -> 32: FP8 where nothing holds it back
    assert not any("head_sites" in n for n in none_back.notes)
    one = plan(report, assume_fast=True, config=DispatchConfig(head_sites=1))
    assert "pre_head" in one.fp8_sites() and "head" not in one.fp8_sites()


def test_the_probe_measures_the_heads_forwards_only(probed):
    """ProbeConfig.head_sites (3, as DispatchConfig's): the two head sites of eight (a
    quarter) get no gradient-role errors or timings, and say why; no default plan loses
    anything by it, and one that keeps fewer sites back leaves those roles on bf16."""
    model, report = probed
    assert loka.ProbeConfig().head_sites == DispatchConfig().head_sites == 3
    assert report.meta["head_forwards_only"] == ["pre_head", "head"]
    for name in RUN_ORDER:
        measured = set(report.sites[name].roles)
        if name in ("pre_head", "head"):
            assert measured == {Role.FWD}
            why = report.sites[name].stats["skipped_roles"]
            assert set(why) == {"dgrad", "wgrad"}
            assert all(w.startswith("nearest the loss (ProbeConfig.head_sites=3)")
                       for w in why.values())
        else:
            assert measured == set(Role)
    serve = plan(report, assume_fast=True, inference=True)  # a serving plan: forwards
    assert "pre_head" in serve.fp8_sites()  # (head, 32 -> 1, fits no FP8 kernel)
    none_back = plan(report, assume_fast=True, head_sites=0)
    for role in (Role.DGRAD, Role.WGRAD):
        choice = none_back.sites["pre_head"].roles[role]
        assert choice.kernel == "bf16"
        assert choice.reason.startswith("not measured (nearest the loss")
    assert none_back.sites["pre_head"].roles[Role.FWD].kernel != "bf16"


def test_head_sites_zero_measures_every_role(probed):
    model, _ = probed
    torch.manual_seed(0)
    batches = [(torch.randn(64, 16), torch.randn(64, 1)) for _ in range(2)]
    config = loka.ProbeConfig(timing=False, num_samples=4, bootstrap=20, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3"), head_sites=0)
    report = loka.probe(model, batches, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                        config=config)
    assert report.meta["head_forwards_only"] == []
    assert all(set(s.roles) == set(Role) for s in report.sites.values())
    assert "pre_head" in plan(report, assume_fast=True, head_sites=0).fp8_sites()


@pytest.mark.parametrize("bad", [-1, "2", True, 1.5])
def test_bad_probe_head_sites_are_refused(bad):
    with pytest.raises(ValueError, match="ProbeConfig.head_sites must be an integer >= 0"):
        loka.ProbeConfig(head_sites=bad)


def test_a_report_without_orders_falls_back_to_registration_order_and_says_so(probed):
    _, report = probed
    d = report.to_dict()
    for s in d["sites"].values():
        s.pop("order")
    old = ProbeReport.from_dict(d)
    assert all(s.order is None for s in old.sites.values())
    assert head_of(old, 3) == (["shared", "embed"], False)  # the last two registered
    p = plan(old, assume_fast=True)
    assert {"shared", "embed"}.isdisjoint(p.fp8_sites())
    assert any("no forward order" in n for n in p.notes)


def test_a_model_of_three_sites_keeps_none_back(make_report, three):
    report = make_report({f"l{i}": (64, 64, 128, {"fwd": three}) for i in range(3)})
    assert head_of(report, 3) == ([], False)
    assert len(plan(report).fp8_sites()) == 3
    four = make_report({f"l{i}": (64, 64, 128, {"fwd": three}) for i in range(4)})
    assert plan(four).fp8_sites() == ["l0", "l1", "l2"]


@pytest.mark.parametrize("bad", [-1, "2", True, 1.5])
def test_bad_head_sites_are_refused(bad, make_report, three):
    with pytest.raises(ValueError, match="head_sites must be an integer >= 0"):
        DispatchConfig(head_sites=bad)
    with pytest.raises(ValueError, match="head_sites"):
        plan(make_report({"s": (64, 64, 128, {"fwd": three})}), head_sites=bad)


@pytest.mark.parametrize("bad", [-1, "x", True, 2.0])
def test_a_corrupt_order_is_a_one_line_report_error(bad, probed):
    _, report = probed
    d = report.to_dict()
    d["sites"]["head"]["order"] = bad
    with pytest.raises(ReportError, match=r"sites\['head'\].order"):
        ProbeReport.from_dict(d)


def test_audit_takes_the_head_as_the_plans_own_choice(make_report, three):
    """GPU-timed report: the head's fast kernels are not a speed violation of a plan that
    kept them back, and are one of a plan that claims no head."""
    report = make_report({f"l{i}": (64, 64, 128, {r: three for r in Role}) for i in range(8)})
    p = plan(report)
    assert p.fp8_sites() == [f"l{i}" for i in range(6)]
    assert audit(p, report)["ok"]
    p.budget["head_sites"] = 0  # edited by hand: nothing justifies l6 and l7 on bf16
    bad = audit(p, report)
    assert {(v["site"], v["kind"]) for v in bad["violations"]} == {
        ("l6", "speed"), ("l7", "speed")}
    p.budget["head_sites"] = "three"  # not a count: no head either
    assert not audit(p, report)["ok"]


def test_the_cli_takes_head_sites(tmp_path, probed, capsys):
    from loka.cli import main
    _, report = probed
    path = tmp_path / "report.json"
    report.save(path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--assume-fast", "--head-sites", "0", "-o", str(out)]) == 0
    assert "pre_head" in loka.Plan.load(out).fp8_sites()
    assert main(["plan", str(path), "--assume-fast", "-o", str(out)]) == 0
    assert {"pre_head", "head"}.isdisjoint(loka.Plan.load(out).fp8_sites())
    assert main(["plan", str(path), "--head-sites", "-1", "-o", str(out)]) == 2
    assert "--head-sites must be >= 0" in capsys.readouterr().err


class Checkpointed(nn.Module):
    """Two blocks under reentrant activation checkpointing, then a head that is not: the
    blocks' forward runs without grad and again in the backward."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(32, 1)
        self.b0, self.b1, self.b2 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(lambda t: torch.relu(self.b1(torch.relu(self.b0(t)))), x,
                       use_reentrant=True)
        h = checkpoint(lambda t: torch.relu(self.b2(t)), h, use_reentrant=True)
        return self.head(h)


def test_the_order_under_reentrant_checkpointing_is_the_forwards_not_the_recompute():
    torch.manual_seed(0)
    model = Checkpointed()
    x = torch.randn(64, 16, requires_grad=True)  # reentrant checkpoints need an input with grad
    config = loka.ProbeConfig(timing=False, num_samples=4, bootstrap=20, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3"))
    report = loka.probe(model, [x, x], lambda m, b: m(b).pow(2).mean(), config=config)
    assert {n: s.order for n, s in report.sites.items()} == {"b0": 0, "b1": 1, "b2": 2, "head": 3}
    assert head_of(report, 3) == (["head"], True)


def test_eval_forwards_record_no_order_and_merging_keeps_the_earliest():
    from loka.probe.hooks import SiteCollector
    from loka.probe.stats import SiteStats
    model = OutOfOrder()
    collector = SiteCollector(model, loka.ProbeConfig(timing=False)).attach()
    model.eval()
    model(torch.randn(4, 16))  # serving forwards are not the training step's order
    assert all(s.order is None for s in collector.sites.values())
    model.train()
    with torch.no_grad():  # a training forward without grad (a reentrant checkpoint's) is
        model(torch.randn(4, 16))
    assert sorted(collector.sites, key=lambda n: collector.sites[n].order) == RUN_ORDER
    collector.detach()
    a, b, c = (SiteStats("s", 8, 8) for _ in range(3))
    b.order, c.order = 5, 2
    assert a.merge(b).order == 5          # a rank that never ran the site takes the other's
    assert a.merge(c).order == 2          # the earliest wins
    assert a.merge(SiteStats("s", 8, 8)).order == 2


def test_serving_plans_keep_no_head_back(probed):
    _, report = probed
    p = plan(report, assume_fast=True, inference=True)
    assert "head" not in p.sites["pre_head"].roles[Role.FWD].reason
    assert p.sites["pre_head"].kernel("fwd") != "bf16"
    assert not any("head_sites" in n for n in p.notes)


def test_a_plan_from_before_head_sites_audits_its_head_sites(probed, make_report, three):
    """A plan without ``head_sites`` in its budget (made before the rule) kept no head: its
    head sites are checked like any other; a recorded forward order is what decides."""
    _, ordered = probed
    timed = make_report({n: (s.in_features, s.out_features, s.tokens, {r: three for r in Role})
                         for n, s in ordered.sites.items()})
    for n, s in timed.sites.items():
        s.order = ordered.sites[n].order
    p = plan(timed)
    assert {"pre_head", "head"}.isdisjoint(p.fp8_sites()) and audit(p, timed)["ok"]
    del p.budget["head_sites"]
    flagged = {v["site"] for v in audit(p, timed)["violations"]}
    assert flagged == {"pre_head", "head"}


@pytest.mark.parametrize("bad", [-1, "3", True, 2.5])
def test_a_plan_file_with_a_bad_head_sites_is_refused(bad, probed, tmp_path):
    _, report = probed
    d = plan(report, assume_fast=True).to_dict()
    d["budget"]["head_sites"] = bad
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ReportError, match="budget.head_sites"):
        loka.Plan.load(path)


def test_kernels_asked_for_that_cannot_run_are_said_not_measured():
    """A kernel named in ProbeConfig.kernels that this device cannot run (fast accumulation
    is CUDA-only) is not silently dropped: a warning, the report's meta, a note in the plan."""
    torch.manual_seed(0)
    model = OutOfOrder()
    batches = [(torch.randn(64, 16), torch.randn(64, 1)) for _ in range(2)]
    config = loka.ProbeConfig(timing=False, num_samples=4, bootstrap=20, compare_naive=False,
                              kernels=("bf16", "emulated-rowwise-e4m3",
                                       "cublas-rowwise-fastacc"))
    with pytest.warns(UserWarning, match="cublas-rowwise-fastacc \\(fast accumulation"):
        report = loka.probe(model, batches, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(),
                            config=config)
    missing = report.meta["kernels_not_measured"]
    assert list(missing) == ["cublas-rowwise-fastacc"] and "CUDA" in missing[
        "cublas-rowwise-fastacc"]
    assert all("cublas-rowwise-fastacc" not in rr.kernels
               for s in report.sites.values() for rr in s.roles.values())
    again = ProbeReport.from_dict(json.loads(json.dumps(report.to_dict())))
    p = plan(again, assume_fast=True)
    assert any(n.startswith("kernels the Probe was asked for but could not run there")
               and "cublas-rowwise-fastacc" in n for n in p.notes), p.notes
