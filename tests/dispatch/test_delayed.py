"""Delayed tensorwise scaling in loka.Linear and loka.apply: the first training call is the
dynamic one, later calls quantize with the estimates of earlier calls, and the compiled
step (Inductor's code for a simulated H200) has no amax pass before a cast."""

import copy
import importlib.util
import json
import math

import pytest
import torch
from torch import nn

import loka
from loka.config import LinearConfig
from loka.dispatch import Linear, Plan
from loka.dispatch.linear import delayed_formats
from loka.kernels import get
from loka.numerics import E4M3, E5M2, dequantize, sqnr
from loka.numerics.delayed import HEADROOM, quantize_delayed

TW = "cublas-tensorwise"
ALL_TW = LinearConfig(TW, TW, TW)
BUFS = ("delayed_amax_x", "delayed_amax_w", "delayed_amax_dy")


def _pair(config=ALL_TW, k=64, n=48, decay=0.9):
    torch.manual_seed(0)
    ref = Linear(k, n, config=config)
    lin = Linear(k, n, config=config)
    lin.load_state_dict(ref.state_dict())
    ops = lin.set_delayed_scaling(decay)
    return ref, lin, ops


def _step(lin, x, g):
    x = x.clone().requires_grad_()
    y = lin(x)
    y.backward(g)
    dw = lin.weight.grad.clone()
    lin.weight.grad = None
    lin.bias.grad = None
    return y.detach(), x.grad, dw


def _est(lin):
    return [float(lin._buffers[n]) for n in BUFS]


@pytest.mark.parametrize("kernel", [TW, "emulated-tensorwise-e4m3"])
def test_the_first_training_call_is_the_dynamic_one_and_seeds_the_estimates(kernel):
    ref, lin, ops = _pair(LinearConfig(kernel, kernel, kernel))
    assert ops == ("x", "w", "dy")
    x, g = torch.randn(32, 64) * 3, torch.randn(32, 48) * 0.01
    for a, b in zip(_step(ref, x, g), _step(lin, x, g)):
        assert torch.equal(a, b)
    assert _est(lin) == pytest.approx([x.abs().max().item(), lin.weight.abs().max().item(),
                                       g.abs().max().item()], rel=1e-6)


def test_later_calls_quantize_with_the_estimates_against_a_float64_reference():
    _, lin, _ = _pair()
    torch.manual_seed(1)
    x0, g0 = torch.randn(32, 64), torch.randn(32, 48)
    _step(lin, x0, g0)
    ex, ew, eg = (lin._buffers[n].clone() for n in BUFS)
    x, g = torch.randn(32, 64) * 1.5, torch.randn(32, 48) * 1.5
    y, dx, dw = _step(lin, x, g)
    # the same GEMMs in float64 on the FP8 operands made with the step-1 estimates
    qx, qw, qg = (dequantize(quantize_delayed(t, e, E4M3), torch.float64)
                  for t, e in ((x, ex), (lin.weight.detach(), ew), (g, eg)))
    y_ref = qx @ qw.t() + lin.bias.detach().double()
    for got, want in ((y, y_ref), (dx, qg @ qw), (dw, qg.t() @ qx)):
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item() + 1e-6, err
    # and the FP8 error against the unquantized float64 product is FP8's, not worse
    exact = x.double() @ lin.weight.detach().double().t() + lin.bias.detach().double()
    assert sqnr(y.double(), exact) > 25.0
    # the estimates moved to this call's amax
    assert _est(lin)[0] == pytest.approx(x.abs().max().item(), rel=2 ** -4)
    assert _est(lin)[2] == pytest.approx(g.abs().max().item(), rel=2 ** -4)


