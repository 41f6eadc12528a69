"""The batch format every model and data source in LoKA agrees on.

Sparse (categorical) features are jagged: per feature a flat ``values`` tensor of ids and
CSR-style ``offsets`` of length ``B + 1`` (bag ``b`` is ``values[offsets[b]:offsets[b+1]]``),
which is what ``nn.EmbeddingBag(include_last_offset=True)`` consumes directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, NamedTuple, Tuple

import torch


class Jagged(NamedTuple):
    """One multi-hot feature of a batch.

    Args:
        values: (nnz,) int64 ids.
        offsets: (B + 1,) int64, non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == nnz``.
    """

    values: torch.Tensor
    offsets: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) int64 bag lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device, non_blocking: bool = False) -> "Jagged":
        return Jagged(self.values.to(device, non_blocking=non_blocking),
                      self.offsets.to(device, non_blocking=non_blocking))


class TableSpec(NamedTuple):
    """One embedding table a model needs: ``(name, num_embeddings, mean_bag_length)``."""

    name: str
    num_embeddings: int
    mean_bag_length: float


@dataclass(frozen=True)
class FeatureSpec:
    """What data a model consumes; data sources generate or read exactly this."""

    num_dense: int
    """number of dense (float) features per example"""
    tables: Tuple[TableSpec, ...] = ()
    """the sparse features, one embedding table each"""

    def __post_init__(self) -> None:
        if self.num_dense < 0:
            raise ValueError(f"FeatureSpec.num_dense must be >= 0, got {self.num_dense}")
        tables = tuple(TableSpec(*t) for t in self.tables)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"FeatureSpec table names must be unique, got {names}")
        for t in tables:
            if t.num_embeddings < 1 or t.mean_bag_length < 1:
                raise ValueError(f"table {t.name!r}: need num_embeddings >= 1 and "
                                 f"mean_bag_length >= 1, got {t}")
        object.__setattr__(self, "tables", tables)

    @property
    def table_names(self) -> Tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise ValueError(f"no table {name!r}; tables are {list(self.table_names)}")


@dataclass(frozen=True)
class Batch:
    """A batch of CTR examples.

    Args:
        dense: (B, n_dense) float32.
        sparse: feature name -> :class:`Jagged` with ``B`` bags.
        labels: (B,) float32 in {0, 1}.
    """

    dense: torch.Tensor
    sparse: Dict[str, Jagged] = field(default_factory=dict)
    labels: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.dense.dim() != 2:
            raise ValueError(f"Batch.dense must be (B, n_dense), got shape {tuple(self.dense.shape)}")
        b = self.dense.shape[0]
        if self.labels is None or tuple(self.labels.shape) != (b,):
            shape = None if self.labels is None else tuple(self.labels.shape)
            raise ValueError(f"Batch.labels must be ({b},), got {shape}")
        for name, jag in self.sparse.items():
            if not isinstance(jag, Jagged):
                object.__setattr__(self, "sparse", {k: Jagged(*v) for k, v in self.sparse.items()})
                break
        for name, jag in self.sparse.items():
            if tuple(jag.offsets.shape) != (b + 1,):
                raise ValueError(f"feature {name!r}: offsets must be ({b + 1},), "
                                 f"got {tuple(jag.offsets.shape)}")

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    @property
    def device(self) -> torch.device:
        return self.dense.device

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A copy on ``device`` (``self`` when already there)."""
        device = torch.device(device)
        if self.dense.device == device:
            return self
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse={k: v.to(device, non_blocking) for k, v in self.sparse.items()},
            labels=self.labels.to(device, non_blocking=non_blocking),
        )
