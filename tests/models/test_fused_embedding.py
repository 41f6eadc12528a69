import pytest
import torch

from loka.data.batch import Jagged, TableSpec
from loka.models import EmbeddingArch, build
from loka.models.fused_embedding import FusedEmbeddingArch, fuse_embeddings


def _jagged(lengths, rows, gen):
    lengths = torch.tensor(lengths)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return Jagged(values, torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


def test_fused_matches_per_table_pooling_and_gradients():
    gen = torch.Generator().manual_seed(0)
    arch = EmbeddingArch([TableSpec("a", 10, 2.0), TableSpec("b", 7, 1.0), TableSpec("c", 5, 3.0)], 4)
    arch = arch.double()
    sparse = {"a": _jagged([2, 0, 3], 10, gen), "b": _jagged([1, 1, 1], 7, gen),
              "c": _jagged([0, 4, 2], 5, gen)}
    fused = FusedEmbeddingArch(arch)
    ref, out = arch(sparse), fused(sparse)
    assert out.shape == (3, 3, 4)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(out[1, 0], torch.zeros(4, dtype=torch.float64))  # empty bag pools to 0
    g = torch.randn_like(ref)
    ref.backward(g)
    out.backward(g)
    for name in arch.names:
        torch.testing.assert_close(fused.weight.grad[fused.row_start[name]:][:fused.num_rows[name]],
                                   arch.tables[name].weight.grad, rtol=1e-12, atol=1e-12)
    # a subset of tables, and the sequence view, agree as well
    torch.testing.assert_close(fused(sparse, ["c", "a"]), arch(sparse, ["c", "a"]))
    s_ref, m_ref = arch.sequence("c", sparse, 3)
    s, m = fused.sequence("c", sparse, 3)
    torch.testing.assert_close(s, s_ref)
    assert torch.equal(m, m_ref)
    with pytest.raises(ValueError, match="lacks sparse features"):
        fused({"a": sparse["a"]})


@pytest.mark.parametrize("name", ["wukong", "dlrm", "dcnv2", "interformer"])
def test_fuse_embeddings_keeps_model_outputs(name):
    from loka.data.synthetic import SyntheticCTR

    torch.manual_seed(0)
    model = build(name, "tiny").double()
    batch = SyntheticCTR(model.feature_spec, 16, seed=1).batch(0)
    batch = type(batch)(dense=batch.dense.double(), sparse=batch.sparse, labels=batch.labels)
    with torch.no_grad():
        ref = model(batch)
        assert fuse_embeddings(model) >= 1
        out = model(batch)
    assert not any(isinstance(m, EmbeddingArch) for m in model.modules())
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
