"""The NE budget (loka.quality.budget) on the tiny Wukong and the synthetic stream: the
second-order cost against a float64 reference, shared-baseline arms that reproduce the
paired check exactly (a control is exactly 0), a planted costly site-role that is detected,
ranked first and moved back first, what the plan records, bad input, and ``loka quality
--max-ne-change``."""

import json
import math

import numpy as np
import pytest
import torch

import loka
import loka.models as M
from loka import cli
from loka.config import Role
from loka.data import SyntheticCTR
from loka.dispatch import Plan, RoleChoice
from loka.jsonio import ReportError
from loka.kernels import Kernel, register, unregister
from loka.kernels import registry
from loka.quality import (PairedArms, QualityResult, SiteRoleCost, fp8_site_roles, ne_budget,
                          paired_check, second_order_cost, without)
from loka.train import loss_fn

FP8 = "emulated-rowwise-e4m3"
BAD = "test-rowwise-noisy"
PLANTED = ("layers.0.fmb.mlp.2", Role.FWD)  # a mid-model site, not the costliest by nature
STEPS, LR, BATCH = 10, 3e-3, 64
EVAL_BATCHES, EVAL_BATCH = 4, 1024
BUDGET = 2e-4


@pytest.fixture(scope="module")
def spec():
    return M.build("wukong", "tiny").feature_spec


@pytest.fixture(scope="module")
def terms(spec):
    held = SyntheticCTR(spec, EVAL_BATCH, seed=999)
    return dict(build_model=lambda seed: M.build("wukong", "tiny"),
                train_data=lambda seed: SyntheticCTR(spec, BATCH, seed=seed),
                eval_data=lambda: (held.batch(i) for i in range(EVAL_BATCHES)), lr=LR)


@pytest.fixture(scope="module")
def bad_kernel():
    """Rowwise E4M3 with an error of 30% of its output's spread added (a fixed pattern per
    shape, from its own generator): a site-role that costs NE, which no normalization after
    it can undo."""
    base = registry.get(FP8)

    def noisy(a, b, out):
        y = base(a, b, out)
        g = torch.Generator().manual_seed(7 * y.shape[0] + y.shape[1])
        return y + 0.3 * y.detach().std() * torch.randn(y.shape, generator=g).to(y.dtype)

    register(Kernel(BAD, noisy, library="emulated", formats=("e4m3", "e4m3"),
                    scaling="rowwise", align=16, description="adds a 30% error"))
    yield BAD
    unregister(BAD)


def _plan(planted=None):
    torch.manual_seed(0)
    plan = Plan.uniform(M.build("wukong", "tiny"), FP8, device="cpu")
    if planted:
        site, role = PLANTED
        plan.sites[site].roles[role] = RoleChoice(planted, reason="planted")
    return plan


