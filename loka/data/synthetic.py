"""A learnable synthetic CTR stream: a hidden teacher labels Zipf-distributed multi-hot ids
and heavy-tailed dense features, so a model that captures more of the teacher reaches a
measurably lower NE.

The teacher's logit is ``bias + main + interaction``:

* ``main``: one hidden scalar per id (mean over the bag, summed over tables) plus a linear
  function of the dense features - what a logistic regression can learn;
* ``interaction``: a factorization machine over the tables' hidden vectors (mean over the
  bag) and one field projected from the dense features - what it cannot.

Each part is scaled to a configured standard deviation and ``bias`` is solved so that the
mean teacher probability equals ``base_ctr``; labels are Bernoulli(teacher probability).

Batch ``i`` of a stream depends only on ``(seed, i)``, so the stream needs no materialized
data, can be positioned anywhere in O(1) (``load_state_dict``), and generates directly on
the device it was given (it can feed a GPU at batch 4096 without host copies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .batch import Batch, FeatureSpec, Jagged
from .torchrec import TorchrecBatches


@dataclass(frozen=True)
class SyntheticConfig:
    """The distribution of a synthetic CTR stream."""

    base_ctr: float = 0.03
    """mean teacher probability (the expected label mean)"""
    zipf_alpha: float = 1.05
    """ids of a table are drawn with P(rank r) ∝ (r + 1) ** -zipf_alpha"""
    teacher_dim: int = 4
    """width of the teacher's hidden vector per id"""
    main_effect_std: float = 0.6
    """std of the additive (logistic-regression-learnable) part of the teacher logit"""
    interaction_std: float = 1.0
    """std of the pairwise-interaction part of the teacher logit"""
    dense_df: float = 3.0
    """degrees of freedom of the Student-t dense channels (odd channels; even ones are log-normal)"""
    outlier_channels: int = 1
    """the last this-many dense channels are scaled by ``outlier_scale`` (outlier channels)"""
    outlier_scale: float = 10.0
    """scale of the outlier channels"""
    teacher_seed: int = 0
    """seed of the teacher; streams with different ``seed`` share it"""
    calibration_examples: int = 32768
    """examples used to scale the teacher's parts and solve its bias"""

    def __post_init__(self) -> None:
        if not 0.0 < self.base_ctr < 1.0:
            raise ValueError(f"base_ctr must be in (0, 1), got {self.base_ctr}")
        if self.zipf_alpha < 0:
            raise ValueError(f"zipf_alpha must be >= 0, got {self.zipf_alpha}")
        if self.teacher_dim < 1 or self.calibration_examples < 1024:
            raise ValueError("teacher_dim must be >= 1 and calibration_examples >= 1024")
        if self.dense_df <= 0 or self.outlier_channels < 0:
            raise ValueError("dense_df must be > 0 and outlier_channels >= 0")


def zipf_pmf(num_embeddings: int, alpha: float) -> np.ndarray:
    """(num_embeddings,) float64 probabilities of id ranks 0.. under the stream's Zipf law."""
    w = np.arange(1, num_embeddings + 1, dtype=np.float64) ** -alpha
    return w / w.sum()


def _derive_seed(*keys: int) -> int:
    lo, hi = np.random.SeedSequence([k & 0xFFFFFFFF for k in keys]).generate_state(2)
    return (int(hi) << 31) ^ int(lo)  # < 2**63: a valid torch seed


