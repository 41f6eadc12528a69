import math

import numpy as np
import pytest
import torch

from loka.data import FeatureSpec, SyntheticConfig, SyntheticCTR, TableSpec, normalized_entropy, zipf_pmf

SPEC = FeatureSpec(4, (TableSpec("a", 2000, 1.0), TableSpec("b", 500, 3.0), TableSpec("c", 50, 6.5)))


def test_deterministic_and_positionable():
    s1, s2 = SyntheticCTR(SPEC, 128, seed=7), SyntheticCTR(SPEC, 128, seed=7)
    b1, b2 = [next(s1) for _ in range(3)], [next(s2) for _ in range(3)]
    for x, y in zip(b1, b2):
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        for k in SPEC.table_names:
            assert torch.equal(x.sparse[k].values, y.sparse[k].values)
            assert torch.equal(x.sparse[k].offsets, y.sparse[k].offsets)
    s3 = SyntheticCTR(SPEC, 128, seed=7)
    s3.load_state_dict({"seed": 7, "position": 2})
    assert torch.equal(next(s3).dense, b1[2].dense) and s1.state_dict() == {"seed": 7, "position": 3}
    other = SyntheticCTR(SPEC, 128, seed=8)
    assert not torch.equal(next(other).dense, b1[0].dense)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict({"seed": 7, "position": 0})


def test_held_out_shares_teacher_not_data():
    s = SyntheticCTR(SPEC, 64, seed=1)
    h = s.held_out()
    assert h.teacher is s.teacher and h.seed != s.seed
    assert not torch.equal(next(h).dense, s.batch(0).dense)


def test_shapes_and_bags():
    b = SyntheticCTR(SPEC, 256).batch(0)
    assert b.dense.shape == (256, 4) and b.dense.dtype == torch.float32
    assert b.labels.shape == (256,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    for t in SPEC.tables:
        jag = b.sparse[t.name]
        assert jag.offsets.shape == (257,) and jag.values.dtype == torch.int64
        assert int(jag.values.min()) >= 0 and int(jag.values.max()) < t.num_embeddings
        assert int(jag.lengths.min()) >= 1
        assert float(jag.lengths.float().mean()) == pytest.approx(t.mean_bag_length, rel=0.15)


@pytest.mark.parametrize("base_ctr", [0.03, 0.1])
def test_base_ctr(base_ctr):
    s = SyntheticCTR(SPEC, 4096, seed=3, config=SyntheticConfig(base_ctr=base_ctr))
    labels = torch.cat([next(s).labels for _ in range(10)])  # 40960 examples
    se = math.sqrt(base_ctr * (1 - base_ctr) / labels.numel())
    assert abs(labels.mean().item() - base_ctr) < 4 * se + 0.002


def test_zipf_skew_matches_configured_law():
    alpha = 1.2
    spec = FeatureSpec(0, (TableSpec("z", 1000, 1.0),))
    s = SyntheticCTR(spec, 4096, config=SyntheticConfig(zipf_alpha=alpha))
    ids = torch.cat([next(s).sparse["z"].values for _ in range(10)])
    counts = np.sort(np.bincount(ids.numpy(), minlength=1000))[::-1]
    top1 = counts[:10].sum() / counts.sum()
    expected = zipf_pmf(1000, alpha)[:10].sum()
    assert abs(top1 - expected) < 0.02, (top1, expected)
    assert top1 > 0.4  # heavily skewed: 1% of the ids carry ~half the lookups


def test_heavy_tailed_dense():
    s = SyntheticCTR(FeatureSpec(4, ()), 4096, config=SyntheticConfig(outlier_channels=1))
    d = torch.cat([next(s).dense for _ in range(5)]).double()
    kurtosis = ((d - d.mean(0)) ** 4).mean(0) / d.var(0) ** 2
    assert (kurtosis > 6).all()  # Gaussian: 3
    assert d[:, 3].abs().median() > 5 * d[:, 1].abs().median()  # the outlier channel


def test_teacher_is_learnable_signal():
    s = SyntheticCTR(SPEC, 4096, seed=0)
    batches = [next(s) for _ in range(5)]
    logits = torch.cat([s.teacher_logits(b) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    ne = normalized_entropy(logits, labels, from_logits=True)
    assert 0.6 < ne < 0.95  # the Bayes-optimal predictor is clearly better than the base rate


def test_validation():
    with pytest.raises(ValueError):
        SyntheticConfig(base_ctr=0.0)
    with pytest.raises(TypeError):
        SyntheticCTR({"num_dense": 3}, 16)
    with pytest.raises(ValueError):
        SyntheticCTR(SPEC, 0)
