"""Online statistics of a GEMM site: what the Probe learns while the model trains.

Three models, each cheap enough to update inside a training step without a host sync:

* :class:`Welford` — mean and covariance of feature vectors (rows of an activation or a
  gradient), float32, batched and merged with the parallel update of Chan, Golub and
  LeVeque (1979). Feature dims above ``max_full_cov_dim`` keep a **block-diagonal**
  covariance (blocks of ``block_size`` consecutive features): memory ``D * block_size``
  floats instead of ``D²``, and correlations across blocks are taken as zero.
* :class:`ChannelMoments` — per-channel power sums up to the fourth, for excess
  kurtosis; :class:`FP8RangeStats` — per-channel amax and the fractions of values an FP8
  cast would overflow or flush (see its docstring).
* :class:`WeightModel` — a matrix-normal model ``W ~ MN(M, U, V)`` of a weight (N, K),
  fitted by the flip-flop algorithm (Dutilleux 1999) on the EMA of weight snapshots.

Rows with a NaN or Inf are left out of the moment updates (and counted), so one bad
batch never poisons what was learned; counts live on the device for the same reason.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..numerics import get_format

__all__ = ["Welford", "ChannelMoments", "FP8RangeStats", "TensorStats", "MatrixNormal",
           "flip_flop", "WeightModel", "SiteStats", "shrinkage_for", "bootstrap_stat"]


def _as_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != dim:
        raise ValueError(f"expected rows of shape (B, {dim}), got {tuple(x.shape)}")
    return x.detach().float()


def _finite_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x with bad rows zeroed, (B,) float mask of the finite rows); no host sync."""
    ok = torch.isfinite(x).all(dim=1)
    return torch.where(ok[:, None], x, 0.0), ok.float()