class _Teacher:
    """The hidden labelling function; shared by a stream and its held-out twin."""

    def __init__(self, spec: FeatureSpec, cfg: SyntheticConfig, device: torch.device):
        self.spec, self.cfg, self.device = spec, cfg, device
        rng = np.random.default_rng(_derive_seed(cfg.teacher_seed, 0x7EAC))
        sizes = [t.num_embeddings for t in spec.tables]
        self.row_base = torch.tensor(np.r_[0, np.cumsum(sizes)[:-1]] if sizes else [],
                                     dtype=torch.int64, device=device)
        # one concatenated CDF, table t shifted by +t, so a single searchsorted of u + t
        # draws ranks for every table at once
        cdfs = [np.cumsum(zipf_pmf(n, cfg.zipf_alpha)) for n in sizes]
        for c in cdfs:
            c[-1] = 1.0
        self.cdf = torch.tensor(np.concatenate([c + t for t, c in enumerate(cdfs)]) if cdfs
                                else np.zeros(0), dtype=torch.float64, device=device)
        # rank -> id bijection per table (id = a * rank + c mod n) so hot ids are scattered
        mult, shift = [], []
        for n in sizes:
            a = int(rng.integers(1, max(n, 2)))
            while math.gcd(a, n) != 1:
                a = a % n + 1
            mult.append(a)
            shift.append(int(rng.integers(0, n)))
        self.mult = torch.tensor(mult, dtype=torch.int64, device=device)
        self.shift = torch.tensor(shift, dtype=torch.int64, device=device)
        r, nd = cfg.teacher_dim, spec.num_dense
        f32 = dict(dtype=torch.float32, device=device)
        self.table = torch.tensor(rng.standard_normal((sum(sizes), r + 1)), **f32)
        self.dense_main = torch.tensor(rng.standard_normal(nd) / math.sqrt(max(nd, 1)), **f32)
        self.dense_field = torch.tensor(rng.standard_normal((nd, r)) / math.sqrt(max(nd, 1)), **f32)
        self.main_scale = self.inter_scale = 1.0
        self.bias = 0.0
        self._calibrate(_derive_seed(cfg.teacher_seed, 0xCA11B))

    def _calibrate(self, seed: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        dense, sparse = self.sample_features(gen, self.cfg.calibration_examples)
        main, inter = (x.double().cpu().numpy() for x in self.parts(dense, sparse))
        sd_m, sd_i = main.std(), inter.std()
        self.main_scale = self.cfg.main_effect_std / sd_m if sd_m > 1e-12 else 0.0
        self.inter_scale = self.cfg.interaction_std / sd_i if sd_i > 1e-12 else 0.0
        logits = self.main_scale * main + self.inter_scale * inter
        lo, hi = -30.0, 30.0  # bisection: mean sigmoid is monotone in the bias
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            mean_p = np.mean(1.0 / (1.0 + np.exp(-(logits + mid))))
            lo, hi = (mid, hi) if mean_p < self.cfg.base_ctr else (lo, mid)
        self.bias = 0.5 * (lo + hi)

    def sample_features(self, gen: torch.Generator, batch_size: int):
        """Dense (B, n_dense) float32 and {table: Jagged} drawn from ``gen``."""
        spec, cfg, dev = self.spec, self.cfg, self.device
        nd, num_tables = spec.num_dense, len(spec.tables)
        normal = torch.randn(batch_size, nd, generator=gen, device=dev)
        # Student-t = N(0,1) / sqrt(chi2_df / df); chi2 via Gamma(df/2, 2)
        chi2 = torch._standard_gamma(torch.full((batch_size, nd), cfg.dense_df / 2, device=dev),
                                     generator=gen) * 2.0
        student_t = normal / torch.sqrt(chi2 / cfg.dense_df).clamp_min(1e-6)
        lognormal = torch.exp(torch.randn(batch_size, nd, generator=gen, device=dev))
        is_lognormal = torch.arange(nd, device=dev) % 2 == 0
        dense = torch.where(is_lognormal, lognormal, student_t)
        if cfg.outlier_channels:
            scale = torch.ones(nd, device=dev)
            scale[max(nd - cfg.outlier_channels, 0):] = cfg.outlier_scale
            dense = dense * scale
        if not num_tables:
            return dense.float(), {}
        mean_len = torch.tensor([t.mean_bag_length for t in spec.tables], device=dev,
                                dtype=torch.float32)
        lengths = 1 + torch.poisson((mean_len - 1).unsqueeze(1).expand(num_tables, batch_size),
                                    generator=gen).long()
        nnz = lengths.sum(1)
        nnz_list = nnz.tolist()  # the one host sync: per-table value counts
        table_of_value = torch.repeat_interleave(torch.arange(num_tables, device=dev), nnz,
                                                 output_size=sum(nnz_list))
        u = torch.rand(table_of_value.numel(), generator=gen, device=dev, dtype=torch.float64)
        pos = torch.searchsorted(self.cdf, u + table_of_value)
        rank = pos - self.row_base[table_of_value]
        sizes = torch.tensor([t.num_embeddings for t in spec.tables], device=dev)
        n = sizes[table_of_value]
        ids = (self.mult[table_of_value] * rank.clamp(max=n - 1) + self.shift[table_of_value]) % n
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        sparse = {}
        for t, (vals, lens) in enumerate(zip(torch.split(ids, nnz_list), lengths)):
            sparse[spec.tables[t].name] = Jagged(vals, torch.cat([zero, lens.cumsum(0)]))
        return dense.float(), sparse

    def parts(self, dense: torch.Tensor, sparse: Dict[str, Jagged]):
        """(main, interaction) unscaled teacher terms, each (B,) float32."""
        z = torch.sign(dense) * torch.log1p(dense.abs())
        main = z @ self.dense_main
        fields = [z @ self.dense_field]
        if self.spec.tables:
            ids, offsets, total = [], [], 0
            for t, spec_t in enumerate(self.spec.tables):
                jag = sparse[spec_t.name]
                ids.append(jag.values + self.row_base[t])
                offsets.append(jag.offsets[:-1] + total)
                total += jag.values.numel()
            offsets.append(torch.tensor([total], device=dense.device))
            pooled = F.embedding_bag(torch.cat(ids), self.table, torch.cat(offsets),
                                     mode="mean", include_last_offset=True)
            pooled = pooled.view(len(self.spec.tables), dense.shape[0], -1)
            main = main + pooled[..., 0].sum(0)
            fields.extend(pooled[..., 1:].unbind(0))
        v = torch.stack(fields)  # (fields, B, r)
        inter = 0.5 * (v.sum(0).pow(2) - v.pow(2).sum(0)).sum(-1)
        return main, inter

    def logits(self, dense, sparse) -> torch.Tensor:
        main, inter = self.parts(dense, sparse)
        return self.bias + self.main_scale * main + self.inter_scale * inter


class SyntheticCTR:
    """An infinite, seeded stream of synthetic CTR batches (an iterator of :class:`Batch`).

    Args:
        spec: the features to generate (``model.feature_spec``).
        batch_size: examples per batch B.
        seed: stream seed; batch ``i`` is a pure function of ``(seed, i)`` and the teacher.
        config: the distribution; its ``teacher_seed`` fixes the labelling function.
        device: where batches (and the teacher) live.

    Yields:
        Batch with dense (B, n_dense) float32, one Jagged per table, labels (B,) float32.
    """

    def __init__(self, spec: FeatureSpec, batch_size: int, *, seed: int = 0,
                 config: SyntheticConfig = SyntheticConfig(), device="cpu",
                 _teacher: Optional[_Teacher] = None) -> None:
        if not isinstance(spec, FeatureSpec):
            raise TypeError(f"spec must be a FeatureSpec, got {type(spec).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.spec, self.batch_size, self.seed, self.config = spec, batch_size, seed, config
        self.device = torch.device(device)
        self.teacher = _teacher or _Teacher(spec, config, self.device)
        self.position = 0
        self._gen = torch.Generator(device=self.device)

    def held_out(self, seed: Optional[int] = None) -> "SyntheticCTR":
        """A stream with the same teacher and a different seed (default ``seed + 1000003``)."""
        return SyntheticCTR(self.spec, self.batch_size,
                            seed=self.seed + 1_000_003 if seed is None else seed,
                            config=self.config, device=self.device, _teacher=self.teacher)

    def batch(self, index: int) -> Batch:
        """Batch number ``index`` of this stream (does not move ``position``)."""
        self._gen.manual_seed(_derive_seed(self.seed, index, 0x5EED))
        dense, sparse = self.teacher.sample_features(self._gen, self.batch_size)
        probs = torch.sigmoid(self.teacher.logits(dense, sparse))
        labels = torch.bernoulli(probs, generator=self._gen)
        return Batch(dense=dense, sparse=sparse, labels=labels)

    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """(B,) the teacher's logits for ``batch`` (the Bayes-optimal predictor)."""
        return self.teacher.logits(batch.dense, batch.sparse)

    def __iter__(self) -> "SyntheticCTR":
        return self

    def __next__(self) -> Batch:
        out = self.batch(self.position)
        self.position += 1
        return out

    def torchrec(self) -> "TorchrecBatches":
        """This stream yielding torchrec batches (``torchrec.datasets.utils.Batch``, sparse
        features as one ``KeyedJaggedTensor``; the optional ``loka[torchrec]``)."""
        return TorchrecBatches(self)

    def state_dict(self) -> Dict[str, int]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if int(state["seed"]) != self.seed:
            raise ValueError(f"stream state is for seed {state['seed']}, this stream has seed "
                             f"{self.seed}; resuming on another stream would change the data")
        self.position = int(state["position"])
