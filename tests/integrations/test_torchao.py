"""torchao in both directions, on the CPU (torchao's emulate mode): a model torchao
converted is refused by ``loka.apply`` with the call to make, turned back by
``from_torchao`` (same Parameters), probed, planned, applied and trained; a LoKA plan
exported to torchao converts exactly the plan's FP8 sites, with the recipe each role
chose, and computes what LoKA's own FP8 model computes within FP8 error."""

import copy
import math

import pytest
import torch
from torch import nn

import loka
from loka.config import LinearConfig, Role
from loka.dispatch import Plan, PlanMismatchError
from loka.kernels import Kernel, register, unregister
from loka.kernels import get as registry_get
from loka.integrations import describe, from_torchao, is_torchao_linear, to_torchao, torchao_sites

pytest.importorskip("torchao.float8", reason="torchao is not installed")
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from loka.kernels.adapters.torchao import convert_torchao  # noqa: E402


class Tower(nn.Module):
    """A plain dense tower: three GEMMs whose dims are multiples of 16, one that is not."""

    def __init__(self):
        super().__init__()
        self.bottom = nn.Linear(32, 64)
        self.mid = nn.Sequential(nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.mid(torch.relu(self.bottom(x))))).squeeze(-1)


def _model(seed=0):
    torch.manual_seed(seed)
    return Tower()


def _data(n=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4].sum(-1) + 0.3 * torch.randn(n, generator=g) > 0).float()
    return x, y


# -- from torchao -----------------------------------------------------------------------

def test_apply_on_a_torchao_model_names_the_call_to_make():
    model = _model()
    converted = convert_torchao(model, "tensorwise", device="cpu")
    assert converted == ["bottom", "mid.0", "mid.2"]  # head is 32 -> 1: not 16-aligned
    plan = Plan.uniform(_model(), "emulated-rowwise-e4m3", device="cpu")
    for strict in (True, False):  # never skipped silently
        with pytest.raises(PlanMismatchError) as err:
            loka.apply(model, plan, strict=strict)
        msg = str(err.value)
        assert "\n" not in msg and "loka.integrations.from_torchao(model)" in msg
        assert "3 site(s) are torchao Float8Linear modules (bottom, mid.0, mid.2)" in msg


