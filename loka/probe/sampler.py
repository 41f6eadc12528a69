"""Synthetic GEMM operands for a site and role, drawn from what the Probe learned.

Operands come in the very layouts ``loka.Linear`` hands to a kernel, so that a kernel
sensitive to strides is measured as it will run:

=======  =======================  ==========================
role     a                        b
=======  =======================  ==========================
fwd      x  (M, K)                Wᵀ (K, N), a view of W (N, K)
dgrad    dy (M, N)                W  (N, K)
wgrad    dyᵀ (N, M), a view       x  (M, K)
=======  =======================  ==========================

Rows of x and dy are drawn from the site's Gaussian models (full covariance, or block by
block for block-diagonal ones), weights from its matrix-normal model. The rows of x and
dy are drawn independently: their correlation through the network is not modelled (use
``source='captured'`` for real pairs). :func:`naive_pair` gives the N(0, 1) baseline of
the same shapes, which is what a Probe without learned statistics would measure.
"""

from __future__ import annotations

import zlib
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..config import Role
from .stats import SiteStats, Welford
from .weights import MatrixNormal

__all__ = ["cholesky_factor", "GaussianSampler", "MatrixNormalSampler", "sample_matrix_normal",
           "OperandSampler",
           "naive_pair", "error_rows", "seed_for"]

ROW_ALIGN = 16
"""sample row counts are multiples of this: the wgrad GEMM reduces over them (K = M)"""


def seed_for(seed: int, *keys: str) -> int:
    """A stable per-(site, role) seed, independent of Python's hash randomisation."""
    return (seed * 1_000_003 + zlib.crc32("/".join(keys).encode())) % (2 ** 63)


def cholesky_factor(cov: torch.Tensor) -> torch.Tensor:
    """A factor L with ``L Lᵀ ≈ cov`` for (d, d) or batched (b, d, d) covariances.

    Cholesky in float64; a failing matrix (singular: a dead channel, padding) gets a
    growing jitter ``ε · mean(diag)`` on its diagonal, and if even that fails, the
    eigen-factor ``Q sqrt(max(Λ, 0))``.
    """
    c = cov.double()
    batched = c.dim() == 3
    if not batched:
        c = c[None]
    c = 0.5 * (c + c.transpose(1, 2))
    eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
    scale = torch.diagonal(c, dim1=1, dim2=2).mean(1).clamp(min=1e-30)[:, None, None]
    chol, info = torch.linalg.cholesky_ex(c)
    for jitter in (1e-7, 1e-5, 1e-3, 1e-1):
        bad = info != 0
        if not bool(bad.any()):
            break
        fixed, info_fixed = torch.linalg.cholesky_ex(c[bad] + jitter * scale[bad] * eye)
        chol[bad], info[bad] = fixed, info_fixed
    bad = info != 0
    if bool(bad.any()):
        lam, q = torch.linalg.eigh(c[bad])
        chol[bad] = q * lam.clamp(min=0).sqrt()[:, None, :]
    chol = chol.float()
    return chol if batched else chol[0]