class Welford:
    """Running mean and covariance of D-dimensional rows.

    ``update(x)`` folds a batch (B, D) in with Chan's merge: the batch is centred on its
    own mean first, so merging batches of any size equals one pass over all rows up to
    float32 rounding, and large offsets do not cancel catastrophically.

    Args:
        dim: D, features per row.
        max_full_cov_dim: full (D, D) covariance up to this D; above it block-diagonal.
        block_size: block length of the block-diagonal covariance (the last block is
            zero-padded to full length; the padding is invisible to callers).
        device: where the state lives (default: that of the first batch).
    """

    def __init__(self, dim: int, max_full_cov_dim: int = 1024, block_size: int = 256,
                 device: "torch.device | str | None" = None) -> None:
        if dim < 1 or block_size < 1:
            raise ValueError(f"Welford needs dim >= 1 and block_size >= 1, got {dim}, {block_size}")
        self.dim = dim
        self.block_size = min(block_size, dim)
        self.blocked = dim > max_full_cov_dim
        self.num_blocks = -(-dim // self.block_size) if self.blocked else 1
        self._n: Optional[torch.Tensor] = None
        self.nonfinite_rows: Optional[torch.Tensor] = None
        if device is not None:
            self._init(torch.device(device))

    def _init(self, device: torch.device) -> None:
        d = self.dim
        self._n = torch.zeros((), device=device)
        self.nonfinite_rows = torch.zeros((), device=device)
        self._mean = torch.zeros(d, device=device)
        if self.blocked:
            self._m2 = torch.zeros(self.num_blocks, self.block_size, self.block_size, device=device)
        else:
            self._m2 = torch.zeros(d, d, device=device)

    # -- updates ---------------------------------------------------------------------
    def _blocks(self, v: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., nb, bs), zero-padding the last block."""
        pad = self.num_blocks * self.block_size - self.dim
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))
        return v.reshape(*v.shape[:-1], self.num_blocks, self.block_size)

    def _add_outer(self, u: torch.Tensor, v: torch.Tensor, alpha: float = 1.0) -> None:
        """M2 += alpha · uᵀ v for row stacks u, v (B, D) (per block when blocked)."""
        if not self.blocked:
            self._m2.addmm_(u.t(), v, alpha=alpha)
        else:
            ub, vb = self._blocks(u).transpose(0, 1), self._blocks(v).transpose(0, 1)
            self._m2.baddbmm_(ub.transpose(1, 2), vb, alpha=alpha)

    def update(self, x: torch.Tensor) -> None:
        """Fold in a batch of rows ``x`` (B, D); rows holding NaN/Inf are skipped."""
        x, w = _finite_rows(_as_rows(x, self.dim))
        self.update_masked(x, w)

    def update_masked(self, x: torch.Tensor, w: torch.Tensor,
                      n_b: Optional[torch.Tensor] = None,
                      batch_mean: Optional[torch.Tensor] = None) -> None:
        """:meth:`update` for rows already cleaned: ``x`` (B, D) float32 with bad rows
        zeroed, ``w`` (B,) their 0/1 float mask (as ``_finite_rows`` returns), and if
        known ``n_b = w.sum()`` and ``batch_mean = x.sum(0) / n_b``.

        Chan's pairwise update with the batch centred on the running mean ``μ`` (on its
        own mean for the first rows): with ``d = x - μ``, ``S = Σ d dᵀ`` and ``s = Σ d``,
        ``M2 += S - s sᵀ / n`` and ``μ += s / n``, algebraically the same as merging the
        batch's own (n_b, mean, M2) and one pass fewer. All in place, no host sync.
        """
        if self._n is None:
            self._init(x.device)
        if x.shape[0] == 0:
            return
        if n_b is None:
            n_b = w.sum()
        if batch_mean is None:
            batch_mean = x.sum(0) / n_b.clamp(min=1.0)
        center = torch.where(self._n > 0, self._mean, batch_mean)
        d = (x - center) * w[:, None]
        s = d.sum(0)
        self._n += n_b
        n = self._n.clamp(min=1.0)
        self._mean.copy_(center + s / n)
        self._add_outer(d, d)
        g = (s / n.sqrt())[None]
        self._add_outer(g, g, alpha=-1.0)
        self.nonfinite_rows += x.shape[0] - n_b

    def _merge(self, n_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        """Chan's merge of a whole accumulator (n_b, mean_b, M2_b)."""
        n_a = self._n
        n = (n_a + n_b).clamp(min=1.0)
        delta = mean_b - self._mean
        self._mean += delta * (n_b / n)
        g = (delta * (n_a * n_b / n).sqrt())[None]
        self._m2 += m2_b
        self._add_outer(g, g)
        self._n = n_a + n_b

    def merge(self, other: "Welford") -> "Welford":
        """Fold another accumulator of the same layout into this one (e.g. another rank's)."""
        if (other.dim, other.blocked, other.block_size) != (self.dim, self.blocked, self.block_size):
            raise ValueError("cannot merge Welford accumulators of different layouts")
        if other._n is None:
            return self
        if self._n is None:
            self._init(other._mean.device)
        self._merge(other._n, other._mean, other._m2)
        self.nonfinite_rows += other.nonfinite_rows
        return self

    # -- results ---------------------------------------------------------------------
    @property
    def count(self) -> int:
        """rows folded in so far (a host sync)."""
        return 0 if self._n is None else int(self._n.item())

    @property
    def mean(self) -> torch.Tensor:
        """(D,) float32."""
        self._require()
        return self._mean

    def _denominator(self, ddof: int) -> torch.Tensor:
        return (self._n - ddof).clamp(min=1.0).float()

    def variance(self, ddof: int = 1) -> torch.Tensor:
        """(D,) per-feature variance."""
        self._require()
        diag = torch.diagonal(self._m2, dim1=-2, dim2=-1).reshape(-1)[: self.dim]
        return diag / self._denominator(ddof)

    def block_covariances(self, ddof: int = 1) -> torch.Tensor:
        """Block-diagonal covariance ``(nb, bs, bs)``; for a full covariance ``(1, D, D)``.
        Rows and columns beyond D in the last block are zero padding."""
        self._require()
        m2 = self._m2 if self.blocked else self._m2[None]
        return m2 / self._denominator(ddof)

    def covariance(self, ddof: int = 1) -> torch.Tensor:
        """(D, D) covariance; in block-diagonal mode it is assembled densely (D² floats:
        for large D prefer :meth:`block_covariances`)."""
        self._require()
        if not self.blocked:
            return self._m2 / self._denominator(ddof)
        return torch.block_diag(*self.block_covariances(ddof))[: self.dim, : self.dim]

    def _require(self) -> None:
        if self._n is None:
            raise RuntimeError("Welford has seen no data yet")


