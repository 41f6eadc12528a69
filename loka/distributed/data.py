"""Each rank's part of a global batch, so that data-parallel training sees the same
examples as one process with the whole batch."""

from __future__ import annotations

from ..data.batch import Batch, Jagged
from .agree import world

__all__ = ["shard_batch"]


def shard_batch(batch: Batch, rank=None, world_size=None) -> Batch:
    """Rows ``[rank * B / W, (rank + 1) * B / W)`` of ``batch`` (B examples, W ranks;
    default: this process's rank and world size). B must split evenly: uneven parts would
    weigh examples differently from the single-process mean loss."""
    r, w = world()
    rank = r if rank is None else int(rank)
    world_size = w if world_size is None else int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    b = batch.batch_size
    if b % world_size:
        raise ValueError(f"a batch of {b} examples does not split evenly over {world_size} ranks")
    lo, hi = rank * b // world_size, (rank + 1) * b // world_size
    sparse = {}
    for name, jag in batch.sparse.items():
        start, end = jag.offsets[lo], jag.offsets[hi]
        sparse[name] = Jagged(jag.values[start:end], jag.offsets[lo:hi + 1] - start)
    return Batch(batch.dense[lo:hi], sparse,
                 None if batch.labels is None else batch.labels[lo:hi])