@pytest.fixture(scope="module")
def budgeted(terms, bad_kernel):
    """The NE budget of a plan with the planted site-role, made once for the module (with
    one intra-op thread: a module fixture runs before the folder's per-test setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = _plan(bad_kernel)
        return plan, ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=BUDGET, steps=STEPS, seeds=(0,),
                               cost_steps=STEPS)
    finally:
        torch.set_num_threads(threads)


def test_second_order_cost_matches_a_float64_reference_and_the_taylor_remainder():
    rng = np.random.default_rng(0)
    n = 50_000
    y = (rng.random(n) < 0.2).astype(np.float64)
    z = rng.normal(-1.5, 1.2, n) + y
    d = 1e-3 * rng.normal(size=n)
    p = 1 / (1 + np.exp(-z))
    loss = lambda zz: y * np.log1p(np.exp(-zz)) + (1 - y) * np.log1p(np.exp(zz))  # noqa: E731
    expected = 0.5 * np.sum(p * (1 - p) * d * d) / np.sum(loss(z))
    cost = second_order_cost(z, z + d, y)
    assert cost == pytest.approx(expected, rel=1e-12)
    # the second-order term of the log loss's expansion: what is left after the first
    remainder = np.sum(loss(z + d) - loss(z) - (p - y) * d) / np.sum(loss(z))
    assert cost == pytest.approx(remainder, rel=1e-2)
    assert second_order_cost(z, z.copy(), y) == 0.0
    for bad in (np.r_[z[:-1], np.nan], np.r_[z[:-1], np.inf]):
        with pytest.raises(ValueError, match="not all finite"):
            second_order_cost(z, bad, y)
    with pytest.raises(ValueError, match="one shape"):
        second_order_cost(z, z[:-1], y)
    with pytest.raises(ValueError, match="non-empty"):
        second_order_cost(np.array([]), np.array([]), np.array([]))


def test_shared_baseline_arms_reproduce_the_paired_check_and_a_control_is_exactly_zero(terms):
    plan = _plan()
    arms = PairedArms(**terms, steps=STEPS, seeds=(0, 1))
    mine = arms.check(plan)
    theirs = paired_check(terms["build_model"], terms["train_data"], terms["eval_data"], plan,
                          steps=STEPS, seeds=(0, 1), lr=LR, progress=False)
    assert [s.rel_ne_change for s in mine.seeds] == [s.rel_ne_change for s in theirs.seeds]
    assert [s.auc_change for s in mine.seeds] == [s.auc_change for s in theirs.seeds]
    assert not mine.identical and mine.seeds[0].examples == EVAL_BATCHES * EVAL_BATCH
    control = arms.check(without(plan, fp8_site_roles(plan), "control"))
    assert control.identical and control.rel_ne_change == 0.0
    assert control.rel_ne_examples == (0.0, 0.0) and control.rel_ne_seeds == (0.0, 0.0)
    assert arms.cost(without(plan, fp8_site_roles(plan), "control")) == (0.0, 0.0)
    # one baseline per seed, trained once and kept: 2 + the three plan arms of each seed
    assert arms.arms_trained == 2 + 3 * 2


def test_the_planted_costly_site_role_ranks_first_and_goes_back_first(budgeted):
    plan, result = budgeted
    n = len(fp8_site_roles(plan))
    key = f"{PLANTED[0]}:{PLANTED[1].value}"
    assert [c.key for c in result.costs][0] == key
    assert result.costs[0].kernel == BAD
    assert result.costs[0].cost > 10 * result.costs[1].cost  # far above every real kernel
    assert all(c.cost >= 0 for c in result.costs) and len(result.costs) == n
    assert [c.cost for c in result.costs] == sorted((c.cost for c in result.costs), reverse=True)
    # the whole plan is detected over the budget; the planted site-role goes back first
    assert result.checks[0]["moved_back"] == 0 and result.checks[0]["upper"] > BUDGET
    assert result.moved_back[0] == key
    assert result.upper <= BUDGET and result.quality is not None
    assert result.upper == pytest.approx(result.quality.rel_ne_examples[1], abs=0)
    assert len(result.checks) <= 1 + math.ceil(math.log2(n))
    assert len(fp8_site_roles(result.plan)) == n - len(result.moved_back)


def test_the_plan_records_every_cost_and_what_went_back_and_survives_json(budgeted, tmp_path):
    plan, result = budgeted
    out = result.plan
    costs = {(c.site, c.role): c.cost for c in result.costs}
    site, role = PLANTED
    choice = out.sites[site].roles[role]
    assert choice.kernel == out.baseline and choice.reason.startswith("NE budget")
    assert choice.ne_cost == costs[(site, role.value)]
    for s, r in fp8_site_roles(plan):
        assert out.sites[s].roles[r].ne_cost == costs[(s, r.value)]
    assert plan.sites[site].roles[role].kernel == BAD  # the plan given is not changed
    assert out.budget["max_ne_change"] == BUDGET
    record = out.budget["ne_budget"]
    assert record["moved_back"] == result.moved_back and record["interval"] == "examples"
    assert [row["ne_cost"] for row in record["ranked"]] == [c.cost for c in result.costs]
    assert out.notes[-1].startswith(f"NE budget: kept {len(fp8_site_roles(out))} of")
    path = tmp_path / "plan.json"
    out.save(path)
    again = Plan.load(path)
    assert again.to_dict() == out.to_dict()
    assert again.sites[site].roles[role].ne_cost == choice.ne_cost


def test_a_plan_within_its_budget_is_kept_whole_with_one_check(terms, budgeted):
    plan, first = budgeted
    # a cost of a site-role this plan lacks (measured on another plan) is not recorded
    extra = SiteRoleCost("no.such.site", "fwd", FP8, 1.0, 0.0)
    lines = []
    result = ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0,),
                       costs=first.costs + [extra], progress=lines.append)
    assert result.moved_back == [] and len(result.checks) == 1
    # each check records both intervals and says its outcome in one progress line
    check = result.checks[0]
    assert check["rel_ne_examples"] == list(result.quality.rel_ne_examples)
    assert check["rel_ne_seeds"] is None  # one seed: no interval over seeds
    assert check["auc_change"] == result.quality.auc_change
    assert check["rel_ne_examples"][0] <= check["rel_ne_change"] <= check["upper"]
    assert lines[-1] == (f"  0 moved back: relative NE change {check['rel_ne_change']:+.4%}, "
                         f"upper bound {check['upper']:+.4%} (within 50.0000%)")
    assert fp8_site_roles(result.plan) == fp8_site_roles(plan)
    assert "no.such.site" not in result.plan.sites


def test_bad_budgets_and_missing_costs_are_refused_in_one_line(terms, budgeted):
    plan, first = budgeted
    for bad in (float("nan"), float("inf"), 0.0, -1e-4, True, "2e-4"):
        with pytest.raises(ValueError, match="max_ne_change must be a finite number > 0"):
            ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=bad, steps=1)
    with pytest.raises(ValueError, match="interval must be one of"):
        ne_budget(plan, **terms, max_baseline_ne=None, steps=1, interval="median")
    with pytest.raises(ValueError, match="needs at least two seeds"):
        ne_budget(plan, **terms, max_baseline_ne=None, steps=1, seeds=(0,), interval="seeds")
    with pytest.raises(ValueError, match="costs are missing"):
        ne_budget(plan, **terms, max_baseline_ne=None, steps=1, costs=first.costs[1:])
    with pytest.raises(ValueError, match="steps must be >= 0"):
        PairedArms(**terms, steps=-1)
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="max_baseline_ne must be None or a finite"):
            ne_budget(plan, **terms, max_baseline_ne=bad, steps=1, costs=first.costs)


def test_the_budget_refuses_a_baseline_that_did_not_learn_before_any_plan_arm(terms,
                                                                                 budgeted,
                                                                                 monkeypatch):
    """By default (``max_baseline_ne=1.0``) the checks' baselines must beat the base rate:
    ten steps of the tiny model do not, so the budget stops after training the baselines
    alone, naming each seed's NE; every check made before it (a resumed run) trains none."""
    from loka.quality import BaselineNotLearnedError
    from loka.quality import budget as qb
    plan, first = budgeted
    trained = []
    real = qb.train

    def spy(model, *a, plan=None, **kw):
        trained.append(plan)
        return real(model, *a, plan=plan, **kw)

    monkeypatch.setattr(qb, "train", spy)
    with pytest.raises(BaselineNotLearnedError,
                       match=r"did not learn in 10 steps \(seed 0: NE 1\.\d+, seed 1: NE"):
        ne_budget(plan, **terms, max_ne_change=BUDGET, steps=STEPS, seeds=(0, 1),
                  costs=first.costs)
    assert trained == [None, None]  # the two baselines, no plan arm
    # a run resumed with every check it needs made before trains nothing, baselines too
    made = {}
    monkeypatch.setattr(qb, "train", real)
    whole = ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=BUDGET, steps=STEPS,
                      seeds=(0,), costs=first.costs, on_check=made.__setitem__)
    monkeypatch.setattr(qb, "train", spy)
    trained.clear()
    resumed = ne_budget(plan, **terms, max_ne_change=BUDGET, steps=STEPS, seeds=(0,),
                        costs=first.costs, prior_checks=made)
    assert trained == [] and resumed.moved_back == whole.moved_back


