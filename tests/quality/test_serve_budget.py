"""The serving NE budget (loka.quality.serve_ne_budget) on a small model of its own: plain
PyTorch with its own activation class, trained on the CPU against a logistic teacher, one
Linear whose input carries an outlier channel that tensorwise FP8 serves badly."""

import copy
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import loka
from loka.dispatch.linear import Linear as LokaLinear
from loka.quality import (BaselineNotLearnedError, ServeBudgetResult, fp8_forwards,
                          serve_ne_budget)

KERNEL = "emulated-tensorwise-e4m3"
OUTLIER = 1e5


class Squash(nn.Module):
    """x * sigmoid(x): the model's own activation."""

    def forward(self, x):
        return x * torch.sigmoid(x)


class Outlier(nn.Module):
    """Channel 0 times ``factor`` (set after training, when the next Linear's weight divides
    it back: the same function, an input that tensorwise FP8 serves badly)."""

    factor = 1.0

    def forward(self, x):
        return torch.cat([x[:, :1] * self.factor, x[:, 1:]], dim=1)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.act = Squash()
        self.spread = Outlier()
        self.second = nn.Linear(64, 64)
        self.third = nn.Linear(64, 32)
        self.logit = nn.Linear(32, 1)

    def forward(self, x):
        h = self.spread(self.act(self.first(x)))
        h = self.act(self.second(h))
        return self.logit(self.act(self.third(h))).squeeze(-1)


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    z = x[:, :8].sum(dim=1) / math.sqrt(8) * 1.5
    y = (torch.rand(n, generator=g) < torch.sigmoid(z)).float()
    return x, y


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for i in range(150):
        x, y = batch(256, i)
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():  # the same function, with an outlier channel into `second`
        model.spread.factor = OUTLIER
        model.second.weight[:, 0] /= OUTLIER
    return model.eval()


@pytest.fixture(scope="module")
def held():
    return [batch(2048, 10_000 + i) for i in range(4)]


def _plan(model):
    plan = loka.Plan.uniform(model, KERNEL)
    return plan


def _ne_change(model, plan, batches):
    """float64 relative NE change of serving ``model`` with ``plan`` against without."""
    def logits(m):
        with torch.no_grad():
            return torch.cat([m(x) for x, _ in batches]).double()
    y = torch.cat([b[1] for b in batches]).double()

    def ll(z):
        return (y * nn.functional.softplus(-z) + (1 - y) * nn.functional.softplus(z)).mean()
    served = copy.deepcopy(model)
    loka.apply(served, plan, inference=True)
    return float(ll(logits(served)) / ll(logits(model)) - 1)


def test_a_loose_budget_keeps_the_plan_and_measures_it_as_a_reference_does(trained, held):
    before = [trained(x).detach().clone() for x, _ in held]
    plan = _plan(trained)
    res = serve_ne_budget(plan, trained, held, max_ne_change=1.0)
    assert isinstance(res, ServeBudgetResult)
    assert res.moved_back == [] and len(res.checks) == 1
    # `logit` (one output) keeps its forward on bf16 in a uniform plan
    assert fp8_forwards(res.plan) == fp8_forwards(plan) == ["first", "second", "third"]
    assert res.to_dict()["fp8_forwards"] == 3
    assert res.examples == 8192 and 0 < res.baseline_ne < 0.95
    ref = _ne_change(trained, plan, held)
    assert res.checks[0]["rel_ne_change"] == pytest.approx(ref, rel=1e-9, abs=1e-12)
    lo, hi = res.checks[0]["interval"]
    assert lo < res.rel_ne_change < hi and res.upper == hi
    # the outlier's Linear costs most, alone; every cost is >= 0 (second order)
    assert res.costs[0].site == "second" and res.costs[0].cost > 10 * res.costs[1].cost
    assert all(c.cost >= 0 and c.role == "fwd" and c.kernel == KERNEL for c in res.costs)
    assert [c.cost for c in res.costs] == sorted((c.cost for c in res.costs), reverse=True)
    # the model is left as it was: no FP8 module, the same outputs
    assert not any(isinstance(m, LokaLinear) for m in trained.modules())
    for (x, _), out in zip(held, before):
        assert torch.equal(trained(x), out)


def test_a_tight_budget_moves_the_costliest_forwards_back_first(trained, held):
    plan = _plan(trained)
    full = serve_ne_budget(plan, trained, held, max_ne_change=1e-12)
    # every check made before the bound held is over it, the last one within
    assert all(c["interval"][1] > 1e-12 for c in full.checks[:-1])
    assert full.upper <= 1e-12 and full.moved_back[0] == "second"
    assert set(fp8_forwards(full.plan)) == set(fp8_forwards(plan)) - set(full.moved_back)
    # a site moved back serves in bf16 whole: every role on the baseline
    assert all(c.kernel == plan.baseline for c in full.plan.sites["second"].roles.values())
    assert full.plan.sites["second"].roles[loka.Role.FWD].ne_cost == pytest.approx(
        full.costs[0].cost)
    assert "serve NE budget" in full.plan.notes[-1]
    # a budget between the full plan's upper bound and the one without its costliest
    # forward moves exactly that one back
    up0, up1 = full.checks[0]["interval"][1], full.checks[1]["interval"][1]
    assert up1 < up0, (up0, up1)
    one = serve_ne_budget(plan, trained, held, max_ne_change=(up0 + up1) / 2)
    assert one.moved_back == ["second"] and len(one.checks) == 2
    assert one.rel_ne_change == pytest.approx(_ne_change(trained, one.plan, held),
                                              rel=1e-9, abs=1e-12)


