import numpy as np
import pytest
import torch

from loka.config import Role
from loka.probe.sampler import (GaussianSampler, MatrixNormalSampler, OperandSampler, cholesky_factor, error_rows,
                                naive_pair, sample_matrix_normal, seed_for)
from loka.probe.stats import SiteStats, Welford
from loka.probe.weights import MatrixNormal


def _rel(a, b) -> float:
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


def _learned(dim: int, rows: int = 4000, max_full: int = 1024, block: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) * torch.linspace(0.3, 2.0, dim)
    x = 5.0 + torch.randn(rows, dim, generator=g) @ mix + torch.arange(dim)
    w = Welford(dim, max_full, block)
    w.update(x)
    return w


@pytest.mark.parametrize("dim,max_full,block", [(10, 1024, 256), (24, 8, 8), (21, 16, 8)],
                         ids=["full", "blocked", "blocked-ragged"])
def test_gaussian_samples_reproduce_learned_mean_and_covariance(dim, max_full, block):
    w = _learned(dim, max_full=max_full, block=block)
    sampler = GaussianSampler(w, "cpu")
    x = sampler.sample(40000, torch.Generator().manual_seed(1))
    assert x.shape == (40000, dim) and x.dtype == torch.float32
    cov = w.covariance()
    # sampling error of a covariance from n rows is ~ sqrt(2 / n) = 0.7 %
    assert float((x.mean(0) - w.mean).abs().max()) < 5 * float(w.variance().max().sqrt()) / 200
    assert _rel(torch.cov(x.t()), cov) < 0.03
    if w.blocked:  # no correlation across blocks, as the model says
        off = torch.ones(dim, dim, dtype=torch.bool)
        for s in range(0, dim, block):
            off[s:s + block, s:s + block] = False
        sample_cov = torch.cov(x.t())
        assert float(sample_cov[off].abs().max()) < 0.05 * float(cov.diagonal().max())


def test_gaussian_sampler_needs_data():
    w = Welford(4)
    w.update(torch.randn(1, 4))
    with pytest.raises(ValueError, match="two observed rows"):
        GaussianSampler(w, "cpu")


def test_cholesky_factor_handles_singular_and_batched():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=g)
    cov = a @ a.t()
    cov[3, :] = 0
    cov[:, 3] = 0  # a dead channel
    l = cholesky_factor(cov)
    assert torch.isfinite(l).all()
    assert _rel(l @ l.t(), cov) < 1e-3
    rank_one = torch.ones(5, 5)  # far from positive definite: jitter or eigen-factor
    batched = cholesky_factor(torch.stack([torch.eye(5), rank_one]))
    assert batched.shape == (2, 5, 5)
    torch.testing.assert_close(batched[0], torch.eye(5))
    assert _rel(batched[1] @ batched[1].t(), rank_one) < 0.2


@pytest.mark.parametrize("diagonal", [False, True])
def test_matrix_normal_samples_reproduce_row_and_column_covariance(diagonal):
    n, k, draws = 5, 4, 6000
    g = torch.Generator().manual_seed(2)
    if diagonal:
        u, v = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.1]), torch.tensor([1.0, 0.2, 3.0, 0.8])
        u_full, v_full = torch.diag(u), torch.diag(v)
    else:
        a, b = torch.randn(n, n, generator=g), torch.randn(k, k, generator=g)
        u, v = a @ a.t() + torch.eye(n), b @ b.t() + torch.eye(k)
        u_full, v_full = u, v
    mean = torch.randn(n, k, generator=g)
    model = MatrixNormal(mean, u, v)
    sampler = MatrixNormalSampler(model)
    w = torch.stack([sampler.sample(g, include_mean=False) for _ in range(draws)])
    # E[W Wᵀ] = tr(V) U and E[Wᵀ W] = tr(U) V for a zero-mean matrix normal
    assert _rel(torch.einsum("tik,tjk->ij", w, w) / draws, torch.trace(v_full) * u_full) < 0.05
    assert _rel(torch.einsum("tni,tnj->ij", w, w) / draws, torch.trace(u_full) * v_full) < 0.05
    with_mean = sample_matrix_normal(model, torch.Generator().manual_seed(3))
    without = sample_matrix_normal(model, torch.Generator().manual_seed(3), include_mean=False)
    torch.testing.assert_close(with_mean - without, mean)