def test_from_torchao_keeps_parameters_hooks_and_names():
    model = _model()
    before = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    seen = []  # what is set on torchao's modules is kept (torchao itself drops both)
    model.mid[0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.mid[0].register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    model.bottom.my_flag = True
    assert torchao_sites(model) == ["bottom", "mid.0", "mid.2", "head"]
    configs = from_torchao(model)
    assert list(configs) == ["bottom", "mid.0", "mid.2", "head"]
    assert all(isinstance(c, Float8LinearConfig) for c in configs.values())
    assert torchao_sites(model) == [] and not any(is_torchao_linear(m) for m in model.modules())
    assert all(type(m) is nn.Linear for m in (model.bottom, model.mid[0], model.mid[2], model.head))
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert model.bottom.my_flag is True
    # the model is the unconverted one again: bit-identical to a fresh copy's forward
    x, _ = _data(8)
    ref = _model()
    ref.load_state_dict(state)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert seen == [torch.Size([8, 64])]  # the hook survived the round trip
    # the optimizer built before still updates the model's weights
    model(x).sum().backward()
    assert seen[1:] == [torch.Size([8, 64]), "backward"]  # a full backward hook runs too
    w0 = model.bottom.weight.detach().clone()
    opt.step()
    assert not torch.equal(w0, model.bottom.weight)


def test_from_torchao_on_a_plain_model_changes_nothing_and_rejects_a_root_float8():
    model = _model()
    assert from_torchao(model) == {}
    lin = nn.Linear(32, 32)
    convert_to_float8_training(nn.Sequential(lin), config=Float8LinearConfig(emulate=True))
    root = convert_to_float8_training(nn.Sequential(nn.Linear(32, 32)),
                                      config=Float8LinearConfig(emulate=True))[0]
    with pytest.raises(ValueError, match="the model itself is a Float8Linear"):
        from_torchao(root)


def test_a_torchao_model_is_probed_planned_applied_and_trained():
    model = _model()
    convert_torchao(model, "rowwise", device="cpu")
    from_torchao(model)
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = loka.ProbeConfig(every_n_steps=2, num_samples=4,
                              kernels=("bf16", "emulated-rowwise-e4m3"))
    loss_f = nn.BCEWithLogitsLoss()
    with loka.Probe(model, config) as probe:
        for i in range(6):
            loss = loss_f(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
            loss.backward()
            opt.step()
            opt.zero_grad()
    report = probe.report()
    assert set(report.sites) >= {"bottom", "mid.0", "mid.2"}
    plan = loka.plan(report, max_error=0.5, assume_fast=True)
    assert set(plan.fp8_sites()) & {"bottom", "mid.0", "mid.2"}
    loka.apply(model, plan)
    assert all(isinstance(model.get_submodule(s), loka.Linear) for s in plan.fp8_sites())
    guard = loka.dispatch.Guard(model, plan, check_every=2)
    losses = []
    for i in range(6):
        loss = loss_f(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
        loss.backward()
        if guard.step(loss):
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert guard.events == [] and all(math.isfinite(v) for v in losses)


# -- to torchao -------------------------------------------------------------------------

def _mixed_plan(model) -> Plan:
    plan = Plan.uniform(model, "bf16", device="cpu")
    roles = {
        "bottom": LinearConfig("emulated-rowwise-e4m3", "emulated-rowwise-e4m3", "bf16"),
        "mid.0": LinearConfig("cublas-tensorwise-fastacc", "cublas-tensorwise-e5m2",
                              "emulated-tensorwise-e5m2"),
        "mid.2": LinearConfig("torchao-rowwise", "torchao-rowwise", "torchao-rowwise"),
    }
    for site, cfg in roles.items():
        for role in Role:
            plan.sites[site].roles[role].kernel = cfg.kernel(role)
    return plan


def test_a_plan_exports_to_the_same_fp8_sites_and_recipes():
    model = _model()
    plan = _mixed_plan(model)
    export = to_torchao(plan, emulate=True)
    assert sorted(export.configs) == sorted(plan.fp8_sites()) == ["bottom", "mid.0", "mid.2"]
    assert describe(export.configs["bottom"]) == {
        "fwd": "rowwise-e4m3", "dgrad": "rowwise-e4m3", "wgrad": "bf16"}
    # mid.0: the output gradient is e5m2 in both gradient GEMMs, the forward fast-accumulates
    assert describe(export.configs["mid.0"]) == {
        "fwd": "tensorwise-e4m3-fastacc", "dgrad": "tensorwise-e5m2", "wgrad": "tensorwise-e5m2"}
    assert describe(export.configs["mid.2"]) == {
        "fwd": "rowwise-e4m3", "dgrad": "rowwise-e4m3", "wgrad": "rowwise-e4m3"}
    assert export.configs["mid.2"].round_scales_to_power_of_2
    assert not export.configs["bottom"].round_scales_to_power_of_2
    assert all(c.emulate for c in export.configs.values())
    fn = export.module_filter_fn()
    assert [n for n, m in model.named_modules() if fn(m, n)] == ["bottom", "mid.0", "mid.2"]
    # the serving side: the forward's granularity per site
    inf = export.inference_configs
    assert sorted(inf) == ["bottom", "mid.0", "mid.2"]
    assert type(inf["bottom"].granularity[0]).__name__ == "PerRow"
    assert type(inf["mid.0"].granularity[0]).__name__ == "PerTensor"
    assert inf["mid.0"].mm_config.use_fast_accum and not inf["bottom"].mm_config.use_fast_accum
    fn = export.module_filter_fn(inference=True)
    assert [n for n, m in model.named_modules() if fn(m, n)] == ["bottom", "mid.0", "mid.2"]

    # converted by torchao: exactly the plan's sites, each with its own recipe
    ao = copy.deepcopy(model)
    assert export.convert(ao) == ["bottom", "mid.0", "mid.2"]
    for site in export.configs:
        assert describe(ao.get_submodule(site).config) == describe(export.configs[site])
    # ... and back: from_torchao returns the very configs, and the plan applies again
    back = from_torchao(ao)
    assert {s: describe(c) for s, c in back.items()} == {
        s: describe(c) for s, c in export.configs.items()}
    report = loka.apply(ao, plan, strict=False)  # mid.0 fast-accumulates: CUDA only
    assert sorted(report.changed) == ["bottom", "mid.2"]
    assert "fast accumulation exists on CUDA" in report.skipped["mid.0"]


def test_torchao_and_loka_compute_the_same_fp8_model():
    """Forward and gradients of the exported torchao model against LoKA's own FP8 model
    and a float64 reference: both within FP8 error of the reference, and of each other."""
    model = _model()
    plan = _mixed_plan(model)
    plan.sites["mid.0"].roles[Role.FWD].kernel = "emulated-tensorwise-e4m3"  # CPU: no fast acc
    plan.sites["mid.0"].roles[Role.DGRAD].kernel = "emulated-tensorwise-e5m2"
    plan.sites["mid.2"].roles[Role.FWD].kernel = "emulated-rowwise-e4m3"
    plan.sites["mid.2"].roles[Role.DGRAD].kernel = "emulated-rowwise-e4m3"
    plan.sites["mid.2"].roles[Role.WGRAD].kernel = "emulated-rowwise-e4m3"
    ref = copy.deepcopy(model).double()
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    loka.apply(ours, plan)
    to_torchao(plan, emulate=True).convert(theirs)
    x, _ = _data(64)
    outs = {}
    for name, m in (("ref", ref), ("loka", ours), ("torchao", theirs)):
        xi = x.double() if name == "ref" else x
        y = m(xi)
        y.square().sum().backward()
        outs[name] = (y.double(), m.bottom.weight.grad.double(), m.mid[0].weight.grad.double())

    def rel(a, b):
        return float(((a - b).norm() / b.norm()).detach())

    # the same casts and GEMMs: LoKA's emulated kernels and torchao's emulate mode agree to
    # float32 rounding (output, bottom's and mid.0's weight gradients)
    for got, want in zip(outs["loka"], outs["torchao"]):
        assert rel(got, want) < 1e-5
    # both within FP8 error of float64: the gradients pass an e5m2 input gradient (2
    # mantissa bits), the loosest bound
    for name in ("loka", "torchao"):
        errs = [rel(got, want) for got, want in zip(outs[name], outs["ref"])]
        assert errs[0] < 0.05 and errs[1] < 0.3 and errs[2] < 0.12, (name, errs)
    # and FP8 is really on: neither model is the float32 model
    f32 = copy.deepcopy(model)
    assert rel(outs["torchao"][0], f32(x).double()) > 1e-4


def test_export_notes_what_torchao_cannot_express_and_rejects_bad_input():
    model = _model()
    plan = Plan.uniform(model, "bf16", device="cpu")
    for role in Role:
        plan.sites["bottom"].roles[role].kernel = "emulated-blockwise-e4m3"
    plan.sites["mid.0"].roles[Role.FWD].kernel = "emulated-mx-e4m3"
    export = to_torchao(plan)
    assert export.configs == {}  # nothing torchao trains in FP8 here
    assert any("bottom fwd: emulated-blockwise-e4m3 (blockwise) has no torchao training"
               in n for n in export.notes)
    assert any(n.startswith("mid.0 fwd: emulated-mx-e4m3") for n in export.notes)
    assert "bottom" in export.inference_configs  # blockwise serves with PerBlock
    assert export.convert(copy.deepcopy(model)) == []
    # formats torchao lacks are not served in others (e4m3fnuz is not e4m3)
    register(Kernel("t-blockwise-fnuz", registry_get("emulated-blockwise-e4m3").fn,
                    library="custom", scaling="blockwise", formats=("e4m3fnuz", "e4m3fnuz"),
                    align=16))
    try:
        fnuz = Plan.uniform(model, "bf16", device="cpu")
        fnuz.sites["mid.0"].roles[Role.FWD].kernel = "t-blockwise-fnuz"
        assert to_torchao(fnuz).inference_configs == {}
    finally:
        unregister("t-blockwise-fnuz")
    with pytest.raises(TypeError, match="expected a loka.Plan"):
        to_torchao({"bottom": "x"})
    plan.sites["head"].roles[Role.FWD].kernel = "no-such-kernel"
    with pytest.raises(ValueError, match="'head' fwd: kernel 'no-such-kernel' is not registered"):
        to_torchao(plan)


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with FP8 tensor cores")
def test_round_trip_on_the_gpu_training_and_serving():
    """On an FP8 GPU: torchao's real kernels for the exported plan (training and serving)
    against LoKA's cuBLAS kernels for the same plan, and float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).cuda().bfloat16()
    plan = Plan.uniform(model, "cublas-rowwise", device="cuda")
    export = to_torchao(plan)
    assert sorted(export.configs) == ["0", "2"] and not export.configs["0"].emulate
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    ref = copy.deepcopy(model).double()(x.double())
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    loka.apply(ours, plan)
    assert export.convert(theirs) == ["0", "2"]

    def rel(a, b):
        return float(((a.double() - b).norm() / b.norm()).detach())

    # two stacked e4m3 GEMMs, both operands rounded to 3 mantissa bits (a few percent rms
    # each): 8% is the bound; the bf16 model itself is far closer
    assert rel(model(x), ref) < 0.02
    assert rel(theirs(x), ref) < 0.08 and rel(ours(x), ref) < 0.08
    assert rel(theirs(x), ours(x).double()) < 0.08
    served = copy.deepcopy(model)
    assert export.quantize(served) == ["0", "2"]
    with torch.no_grad():
        assert rel(served(x), ref) < 0.08


def test_plan_converter_after_torchao_converter_applies_the_plan():
    """A converter list with torchao's float8 converter first, then LoKA's: LoKA's plan
    decides (the torchao conversion is undone, the same Parameters kept)."""
    from loka.integrations import PlanConverter

    model = _model()
    weight = model.bottom.weight
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=True))
    converter = PlanConverter(Plan.uniform(_model(), "emulated-rowwise-e4m3", device="cpu"))
    report = converter.convert(model)
    assert torchao_sites(model) == [] and converter.last_report is report
    assert sorted(report.changed) == sorted(s for s in ("bottom", "mid.0", "mid.2", "head")
                                            if isinstance(model.get_submodule(s), loka.Linear))
    assert isinstance(model.bottom, loka.Linear) and model.bottom.weight is weight