def test_static_scales_stay_with_the_sites_that_keep_fp8(trained, held):
    plan = _plan(trained)
    plan.static_scales = {name: 50.0 for name in plan.fp8_sites()}
    plan.static_scales["second"] = OUTLIER * 6.0
    res = serve_ne_budget(plan, trained, held, max_ne_change=1e-3)
    assert res.moved_back[0] == "second" and res.upper <= 1e-3
    served = copy.deepcopy(trained)
    loka.apply(served, res.plan, inference=True)  # a site moved back takes no scale
    kept = fp8_forwards(res.plan)
    assert kept and "second" not in kept
    assert set(res.plan.static_scales) == set(kept)  # a site moved back takes no scale
    for name in kept:
        assert float(served.get_submodule(name).input_amax) == pytest.approx(50.0)
    # the checks serve the static plans as loka.apply sets them
    assert res.rel_ne_change == pytest.approx(_ne_change(trained, res.plan, held),
                                              rel=1e-9, abs=1e-12)
    assert res.checks[0]["rel_ne_change"] == pytest.approx(_ne_change(trained, plan, held),
                                                           rel=1e-9, abs=1e-12)


def test_each_module_keeps_its_own_mode(trained, held):
    """A model holding an eval submodule in a training root comes back as it was."""
    model = copy.deepcopy(trained).train()
    model.third.eval()
    serve_ne_budget(_plan(model), model, held, max_ne_change=1.0)
    assert model.training and model.second.training and not model.third.training


def test_a_plan_that_serves_non_finite_logits_is_infinitely_costly(trained, held):
    """A forward a plan makes non-finite costs inf and is the first moved back (a stand-in
    forward here turns the logits to inf while `second` serves in FP8); the budget's JSON
    carries the infinities as strings."""
    def forward(m, b):
        out = m(b[0])
        return out * math.inf if isinstance(m.second, LokaLinear) else out
    res = serve_ne_budget(_plan(trained), trained, held, forward=forward, max_ne_change=1.0)
    assert res.costs[0].site == "second" and res.costs[0].cost == math.inf
    assert res.checks[0]["interval"][1] == math.inf and res.moved_back == ["second"]
    assert math.isfinite(res.upper) and res.upper <= 1.0
    d = res.to_dict()
    assert d["costs"][0]["cost"] == "inf" and d["checks"][0]["rel_ne_change"] == "inf"
    assert res.plan.sites["second"].roles[loka.Role.FWD].ne_cost is None
    res.plan.save(str(Path(tempfile.mkdtemp()) / "plan.json"))  # strict JSON


def test_bad_input_is_refused(trained, held):
    plan = _plan(trained)
    for bad in (0, -1e-4, float("nan"), float("inf"), True, "2e-4"):
        with pytest.raises(ValueError, match="max_ne_change"):
            serve_ne_budget(plan, trained, held, max_ne_change=bad)
    with pytest.raises(ValueError, match="at least one batch"):
        serve_ne_budget(plan, trained, [])
    with pytest.raises(ValueError, match="confidence"):
        serve_ne_budget(plan, trained, held, confidence=1.0)

    class Constant(nn.Module):  # predicts the base rate's complement: no better than it
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 1)

        def forward(self, x):
            return self.lin(x).squeeze(-1) * 0.0
    const = Constant()
    with pytest.raises(BaselineNotLearnedError, match="NE"):
        serve_ne_budget(loka.Plan.uniform(const, KERNEL), const, held)

    class Nan(Tower):
        def forward(self, x):
            return super().forward(x) * float("nan")
    nan = Nan()
    nan.load_state_dict(trained.state_dict())
    with pytest.raises(ValueError, match="non-finite"):
        serve_ne_budget(plan, nan.eval(), held)
    with pytest.raises(ValueError, match="one logit per example"):
        serve_ne_budget(plan, trained, held, forward=lambda m, b: m(b[0]).repeat(2))
    with pytest.raises(TypeError, match="labels"):
        serve_ne_budget(plan, trained, [x for x, _ in held], forward=lambda m, b: m(b))
    # a plan without an FP8 forward is returned as it is
    none = loka.Plan.uniform(trained, "bf16")
    res = serve_ne_budget(none, trained, held)
    assert res.costs == [] and res.moved_back == [] and fp8_forwards(res.plan) == []
    assert res.rel_ne_change == 0.0 and np.isfinite(res.baseline_ne)
