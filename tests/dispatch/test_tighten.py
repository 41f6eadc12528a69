"""The end-to-end accuracy budget (loka/dispatch/tighten.py): sites go back to the
baseline, largest contribution first, until the output change is within the bound."""

import pytest
import torch
from torch import nn

import loka
from loka.config import LinearConfig, Role
from loka.dispatch import Plan
from loka.dispatch.tighten import tighten_end_to_end
from loka.kernels import Kernel, get, register, unregister


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


def test_tighten_is_where_the_docs_name_it():
    assert loka.dispatch.tighten_end_to_end is tighten_end_to_end  # the documented spelling
