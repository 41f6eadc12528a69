import pytest
import torch

from loka.numerics import E4M3, E4M3FNUZ, E5M2, E5M2FNUZ, FORMATS, get_format


@pytest.mark.parametrize("fmt,max_value,min_normal", [
    (E4M3, 448.0, 2.0 ** -6), (E5M2, 57344.0, 2.0 ** -14),
    (E4M3FNUZ, 240.0, 2.0 ** -7), (E5M2FNUZ, 57344.0, 2.0 ** -15),
])
def test_format_limits(fmt, max_value, min_normal):
    assert fmt.max == max_value
    assert fmt.min_normal == min_normal
    # the largest value survives a round trip, one step beyond saturates or becomes NaN
    x = torch.tensor([fmt.max, -fmt.max])
    assert torch.equal(x.to(fmt.dtype).float(), x)


@pytest.mark.parametrize("alias,name", [("e4m3fn", "e4m3"), ("float8_e5m2", "e5m2"),
                                        (torch.float8_e4m3fnuz, "e4m3fnuz"), ("E5M2", "e5m2")])
def test_get_format_aliases(alias, name):
    assert get_format(alias).name == name


def test_get_format_rejects_unknown():
    with pytest.raises(ValueError, match="unknown FP8 format"):
        get_format("e3m4")
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        get_format(torch.bfloat16)


def test_vendor():
    assert {f.name: f.vendor for f in FORMATS.values()} == {
        "e4m3": "ocp", "e5m2": "ocp", "e4m3fnuz": "amd", "e5m2fnuz": "amd"}
