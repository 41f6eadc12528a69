import pytest
import torch
import torch.nn as nn

import loka.models as M
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.mods import BlockNorm, ModsReport, convert, final_linears

MODELS = M.list_models()
CONFIGS = {
    "paper": ModsConfig.paper(),
    "no_bias": ModsConfig(no_bias=True),
    "blocknorm": ModsConfig(blocknorm=8),
    "hardswish": ModsConfig(hardswish=True),
    "all": ModsConfig(no_bias=True, blocknorm=256, hardswish=True, pad_to=16, merge_siblings=True),
}


def _modules(model):
    return {fqn: m for fqn, m in model.named_modules()}


def _signature(model):
    """(fqn, type, has-bias) of every leaf module: the structure convert() changes."""
    out = []
    for fqn, m in model.named_modules():
        if not list(m.children()):
            out.append((fqn, type(m).__name__, getattr(m, "bias", None) is not None))
    return out


@pytest.mark.parametrize("mods_name", list(CONFIGS))
@pytest.mark.parametrize("name", MODELS)
def test_convert_changes_exactly_what_it_reports(name, mods_name):
    mods = CONFIGS[mods_name]
    torch.manual_seed(0)
    model = M.build(name, "tiny")
    before = {fqn: (type(m), getattr(m, "bias", None) is not None) for fqn, m in _modules(model).items()
              if not list(m.children())}
    report = convert(model, mods)
    assert isinstance(report, ModsReport)
    after = {fqn: (type(m), getattr(m, "bias", None) is not None) for fqn, m in _modules(model).items()
             if not list(m.children())}
    changed = {fqn for fqn in before if after.get(fqn) != before[fqn]}
    reported = set(report.fqns)
    # every changed leaf was reported (a merged / padded Linear's fqn is reported at the
    # module that replaced it, whose leaves live under it)
    for fqn in changed:
        assert any(fqn == r or fqn.startswith(r + ".") for r in reported), fqn
    for r in reported:
        # ... and every report names a changed module, or one that a previous step of the
        # same conversion created (a merged GEMM losing its bias) or removed (a merged sibling)
        assert (any(f == r or f.startswith(r + ".") for f in changed)
                or r not in before or r not in after), r
    if mods.no_bias:
        linears = [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Linear)]
        finals = set(final_linears(model))
        assert finals and all(m.bias is not None for f, m in linears if f in finals)
        assert all(m.bias is None for f, m in linears if f not in finals)
    if mods.blocknorm:
        assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    if mods.hardswish:
        assert not any(isinstance(m, nn.SiLU) for m in model.modules())
    data = SyntheticCTR(model.feature_spec, 64, seed=3)
    out = model(next(data))
    assert out.shape == (64,) and torch.isfinite(out).all()
    # idempotent
    assert len(convert(model, mods)) == 0


@pytest.mark.parametrize("name", MODELS)
def test_convert_matches_building_with_mods(name):
    mods = ModsConfig.paper()
    converted = M.build(name, "tiny")
    convert(converted, mods)
    built = M.build(name, "tiny", mods)
    assert _signature(converted) == _signature(built)


def test_report_contents():
    model = M.build("wukong", "tiny")
    report = convert(model, ModsConfig(hardswish=True, fuse_norm_quant=True))
    swaps = [c for c in report if c.old.startswith("SiLU")]
    assert swaps and all(c.new.startswith("Hardswish") for c in swaps)
    switched = {c.fqn for c in report if c not in swaps}
    # the fuse switch: every MLP (the FM blocks' and the top one) and the model itself
    assert switched == {"", "over_arch.mlp"} | {f"layers.{i}.fmb.mlp" for i in range(2)}
    assert all(model.get_submodule(f).fuse_norm_quant for f in switched)
    assert not report.skipped
    d = report.to_dict()
    assert d["config"]["hardswish"] is True and len(d["changes"]) == len(report)
    assert "Hardswish" in report.summary() and "quantization fused" in report.summary()
    assert len(convert(model, ModsConfig(fuse_norm_quant=True))) == 0  # idempotent


def test_fuse_switch_without_a_module_that_has_it_is_skipped():
    report = convert(nn.Sequential(nn.Linear(4, 4), nn.Hardswish(), nn.Linear(4, 1)),
                     ModsConfig(fuse_norm_quant=True, token_major=True))
    assert not report.changes
    assert [r.split(":")[0] for _, r in report.skipped] == ["token_major", "fuse_norm_quant"]
    assert "FusedNormActQuant" in report.skipped[1][1]


def test_final_linear_rule():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    m = Plain()
    assert final_linears(m) == ["c"]
    m.a._loka_final = True
    assert final_linears(m) == ["a"]
    report = convert(m, ModsConfig(no_bias=True))
    assert sorted(report.fqns) == ["b", "c"]
    assert m.a.bias is not None and m.b.bias is None and m.c.bias is None


def test_no_bias_keeps_weight_and_function_when_bias_zero():
    m = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 1))
    nn.init.zeros_(m[0].bias)
    x = torch.randn(5, 8)
    before = m(x)
    w = m[0].weight
    convert(m, ModsConfig(no_bias=True))
    assert m[0].weight is w and m[0].bias is None and m[2].bias is not None
    assert torch.equal(m(x), before)


def test_layernorm_over_two_dims_is_skipped():
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm([2, 3]))
    report = convert(m, ModsConfig(blocknorm=4))
    assert len(report) == 0 and report.skipped and isinstance(m[1], nn.LayerNorm)
    m = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    assert convert(m, ModsConfig(blocknorm=4)).fqns == ["1"] and isinstance(m[1], BlockNorm)


def test_bad_arguments():
    with pytest.raises(TypeError):
        convert(nn.Linear(2, 2), {"no_bias": True})
    with pytest.raises(TypeError):
        convert("model", ModsConfig())