class ChannelMoments:
    """Per-channel power sums ``S_p = Σ (x - c)^p``, p = 1..4, about a fixed centre ``c``
    (the first batch's channel means), accumulated in float64: excess kurtosis and
    variance per channel, and pooled over all channels, at any time.

    Summing about a fixed centre needs no merge step (a handful of kernels per update),
    and because ``c`` is near the mean the shift back to central moments loses almost
    nothing.

    Args:
        dim: channels C; ``update`` takes (B, C).
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._n: Optional[torch.Tensor] = None

    def update(self, x: torch.Tensor, row_weight: Optional[torch.Tensor] = None,
               rows: Optional[torch.Tensor] = None,
               batch_mean: Optional[torch.Tensor] = None) -> None:
        """Fold in (B, C). Optionally, as :class:`TensorStats` passes them: ``row_weight``
        (B,) 0/1 marks the rows to keep (bad rows of x then zeroed), ``rows`` its sum and
        ``batch_mean`` the mean of the kept rows."""
        if row_weight is None:
            x, row_weight = _finite_rows(_as_rows(x, self.dim))
        if x.shape[0] == 0:
            return
        if rows is None:
            rows = row_weight.sum()
        if batch_mean is None:
            batch_mean = x.sum(0) / rows.clamp(min=1.0)
        if self._n is None:
            self._n = torch.zeros((), dtype=torch.float64, device=x.device)
            self._sums = torch.zeros(4, self.dim, dtype=torch.float64, device=x.device)
            self._center = torch.zeros(self.dim, device=x.device)
        # the centre is fixed by the first rows seen (it moves only while nothing is summed)
        torch.where(self._n > 0, self._center, batch_mean, out=self._center)
        d = (x - self._center) * row_weight[:, None]
        d2 = d * d
        self._sums += torch.stack([d.sum(0), d2.sum(0), (d2 * d).sum(0), (d2 * d2).sum(0)])
        self._n += rows

    @property
    def count(self) -> int:
        return 0 if self._n is None else int(self._n.item())

    def _central(self, sums: torch.Tensor, n: torch.Tensor):
        """(mean offset from the centre, m2, m4) from power sums (4, C) of n values each."""
        m1, s2, s3, s4 = (sums[i] / n for i in range(4))
        m2 = s2 - m1 ** 2
        m4 = s4 - 4 * m1 * s3 + 6 * m1 ** 2 * s2 - 3 * m1 ** 4
        return m1, m2, m4

    @property
    def mean(self) -> torch.Tensor:
        """(C,) float32."""
        m1, _, _ = self._central(self._sums, self._n.clamp(min=1.0))
        return (self._center.double() + m1).float()

    def variance(self, ddof: int = 0) -> torch.Tensor:
        n = self._n.clamp(min=1.0)
        _, m2, _ = self._central(self._sums, n)
        return (m2 * n / (n - ddof).clamp(min=1.0)).float()

    def excess_kurtosis(self) -> torch.Tensor:
        """(C,) ``m4 / m2² - 3``; 0 for a Gaussian, large for heavy tails; NaN for a
        constant channel."""
        _, m2, m4 = self._central(self._sums, self._n.clamp(min=1.0))
        return (m4 / (m2 * m2) - 3.0).float()

    def pooled_excess_kurtosis(self) -> float:
        """Excess kurtosis of all values of all channels together: large when a few
        channels are far wider than the rest (outlier channels), even if each channel
        alone is Gaussian."""
        n = self._n.clamp(min=1.0)
        m1, _, _ = self._central(self._sums, n)
        c = self._center.double()
        delta = c - (c + m1).mean()  # each channel's centre relative to the pooled mean
        s1, s2, s3, s4 = self._sums
        # Σ (d + δ)^p over every channel, by the binomial expansion
        t1 = s1 + delta * n
        t2 = s2 + 2 * delta * s1 + delta ** 2 * n
        t3 = s3 + 3 * delta * s2 + 3 * delta ** 2 * s1 + delta ** 3 * n
        t4 = s4 + 4 * delta * s3 + 6 * delta ** 2 * s2 + 4 * delta ** 3 * s1 + delta ** 4 * n
        pooled = torch.stack([t1.sum(), t2.sum(), t3.sum(), t4.sum()])[:, None]
        _, m2, m4 = self._central(pooled, n * self.dim)
        return float(m4[0] / (m2[0] * m2[0]) - 3.0)


class FP8RangeStats:
    """Per-channel amax and how an FP8 cast treats the values, per update batch.

    Definitions (for format ``fmt``, e4m3 by default: max 448, smallest normal 2⁻⁶):

    * ``overflow_frac``: fraction of values with ``|x| > fmt.max`` at **unit scale**, i.e.
      what a cast without scaling would saturate;
    * ``underflow_frac``: fraction of the non-zero values that fall below ``fmt.min_normal``
      after **tensorwise** scaling of their batch, ``|x| / s < min_normal`` with
      ``s = amax(batch) / fmt.max``: values that lose mantissa bits or flush to zero because
      one outlier sets the scale of the whole tensor (what breaks tensorwise FP8);
    A row holding a NaN or Inf is left out (all its values, as in the moments); the
    moments count such rows.

    Args:
        dim: channels C of the (B, C) batches.
        fmt: FP8 format name.
    """

    def __init__(self, dim: int, fmt: str = "e4m3") -> None:
        self.dim = dim
        self.fmt = get_format(fmt)
        self._amax: Optional[torch.Tensor] = None

    def update(self, x: torch.Tensor, rows: Optional[torch.Tensor] = None,
               clean: bool = False) -> None:
        """Fold in (B, C); with ``clean`` the bad rows of x are zeroed already and
        ``rows`` is the number of the others."""
        if not clean:
            x, w = _finite_rows(_as_rows(x, self.dim))
            rows = w.sum()
        if self._amax is None:
            dev = x.device
            self._amax = torch.zeros(self.dim, device=dev)
            self._counts = torch.zeros(3, dtype=torch.float64, device=dev)  # n, over, under
        if x.shape[0] == 0:
            return
        a = x.abs()
        ch_amax = a.amax(0)
        torch.maximum(self._amax, ch_amax, out=self._amax)
        threshold = ch_amax.max() * (self.fmt.min_normal / self.fmt.max)
        self._counts += torch.stack([rows * self.dim, (a > self.fmt.max).sum(),
                                     ((a > 0) & (a < threshold)).sum()])

    @property
    def channel_amax(self) -> torch.Tensor:
        """(C,) largest |x| seen per channel (rows holding NaN/Inf excluded)."""
        return self._amax

    def summary(self) -> Dict[str, float]:
        n, over, under = (float(v) for v in self._counts.tolist())
        amax = self._amax
        med = float(amax.median())
        top = float(amax.max())
        return {"amax": top, "channel_amax_median": med,
                "channel_amax_ratio": top / med if med > 0 else (math.inf if top > 0 else 1.0),
                f"overflow_frac_{self.fmt.name}": over / max(n, 1.0),
                f"underflow_frac_{self.fmt.name}": under / max(n, 1.0)}


_GRAPH_POOLS: Dict[int, object] = {}
"""one CUDA-graph memory pool per device, shared by every statistics graph: the graphs
replay one after another, so their temporaries can share memory"""


class TensorStats:
    """Everything learned about one operand (the input x or the output gradient dy):
    Gaussian moments for sampling, per-channel range and kurtosis for the report.

    One update is about 45 small kernels and no host sync. With ``graphs`` on a CUDA
    device, the update of each batch shape is captured once as a CUDA graph (at the second
    update of that shape, after an eager warm-up) and replayed from then on: one copy and
    one launch instead of 45, which is what keeps a statistics step cheap. If a capture
    fails the shape is updated eagerly, with the same numbers.

    Args:
        dim: features D per row.
        max_full_cov_dim, block_size: the covariance layout (see :class:`Welford`).
        graphs: replay updates as CUDA graphs on CUDA devices.
    """

    def __init__(self, dim: int, max_full_cov_dim: int = 1024, block_size: int = 256,
                 graphs: bool = False) -> None:
        self.dim = dim
        self.moments = Welford(dim, max_full_cov_dim, block_size)
        self.channels = ChannelMoments(dim)
        self.range = FP8RangeStats(dim)
        self.updates = 0
        self.graphs = graphs
        self._graphs: Dict[tuple, tuple] = {}
        self._eager_shapes: set = set()
        self.graph_replays = 0
        """updates done by replaying a captured graph (the rest ran eagerly)"""
        self.graph_failure: Optional[str] = None
        """why a capture failed, if one did (those shapes are then updated eagerly)"""

    def update(self, x: torch.Tensor) -> None:
        """Fold in rows (B, D) (any float dtype)."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected rows of shape (B, {self.dim}), got {tuple(x.shape)}")
        x = x.detach()
        if not (self.graphs and x.is_cuda and self.updates > 0 and self._replay(x)):
            self._update(x.float())
        self.updates += 1

    def _update(self, x: torch.Tensor) -> None:
        """The device work of one update; every piece of state changes in place."""
        x, w = _finite_rows(x)
        rows = w.sum()
        batch_mean = x.sum(0) / rows.clamp(min=1.0)
        self.moments.update_masked(x, w, rows, batch_mean)
        self.channels.update(x, w, rows, batch_mean)
        self.range.update(x, rows, clean=True)

    def _replay(self, x: torch.Tensor) -> bool:
        key = (tuple(x.shape), x.device)
        entry = self._graphs.get(key)
        if entry is not None:
            graph, static = entry
            static.copy_(x)
            graph.replay()
            self.graph_replays += 1
            return True
        if key in self._eager_shapes:
            return False
        static = x.float().clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # this update, eagerly: the warm-up capture wants
            self._update(static)
        torch.cuda.current_stream(x.device).wait_stream(side)
        pool = _GRAPH_POOLS.setdefault(x.device.index or 0, torch.cuda.graph_pool_handle())
        graph = torch.cuda.CUDAGraph()
        try:
            # capture_begin/end rather than torch.cuda.graph(), which would also run
            # gc.collect() and empty the allocator's cache in the middle of a training step
            with torch.cuda.stream(side):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    self._update(static)  # recorded, not run
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - capture unsupported here: stay eager
            self.graph_failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            self._eager_shapes.add(key)
            torch.cuda.synchronize(x.device)
            return True  # this update was applied by the warm-up
        self._graphs[key] = (graph, static)
        return True

    def summary(self) -> Dict[str, float]:
        """Scalars for the report (host syncs)."""
        if self.updates == 0:
            return {"updates": 0}
        var = self.moments.variance()
        kurt = self.channels.excess_kurtosis()
        kurt = kurt[torch.isfinite(kurt)]
        out = {"updates": self.updates, "rows": self.moments.count,
               "mean_abs_mean": float(self.moments.mean.abs().mean()),
               "rms": float((var + self.moments.mean ** 2).mean().sqrt()),
               "kurtosis": self.channels.pooled_excess_kurtosis(),
               "channel_kurtosis_max": float(kurt.max()) if kurt.numel() else math.nan,
               "channel_kurtosis_mean": float(kurt.mean()) if kurt.numel() else math.nan,
               "nonfinite_rows": float(self.moments.nonfinite_rows),
               "covariance": "block-diagonal" if self.moments.blocked else "full",
               "graph_replays": self.graph_replays}
        if self.graph_failure:
            out["graph_failure"] = self.graph_failure
        out.update(self.range.summary())
        return out


