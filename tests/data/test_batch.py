import pytest
import torch

from loka.data import Batch, FeatureSpec, Jagged, TableSpec


def test_batch_basics():
    b = Batch(torch.zeros(3, 2), {"a": (torch.tensor([1, 2]), torch.tensor([0, 1, 1, 2]))},
              torch.zeros(3))
    assert b.batch_size == 3 and isinstance(b.sparse["a"], Jagged)
    assert b.sparse["a"].lengths.tolist() == [1, 0, 1]
    assert b.to("cpu") is b
    moved = b.to("meta")
    assert moved.dense.is_meta and moved.sparse["a"].values.is_meta


def test_batch_validation():
    with pytest.raises(ValueError, match="labels"):
        Batch(torch.zeros(3, 2), {}, torch.zeros(2))
    with pytest.raises(ValueError, match="offsets"):
        Batch(torch.zeros(3, 2), {"a": Jagged(torch.tensor([1]), torch.tensor([0, 1]))},
              torch.zeros(3))
    with pytest.raises(ValueError, match="dense"):
        Batch(torch.zeros(3), {}, torch.zeros(3))


def test_feature_spec_validation():
    spec = FeatureSpec(2, (("a", 10, 1.5), TableSpec("b", 3, 1.0)))
    assert spec.table_names == ("a", "b") and spec.table("a").num_embeddings == 10
    with pytest.raises(ValueError, match="unique"):
        FeatureSpec(1, (("a", 2, 1.0), ("a", 3, 1.0)))
    with pytest.raises(ValueError):
        FeatureSpec(1, (("a", 0, 1.0),))
    with pytest.raises(ValueError, match="no table"):
        spec.table("c")