def test_a_jump_saturates_one_call_and_the_estimate_catches_up():
    _, lin, _ = _pair()
    g = torch.randn(16, 48)
    _step(lin, torch.randn(16, 64), g)
    big = torch.randn(16, 64) * 40  # far beyond HEADROOM x the estimate
    y, _, _ = _step(lin, big, g)
    fit = []
    for _ in range(20):  # grows x4, x16 ... per saturated call, then decays x0.9 to the amax
        _step(lin, big, g)
        fit.append(HEADROOM * _est(lin)[0] >= big.abs().max().item())
    assert fit.index(True) <= 2 and all(fit[fit.index(True):])
    assert _est(lin)[0] == pytest.approx(big.abs().max().item(), rel=2 ** -4)
    ref = Linear(64, 48, config=ALL_TW)
    ref.load_state_dict(lin.state_dict())
    exact = _step(ref, big, g)[0]  # dynamic scaling of the same call
    assert sqnr(_step(lin, big, g)[0], exact) > 25.0  # once caught up, as good as dynamic
    assert sqnr(y, exact) < sqnr(_step(lin, big, g)[0], exact)  # the saturated call was worse


def test_non_finite_input_gives_non_finite_output_and_keeps_the_estimates():
    _, lin, _ = _pair()
    g = torch.randn(8, 48)
    _step(lin, torch.randn(8, 64), g)
    before = _est(lin)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(8, 64)
        x[3, 5] = bad
        y, _, _ = _step(lin, x, g)
        assert not bool(torch.isfinite(y[3]).all()) and bool(torch.isfinite(y[:3]).all())
        assert _est(lin)[0] == before[0]


