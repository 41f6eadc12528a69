import pytest
import torch
from torch import nn

import loka
from loka.config import LinearConfig, Role
from loka.dispatch import Plan, PlanMismatchError
from loka.dispatch.swap import ApplyReport, applied_plan, check
from loka.kernels.registry import get
from loka.numerics import sqnr
from tests.support import need_kernel

KERNELS = ["emulated-rowwise-e4m3", "emulated-tensorwise-e4m3", "cublas-rowwise",
           "cublas-tensorwise"]


class Tower(nn.Module):
    """Two MLP branches and a logit: (B, 64) -> (B, 1)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.user = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.item = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.logit = nn.Linear(64, 1)
        self.to(dtype)

    def forward(self, x):
        return self.logit(torch.relu(self.user(x)) + self.item(x))


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_state(model, snap):
    sd = model.state_dict()
    return list(sd) == list(snap) and all(torch.equal(sd[k], snap[k]) for k in snap)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_and_unapply_keep_the_state_dict(kernel, dtype):
    need_kernel(kernel)
    model = Tower(dtype)
    snap = _snapshot(model)
    params = {n: id(p) for n, p in model.named_parameters()}
    p = Plan.uniform(model, kernel)
    report = loka.apply(model, p)
    assert isinstance(report, ApplyReport)
    assert sorted(report.changed) == ["item.0", "logit", "user.0", "user.2"]
    assert all(isinstance(model.get_submodule(s), loka.Linear) for s in report.changed)
    assert model.user[0].config == LinearConfig.uniform(kernel)
    assert model.logit.config == LinearConfig("bf16", "bf16", kernel)  # N=1: fwd/dgrad stay
    assert _same_state(model, snap)
    assert {n: id(p) for n, p in model.named_parameters()} == params
    x = torch.randn(32, 64, dtype=dtype)
    model(x).sum().backward()  # runs on the FP8 kernels
    assert loka.unapply(model) and applied_plan(model) is None
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert _same_state(model, snap)
    assert {n: id(p) for n, p in model.named_parameters()} == params


@pytest.mark.parametrize("kernel", ["emulated-rowwise-e4m3", "cublas-tensorwise"])
def test_applied_model_runs_fp8_numerics(kernel):
    model = Tower()
    x = torch.randn(64, 64)
    with torch.no_grad():
        ref = model.user[0](x).double()
        loka.apply(model, Plan.uniform(model, kernel))
        got = model.user[0](x)
    assert 22 < sqnr(got, ref) < 45  # FP8 e4m3 error: far above fp32's, well below noise


def test_optimizer_built_before_apply_keeps_training_the_model():
    torch.manual_seed(1)
    model = Tower()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"))
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    losses = []
    for _ in range(5):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(torch.isfinite(torch.tensor(losses)))


def test_hooks_survive_apply_and_unapply():
    model = Tower()
    seen = []
    handle = model.user[0].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    pre = model.user[0].register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"))
    model(torch.randn(4, 64))
    loka.unapply(model)
    model(torch.randn(4, 64))
    assert seen == ["Linear", "Linear"] and type(model.user[0]) is nn.Linear
    handle.remove()
    pre.remove()
    model(torch.randn(4, 64))
    assert len(seen) == 2


def test_all_baseline_sites_are_left_alone_and_reported_as_kept():
    model = Tower()
    p = Plan.uniform(model, "emulated-rowwise-e4m3", module_filter="^user")
    p.sites["user.2"].roles = {}  # a site the plan keeps on bf16
    report = loka.apply(model, p)
    assert report.changed == ["user.0"]
    assert [c.action for c in report.changes] == ["swap", "keep"]
    assert type(model.user[2]) is nn.Linear and type(model.item[0]) is nn.Linear
    assert "swap" in report.summary() and "user.0" in report.summary()


def test_wrong_model_is_a_clear_error_naming_the_sites():
    p = Plan.uniform(Tower(), "emulated-rowwise-e4m3")
    other = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(PlanMismatchError, match=r"4 site\(s\) not in the model: user\.0, "
                                                 r"user\.2, item\.0, logit"):
        loka.apply(other, p)
    resized = Tower()
    resized.user[2] = nn.Linear(128, 32)
    with pytest.raises(PlanMismatchError, match=r"shape mismatch: user\.2 \(plan 128->64, "
                                                r"model 128->32\)"):
        loka.apply(resized, p)
    assert type(resized.user[0]) is nn.Linear  # nothing was applied
    renamed = Tower()
    renamed.user[0] = nn.ReLU()
    with pytest.raises(PlanMismatchError, match=r"user\.0 \(a ReLU, not an nn.Linear\)"):
        check(renamed, p)


def test_non_strict_apply_skips_mismatched_sites():
    p = Plan.uniform(Tower(), "emulated-rowwise-e4m3")
    model = Tower()
    model.user[2] = nn.Linear(128, 32)
    report = loka.apply(model, p, strict=False)
    assert report.skipped == {"user.2": "plan 128->64, model 128->32"}
    assert isinstance(model.user[0], loka.Linear) and type(model.user[2]) is nn.Linear


def test_subclass_with_its_own_forward_is_not_swapped():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = Tower()
    model.logit = Scaled(64, 1)
    p = Plan.uniform(Tower(), "emulated-rowwise-e4m3")
    with pytest.raises(PlanMismatchError, match="logit .a Scaled, not an nn.Linear"):
        loka.apply(model, p)


def test_kernels_that_cannot_run_on_the_model_device_are_refused():
    model = Tower()
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    p.sites["user.0"].roles[Role.FWD].kernel = "cublas-tensorwise-fastacc"
    with pytest.raises(PlanMismatchError, match="user.0 .cublas-tensorwise-fastacc: fast accum"):
        loka.apply(model, p)
    p.sites["user.0"].roles[Role.FWD].kernel = "no-such-kernel"
    with pytest.raises(PlanMismatchError, match="no kernel named 'no-such-kernel'"):
        loka.apply(model, p)
    report = loka.apply(model, p, strict=False)
    assert "user.0" in report.skipped and type(model.user[0]) is nn.Linear


def test_check_is_a_dry_run():
    model = Tower()
    snap = _snapshot(model)
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    changes = check(model, Plan.uniform(model, rw))
    assert [(c.site, c.action) for c in changes] == [
        ("user.0", "swap"), ("user.2", "swap"), ("item.0", "swap"), ("logit", "swap")]
    assert changes[0].before is None and changes[0].after == LinearConfig.uniform(rw)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert _same_state(model, snap) and not hasattr(model, "_loka_dispatch")
    assert loka.dispatch.check is check  # the CLI's spelling


def test_reapply_replaces_the_previous_plan():
    model = Tower()
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"))
    second = Plan.uniform(model, "cublas-tensorwise", module_filter="^item")
    changes = check(model, second)
    assert [(c.site, c.action, c.before) for c in changes] == [("item.0", "swap", None)]
    loka.apply(model, second)
    assert model.item[0].config == LinearConfig.uniform("cublas-tensorwise")
    assert type(model.user[0]) is nn.Linear  # the first plan was undone
    assert applied_plan(model) is second


def test_shared_module_is_swapped_once_at_every_name():
    model = Tower()
    model.shared = model.user[0]  # one module, two names
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3", module_filter=r"^user\.0$"))
    assert model.shared is model.user[0] and isinstance(model.shared, loka.Linear)
    loka.unapply(model)
    assert model.shared is model.user[0] and type(model.shared) is nn.Linear


def test_existing_loka_linear_is_reconfigured_and_restored():
    model = Tower()
    model.item[0] = loka.Linear.from_linear(model.item[0], LinearConfig(fwd="cublas-rowwise"))
    report = loka.apply(model, Plan.uniform(model, "emulated-tensorwise-e4m3"))
    assert {c.site: c.action for c in report.changes}["item.0"] == "reconfigure"
    assert model.item[0].config == LinearConfig.uniform("emulated-tensorwise-e4m3")
    loka.unapply(model)
    assert isinstance(model.item[0], loka.Linear)
    assert model.item[0].config == LinearConfig(fwd="cublas-rowwise")


def test_root_linear_cannot_be_replaced():
    lin = nn.Linear(64, 64)
    p = Plan.uniform(lin, "emulated-rowwise-e4m3")
    assert list(p.sites) == [""]
    with pytest.raises(PlanMismatchError, match="root Linear"):
        loka.apply(lin, p)


def test_bad_arguments():
    model = Tower()
    p = Plan.uniform(model, "emulated-rowwise-e4m3")
    with pytest.raises(TypeError, match="loka.Plan"):
        loka.apply(model, p.to_dict())
    with pytest.raises(ValueError, match="inference=True"):
        loka.apply(model, p, drop_weights=True)
    with pytest.raises(KeyError, match="not in the plan: nope"):
        loka.apply(model, p, inference=True, static_scales={"nope": 1.0})
    with pytest.raises(ValueError, match="finite positive"):
        loka.apply(model, p, inference=True, static_scales={"user.0": float("nan")})
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_a_bad_plan_changes_nothing_not_even_an_applied_one():
    model = Tower()
    first = Plan.uniform(model, "emulated-rowwise-e4m3")
    loka.apply(model, first)
    bad = first.copy()
    # N=1 cannot align (a kernel of this CPU: torch 2.11 has no rowwise one here)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "cublas-tensorwise"
    bad.sites["logit"].roles[Role.FWD].kernel = rw
    with pytest.raises(ValueError, match="multiples of 16"):
        loka.apply(model, bad)
    assert applied_plan(model) is first
    assert model.user[0].config == LinearConfig.uniform("emulated-rowwise-e4m3")