def test_a_result_flags_seeds_whose_baseline_did_not_learn(terms):
    torch.manual_seed(0)
    result = paired_check(terms["build_model"], terms["train_data"], terms["eval_data"],
                          _plan(), steps=2, seeds=(0,), lr=LR, progress=False)
    assert result.seeds[0].ne_base >= 1.0 and result.unlearned == [0]
    assert "WARNING: the baseline did not learn at seed(s) [0]" in result.summary()
    assert result.to_dict()["summary"]["unlearned_seeds"] == [0]
    again = QualityResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again.unlearned == [0]


def test_old_plan_files_load_and_a_corrupt_ne_cost_is_refused(tmp_path):
    plan = _plan()
    data = plan.to_dict()
    site = next(iter(data["sites"]))
    assert all("ne_cost" not in c for c in data["sites"][site]["roles"].values())
    assert Plan.from_dict(data).sites[site].roles[Role.FWD].ne_cost is None
    data["sites"][site]["roles"]["fwd"]["ne_cost"] = "cheap"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"ne_cost: expected a number"):
        Plan.load(path)
    data["sites"][site]["roles"]["fwd"]["ne_cost"] = 1e-6
    data["budget"]["max_ne_change"] = "a lot"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"budget.max_ne_change"):
        Plan.load(path)