def test_which_operands_each_plan_of_kernels_delays():
    B = loka.config.BASELINE
    k = lambda name: get(name)
    assert delayed_formats((k(TW), k(TW), k(TW))) == ("e4m3", "e4m3", "e4m3")
    # a rowwise reader of an operand keeps it dynamic; baseline roles read nothing in FP8
    assert delayed_formats((k(TW), k(B), k("cublas-rowwise"))) == (None, "e4m3", None)
    assert delayed_formats((k(TW), k(B), k(B))) == ("e4m3", "e4m3", None)
    # e5m2 gradients: dy in e5m2, x and W in e4m3
    e5 = k("cublas-tensorwise-e5m2")
    assert delayed_formats((k(TW), e5, e5)) == ("e4m3", "e4m3", "e5m2")
    assert delayed_formats((k(B), k(B), k(B))) == (None, None, None)
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    _, lin, ops = _pair(LinearConfig(rw, rw, rw))
    assert ops == ()  # nothing to delay: the Linear is the dynamic one, bit for bit
    ref = Linear(64, 48, config=LinearConfig(rw, rw, rw))
    ref.load_state_dict(lin.state_dict())
    x, g = torch.randn(8, 64), torch.randn(8, 48)
    for _ in range(2):
        for a, b in zip(_step(ref, x, g), _step(lin, x, g)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", [TW, "torchao-tensorwise", "emulated-tensorwise-e4m3"])
def test_a_one_output_linear_takes_its_one_row_weight_gradient_operand(kernel):
    """out_features = 1: the weight gradient's a operand, dyᵀ, has one row; the transpose
    of the FP8 dy is a (1, M) view whose row stride is 1, which _scaled_mm refuses unless
    it is laid out again."""
    if kernel.startswith("torchao"):
        pytest.importorskip("torchao")
    torch.manual_seed(0)
    cfg = LinearConfig(loka.config.BASELINE, loka.config.BASELINE, kernel)
    lin = Linear(64, 1, config=cfg)
    lin.set_delayed_scaling(0.9)
    x, g = torch.randn(32, 64), torch.randn(32, 1)
    torch._dynamo.reset()
    compiled = torch.compile(lin, fullgraph=True)  # the layout check is the compiled one's
    for _ in range(3):
        (compiled(x) * g).sum().backward()
        dw = lin.weight.grad.clone()
        lin.weight.grad = lin.bias.grad = None
    torch._dynamo.reset()
    exact = g.double().t() @ x.double()
    assert sqnr(dw.double(), exact) > 25.0


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
def test_on_a_simulated_gpu_a_one_row_weight_gradient_operand_is_laid_out_row_major():
    """The CUDA _scaled_mm (its meta function, which Inductor traces) refuses an a operand
    whose row stride is not its width; the transpose of an (M, 1) FP8 dy is such a view."""
    from loka.bench.stepcode import cuda_step_code, inventory
    torch.manual_seed(0)
    lin = Linear(64, 1, config=LinearConfig(loka.config.BASELINE, loka.config.BASELINE, TW),
                 dtype=torch.bfloat16)
    lin.set_delayed_scaling(0.9)
    lin.seed_delayed(1.0, 1.0, 1.0)
    codes = cuda_step_code(lin, (torch.randn(256, 64, dtype=torch.bfloat16),), train=True)
    launches = [launch for code in codes for launch in inventory(code)]
    assert sum(l.kind == "gemm_fp8" for l in launches) == 1  # the weight gradient


def test_e5m2_gradients_are_delayed_in_e5m2():
    cfg = LinearConfig(TW, "cublas-tensorwise-e5m2", "cublas-tensorwise-e5m2")
    _, lin, ops = _pair(cfg)
    assert ops == ("x", "w", "dy")
    g = torch.randn(8, 48) * 1e-3
    for _ in range(3):
        _step(lin, torch.randn(8, 64), g)
    assert _est(lin)[2] == pytest.approx(g.abs().max().item(), rel=2 ** -2)


def test_state_off_switch_evaluation_and_bad_values():
    ref, lin, _ = _pair()
    assert list(lin.state_dict()) == ["weight", "bias"]  # the estimates are not saved
    lin.seed_delayed(70000.0, 1.0 + 2 ** -12, 3.0)
    lin.half()  # the states keep their float32 values (fp16 would make 70000 inf)
    assert all(b.dtype == torch.float32 for n, b in lin.named_buffers() if "delayed" in n)
    assert _est(lin) == [70000.0, 1.0 + 2 ** -12, 3.0]
    lin.to(torch.bfloat16)
    assert _est(lin) == [70000.0, 1.0 + 2 ** -12, 3.0]
    lin.float()
    lin.set_delayed_scaling(0.9)
    ref.load_state_dict(lin.state_dict())  # the bf16 round trip rounded the weights
    x, g = torch.randn(8, 64), torch.randn(8, 48)
    _step(lin, x, g)
    before = _est(lin)
    with torch.no_grad():  # evaluation: dynamic scaling, estimates untouched
        assert torch.equal(lin(x * 9), ref(x * 9))
    assert _est(lin) == before
    lin.eval()  # so is a forward in eval mode with gradients on
    assert torch.equal(lin(x * 9), ref(x * 9))
    assert _est(lin) == before
    lin.train()
    assert lin.set_delayed_scaling(None) == ()
    assert not any("delayed" in n for n, _ in lin.named_buffers())
    for a, b in zip(_step(ref, x * 5, g), _step(lin, x * 5, g)):
        assert torch.equal(a, b)
    for bad in (0.0, 1.5, -1, True, "0.9"):
        with pytest.raises(ValueError, match="decay"):
            lin.set_delayed_scaling(bad)
    with pytest.raises(ValueError, match="set_delayed_scaling"):
        lin.seed_delayed(1.0, 1.0, 1.0)
    lin.set_delayed_scaling(0.5)
    with pytest.raises(ValueError, match="finite and positive"):
        lin.seed_delayed(1.0, float("nan"), 1.0)
    lin.seed_delayed(2.0, 3.0, 4.0)
    assert _est(lin) == [2.0, 3.0, 4.0] and lin.delayed_state() == {"x": 2.0, "w": 3.0, "dy": 4.0}
    plain = lin.to_linear()
    assert type(plain) is nn.Linear and not any("delayed" in n for n, _ in plain.named_buffers())
    # wrapped again, a loka.Linear that had delayed scaling starts without it
    again = Linear.from_linear(lin, ALL_TW)
    assert again.delayed_decay is None and not any("delayed" in n for n, _ in again.named_buffers())


def test_seeded_estimates_skip_the_dynamic_first_call():
    _, lin, _ = _pair()
    lin.seed_delayed(1.0, 1.0, 1.0)
    x = torch.randn(8, 64) * 0.1
    y, _, _ = _step(lin, x, torch.randn(8, 48))
    qx = dequantize(quantize_delayed(x, torch.tensor(1.0), E4M3), torch.float64)
    qw = dequantize(quantize_delayed(lin.weight.detach(), torch.tensor(1.0), E4M3), torch.float64)
    want = qx @ qw.t() + lin.bias.detach().double()
    assert (y.double() - want).abs().max().item() < 1e-5


def _dynamic_pair(config):
    torch.manual_seed(0)
    ref = Linear(64, 48, config=config)
    lin = Linear(64, 48, config=config)
    lin.load_state_dict(ref.state_dict())
    lin.set_delayed_scaling(0.9)
    return ref, lin


def _close(a, b, db=20.0):
    return sqnr(a.double(), b.double()) > db


@pytest.mark.parametrize("case", ["guard first", "forward without backward",
                                  "non-finite first", "all-zero first", "two forwards"])
def test_no_first_call_leaves_an_operand_without_a_usable_estimate(case):
    """Whatever the first training call is, the later calls' outputs and gradients come
    within FP8 error of dynamic scaling: from the second call where x and W were seeded
    (the Guard's step, two forwards), within seven where dy was not (no backward, or a dy
    that said nothing: it grows from the smallest estimate, saturation being visible)."""
    from loka.dispatch.linear import SiteMonitor
    cfg = LinearConfig(loka.config.BASELINE, TW, TW)  # bf16 forward, FP8 gradients
    ref, lin = _dynamic_pair(cfg)
    torch.manual_seed(3)
    x, g = torch.randn(32, 64) * 5, torch.randn(32, 48) * 1e-3
    if case == "guard first":  # the Guard checks the first step: x is saved, not cast
        lin.monitor = SiteMonitor()
        lin.monitor.arm(torch.device("cpu"))
        _step(lin, x, g)
        lin.monitor.disarm()
    elif case == "forward without backward":
        lin(x.clone().requires_grad_())
    elif case == "non-finite first":
        bad = g.clone()
        bad[0, 0] = float("inf")
        _step(lin, x, bad)
    elif case == "all-zero first":
        _step(lin, x, torch.zeros_like(g))
    else:  # two forwards, one backward of their sum
        xa = x.clone().requires_grad_()
        ((lin(xa) + lin(xa)) * g).sum().backward()
        lin.weight.grad = lin.bias.grad = None
    worst = []
    for step in range(10):
        got, want = _step(lin, x, g), _step(ref, x, g)
        worst.append(min(sqnr(a.double(), b.double()) for a, b in zip(got[1:], want[1:])))
    settled = 2 if case in ("guard first", "two forwards") else 7
    assert all(w > 20.0 for w in worst[settled:]), worst
    assert all(math.isfinite(e) and e > 0 for e in _est(lin))


def test_apply_and_unapply_manage_delayed_scaling_on_linears_already_planned():
    torch.manual_seed(0)
    net = Net()
    plan = Plan.uniform(net, TW)
    loka.apply(net, plan)
    loka.unapply(net)
    # an existing loka.Linear on the plan's kernels ("keep") is turned on, and back off
    net.a = Linear.from_linear(net.a, ALL_TW)
    report = loka.apply(net, plan, delayed_scaling=True)
    assert net.a.delayed_decay == 0.9 and net.b.delayed_decay == 0.9
    assert any("on 2 of 2 site(s)" in n for n in report.notes)
    loka.apply(net, plan, delayed_scaling=False)
    assert net.a.delayed_decay is None and net.b.delayed_decay is None
    loka.apply(net, plan, delayed_scaling=0.5)
    loka.unapply(net)
    assert isinstance(net.a, Linear) and net.a.delayed_decay is None  # as it was before
    assert type(net.b) is nn.Linear
    net.a.set_delayed_scaling(0.7)
    loka.apply(net, plan, delayed_scaling=0.5)
    loka.unapply(net)
    assert net.a.delayed_decay == 0.7


def test_repeated_applies_aliases_and_unapply_restore_each_linears_own_setting():
    torch.manual_seed(0)
    net = Net()
    net.a = Linear.from_linear(net.a, ALL_TW)
    net.b = Linear.from_linear(net.b, ALL_TW)
    plan = Plan.uniform(net, TW)  # every site "keep": the Linears are on its kernels already
    loka.apply(net, plan, delayed_scaling=0.9)
    loka.apply(net, plan, delayed_scaling=0.5)  # the second apply undoes the first first
    loka.unapply(net)
    assert net.a.delayed_decay is None and net.b.delayed_decay is None
    # unchanged by apply: its estimates are left as they were by apply and unapply
    net.a.set_delayed_scaling(0.5)
    net.a.seed_delayed(3.0, 4.0, 5.0)
    loka.apply(net, plan, delayed_scaling=0.5)
    loka.unapply(net)
    assert net.a.delayed_decay == 0.5 and net.a.delayed_state() == {"x": 3.0, "w": 4.0, "dy": 5.0}


def test_a_linear_under_two_names_is_set_once_and_restored():
    torch.manual_seed(0)
    net = Net()
    net.a = Linear.from_linear(net.a, ALL_TW)
    net.c = net.a  # the same module at two paths
    d = Plan.uniform(net, TW).to_dict()  # Plan.uniform names a shared module once; a
    d["sites"]["c"] = dict(d["sites"]["a"], name="c")  # hand-made plan may name both
    plan = Plan.from_dict(d)
    report = loka.apply(net, plan, delayed_scaling=0.9)
    assert net.c.delayed_decay == 0.9
    assert any("on 2 of 2 site(s)" in n for n in report.notes)  # a (= c) and b
    loka.unapply(net)
    assert net.a.delayed_decay is None and net.c is net.a


def test_to_empty_from_the_meta_device_starts_the_state_afresh():
    with torch.device("meta"):
        lin = Linear(64, 48, config=ALL_TW)
    lin.set_delayed_scaling(0.9)
    lin.to_empty(device="cpu")
    assert lin._delayed_ready is False
    assert all(v == pytest.approx(1e-12) for v in lin.delayed_state().values())


def test_a_bad_delayed_scaling_set_on_a_plan_is_refused_before_anything_changes(tmp_path):
    net = Net()
    plan = Plan.uniform(net, TW)
    for bad in (True, 2.0, "0.9"):
        plan.delayed_scaling = bad
        with pytest.raises(ValueError, match="delayed_scaling"):
            loka.apply(net, plan)
        assert type(net.a) is nn.Linear and loka.dispatch.applied_plan(net) is None
        with pytest.raises(ValueError, match="delayed_scaling"):
            plan.save(tmp_path / "bad.json")
        assert not (tmp_path / "bad.json").exists()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _planned(delayed):
    torch.manual_seed(0)
    net = Net()
    report = loka.apply(net, Plan.uniform(net, TW), delayed_scaling=delayed)
    return net, report


def test_apply_says_when_this_torchs_inductor_keeps_an_amax_pass(monkeypatch):
    from loka.dispatch import swap
    from loka.numerics.delayed import inductor_fuses_the_estimate
    assert not inductor_fuses_the_estimate("2.11.0+cu130")
    assert not inductor_fuses_the_estimate("2.12.0a0+git1234")
    assert inductor_fuses_the_estimate("2.13.0+cpu") and inductor_fuses_the_estimate("3.0")
    assert inductor_fuses_the_estimate("nightly")  # unreadable: no claim
    for fuses in (True, False):
        monkeypatch.setattr(swap, "inductor_fuses_the_estimate", lambda: fuses)
        _, report = _planned(True)
        said = [n for n in report.notes if "reduction of its own" in n]
        assert len(said) == (0 if fuses else 1)
        _, report = _planned(False)  # nothing delayed: nothing to say
        assert not any("reduction of its own" in n for n in report.notes)


def test_apply_turns_it_on_and_says_so():
    net, report = _planned(True)
    assert any("delayed scaling (decay 0.9) on 2 of 2 site(s), 6 operand(s)" in n
               for n in report.notes)
    assert net.a.delayed_decay == 0.9
    net2, _ = _planned(0.5)
    assert net2.b.delayed_decay == 0.5
    with pytest.raises(ValueError, match="for training"):
        loka.apply(Net(), Plan.uniform(Net(), TW), inference=True, delayed_scaling=True)
    for bad in (2.0, 0, "yes"):
        with pytest.raises(ValueError, match="delayed_scaling"):
            loka.apply(Net(), Plan.uniform(Net(), TW), delayed_scaling=bad)
    loka.unapply(net)
    assert type(net.a) is nn.Linear


def test_the_plan_carries_delayed_scaling_and_apply_can_override_it(tmp_path):
    torch.manual_seed(0)
    net = Net()
    plan = Plan.uniform(net, TW)
    assert plan.delayed_scaling is None and "delayed_scaling" not in plan.to_dict()
    plan.delayed_scaling = 0.8
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.delayed_scaling == 0.8 and loaded.copy().delayed_scaling == 0.8
    assert "decay 0.8" in loaded.summary()
    loka.apply(net, loaded)
    assert net.a.delayed_decay == net.b.delayed_decay == 0.8
    loka.apply(net, loaded, delayed_scaling=False)  # the caller's word wins
    assert net.a.delayed_decay is None
    loka.apply(net, loaded, delayed_scaling=0.3)
    assert net.a.delayed_decay == 0.3
    loka.apply(net, loaded, inference=True)  # a training option: serving ignores it
    assert net.a.delayed_decay is None
    loka.unapply(net)
    for bad in (1.5, 0, -0.1, "0.5", True):
        d = loaded.to_dict()
        d["delayed_scaling"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(loka.jsonio.ReportError, match="delayed_scaling"):
            Plan.load(path)
    with pytest.raises(ValueError, match="delayed_scaling"):
        Plan(delayed_scaling=2.0)


def test_compiled_steps_equal_eager_ones_with_one_recompile():
    import torch._dynamo.utils as dynamo_utils
    torch._dynamo.reset()
    net, _ = _planned(True)
    eager = copy.deepcopy(net)
    compiled = torch.compile(net, fullgraph=True)
    dynamo_utils.counters.clear()
    for step in range(4):
        x = torch.randn(32, 64) * (1 + step)
        lc = compiled(x).square().mean()
        lc.backward()
        le = eager(x).square().mean()
        le.backward()
        assert torch.equal(lc.detach(), le.detach())
        assert torch.equal(net.a.weight.grad, eager.a.weight.grad)
        assert _est(net.b) == _est(eager.b)
        net.zero_grad()
        eager.zero_grad()
    # the first call (dynamic, seeding) and the delayed ones: two graphs, no more
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


class Tower(nn.Module):
    """x -> Linear -> own norm -> Linear -> Hard Swish -> Linear (user classes, no LoKA)."""

    def __init__(self, width=256):
        super().__init__()
        self.l1, self.l2, self.l3 = (nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.l1(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.l3(nn.functional.hardswish(self.l2(h)))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="Inductor before torch 2.13 reads the operand again for the new "
                           "estimate (a reduction of its own; bench/BENCHMARKS.md, Delayed scaling)")
def test_on_a_simulated_gpu_no_amax_pass_precedes_a_delayed_cast():
    """Dynamic tensorwise: each quantized operand is read once for its amax and again by its
    cast. Delayed: the cast needs no amax first, so no launch reads an operand without
    writing its FP8 copy, and the step moves fewer bytes in fewer launches."""
    from loka.bench.stepcode import cuda_step_code, inventory
    width, rows = 256, 512
    whole = rows * width * 2  # one bf16 operand

    def launches(delayed):
        torch.manual_seed(0)
        model = Tower(width).to(torch.bfloat16)
        loka.apply(model, Plan.uniform(model, TW), delayed_scaling=delayed)
        if delayed:
            for mod in (model.l1, model.l2, model.l3):
                mod.seed_delayed(1.0, 1.0, 1.0)
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        codes = cuda_step_code(model, (x,), train=True)
        return [launch for code in codes for launch in inventory(code)]

    dynamic, delayed = launches(False), launches(True)

    def amax_only(ls):  # reads at least a whole operand and writes almost nothing
        return [l.name for l in ls if l.kind == "inductor" and l.bytes_read >= whole / 2
                and l.bytes_written < l.bytes_read / 16]

    assert len(amax_only(dynamic)) >= 3, [l.name for l in dynamic]
    assert amax_only(delayed) == [], [l.name for l in delayed]
    assert sum(l.kind == "gemm_fp8" for l in delayed) == 8  # 3 x 3, less l1's dgrad (x: no grad)
    non_gemm = lambda ls: sum(l.bytes for l in ls if not l.kind.startswith("gemm"))
    assert non_gemm(delayed) < non_gemm(dynamic)
    assert len(delayed) < len(dynamic)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs, cuBLAS FP8)")
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_on_a_gpu_compiled_and_graphed_steps_follow_the_eager_ones(mode):
    """On a GPU, compiled (and CUDA-graphed: the estimates are buffers updated in the
    forward and in the backward) delayed steps track the eager model: loss and weight
    gradients within FP8 rounding of each other, estimates within 12% (a decay step and
    rounding), and both within 10%
    of a float64 reference of the same weights."""
    torch.manual_seed(0)
    ref = Tower(256).double().cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    loka.apply(model, Plan.uniform(model, "cublas-tensorwise-fastacc"), delayed_scaling=True)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    compiled = torch.compile(model, mode=mode)
    for step in range(5):
        x = torch.randn(512, 256, device="cuda", dtype=torch.float64) * (1 + step)
        if mode:
            torch.compiler.cudagraph_mark_step_begin()
        lc = compiled(x.bfloat16()).float().square().mean()
        lc.backward()
        le = eager(x.bfloat16()).float().square().mean()
        le.backward()
        lr = ref(x).square().mean()
        lr.backward()
        assert abs(float(lc) - float(le)) <= 0.02 * float(le), step
        assert abs(float(le) - float(lr)) <= 0.1 * float(lr), step
        for mine, theirs, exact in ((model.l2.weight.grad, eager.l2.weight.grad, ref.l2.weight.grad),):
            assert float((mine.double() - theirs.double()).norm() / theirs.double().norm()) < 0.05
            assert float((theirs.double() - exact).norm() / exact.norm()) < 0.1
        # (rounding may put one at max(seen, decay * estimate)'s other branch: one decay
        # step, 10%, apart, and the FP8 rounding of what each saw on top)
        for a, b in zip(_est(model.l2), _est(eager.l2)):
            assert a == pytest.approx(b, rel=0.12), step
        for m in (model, eager, ref):
            m.zero_grad(set_to_none=True)
    assert _est(model.l2)[0] > 1.0  # a live estimate of a normalized activation's amax
    # the buffer updates did not turn CUDA graphs off
    assert sum(counters["inductor"].get(k, 0) for k in counters["inductor"]
               if "cudagraph_skip" in k) == 0, dict(counters["inductor"])
    torch._dynamo.reset()
