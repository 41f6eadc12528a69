"""Online statistics of a GEMM site: what the Probe learns while the model trains.

Models of the activation and gradient rows, each cheap enough to update inside a training
step without a host sync:

* :class:`Welford` — mean and covariance of feature vectors (rows of an activation or a
  gradient), float32, batched and merged with the parallel update of Chan, Golub and
  LeVeque (1979). Feature dims above ``max_full_cov_dim`` keep a **block-diagonal**
  covariance (blocks of ``block_size`` consecutive features): memory ``D * block_size``
  floats instead of ``D²``, and correlations across blocks are taken as zero.
* :class:`ChannelMoments` — per-channel power sums up to the fourth, for excess
  kurtosis; :class:`FP8RangeStats` — per-channel amax and the fractions of values an FP8
  cast would overflow or flush (see its docstring).

The weight's model is :class:`~loka.probe.weights.WeightModel`; :class:`SiteStats` holds
all three of a site.

Rows with a NaN or Inf are left out of the moment updates (and counted), so one bad
batch never poisons what was learned; counts live on the device for the same reason.

Each accumulator merges with another of its kind (``merge``: another rank's rows, in
data-parallel training), and :meth:`SiteStats.to` copies a site's statistics to another
device, ready to travel between processes.

Length: the accumulators of one site, their updates and merges belong together; split,
each piece would need the others' internals.
"""

from __future__ import annotations

import copy
import math
from typing import Dict, Optional, Tuple

import torch

from ..numerics import get_format
from ..timing import capture_into, release_rng_after_failed_capture
from .producers import merge_kinds
from .weights import WeightModel

__all__ = ["Welford", "ChannelMoments", "FP8RangeStats", "TensorStats", "SiteStats"]


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

    def merge(self, other: "ChannelMoments") -> "ChannelMoments":
        """Fold in another accumulator of the same channels (e.g. another rank's): its
        power sums are moved to this centre by the binomial expansion, then added."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge ChannelMoments of {other.dim} and {self.dim} channels")
        if other._n is None:
            return self
        if self._n is None:
            self._n = other._n.clone()
            self._sums = other._sums.clone()
            self._center = other._center.clone()
            return self
        delta = other._center.double().to(self._sums.device) - self._center.double()
        s1, s2, s3, s4 = other._sums.to(self._sums.device)
        n = other._n.to(self._n.device)
        self._sums += torch.stack([
            s1 + delta * n,
            s2 + 2 * delta * s1 + delta ** 2 * n,
            s3 + 3 * delta * s2 + 3 * delta ** 2 * s1 + delta ** 3 * n,
            s4 + 4 * delta * s3 + 6 * delta ** 2 * s2 + 4 * delta ** 3 * s1 + delta ** 4 * n])
        self._n += n
        return self

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

    def merge(self, other: "FP8RangeStats") -> "FP8RangeStats":
        """Fold in another accumulator of the same channels: the larger amax per channel,
        the counts added."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge FP8RangeStats of {other.dim} and {self.dim} channels")
        if other._amax is None:
            return self
        if self._amax is None:
            self._amax, self._counts = other._amax.clone(), other._counts.clone()
            return self
        torch.maximum(self._amax, other._amax.to(self._amax.device), out=self._amax)
        self._counts += other._counts.to(self._counts.device)
        return self

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
        try:  # (not torch.cuda.graph(): no gc.collect() in the middle of a training step)
            capture_into(graph, lambda: self._update(static), side, "thread_local", pool=pool)
        except Exception as exc:  # noqa: BLE001 - capture unsupported here: stay eager
            self.graph_failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            self._eager_shapes.add(key)
            torch.cuda.synchronize(x.device)
            release_rng_after_failed_capture(x.device)
            return True  # this update was applied by the warm-up
        self._graphs[key] = (graph, static)
        return True

    def merge(self, other: "TensorStats") -> "TensorStats":
        """Fold in what another accumulator of the same operand learned (another rank's
        rows): moments by Chan's merge, channel sums re-centred, ranges by max and sum."""
        if other.dim != self.dim:
            raise ValueError(f"cannot merge TensorStats of {other.dim} and {self.dim} features")
        self.moments.merge(other.moments)
        self.channels.merge(other.channels)
        self.range.merge(other.range)
        self.updates += other.updates
        return self

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
        self.producers: Dict[str, str] = {}
        """'x' and 'dy' -> the kind of op that makes that operand
        (:mod:`loka.probe.producers`), where the Probe saw it"""
        self.order: Optional[int] = None
        """when the site first ran in the observed training forwards: 0 for the first site
        to run, counting sites (a shared Linear counts at its first call)"""

    def summary(self) -> Dict[str, object]:
        return {"act": self.act.summary(), "grad": self.grad.summary(),
                "weight": self.weight.summary()}

    def merge(self, other: "SiteStats") -> "SiteStats":
        """Fold in another rank's statistics of the same site (data parallel: each rank
        saw its own rows). The weight model is kept: every rank holds the same weights."""
        if (other.in_features, other.out_features) != (self.in_features, self.out_features):
            raise ValueError(f"cannot merge site {other.name!r} "
                             f"({other.in_features}->{other.out_features}) into {self.name!r} "
                             f"({self.in_features}->{self.out_features})")
        self.act.merge(other.act)
        self.grad.merge(other.grad)
        self.tokens = max(self.tokens, other.tokens)
        self.dtype = self.dtype or other.dtype
        for operand, kind in other.producers.items():
            self.producers[operand] = merge_kinds(self.producers.get(operand), kind)
        if other.order is not None and (self.order is None or other.order < self.order):
            self.order = other.order  # a rank that never ran the site recorded none
        return self

    def to(self, device: "torch.device | str") -> "SiteStats":
        """A copy with every state tensor on ``device``, without captured CUDA graphs or
        captured operand rows (what can travel between processes)."""
        device = torch.device(device)

        def moved(obj):
            new = copy.copy(obj)
            for key, value in vars(obj).items():
                if isinstance(value, torch.Tensor):
                    setattr(new, key, value.detach().to(device, copy=True))
            return new

        out = copy.copy(self)
        out.captured_x = out.captured_dy = None
        out.producers = dict(self.producers)
        for part in ("act", "grad"):
            ts = moved(getattr(self, part))
            ts.moments, ts.channels, ts.range = (moved(ts.moments), moved(ts.channels),
                                                 moved(ts.range))
            ts._graphs, ts._eager_shapes = {}, set()
            setattr(out, part, ts)
        out.weight = moved(self.weight)
        out.weight._fit = None
        return out