# --------------------------------------------------------------------------------------
# weights: matrix-normal model
# --------------------------------------------------------------------------------------

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


class SiteStats:
    """What the Probe learned at one Linear: input x (K features), output gradient dy
    (N features), the weight model, and the observed row count M."""

    def __init__(self, name: str, in_features: int, out_features: int, *,
                 max_full_cov_dim: int = 1024, block_size: int = 256, weight_ema: float = 0.9,
                 graphs: bool = False):
        self.name = name
        self.in_features, self.out_features = in_features, out_features
        self.act = TensorStats(in_features, max_full_cov_dim, block_size, graphs)
        self.grad = TensorStats(out_features, max_full_cov_dim, block_size, graphs)
        self.weight = WeightModel(weight_ema, max_full_cov_dim)
        self.tokens = 0
        """largest row count M of one forward call seen (the M of the site's GEMMs)"""
        self.dtype: Optional[torch.dtype] = None
        """dtype the GEMM ran in (the forward output's dtype, so autocast is seen)"""
        self.captured_x: Optional[torch.Tensor] = None
        """source='captured': the last captured input rows (R, K), row-aligned with dy"""
        self.captured_dy: Optional[torch.Tensor] = None
        """source='captured': the output-gradient rows (R, N) of the same rows as x"""

    def summary(self) -> Dict[str, object]:
        return {"act": self.act.summary(), "grad": self.grad.summary(),
                "weight": self.weight.summary()}


