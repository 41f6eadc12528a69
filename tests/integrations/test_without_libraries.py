"""What the integrations do without torchao or torchrec installed. torchao:  ``loka.apply`` refuses torchao's float8 Linears
by their class (strict or not) and names the call to make; ``is_torchao_linear`` and
``from_torchao`` recognise them the same way. torchao's real module is used in
test_torchao.py; here a class carries its name and module, which is all these checks read,
so that they also run where torchao is not installed. torchrec: site names under
``DistributedModelParallel`` (recognised by its attribute names), and a clear error from
the conversions when torchrec is absent."""

import pytest
import torch
from torch import nn

import loka
from loka.dispatch import Plan, PlanMismatchError
from loka.data.torchrec import torchrec_available
from loka.integrations import (from_torchao, is_torchao_linear, site_name, to_torchrec,
                               torchao_sites, unwrap)


class Float8Linear(nn.Linear):
    """Named and placed as torchao's class; computes what nn.Linear computes."""

    def forward(self, x):
        return super().forward(x)


Float8Linear.__module__ = "torchao.float8.float8_linear"


class NotTorchao(nn.Linear):
    def forward(self, x):
        return super().forward(x)


NotTorchao.__name__ = "Float8Linear"  # the same name elsewhere is not torchao's


def _converted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    plan = Plan.uniform(model, "emulated-rowwise-e4m3", device="cpu")
    old = model[0]
    new = Float8Linear(32, 64)
    new.weight, new.bias = old.weight, old.bias
    model[0] = new
    return model, plan


def test_apply_names_from_torchao_strict_or_not():
    model, plan = _converted()
    for strict in (True, False):
        with pytest.raises(PlanMismatchError) as err:
            loka.apply(model, plan, strict=strict)
        assert str(err.value) == (
            "1 site(s) are torchao Float8Linear modules (0): call "
            "loka.integrations.from_torchao(model) first (nn.Linear again, same Parameters), "
            "then apply")
    assert type(model[0]) is Float8Linear  # nothing was changed


def test_from_torchao_then_apply():
    model, plan = _converted()
    weight = model[0].weight
    assert torchao_sites(model) == ["0"] and is_torchao_linear(model[0])
    assert not is_torchao_linear(NotTorchao(4, 4)) and not is_torchao_linear(nn.Linear(4, 4))
    assert list(from_torchao(model)) == ["0"]
    assert type(model[0]) is nn.Linear and model[0].weight is weight
    assert sorted(loka.apply(model, plan).changed) == ["0", "2"]


def test_a_look_alike_elsewhere_is_an_ordinary_mismatch():
    model, plan = _converted()
    model[0] = NotTorchao(32, 64)
    with pytest.raises(PlanMismatchError, match=r"not an nn.Linear: 0 \(a Float8Linear"):
        loka.apply(model, plan)


def test_site_names_without_the_model_parallel_wrappers():
    assert site_name("_dmp_wrapped_module.module.over.0") == "over.0"
    assert site_name("_dmp_wrapped_module.over.0") == "over.0"
    assert site_name("_dmp_wrapped_module._orig_mod.over.0") == "over.0"
    assert site_name("over.0") == "over.0" and site_name("") == ""
    assert site_name("module_list.0") == "module_list.0"
    model = nn.Sequential(nn.Linear(4, 4))
    assert unwrap(model) is model


@pytest.mark.skipif(torchrec_available(), reason="torchrec is installed")
def test_torchrec_conversions_say_how_to_install():
    batch = next(loka.data.SyntheticCTR(loka.models.build("dlrm", "tiny").feature_spec, 4))
    with pytest.raises(ImportError, match="torchrec is not usable here .*README"):
        to_torchrec(batch)
