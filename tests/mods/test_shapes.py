import pytest
import torch
import torch.nn as nn

import loka.models as M
from loka.config import ModsConfig
from loka.data import SyntheticCTR
from loka.mods import MergedLinear, PaddedLinear, convert, merge_siblings, pad_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 3), (16, 16), (17, 1), (64, 33)])
def test_padded_linear_same_function(shape, bias):
    lin = nn.Linear(*shape, bias=bias).double()
    pad = PaddedLinear(lin, 16)
    assert pad.linear.in_features % 16 == 0 and pad.linear.out_features % 16 == 0
    x = torch.randn(4, 2, shape[0], dtype=torch.float64)
    assert torch.allclose(pad(x), lin(x), rtol=0, atol=1e-13)


def test_padding_stays_zero_under_training():
    torch.manual_seed(0)
    pad = PaddedLinear(nn.Linear(5, 3), 8)
    opt = torch.optim.AdamW(pad.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        pad(torch.randn(16, 5)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    w = pad.linear.weight
    assert torch.count_nonzero(w[3:]) == 0 and torch.count_nonzero(w[:, 5:]) == 0
    assert torch.count_nonzero(pad.linear.bias[3:]) == 0


def test_merged_linear_same_function():
    torch.manual_seed(0)
    a, b, c = (nn.Linear(6, n).double() for n in (2, 3, 4))
    merged = MergedLinear([a, b, c])
    x = torch.randn(5, 6, dtype=torch.float64)
    for got, lin in zip(merged(x), (a, b, c)):
        assert torch.allclose(got, lin(x), rtol=0, atol=1e-14)
    with pytest.raises(ValueError):
        MergedLinear([nn.Linear(6, 2), nn.Linear(5, 2)])
    with pytest.raises(ValueError):
        MergedLinear([nn.Linear(6, 2), nn.Linear(6, 2, bias=False)])
    with pytest.raises(TypeError):
        MergedLinear([PaddedLinear(nn.Linear(6, 2), 4), nn.Linear(6, 2)])


def _outputs(model, batch):
    model.eval()
    with torch.no_grad():
        return model(batch)


@pytest.mark.parametrize("name", M.list_models())
@pytest.mark.parametrize("transform", ["pad", "merge", "both"])
def test_model_outputs_unchanged(name, transform):
    torch.manual_seed(0)
    model = M.build(name, "tiny").double()
    batch = next(SyntheticCTR(model.feature_spec, 32, seed=5))
    batch = type(batch)(batch.dense.double(), batch.sparse, batch.labels)
    before = _outputs(model, batch)
    changes = []
    if transform in ("merge", "both"):
        changes += merge_siblings(model)
    if transform in ("pad", "both"):
        changes += pad_linears(model, 16)
    if transform != "pad" and name in ("wukong", "interformer"):
        assert any(isinstance(m, MergedLinear) for m in model.modules())
    if transform == "pad":
        assert changes and all(m.in_features % 16 == 0 and m.out_features % 16 == 0
                               for m in model.modules() if type(m) is nn.Linear)
    assert torch.allclose(_outputs(model, batch), before, rtol=1e-12, atol=1e-12)


def test_wukong_merge_siblings_hook():
    model = M.build("wukong", "tiny")
    changes = model.merge_siblings()
    # FMB projection + LCB of each of the 2 layers (n == nF + nL: no residual projection)
    assert sorted(c.fqn for c in changes) == ["layers.0.fmb.proj", "layers.0.lcb.proj",
                                              "layers.1.fmb.proj", "layers.1.lcb.proj"]
    assert model.layers[0].merged.split_sizes == (4, 4)
    assert model.merge_siblings() == []  # idempotent


def test_wukong_merge_with_residual_projection():
    model = M.build("wukong", "tiny", num_fm=3, num_lcb=2)  # n = 8 -> 5: a residual Linear
    layer = model.layers[0]
    assert layer.residual is not None
    model.merge_siblings()
    assert layer.merged.split_sizes == (4, 2, 5) and layer.residual is None


def test_built_with_shape_mods_matches_function():
    torch.manual_seed(0)
    plain = M.build("wukong", "tiny")
    torch.manual_seed(0)
    shaped = M.build("wukong", "tiny", ModsConfig(pad_to=16, merge_siblings=True))
    batch = next(SyntheticCTR(plain.feature_spec, 16, seed=1))
    assert torch.allclose(_outputs(plain, batch), _outputs(shaped, batch), rtol=1e-5, atol=1e-6)


def test_pad_rejects_bad_multiple():
    with pytest.raises(ValueError):
        pad_linears(nn.Sequential(nn.Linear(3, 3)), 0)


def test_convert_pad_reports():
    m = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 3))
    report = convert(m, ModsConfig(pad_to=16))
    assert report.fqns == ["1"] and isinstance(m[1], PaddedLinear)


def test_merge_siblings_asks_when_and_merge_pays_decides_by_timing():
    from loka.mods import merge_pays

    model = M.build("wukong", "tiny")
    seen = []
    assert merge_siblings(model, when=lambda sib: seen.append(len(sib)) or False) == []
    assert seen == [2, 2] and model.layers[0].merged is None  # asked per layer, kept apart
    # a timer fed by the test: per role, the time apart then the time merged
    def timer_of(times):
        it = iter(times)
        return lambda fn: (fn(), next(it))[1]

    record = []
    slower = merge_pays(512, dtype=torch.float32, roles=("fwd", "wgrad"), record=record,
                        timer=timer_of([10.0, 12.0, 10.0, 9.0] * 2))
    assert merge_siblings(model, when=slower) == [] and model.layers[0].merged is None
    assert record[0]["apart_us"] == 20.0 and record[0]["merged_us"] == 21.0
    assert record[0]["roles"]["wgrad"] == {"apart_us": 10.0, "merged_us": 9.0}
    assert record[0]["merge"] is False and record[0]["out_features"] == [4, 4]
    faster = merge_pays(512, dtype=torch.float32, min_speedup=1.2,
                        timer=timer_of([12.0, 10.0] * 3 + [12.0, 10.0] * 3))
    changes = merge_siblings(model, when=faster)  # 36 / 30 = 1.2: merged
    assert len(changes) == 4 and model.layers[1].merged.split_sizes == (4, 4)
    # the real timer (wall clock on the CPU: a smoke test of the GEMMs it times)
    record = []
    merge_pays(256, dtype=torch.float32, record=record)(
        [nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)])
    assert set(record[0]["roles"]) == {"fwd", "dgrad", "wgrad"}
    assert all(v > 0 for r in record[0]["roles"].values() for v in r.values())
    with pytest.raises(ValueError, match="tokens"):
        merge_pays(0)
    with pytest.raises(ValueError, match="role"):
        merge_pays(8, roles=())


def test_merged_and_apart_gemms_compute_the_same_thing():
    from loka.mods.shapes import _role_gemms

    for role in ("fwd", "dgrad", "wgrad"):
        apart, merged = _role_gemms(32, [8, 24], 64, role, "cpu", torch.float64)
        a, m = apart(), merged()
        if role == "dgrad":
            assert torch.allclose(a, m, rtol=1e-12, atol=1e-10)
        else:
            assert torch.allclose(torch.cat(a, dim=1 if role == "fwd" else 0), m,
                                  rtol=1e-12, atol=1e-10)