def bootstrap_stat(values, resamples: int = 1000, seed: int = 0, level: float = 0.95):
    """Mean of per-sample values with a percentile-bootstrap confidence interval.

    Args:
        values: (n,) per-sample statistics (e.g. one MERE per synthetic sample).
        resamples: bootstrap resamples; 0 gives the normal interval ``mean ± 1.96 s/√n``.
        seed: seed of the resampling.
        level: coverage of the interval.

    Returns:
        :class:`~loka.probe.report.ErrorStat` (mean, lo, hi, n, std). Non-finite values
        propagate (a NaN anywhere makes every field NaN), so they never pass a budget.
    """
    import numpy as np

    from .report import ErrorStat

    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n = v.size
    if n == 0:
        raise ValueError("bootstrap_stat needs at least one value")
    with np.errstate(all="ignore"):
        mean = float(v.mean())
        std = float(v.std(ddof=1)) if n > 1 else 0.0
        if not np.isfinite(v).all():
            return ErrorStat(mean, mean, mean, n, std)
        alpha = (1.0 - level) / 2.0
        if resamples == 0 or n == 1:
            half = statistics.NormalDist().inv_cdf(1.0 - alpha) * std / math.sqrt(n)
            return ErrorStat(mean, mean - half, mean + half, n, std)
        rng = np.random.default_rng(seed)
        means = v[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
        lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return ErrorStat(mean, float(lo), float(hi), n, std)
