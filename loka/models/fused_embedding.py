"""Table-batched embeddings: every table of an ``EmbeddingArch`` in one weight and one
``embedding_bag`` call (the layout of FBGEMM's TBE and torchrec's fused tables).

One call per table costs a launch (and, in the backward, a sort of its ids) per table;
with the 56 tables of the Wukong ``paper`` preset that is milliseconds of a ~15 ms step,
all of it latency. Stacking the tables row-wise and offsetting each table's ids turns it
into one forward kernel and one backward sort. The function of the model is unchanged.
"""

from __future__ import annotations

import os

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from loka.data.batch import Jagged
from loka.kernels import capabilities as caps
from loka.kernels.ops import triton_kernel_op

from .arch import EmbeddingArch, jagged_to_padded

POOLINGS = ("torch", "triton")
"""how a :class:`FusedEmbeddingArch` pools its bags: ``torch`` (``F.embedding_bag``) or
``triton`` (LoKA's one-pass Triton kernel, ``loka.kernels.triton.embedding_bag``, on a CUDA
device with Triton; elsewhere, and for sparse gradients, ``torch`` stands in)"""


def _bag_sum_fake(values, offsets, weight):
    return weight.new_empty((offsets.shape[0] - 1, weight.shape[1]))


@triton_kernel_op("loka::embedding_bag_sum", _bag_sum_fake)
def embedding_bag_sum(values: torch.Tensor, offsets: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
    """(bags, D) bag sums by the Triton kernel, differentiable in ``weight`` (dense
    gradient, by PyTorch's embedding-bag backward); see
    :func:`loka.kernels.ops.triton_kernel_op`."""
    from ..kernels.triton import common
    from ..kernels.triton.embedding_bag import embedding_bag_sum as kernel

    with common.op_body():
        return kernel(values, offsets, weight)


def _setup_context(ctx, inputs, output):
    values, offsets, weight = inputs
    ctx.save_for_backward(values, offsets)
    ctx.num_weights = weight.shape[0]


def _backward(ctx, grad):
    """PyTorch's own dense embedding-bag backward (sum mode): it reads each id's gradient
    row through its bag, never materializing an (nnz, D) copy."""
    values, offsets = ctx.saved_tensors
    bags = offsets.shape[0] - 1
    lengths = offsets[1:] - offsets[:-1]
    # the bag of every id, without a host sync (the output size is the ids' count)
    bag_of = torch.repeat_interleave(torch.arange(bags, device=offsets.device), lengths,
                                     output_size=values.shape[0])
    dweight = torch.ops.aten._embedding_bag_dense_backward(
        grad.contiguous(), values, bag_of, lengths, values.new_empty(0), ctx.num_weights,
        False, 0, None, -1)
    return None, None, dweight


embedding_bag_sum.register_autograd(_backward, setup_context=_setup_context)


def triton_pooling_available(weight: torch.Tensor) -> bool:
    """Whether the Triton pooling kernel runs for ``weight``: a CUDA tensor with Triton, or
    a CPU tensor under Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _triton_pooling_available(weight.device.type)


@torch.compiler.assume_constant_result
def _triton_pooling_available(device_type: str) -> bool:
    """Decided once per device type, and a constant to ``torch.compile``: tracing the
    import probe behind it would break the graph (Dynamo cannot trace ``importlib``)."""
    ok = _POOLING_OK.get(device_type)
    if ok is None:
        ok = _POOLING_OK[device_type] = _probe_triton_pooling(device_type)
    return ok


_POOLING_OK: Dict[str, bool] = {}


def _probe_triton_pooling(device_type: str) -> bool:
    if device_type == "cuda":
        return caps.triton_available("cuda")
    return (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and caps.module_available("triton"))


class FusedEmbeddingArch(nn.Module):
    """All tables of an :class:`EmbeddingArch` in one ``(sum of rows, d)`` weight.

    Shapes:
        sparse: {name: Jagged(values (nnz,), offsets (B + 1,))} -> (B, T, d), tables in order.
    """

    def __init__(self, arch: EmbeddingArch, pooling: str = "torch") -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.names: Tuple[str, ...] = tuple(arch.names)
        self.dim = arch.dim
        tables = [arch.tables[n] for n in self.names]
        self.sparse = bool(tables[0].sparse) if tables else False
        rows = [t.num_embeddings for t in tables]
        starts = [0]
        for r in rows[:-1]:
            starts.append(starts[-1] + r)
        self.row_start: Dict[str, int] = dict(zip(self.names, starts))
        self.num_rows: Dict[str, int] = dict(zip(self.names, rows))
        with torch.no_grad():
            weight = torch.cat([t.weight for t in tables], dim=0) if tables else \
                torch.empty(0, self.dim)
        self.weight = nn.Parameter(weight)

    def forward(self, sparse: Dict[str, Jagged], names: Optional[Sequence[str]] = None
                ) -> torch.Tensor:
        """Args: sparse {name: Jagged}; names: a subset of tables (default all).
        Returns: (B, T, d) pooled embeddings."""
        names = self.names if names is None else tuple(names)
        missing = [n for n in names if n not in sparse]
        if missing:
            raise ValueError(f"batch lacks sparse features {missing}; it has {sorted(sparse)}")
        batch = sparse[names[0]].offsets.shape[0] - 1
        values = torch.cat([sparse[n].values + self.row_start[n] for n in names])
        # bag t*B + b of the stacked batch is bag b of table t; nnz of the tables before
        # table t shift its offsets (device arithmetic only: no host sync)
        ends = torch.stack([sparse[n].offsets[-1] for n in names])
        shift = torch.cumsum(ends, 0) - ends
        offsets = torch.cat([sparse[n].offsets[:-1] + shift[i] for i, n in enumerate(names)]
                            + [ends.sum().reshape(1)])
        if (self.pooling == "triton" and not self.sparse
                and triton_pooling_available(self.weight)):
            pooled = embedding_bag_sum(values, offsets, self.weight)
        else:
            pooled = F.embedding_bag(values, self.weight, offsets, mode="sum",
                                     sparse=self.sparse, include_last_offset=True)
        return pooled.view(len(names), batch, self.dim).transpose(0, 1)

    def sequence(self, name: str, sparse: Dict[str, Jagged], max_len: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The un-pooled bag of table ``name`` as (B, max_len, d) plus a (B, max_len) mask."""
        jagged = sparse[name]
        emb = F.embedding(jagged.values + self.row_start[name], self.weight, sparse=self.sparse)
        return jagged_to_padded(emb, jagged.offsets, max_len)

    def extra_repr(self) -> str:
        return (f"tables={len(self.names)}, rows={self.weight.shape[0]}, dim={self.dim}, "
                f"pooling={self.pooling}")


def fuse_embeddings(model: nn.Module, pooling: str = "torch") -> int:
    """Replace every :class:`EmbeddingArch` in ``model`` by a :class:`FusedEmbeddingArch`
    holding the same weights (in place), pooling with ``pooling`` (:data:`POOLINGS`).
    Returns how many were fused.

    The state_dict changes (one ``weight`` per arch instead of one per table): fuse before
    training, or after loading a checkpoint of the unfused model."""
    count = 0
    for fqn, mod in list(model.named_modules()):
        if isinstance(mod, EmbeddingArch) and mod.names:
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    FusedEmbeddingArch(mod, pooling))
            count += 1
    return count