def _site(k=32, n=48, rows=256, capture=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = SiteStats("layer", k, n)
    x, dy = torch.randn(rows, k, generator=g) * 3 + 1, torch.randn(rows, n, generator=g) * 1e-3
    s.act.update(x)
    s.grad.update(dy)
    s.weight.observe(torch.randn(n, k, generator=g) * 0.1)
    s.tokens = rows
    if capture:
        s.captured_x, s.captured_dy = x, dy
    return s


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("source", ["learned", "captured"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operand_pairs_have_linear_shapes_and_layouts(role, source, dtype):
    k, n, m = 32, 48, 64
    site = _site(k, n, capture=source == "captured")
    weight = torch.randn(n, k)
    sampler = OperandSampler(site, role, "cpu", dtype, source=source, weight=weight, seed=1)
    a, b = sampler.pair(m)
    expect = {Role.FWD: ((m, k), (k, n)), Role.DGRAD: ((m, n), (n, k)),
              Role.WGRAD: ((n, m), (m, k))}[role]
    assert (tuple(a.shape), tuple(b.shape)) == expect
    assert a.dtype == b.dtype == dtype
    # the layouts loka.Linear passes: Wᵀ and dyᵀ are transposed views
    if role is Role.FWD:
        assert b.t().is_contiguous() and a.is_contiguous()
    if role is Role.WGRAD:
        assert a.t().is_contiguous() and b.is_contiguous()
    if source == "captured":
        if role is not Role.DGRAD:  # the x rows are real captured rows
            x = (b if role is Role.WGRAD else a).float()
            cap = site.captured_x.to(dtype).float()
            assert all(bool((cap == row).all(1).any()) for row in x[:5])
        if role is not Role.WGRAD:  # the weight is the current weight
            w = b.t() if role is Role.FWD else b
            torch.testing.assert_close(w, weight.to(dtype))


def test_captured_pairs_keep_x_and_dy_rows_aligned():
    site = _site(capture=True)
    a, b = OperandSampler(site, "wgrad", "cpu", torch.float32, source="captured").pair(64)
    dy, x = a.t(), b
    rows_x = [int((site.captured_x == r).all(1).nonzero()[0]) for r in x]
    rows_dy = [int((site.captured_dy == r).all(1).nonzero()[0]) for r in dy]
    assert rows_x == rows_dy


def test_learned_pairs_follow_learned_statistics_and_weight_model():
    site = _site(rows=2000)
    s = OperandSampler(site, "fwd", "cpu", torch.float32, weight_source="model")
    x = torch.cat([s.pair(256)[0] for _ in range(20)])
    torch.testing.assert_close(x.mean(0), site.act.moments.mean, atol=0.3, rtol=0)
    assert _rel(x.std(0), site.act.moments.variance().sqrt()) < 0.05
    w_mean = OperandSampler(site, "fwd", "cpu", torch.float32, weight_source="mean").pair(16)[1]
    torch.testing.assert_close(w_mean.t(), site.weight.mean)
    draws = [OperandSampler(site, "dgrad", "cpu", torch.float32, seed=i).pair(16)[1]
             for i in range(2)]
    assert not torch.equal(draws[0], draws[1])  # fresh weights from MN(0, U, V)
    assert float(draws[0].square().mean()) == pytest.approx(
        float(site.weight.mean.square().mean()), rel=0.3)


def test_sampler_is_deterministic_per_seed_and_role():
    site = _site()
    p1 = OperandSampler(site, "fwd", "cpu", torch.float32, seed=4).pair(32)
    p2 = OperandSampler(site, "fwd", "cpu", torch.float32, seed=4).pair(32)
    p3 = OperandSampler(site, "fwd", "cpu", torch.float32, seed=5).pair(32)
    assert torch.equal(p1[0], p2[0]) and not torch.equal(p1[0], p3[0])
    assert seed_for(0, "a", "fwd") != seed_for(0, "a", "dgrad")


def test_roles_of_a_site_share_its_factorisations_and_draw_the_same(monkeypatch):
    """With ``shared``, a site's roles factor x's and dy's covariances and the weight model
    once (forward and wgrad both draw x, dgrad and wgrad dy): four factorisations for the
    three roles, not six, and every pair is bit for bit the one drawn without sharing."""
    from loka.probe import sampler as sm

    site = _site()
    alone = {r: OperandSampler(site, r, "cpu", torch.float32, seed=3).pair(40)
             for r in ("fwd", "dgrad", "wgrad")}
    calls = []
    real = sm.cholesky_factor
    monkeypatch.setattr(sm, "cholesky_factor", lambda c: calls.append(c.shape) or real(c))
    shared = {}
    together = {r: OperandSampler(site, r, "cpu", torch.float32, seed=3, shared=shared).pair(40)
                for r in ("fwd", "dgrad", "wgrad")}
    assert sorted(shared) == ["dy", "w", "x"]
    # x, dy, and the weight model's row and column factors (full at these sizes)
    assert len(calls) == 4, calls
    for r in alone:
        for a, b in zip(alone[r], together[r]):
            assert torch.equal(a, b)


def test_sampler_bad_input():
    site = _site()
    with pytest.raises(ValueError, match="nothing captured"):
        OperandSampler(site, "fwd", "cpu", torch.float32, source="captured", weight=torch.zeros(48, 32))
    with pytest.raises(ValueError, match="unknown source"):
        OperandSampler(site, "fwd", "cpu", torch.float32, source="real")
    with pytest.raises(ValueError, match="weight_source"):
        OperandSampler(site, "fwd", "cpu", torch.float32, weight_source="ema")
    cap = _site(capture=True)
    with pytest.raises(ValueError, match="current weight"):
        OperandSampler(cap, "fwd", "cpu", torch.float32, source="captured")
    with pytest.raises(ValueError, match="captured"):
        OperandSampler(cap, "wgrad", "cpu", torch.float32, source="captured").pair(1000)


@pytest.mark.parametrize("role", list(Role))
def test_naive_pairs_are_standard_normal(role):
    g = torch.Generator().manual_seed(0)
    a, b = naive_pair(role, 512, 64, 96, "cpu", torch.float32, g)
    ref_a, ref_b = OperandSampler(_site(64, 96), role, "cpu", torch.float32).pair(512)
    assert a.shape == ref_a.shape and b.shape == ref_b.shape
    assert a.stride() == ref_a.stride() and b.stride() == ref_b.stride()
    both = torch.cat([a.reshape(-1), b.reshape(-1)])
    assert abs(float(both.mean())) < 0.01 and abs(float(both.std()) - 1) < 0.01


def test_error_rows():
    site = _site(rows=100)
    assert error_rows(site, "learned", None) == 112       # observed M, rounded up to 16
    assert error_rows(site, "learned", 50) == 64
    site.tokens = 100_000
    assert error_rows(site, "learned", None) == 4096      # capped
    cap = _site(rows=256, capture=True)
    assert error_rows(cap, "captured", None) == 128       # half the captured rows
    assert error_rows(cap, "captured", 40) == 32
    cap.captured_x = cap.captured_x[:20]
    assert error_rows(cap, "captured", None) == 20
    cap.captured_x = None
    assert error_rows(cap, "captured", None) == 0
    np.testing.assert_equal(error_rows(_site(rows=3), "learned", None), 16)
