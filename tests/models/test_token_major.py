"""ModsConfig.token_major: Wukong's token-axis Linears as W @ X give the function of the
transposed path, forward and backward, merged or not, with a residual projection or not,
and with Linears a plan or a Mod has swapped."""

import dataclasses

import pytest
import torch

import loka
import loka.models as M
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.dispatch import Plan
from loka.models.presets import feature_spec
from loka.models.wukong import token_linear

MODS = ModsConfig.paper()


def _pair(merge: bool, **overrides):
    """The same weights built transposed and token-major (float64)."""
    torch.manual_seed(0)
    plain = M.build("wukong", "tiny", mods=dataclasses.replace(MODS, merge_siblings=merge),
                    **overrides).double()
    tm = M.build("wukong", "tiny", mods=dataclasses.replace(MODS, merge_siblings=merge,
                                                            token_major=True), **overrides).double()
    tm.load_state_dict(plain.state_dict())
    return plain, tm


def _batch(model, n=32, seed=0):
    return SyntheticCTR(model.feature_spec, n, seed=seed).batch(0)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("overrides", [{}, {"num_fm": 3, "num_lcb": 2}])  # 2nd: residual Linear
def test_token_major_is_the_same_function(merge, overrides):
    plain, tm = _pair(merge, **overrides)
    assert tm.layers[0].token_major and not plain.layers[0].token_major
    assert list(tm.state_dict()) == list(plain.state_dict())
    if overrides:
        assert tm.layers[0].residual is not None or tm.layers[0].merged is not None
    batch = _batch(plain)
    y0, y1 = plain(batch), tm(batch)
    torch.testing.assert_close(y1, y0, rtol=1e-10, atol=1e-12)
    y0.square().sum().backward()
    y1.square().sum().backward()
    for (name, p0), p1 in zip(plain.named_parameters(), tm.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_blocks_alone_are_token_major_too():
    plain, tm = _pair(False)
    x = torch.randn(4, 8, 16, dtype=torch.float64)
    torch.testing.assert_close(tm.layers[0].fmb(x), plain.layers[0].fmb(x))
    torch.testing.assert_close(tm.layers[0].lcb(x), plain.layers[0].lcb(x))


def test_token_linear_with_bias_and_a_swapped_linear():
    lin = torch.nn.Linear(6, 4).double()
    x = torch.randn(3, 6, 5, dtype=torch.float64)
    ref = lin(x.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(token_linear(lin, x), ref, rtol=1e-12, atol=1e-12)

    class Wrapped(torch.nn.Module):  # stands for loka.Linear / PaddedLinear: called on xᵀ
        def __init__(self):
            super().__init__()
            self.inner, self.calls = lin, 0

        def forward(self, t):
            self.calls += 1
            return self.inner(t)
    w = Wrapped()
    torch.testing.assert_close(token_linear(w, x), ref, rtol=1e-12, atol=1e-12)
    assert w.calls == 1


def test_a_plan_on_the_merged_linear_takes_the_transposed_path():
    """FP8 (emulated) on every Linear: the swapped merged GEMM runs as itself, and the
    token-major model still computes what the transposed one does with the same plan."""
    # widths that are multiples of 16, so that the n-axis GEMMs can take FP8
    plain, tm = _pair(True, features=feature_spec(16, 16, 100, (1, 2)), num_fm=16,
                      num_lcb=16, fm_rank=16)
    plain, tm = plain.float(), tm.float()
    plan = Plan.uniform(plain, "emulated-rowwise-e4m3")
    assert "layers.0.merged.linear" in plan.fp8_sites()
    loka.apply(plain, plan)
    loka.apply(tm, plan)
    assert isinstance(tm.layers[0].merged.linear, loka.Linear)
    batch = _batch(plain)
    torch.testing.assert_close(tm(batch), plain(batch), rtol=1e-5, atol=1e-6)


def test_convert_switches_an_existing_model_and_says_so():
    torch.manual_seed(0)
    model = M.build("wukong", "tiny", mods=MODS)
    before = model(_batch(model))
    report = loka.mods.convert(model, ModsConfig(token_major=True))
    switched = sorted(c.fqn for c in report.changes)
    assert switched == sorted([f"layers.{i}" for i in range(2)] + [f"layers.{i}.fmb" for i in range(2)]
                              + [f"layers.{i}.lcb" for i in range(2)])
    assert all(m.token_major for m in model.modules() if hasattr(m, "token_major"))
    torch.testing.assert_close(model(_batch(model)), before, rtol=1e-5, atol=1e-6)
    assert loka.mods.convert(model, ModsConfig(token_major=True)).changes == ()  # idempotent
    dcn = M.build("dcnv2", "tiny")
    assert loka.mods.convert(dcn, ModsConfig(token_major=True)).skipped


def test_token_major_compiles_without_graph_breaks():
    model = M.build("wukong", "tiny", mods=dataclasses.replace(MODS, merge_siblings=True,
                                                               token_major=True))
    explanation = torch._dynamo.explain(model)(_batch(model, 16))
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_token_linear_reads_x_as_it_lies_and_writes_rows_the_norm_reads():
    """The point of the Mod: no copy of x (torch.matmul(W, x) would copy it transposed)
    and an output whose feature rows are contiguous."""
    from torch.profiler import profile

    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(32, 16, 24)
    with profile() as prof:
        y = token_linear(lin, x)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" in ops and not ops & {"aten::copy_", "aten::clone", "aten::contiguous"}
    assert y.shape == (32, 8, 24) and y.is_contiguous()
    with profile() as prof:
        torch.matmul(lin.weight, x)
    assert {e.key for e in prof.key_averages()} & {"aten::copy_", "aten::clone"}  # why not matmul
