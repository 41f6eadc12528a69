import pytest
import torch
import torch.nn as nn

from loka.config import ModsConfig
from loka.data import Jagged, TableSpec
from loka.models import (MLP, DenseArch, DenseTokenArch, EmbeddingArch, OverArch,
                         jagged_to_padded, make_activation, make_linear, make_norm)
from loka.mods import BlockNorm


def test_factory_honours_mods():
    plain, mods = ModsConfig(), ModsConfig.paper()
    assert make_linear(4, 3).bias is not None
    assert make_linear(4, 3, mods).bias is None
    last = make_linear(4, 1, mods, last=True)
    assert last.bias is not None and last._loka_final
    assert isinstance(make_norm(8, plain), nn.LayerNorm)
    norm = make_norm(8, mods)
    assert isinstance(norm, BlockNorm) and norm.block_size == 256
    assert isinstance(make_activation(None), nn.SiLU)
    assert isinstance(make_activation(mods), nn.Hardswish)


def test_mlp_and_over_arch_shapes():
    mlp = MLP(6, (8, 4), ModsConfig(blocknorm=4), out_features=2, norm=True)
    assert mlp(torch.randn(3, 6)).shape == (3, 2)
    assert sum(isinstance(m, BlockNorm) for m in mlp) == 2
    over = OverArch(6, (5,), ModsConfig.paper())
    assert over(torch.randn(3, 6)).shape == (3,)
    assert over.mlp[-1].bias is not None and over.mlp[0].bias is None


def test_dense_archs():
    assert DenseArch(5, (7,), 4)(torch.randn(2, 5)).shape == (2, 4)
    tok = DenseTokenArch(5, 3)
    x = torch.randn(2, 5)
    out = tok(x)
    assert out.shape == (2, 5, 3)
    assert torch.allclose(out[1, 2], x[1, 2] * tok.weight[2] + tok.bias[2])
    with pytest.raises(ValueError, match="dense features"):
        tok(torch.randn(2, 4))


def test_embedding_arch_sum_pooling_variable_bags():
    arch = EmbeddingArch([TableSpec("a", 10, 2.0), TableSpec("b", 5, 1.0)], dim=3)
    sparse = {"a": Jagged(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 3, 4])),  # bags 3, 0, 1
              "b": Jagged(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2, 3]))}
    out = arch(sparse)
    assert out.shape == (3, 2, 3)
    wa = arch.tables["a"].weight
    assert torch.allclose(out[0, 0], wa[1] + wa[2] + wa[3])
    assert torch.equal(out[1, 0], torch.zeros(3))  # an empty bag pools to zero
    assert torch.allclose(out[2, 0], wa[4])
    with pytest.raises(ValueError, match="lacks sparse features"):
        arch({"a": sparse["a"]})


def test_jagged_to_padded():
    values = torch.arange(6.0).unsqueeze(-1)          # items 0..5
    offsets = torch.tensor([0, 4, 4, 6])              # bags of 4, 0, 2 items
    padded, mask = jagged_to_padded(values, offsets, max_len=3)
    assert padded.shape == (3, 3, 1)
    assert padded[..., 0].tolist() == [[0, 1, 2], [0, 0, 0], [4, 5, 0]]
    assert mask.tolist() == [[True] * 3, [False] * 3, [True, True, False]]


def test_meta_construction():
    with torch.device("meta"):
        arch = EmbeddingArch([TableSpec("a", 10**7, 1.0)], dim=256)
    assert arch.tables["a"].weight.is_meta