def test_loka_quality_max_ne_change_on_the_command_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    out, kept = tmp_path / "q.json", tmp_path / "plan.ne.json"
    base = ["quality", "--preset", "tiny", "--device", "cpu", "--steps", "3", "--batch-size",
            "32", "--eval-steps", "4", "--seeds", "0", "--plan", str(plan), "-o", str(out),
            "--plan-out", str(kept)]
    # three steps do not train the tiny model past the base rate: refused in one line
    assert cli.main(base + ["--max-ne-change", "0.5"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error: the baseline did not learn in 3 steps (seed 0: NE 1.")
    assert "hint: " in err and "--debug" not in err
    assert not kept.exists()
    base += ["--max-baseline-ne", "0"]  # 0: no check
    assert cli.main(base + ["--max-ne-change", "0.5"]) == 0
    text = capsys.readouterr().out
    assert "NE budget: kept" in text and "NE cost" in text
    written = Plan.load(kept)
    assert written.budget["max_ne_change"] == 0.5
    assert fp8_site_roles(written) == fp8_site_roles(Plan.load(plan))
    assert all(written.sites[s].roles[r].ne_cost is not None for s, r in fp8_site_roles(written))
    assert out.exists()
    for bad in (["--max-ne-change", "inf"], ["--max-ne-change", "0.5", "--control"],
                ["--max-ne-change", "-1"]):
        assert cli.main(base + bad) == 2
        assert "--max-ne-change" in capsys.readouterr().err
    for bad in (["--max-baseline-ne", "-1"], ["--max-baseline-ne", "inf"],
                ["--max-baseline-ne", "nan"], ["--warmup-steps", "-2"]):
        assert cli.main(base + ["--max-ne-change", "0.5"] + bad) == 2


def test_optimize_takes_an_ne_budget_as_its_refine_hook(terms):
    """``loka.optimize(refine=...)``: the NE budget applied to the report's plan (on the CPU
    nothing is timed, so the refined plan is the result)."""
    model = M.build("wukong", "tiny")
    batches = [SyntheticCTR(model.feature_spec, BATCH, seed=0).batch(i) for i in range(2)]
    config = loka.ProbeConfig(every_n_steps=1, num_samples=4, timing=False,
                              kernels=("bf16", FP8))
    seen = []

    def refine(p):
        seen.append(p.copy())
        return ne_budget(p, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=2, seeds=(0,), cost_steps=1).plan

    result = loka.optimize(model, batches, loss_fn, config=config, refine=refine)
    assert len(seen) == 1 and seen[0].to_dict() == result.untuned.to_dict()
    assert result.plan.budget["max_ne_change"] == 0.5
    assert all(result.plan.sites[s].roles[r].ne_cost is not None
               for s, r in fp8_site_roles(result.plan))
    with pytest.raises(TypeError, match="refine must return a Plan"):
        loka.optimize(model, batches, loss_fn, config=config, report=result.report,
                      refine=lambda p: None)


def test_checks_made_before_are_reused_and_each_new_check_is_reported(terms, budgeted):
    plan, first = budgeted
    made = []
    result = ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0,),
                       costs=first.costs, on_check=lambda k, r: made.append((k, r)))
    assert [k for k, _ in made] == [c["moved_back"] for c in result.checks] == [0]
    assert made[0][1] is result.quality
    # resumed: the check is not made again (no callback), the outcome is the same
    again, lines = [], []
    resumed = ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0,),
                        costs=first.costs, on_check=lambda k, r: again.append(k),
                        prior_checks={0: result.quality}, progress=lines.append)
    assert again == [] and resumed.checks == result.checks
    assert lines[0].endswith("moved back: made before")
    assert result.quality.meta["moved_back"] == []  # what the check moved back, recorded
    n = len(fp8_site_roles(plan))
    for bad in ({n + 1: result.quality}, {-1: result.quality}, {0: "not a result"}):
        with pytest.raises(ValueError, match="prior_checks"):
            ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0,),
                      costs=first.costs, prior_checks=bad)
    # a check of other terms, or of another ranking's k site-roles, is refused by name
    import dataclasses
    q = result.quality
    for other, field in ((dataclasses.replace(q, steps=STEPS + 1), "steps"),
                         (dataclasses.replace(q, confidence=0.9), "confidence"),
                         (dataclasses.replace(q, meta={"moved_back": ["x:fwd"]}), "moved_back"),
                         (dataclasses.replace(q, meta={}), "moved_back")):
        with pytest.raises(ValueError, match=f"prior_checks\\[0\\]: made on other terms \\({field}\\)"):
            ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0,),
                      costs=first.costs, prior_checks={0: other})
    with pytest.raises(ValueError, match="other terms \\(seeds\\)"):
        ne_budget(plan, **terms, max_baseline_ne=None, max_ne_change=0.5, steps=STEPS, seeds=(0, 1),
                  costs=first.costs, prior_checks={0: q})


def test_an_arm_whose_data_runs_out_is_refused_not_trained_short(terms, spec):
    """train() stops quietly at the end of its data; a paired arm that trained fewer steps
    than it says would be a different check: refused, naming the seed and the count."""
    short = dict(terms, train_data=lambda seed: iter(
        [SyntheticCTR(spec, BATCH, seed=seed).batch(i) for i in range(STEPS - 3)]))
    arms = PairedArms(**short, steps=STEPS, seeds=(4,))
    with pytest.raises(ValueError, match=f"train_data\\(4\\) ran out after {STEPS - 3} of "
                                         f"{STEPS} steps"):
        arms.check(_plan())
