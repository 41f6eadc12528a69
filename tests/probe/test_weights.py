"""The matrix-normal weight model (loka/probe/weights.py)."""

import numpy as np
import pytest
import torch

from loka.probe.weights import MatrixNormal, WeightModel, flip_flop, shrinkage_for


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _matrix_normal_samples(t, u, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.linalg.cholesky(u), torch.linalg.cholesky(v)
    z = torch.randn(t, u.shape[0], v.shape[0], generator=g, dtype=torch.float64)
    return a @ z @ b.t()


def _spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.t() / n + torch.diag(torch.linspace(0.5, 2.0, n, dtype=torch.float64))


@pytest.mark.parametrize("n,k", [(6, 4), (5, 5), (3, 8)])
def test_flip_flop_recovers_known_covariances(n, k):
    u, v = _spd(n, 1), _spd(k, 2)
    v = v * k / torch.trace(v)  # the estimator's normalisation, trace(V) = K
    mean = torch.randn(n, k, dtype=torch.float64)
    w = _matrix_normal_samples(3000, u, v) + mean
    fit = flip_flop(w)
    assert _rel(fit.mean.double(), mean) < 0.06  # sampling error ~ sqrt(u v / T) per entry
    assert _rel(fit.row_cov.double(), u) < 0.05
    assert _rel(fit.col_cov.double(), v) < 0.05
    assert float(torch.trace(fit.col_cov)) == pytest.approx(k, rel=1e-5)
    assert _rel(fit.kron().double(), torch.kron(v, u)) < 0.07


def test_flip_flop_diagonal_factors():
    u = torch.diag(torch.tensor([0.1, 1.0, 4.0, 9.0], dtype=torch.float64))
    v = torch.diag(torch.tensor([0.5, 1.5, 1.0], dtype=torch.float64))
    w = _matrix_normal_samples(4000, u, v)
    fit = flip_flop(w, torch.zeros(4, 3), diagonal_rows=True, diagonal_cols=True)
    assert fit.row_cov.shape == (4,) and fit.col_cov.shape == (3,)
    assert _rel(fit.row_cov.double(), torch.diagonal(u)) < 0.05
    assert _rel(fit.col_cov.double(), torch.diagonal(v)) < 0.05


def test_flip_flop_bad_input():
    with pytest.raises(ValueError, match="explicit mean"):
        flip_flop(torch.randn(4, 3))
    w = torch.randn(5, 4, 3)
    w[2, 1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        flip_flop(w)
    with pytest.raises(ValueError, match=r"\(T, N, K\)"):
        flip_flop(torch.randn(2, 2, 2, 2))


def test_weight_model_ema_is_bias_corrected():
    wm = WeightModel(ema=0.9)
    w1, w2 = torch.randn(8, 4), torch.randn(8, 4)
    wm.observe(w1)
    torch.testing.assert_close(wm.mean, w1)
    wm.observe(w2)
    expected = (0.9 * 0.1 * w1 + 0.1 * w2) / (1 - 0.81)
    torch.testing.assert_close(wm.mean, expected)
    assert wm.snapshots == 2
    with pytest.raises(ValueError, match="shape changed"):
        wm.observe(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="no weight"):
        WeightModel().mean


@pytest.mark.parametrize("max_full", [1024, 16], ids=["full", "diagonal"])
def test_weight_model_single_matrix_captures_row_and_column_scales(max_full):
    """One matrix from MN(0, diag(u), diag(v)): the shrunk single-matrix fit recovers the
    row and column scales (the structure that decides rowwise vs tensorwise FP8)."""
    n, k = 96, 64
    u = torch.logspace(-1, 1, n, dtype=torch.float64)[torch.randperm(n)]
    v = torch.logspace(-0.5, 0.5, k, dtype=torch.float64)[torch.randperm(k)]
    w = u.sqrt()[:, None] * torch.randn(n, k, dtype=torch.float64) * v.sqrt()[None, :]
    wm = WeightModel(max_full_cov_dim=max_full)
    wm.observe(w.float())
    fit = wm.fit()
    assert isinstance(fit, MatrixNormal) and fit.mean.shape == (n, k)
    est_u = fit.row_cov if fit.row_cov.dim() == 1 else torch.diagonal(fit.row_cov)
    est_v = fit.col_cov if fit.col_cov.dim() == 1 else torch.diagonal(fit.col_cov)
    assert (fit.row_cov.dim() == 1) == (max_full < n)
    corr_u = np.corrcoef(np.log(est_u.numpy()), np.log(u.numpy()))[0, 1]
    corr_v = np.corrcoef(np.log(est_v.numpy()), np.log(v.numpy()))[0, 1]
    assert corr_u > 0.95 and corr_v > 0.7
    # overall scale: E|W|² = mean(u) mean(v)
    assert float(est_u.mean() * est_v.mean()) == pytest.approx(float(w.square().mean()), rel=0.1)
    assert shrinkage_for(n, k) == pytest.approx(n / (n + k))
    s = wm.summary()
    assert s["snapshots"] == 1 and s["row_rms_ratio"] > 3
