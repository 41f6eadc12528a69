import math

import numpy as np
import pytest
import torch

from loka.data import Metrics, auc, log_loss, normalized_entropy


def ref_log_loss(p, y):
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def ref_auc(s, y):
    """O(n^2) pair count in float64: ties count one half."""
    s, y = np.asarray(s, np.float64), np.asarray(y)
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (len(pos) * len(neg)))


@pytest.mark.parametrize("n_pos,n", [(1, 2), (3, 100), (37, 1000), (12345, 400000)])
def test_base_rate_predictor_has_ne_exactly_one(n_pos, n):
    y = np.zeros(n)
    y[np.random.default_rng(0).choice(n, n_pos, replace=False)] = 1
    assert normalized_entropy(np.full(n, n_pos / n), y) == 1.0
    m = Metrics(from_logits=False)
    m.update(np.full(n, n_pos / n), y)
    assert m.compute()["ne"] == 1.0


def test_known_values():
    p, y = [0.9, 0.2, 0.6, 0.1], [1, 0, 1, 0]
    assert log_loss(p, y) == pytest.approx(ref_log_loss(p, y), rel=1e-15)
    ctr = 0.5
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    assert normalized_entropy(p, y) == pytest.approx(ref_log_loss(p, y) / entropy, rel=1e-15)
    assert auc(p, y) == 1.0
    assert auc([0.1, 0.9], [1, 0]) == 0.0
    assert auc([0.5] * 6, [1, 0, 1, 0, 0, 0]) == 0.5          # all tied
    assert auc([0.3, 0.3, 0.1, 0.9], [1, 0, 0, 1]) == ref_auc([0.3, 0.3, 0.1, 0.9], [1, 0, 0, 1])


def test_against_float64_reference_random():
    rng = np.random.default_rng(1)
    y = (rng.random(3000) < 0.1).astype(np.float64)
    logits = rng.standard_normal(3000) + 2 * y - 2
    scores = np.round(logits, 1)  # many ties
    p = 1 / (1 + np.exp(-logits))
    assert log_loss(logits, y, from_logits=True) == pytest.approx(ref_log_loss(p, y), rel=1e-12)
    assert auc(scores, y) == pytest.approx(ref_auc(scores, y), abs=1e-14)


def test_streaming_equals_one_shot_and_logits_equal_probs():
    rng = np.random.default_rng(2)
    y = (rng.random(1000) < 0.2).astype(np.float32)
    logits = torch.tensor(rng.standard_normal(1000), dtype=torch.float32)
    m = Metrics(from_logits=True)
    for i in range(0, 1000, 128):
        m.update(logits[i:i + 128], torch.tensor(y[i:i + 128]))
    out = m.compute()
    assert out["count"] == 1000 and out["ctr"] == pytest.approx(y.mean())
    assert out["ne"] == pytest.approx(normalized_entropy(logits, y, from_logits=True), rel=1e-15)
    probs = torch.sigmoid(logits.double())
    assert out["logloss"] == pytest.approx(log_loss(probs, y), rel=1e-9)
    assert out["auc"] == pytest.approx(auc(probs, y), abs=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        log_loss([], [])
    with pytest.raises(ValueError, match="before any update"):
        Metrics().compute()
    with pytest.raises(ValueError, match="0 or 1"):
        normalized_entropy([0.5, 0.5], [1, 2])
    with pytest.raises(ValueError, match="NaN"):
        auc([0.5, float("nan")], [1, 0])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        log_loss([1.5, 0.5], [1, 0])
    with pytest.raises(ValueError, match="undefined"):
        normalized_entropy([0.5, 0.5], [1, 1])
    assert auc([0.5, 0.2], [0, 0]) == 0.5  # a single class: torchrec's no-signal value
    with pytest.raises(ValueError, match="differ"):
        auc([0.5, 0.2, 0.1], [0, 1])