class GaussianSampler:
    """Rows ``~ N(mean, Σ)`` from a :class:`~loka.probe.stats.Welford` (factored once)."""

    def __init__(self, moments: Welford, device: "torch.device | str") -> None:
        if moments.count < 2:
            raise ValueError("a Gaussian needs at least two observed rows")
        device = torch.device(device)
        self.dim = moments.dim
        self.mean = moments.mean.to(device)
        self.factors = cholesky_factor(moments.block_covariances().to(device))  # (nb, bs, bs)

    def sample(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        """(rows, D) float32."""
        nb, bs, _ = self.factors.shape
        z = torch.randn(rows, nb, bs, device=self.mean.device, generator=generator)
        x = torch.einsum("rbj,bij->rbi", z, self.factors).reshape(rows, nb * bs)
        return x[:, : self.dim] + self.mean


class MatrixNormalSampler:
    """Draws ``W = M + A Z Bᵀ`` with ``A Aᵀ = U``, ``B Bᵀ = V`` (factored once); diagonal
    factors scale rows or columns instead."""

    def __init__(self, model: MatrixNormal) -> None:
        self.mean = model.mean
        dev = model.mean.device
        u, v = model.row_cov.to(dev), model.col_cov.to(dev)
        self.row = u.clamp(min=0).sqrt() if u.dim() == 1 else cholesky_factor(u)
        self.col = v.clamp(min=0).sqrt() if v.dim() == 1 else cholesky_factor(v)

    def sample(self, generator: torch.Generator, include_mean: bool = True) -> torch.Tensor:
        """(N, K) float32."""
        z = torch.randn(*self.mean.shape, device=self.mean.device, generator=generator)
        w = self.row[:, None] * z if self.row.dim() == 1 else self.row @ z
        w = w * self.col[None, :] if self.col.dim() == 1 else w @ self.col.t()
        return w + self.mean if include_mean else w


def sample_matrix_normal(model: MatrixNormal, generator: torch.Generator, *,
                         include_mean: bool = True) -> torch.Tensor:
    """One draw of ``model`` (N, K) float32 (see :class:`MatrixNormalSampler`)."""
    return MatrixNormalSampler(model).sample(generator, include_mean)


def error_rows(stats: SiteStats, source: str, sample_rows: Optional[int]) -> int:
    """Rows M of each error-estimation sample, a multiple of 16 where possible.

    learned: ``sample_rows`` or the observed M capped at 4096, rounded up; captured: half
    the captured rows (so that the samples differ), rounded down, at most ``sample_rows``.
    """
    def up(m: int) -> int:
        return -(-m // ROW_ALIGN) * ROW_ALIGN

    if source == "learned":
        return up(max(1, sample_rows or min(stats.tokens, 4096)))
    have = 0 if stats.captured_x is None else stats.captured_x.shape[0]
    if have < 2 * ROW_ALIGN:
        return have
    m = have // 2 if sample_rows is None else min(sample_rows, have // 2)
    return max(ROW_ALIGN, m // ROW_ALIGN * ROW_ALIGN)


def _role_pair(role: Role, x: Optional[torch.Tensor], dy: Optional[torch.Tensor],
               w: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    if role is Role.FWD:
        return x, w.t()
    if role is Role.DGRAD:
        return dy, w
    return dy.t(), x


class OperandSampler:
    """Draws (a, b) operand pairs of one site and role.

    Args:
        stats: the site's learned statistics (and captured tensors, for 'captured').
        role: which GEMM of the Linear.
        device: where the operands are made.
        dtype: the GEMM's dtype at the site (operands are drawn in float32, then cast).
        source: 'learned' or 'captured'.
        weight_source: 'model' (fresh MN(0, U, V) draws) or 'mean' (the snapshot EMA),
            for 'learned'; 'captured' always uses ``weight``.
        weight: the current weight (N, K), used for 'captured'.
        seed: base seed; the stream is specific to (site, role).
        shared: a dict kept per site across its roles (the same ``stats`` and ``device``):
            the factorisations of x's and dy's covariances and of the weight model are
            made once there and reused by the other roles that draw the same operand
            (forward and wgrad both draw x, dgrad and wgrad dy). The draws are the same as
            without it: each role keeps its own random stream.
    """

    def __init__(self, stats: SiteStats, role: "Role | str", device, dtype: torch.dtype, *,
                 source: str = "learned", weight_source: str = "model",
                 weight: Optional[torch.Tensor] = None, seed: int = 0,
                 shared: Optional[Dict[str, object]] = None) -> None:
        self.stats, self.role = stats, Role.parse(role)
        self.device, self.dtype = torch.device(device), dtype
        self.source, self.weight_source = source, weight_source
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed_for(seed, stats.name, self.role.value))
        need_x = self.role in (Role.FWD, Role.WGRAD)
        need_dy = self.role in (Role.DGRAD, Role.WGRAD)
        need_w = self.role in (Role.FWD, Role.DGRAD)
        self._weight = self._model = None
        if source == "captured":
            if (need_x and stats.captured_x is None) or (need_dy and stats.captured_dy is None):
                raise ValueError(f"site {stats.name!r}: nothing captured for role {self.role}")
            if need_w and weight is None:
                raise ValueError("source='captured' needs the current weight")
            self._weight = None if weight is None else weight.detach().to(self.device, torch.float32)
        elif source == "learned":
            def once(key: str, build):  # a factorisation the site's other roles reuse
                if shared is None:
                    return build()
                if key not in shared:
                    shared[key] = build()
                return shared[key]
            self._x = (once("x", lambda: GaussianSampler(stats.act.moments, self.device))
                       if need_x else None)
            self._dy = (once("dy", lambda: GaussianSampler(stats.grad.moments, self.device))
                        if need_dy else None)
            if need_w:
                if weight_source not in ("mean", "model"):
                    raise ValueError(f"unknown weight_source {weight_source!r}")
                fitted = stats.weight.fit()
                if weight_source == "mean":
                    self._weight = fitted.mean.to(self.device)
                else:
                    self._model = once("w", lambda: MatrixNormalSampler(MatrixNormal(
                        fitted.mean.to(self.device), fitted.row_cov, fitted.col_cov)))
        else:
            raise ValueError(f"unknown source {source!r}")

    def _w(self) -> Optional[torch.Tensor]:
        if self._model is not None:
            return self._model.sample(self.generator, include_mean=False)
        return self._weight

    def pair(self, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """One (a, b) pair with M = ``rows`` in the site's dtype and Linear's layouts."""
        role, s = self.role, self.stats
        x = dy = None
        if self.source == "captured":
            have = (s.captured_x if s.captured_x is not None else s.captured_dy).shape[0]
            if rows > have:
                raise ValueError(f"asked for {rows} rows, {have} captured")
            idx = torch.randperm(have, generator=self.generator, device=self.device)[:rows]
            if role is not Role.DGRAD:
                x = s.captured_x.to(self.device)[idx].float()
            if role is not Role.FWD:
                dy = s.captured_dy.to(self.device)[idx].float()
        else:
            x = None if self._x is None else self._x.sample(rows, self.generator)
            dy = None if self._dy is None else self._dy.sample(rows, self.generator)
        w = self._w()
        cast = (lambda t: None if t is None else t.to(self.dtype).contiguous())
        return _role_pair(role, cast(x), cast(dy), cast(w))

    def pairs(self, n: int, rows: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(n):
            yield self.pair(rows)


def naive_pair(role: "Role | str", rows: int, in_features: int, out_features: int, device,
               dtype: torch.dtype, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """N(0, 1) operands of the shapes and layouts of :class:`OperandSampler`'s pairs."""
    role = Role.parse(role)
    device = torch.device(device)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    x = randn(rows, in_features) if role is not Role.DGRAD else None
    dy = randn(rows, out_features) if role is not Role.FWD else None
    w = randn(out_features, in_features) if role is not Role.WGRAD else None
    return _role_pair(role, x, dy, w)
