import math
import logging

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import loka
from loka.config import LinearConfig, Role
from loka.dispatch import Guard, GuardEvent, Plan
from loka.kernels import Kernel, get, register, unregister

FP8 = "emulated-rowwise-e4m3"
INJECT = {"on": False}


def _inf_after_switch_on(a, b, out_dtype):
    """The FP8 kernel, but its first output row turns Inf while INJECT['on']."""
    y = get(FP8)(a, b, out_dtype)
    if INJECT["on"]:
        y = y.clone()
        y[0] = float("inf")
    return y


@pytest.fixture(autouse=True)
def faulty_kernel():
    base = get(FP8)
    register(Kernel("t-faulty", _inf_after_switch_on, library="custom", scaling="rowwise",
                    formats=("e4m3", "e4m3"), align=16, quantize_a=base.quantize_a,
                    quantize_b=base.quantize_b), override=True)
    INJECT["on"] = False
    torch._dynamo.reset()
    yield
    INJECT["on"] = False
    unregister("t-faulty")
    torch._dynamo.reset()


class Chain(nn.Module):
    """(B, 32) -> (B, 1) through four Linears; 'mid' is where faults are injected."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        x = torch.relu(self.inp(x))
        x = torch.relu(self.mid(x))
        return self.head(torch.relu(self.out(x)))


def _planned(faulty_role=None):
    torch.manual_seed(0)
    model = Chain()
    plan = Plan.uniform(model, FP8)
    if faulty_role is not None:
        plan.sites["mid"].roles[Role.parse(faulty_role)].kernel = "t-faulty"
    loka.apply(model, plan)
    return model, plan


def _train(model, guard, steps, inject_from, x, y, opt, recheck=False):
    losses, healthy = [], []
    for step in range(steps):
        INJECT["on"] = step >= inject_from
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        closure = (lambda: ((model(x) - y) ** 2).mean().backward()) if recheck else None
        ok = guard.step(loss, recheck=closure)
        if ok:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        healthy.append(ok)
    return losses, healthy


def test_injected_inf_in_forward_switches_the_site_and_training_continues():
    model, plan = _planned("fwd")
    events = []
    run = model
    guard = Guard(run, plan, check_every=4, on_switch=events.append)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, healthy = _train(run, guard, 12, inject_from=5, x=x, y=y, opt=opt)
    # step 5 (not a check step) sees a non-finite loss; step 6 is checked and finds 'mid'
    assert healthy[:5] == [True] * 5 and healthy[5:7] == [False, False]
    assert all(healthy[7:]) and all(torch.isfinite(torch.tensor(losses[7:])))
    assert losses[-1] < losses[7]  # and it still learns
    assert [(e.site, e.step) for e in events] == [("mid", 6)]
    assert "non-finite output from a finite input (fwd t-faulty)" in events[0].reason
    assert events[0].previous.fwd == "t-faulty"
    assert model.mid.config == LinearConfig.uniform("bf16")
    assert model.inp.config == LinearConfig.uniform(FP8)  # upstream untouched
    assert model.out.config == LinearConfig.uniform(FP8)  # downstream only received the Inf
    assert [(f.site, f.step) for f in plan.fallbacks] == [("mid", 6)]
    assert plan.sites["mid"].kernel("fwd") == "bf16"


@pytest.mark.parametrize("role, flag", [("dgrad", "non-finite input gradient"),
                                        ("wgrad", "non-finite weight gradient")])
def test_injected_inf_in_a_gradient_gemm_is_attributed_to_its_site(role, flag):
    model, plan = _planned(role)
    guard = Guard(model, plan, check_every=1)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, healthy = _train(model, guard, 6, inject_from=2, x=x, y=y, opt=opt)
    assert healthy == [True, True, False, True, True, True]
    assert [e.site for e in guard.events] == ["mid"] and flag in guard.events[0].reason
    assert all(p.isfinite().all() for p in model.parameters())  # the bad update was skipped
    assert all(torch.isfinite(torch.tensor(losses)))


def test_recheck_finds_the_site_on_the_same_step():
    model, plan = _planned("fwd")
    guard = Guard(model, plan, check_every=100)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _, healthy = _train(model, guard, 6, inject_from=3, x=x, y=y, opt=opt, recheck=True)
    assert healthy == [True, True, True, False, True, True]
    assert [(e.site, e.step) for e in guard.events] == [("mid", 3)]


def test_a_switched_site_never_switches_back_and_others_are_still_checked():
    model, plan = _planned("fwd")
    guard = Guard(model, plan, check_every=1)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, guard, 3, inject_from=1, x=x, y=y, opt=opt)
    assert guard.switched == {"mid"} and "mid" not in guard.sites
    INJECT["on"] = False  # the fault goes away: the site stays on bf16
    _train(model, guard, 3, inject_from=99, x=x, y=y, opt=opt)
    assert model.mid.config == LinearConfig.uniform("bf16") and len(guard.events) == 1
    assert sorted(guard.sites) == ["head", "inp", "out"]
    assert all(m.monitor is not None for m in guard.sites.values()) and model.mid.monitor is None


def test_non_finite_values_no_fp8_site_introduced_are_not_blamed(caplog):
    model, plan = _planned()
    guard = Guard(model, plan, check_every=1)
    x = torch.randn(8, 32)
    x[0, 0] = float("nan")  # bad data, not a bad kernel
    loss = model(x).sum()
    loss.backward()
    with caplog.at_level(logging.WARNING, logger="loka.dispatch"):
        assert guard.step(loss) is False
    assert guard.events == [] and "no FP8 site introduced it" in caplog.text
    assert guard.notes == ["step 0: non-finite loss not introduced by an FP8 site"]


def test_checks_run_only_on_check_steps():
    model, plan = _planned()
    guard = Guard(model, plan, check_every=3)
    armed = []
    for _ in range(7):
        armed.append(model.inp.monitor.armed)
        model(torch.randn(4, 32)).sum().backward()
        guard.step(torch.tensor(1.0))
    assert armed == [True, False, False, True, False, False, True]
    guard.close()
    assert all(m.monitor is None for m in (model.inp, model.mid, model.out))


def test_static_scale_saturation_above_threshold_switches_the_site():
    torch.manual_seed(0)
    model = Chain()
    plan = Plan.uniform(model, FP8)
    loka.apply(model, plan)
    model.inp.set_input_amax(0.5)  # most of a N(0, 1) input lies beyond it
    model.mid.set_input_amax(1e3)  # none does
    events = []
    guard = Guard(model, plan, saturation_threshold=1e-2, on_switch=events.append)
    loss = model(torch.randn(64, 32)).sum()
    loss.backward()
    assert guard.step(loss) is False
    assert [e.site for e in events] == ["inp"] and "FP8 saturation" in events[0].reason


def test_fallbacks_saved_in_the_plan_start_the_next_run_on_bf16(tmp_path):
    model, plan = _planned("fwd")
    guard = Guard(model, plan, check_every=1)
    _train(model, guard, 2, inject_from=0, x=torch.randn(16, 32), y=torch.randn(16, 1),
           opt=torch.optim.SGD(model.parameters(), lr=0.01))
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert [f.site for f in loaded.fallbacks] == ["mid"]
    assert loaded.fallbacks[0].previous["fwd"] == "t-faulty"
    fresh = Chain()
    loka.apply(fresh, loaded)
    assert type(fresh.mid) is nn.Linear and isinstance(fresh.inp, loka.Linear)
    assert "mid" not in Guard(fresh, loaded).sites


def test_guard_on_a_compiled_model_that_ran_before_the_guard_existed():
    model, plan = _planned("fwd")
    # Dynamo traces the autograd.Function's forward and backward with any backend;
    # 'eager' keeps this test fast (test_compile covers Inductor)
    counter = CompileCounterWithBackend("eager")
    run = torch.compile(model, fullgraph=True, backend=counter)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    run(x).sum().backward()  # compiled before the guard attached its monitors
    model.zero_grad()
    guard = Guard(run, plan, check_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, healthy = _train(run, guard, 6, inject_from=4, x=x, y=y, opt=opt)
    # step 4 is a check step: the fault is found at once; the loss is finite again at 5
    assert [(e.site, e.step) for e in guard.events] == [("mid", 4)]
    assert healthy == [True] * 4 + [False, True]
    assert torch.isfinite(torch.tensor(losses[5])) and losses[5] < losses[0]
    # graphs: plain, armed, unarmed, armed with the fault (a Python flag of the test
    # kernel), unarmed after the switch to bf16: no recompilation per call or per check
    assert counter.frame_count <= 5


def test_bad_arguments():
    model, plan = _planned()
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="check_every"):
            Guard(model, plan, check_every=bad)
    with pytest.raises(ValueError, match="saturation_threshold"):
        Guard(model, plan, saturation_threshold=2.0)
    with pytest.raises(ValueError, match="loka.apply"):
        Guard(Chain(), plan)
    assert isinstance(GuardEvent("a", 1, "r", LinearConfig()), GuardEvent)


# -- reliability (issue 29) ------------------------------------------------------------------
@pytest.mark.parametrize("param", ["weight", "bias"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_fault_the_baseline_shares_is_not_blamed_on_fp8(param, bad):
    # a NaN weight makes bf16 NaN too: switching the site to bf16 would fix nothing
    model, plan = _planned()
    events = []
    guard = Guard(model, plan, check_every=1, on_switch=events.append)
    with torch.no_grad():
        getattr(model.mid, param)[0] = bad
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    assert guard.step(loss) is False  # the update is skipped all the same
    assert events == [] and plan.fallbacks == [] and model.mid.config == LinearConfig.uniform(FP8)
    assert guard.notes == ["step 0: non-finite loss not introduced by an FP8 site"]


def test_a_nan_weight_read_by_a_gradient_gemm_is_not_blamed_on_fp8():
    # 'out' gets a finite dy from the head; its dgrad dy @ W reads the NaN weight
    model, plan = _planned()
    guard = Guard(model, plan, check_every=1)
    with torch.no_grad():
        model.out.weight[:, 0] = math.nan
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    assert guard.step(loss) is False and guard.events == []


def test_sites_skipped_by_a_non_strict_apply_are_not_guarded():
    torch.manual_seed(0)
    model = Chain()
    plan = Plan.uniform(model, FP8)
    other = Chain()
    other.mid = nn.Linear(64, 48)  # a site of another shape: apply(strict=False) skips it
    other.out = nn.Linear(48, 32)
    report = loka.apply(other, plan, strict=False)
    assert set(report.skipped) == {"mid", "out"}
    guard = Guard(other, plan, check_every=1)
    assert sorted(guard.sites) == ["head", "inp"]
    assert set(guard.unguarded) == {"mid", "out"} and "64->48" in guard.unguarded["mid"]
    loss = other(torch.randn(8, 32)).sum()
    loss.backward()
    assert guard.step(loss) is True


def test_a_plan_never_applied_is_still_refused():
    model, plan = _planned()
    with pytest.raises(ValueError, match="loka.apply"):
        Guard(Chain(), plan)
    fresh = Chain()
    loka.apply(fresh, Plan.uniform(fresh, FP8, module_filter="inp"))
    with pytest.raises(ValueError, match="loka.apply"):  # another plan was applied
        Guard(fresh, plan)
