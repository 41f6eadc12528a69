"""What the Probe learns about a weight: a matrix-normal model ``W ~ MN(M, U, V)`` of a
weight (N, K), fitted by the flip-flop algorithm (Dutilleux 1999) on the exponential
moving average of weight snapshots (:class:`WeightModel`), from which
:mod:`loka.probe.sampler` draws synthetic weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

__all__ = ["MatrixNormal", "shrinkage_for", "flip_flop", "WeightModel"]


@dataclass
class MatrixNormal:
    """``W ~ MN(M, U, V)``: ``vec(W) ~ N(vec(M), V ⊗ U)`` for W of shape (N, K).

    ``row_cov`` U is (N, N) or, when ``diagonal_rows``, its diagonal (N,); likewise
    ``col_cov`` V (K, K) or (K,). The factorisation is defined up to ``U c, V / c``; the
    estimators here fix ``trace(V) = K``.
    """

    mean: torch.Tensor
    row_cov: torch.Tensor
    col_cov: torch.Tensor

    @property
    def shape(self) -> Tuple[int, int]:
        return tuple(self.mean.shape)

    def kron(self) -> torch.Tensor:
        """The full (NK, NK) covariance ``V ⊗ U`` of ``vec(W)`` (small shapes only)."""
        u = self.row_cov if self.row_cov.dim() == 2 else torch.diag(self.row_cov)
        v = self.col_cov if self.col_cov.dim() == 2 else torch.diag(self.col_cov)
        return torch.kron(v, u)


def shrinkage_for(dim: int, samples: float) -> float:
    """Shrinkage towards the diagonal, ``dim / (dim + samples)``: 0.5 for a square matrix
    seen once, small when many more samples than dimensions back the estimate."""
    return dim / (dim + samples)


def _shrink(s: torch.Tensor, lam: float) -> torch.Tensor:
    if lam <= 0:
        return s
    return (1.0 - lam) * s + lam * torch.diag(torch.diagonal(s))


def _spd_inverse(s: torch.Tensor) -> torch.Tensor:
    """Inverse of a symmetric positive (semi)definite matrix, with a jitter if needed."""
    eye = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
    scale = torch.diagonal(s).mean().clamp(min=1e-30)
    for jitter in (0.0, 1e-8, 1e-6, 1e-4, 1e-2):
        chol, info = torch.linalg.cholesky_ex(s + jitter * scale * eye)
        if int(info) == 0:
            return torch.cholesky_inverse(chol)
    return torch.linalg.pinv(s, hermitian=True)


def flip_flop(samples: torch.Tensor, mean: Optional[torch.Tensor] = None, *, iters: int = 50,
              tol: float = 1e-6, row_shrinkage: float = 0.0, col_shrinkage: float = 0.0,
              diagonal_rows: bool = False, diagonal_cols: bool = False) -> MatrixNormal:
    """Maximum-likelihood matrix-normal fit by the flip-flop algorithm (Dutilleux 1999).

    Alternates ``U = Σ_t R_t V⁻¹ R_tᵀ / (T K)`` and ``V = Σ_t R_tᵀ U⁻¹ R_t / (T N)`` over the
    residuals ``R_t = W_t - M`` until V stops moving, then normalises ``trace(V) = K``.
    The plain MLE needs about ``T >= N/K + K/N`` samples; below that (one matrix, say)
    shrink towards the diagonal (``*_shrinkage`` in [0, 1]) or fit diagonal factors,
    which is the rank-one variance model ``Var W_ij = u_i v_j``.

    Args:
        samples: (T, N, K) or one (N, K) matrix.
        mean: (N, K) known mean; None: the sample mean (zero for T == 1 would be
            degenerate, so pass ``torch.zeros`` explicitly to model a single matrix).
        iters, tol: iteration cap and relative-change stopping rule.
        row_shrinkage, col_shrinkage: shrinkage of U and V towards their diagonals.
        diagonal_rows, diagonal_cols: keep only the diagonal of U (N,) or V (K,).

    Returns:
        MatrixNormal with float64-estimated factors cast to float32.
    """
    w = samples.detach().double()
    if w.dim() == 2:
        w = w[None]
    if w.dim() != 3 or min(w.shape) == 0:
        raise ValueError(f"flip_flop expects samples (T, N, K), got {tuple(samples.shape)}")
    t, n, k = w.shape
    if mean is None:
        if t == 1:
            raise ValueError("flip_flop on one matrix needs an explicit mean (e.g. zeros)")
        m = w.mean(0)
    else:
        m = mean.detach().double().to(w.device)
    r = w - m
    if not torch.isfinite(r).all():
        raise ValueError("flip_flop: samples hold NaN or Inf")
    u = torch.ones(n, dtype=w.dtype, device=w.device)
    v = torch.ones(k, dtype=w.dtype, device=w.device)
    if not diagonal_rows:
        u = torch.diag(u)
    if not diagonal_cols:
        v = torch.diag(v)
    for _ in range(iters):
        v_old = v
        if diagonal_cols:
            rv = r / v
        else:
            rv = r @ _spd_inverse(v)
        u = (rv * r).sum((0, 2)) / (t * k) if diagonal_rows else \
            _shrink(torch.einsum("tnk,tmk->nm", rv, r) / (t * k), row_shrinkage)
        if diagonal_rows:
            ru = r / u[:, None]
        else:
            ru = _spd_inverse(u) @ r
        v = (ru * r).sum((0, 1)) / (t * n) if diagonal_cols else \
            _shrink(torch.einsum("tnk,tnj->kj", ru, r) / (t * n), col_shrinkage)
        trace_v = (v.sum() if diagonal_cols else torch.trace(v)).clamp(min=1e-300)
        c = trace_v / k
        v, u = v / c, u * c
        change = torch.linalg.norm(v - v_old) / torch.linalg.norm(v_old).clamp(min=1e-300)
        if float(change) < tol:
            break
    return MatrixNormal(m.float(), u.float(), v.float())


class WeightModel:
    """Matrix-normal model of a Linear's weight W (N, K), learned across snapshots.

    One weight snapshot is a single matrix, on which the flip-flop MLE is degenerate. So:

    * ``mean`` M is the bias-corrected EMA of the snapshots (factor ``ema``; one snapshot
      gives M = W exactly). Updating it is one fused multiply-add per stats step.
    * U and V are fitted lazily, when asked for, to M seen as **one zero-mean draw**
      ``M ~ MN(0, U, V)``: the rows act as K-dim samples for V and the columns as N-dim
      samples for U, with shrinkage towards the diagonal ``d / (d + samples)`` (0.5 for a
      square weight). A factor above ``max_full_cov_dim`` is kept diagonal. U and V thus
      describe the second moments of the weight's entries (row and column scales and
      correlations), not the drift between snapshots; the overall scale is then set so that
      ``mean(diag U) · mean(diag V) = mean(M²)``. The sampler draws fresh weights
      ``MN(0, U, V)`` with that structure (or uses M itself: ``weight_source='mean'``).
    """

    def __init__(self, ema: float = 0.9, max_full_cov_dim: int = 1024) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError("WeightModel.ema must be in [0, 1)")
        self.ema = ema
        self.max_full_cov_dim = max_full_cov_dim
        self.snapshots = 0
        self._acc: Optional[torch.Tensor] = None
        self._fit: Optional[MatrixNormal] = None

    def observe(self, weight: torch.Tensor) -> None:
        """Fold one snapshot (N, K) into the EMA (no host sync)."""
        w = weight.detach()
        if w.dim() != 2:
            raise ValueError(f"a weight must be 2-D, got {tuple(w.shape)}")
        if self._acc is None:
            self._acc = torch.zeros(w.shape, device=w.device)
        elif self._acc.shape != w.shape:
            raise ValueError(f"weight shape changed from {tuple(self._acc.shape)} to {tuple(w.shape)}")
        self._acc.mul_(self.ema).add_(w, alpha=1.0 - self.ema)  # float32 EMA of any dtype
        self.snapshots += 1
        self._fit = None

    @property
    def mean(self) -> torch.Tensor:
        """(N, K) bias-corrected EMA of the snapshots."""
        if self._acc is None:
            raise RuntimeError("WeightModel has seen no weight yet")
        return self._acc / (1.0 - self.ema ** self.snapshots)

    def fit(self) -> MatrixNormal:
        """MN(M, U, V) with U, V from the single-matrix flip-flop described above (cached)."""
        if self._fit is None:
            m = self.mean
            n, k = m.shape
            rows_diag, cols_diag = n > self.max_full_cov_dim, k > self.max_full_cov_dim
            fitted = flip_flop(m, torch.zeros_like(m), iters=20, tol=1e-4,
                               row_shrinkage=shrinkage_for(n, k), col_shrinkage=shrinkage_for(k, n),
                               diagonal_rows=rows_diag, diagonal_cols=cols_diag)
            # The shrunk single-sample fit is biased in overall scale; fix the scale by the
            # moment estimator E|W_ij|² = mean(diag U) · mean(diag V).
            u, v = fitted.row_cov, fitted.col_cov
            du = u if u.dim() == 1 else torch.diagonal(u)
            dv = v if v.dim() == 1 else torch.diagonal(v)
            scale = m.square().mean() / (du.mean() * dv.mean()).clamp(min=1e-30)
            self._fit = MatrixNormal(m, u * scale, v)
        return self._fit

    def summary(self) -> Dict[str, float]:
        if self._acc is None:
            return {"snapshots": 0}
        m = self.mean
        a = m.abs()
        row_rms = m.square().mean(1).sqrt()
        col_rms = m.square().mean(0).sqrt()
        x = m.reshape(-1).double()
        xc = x - x.mean()
        kurt = float(xc.pow(4).mean() / xc.square().mean().square().clamp(min=1e-300) - 3.0)
        return {"snapshots": self.snapshots, "amax": float(a.max()),
                "rms": float(m.square().mean().sqrt()), "kurtosis": kurt,
                "row_rms_ratio": float(row_rms.max() / row_rms.median().clamp(min=1e-30)),
                "col_rms_ratio": float(col_rms.max() / col_rms.median().clamp(min=1e-30))}
