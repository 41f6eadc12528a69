"""The reference models' tables as a torchrec ``EmbeddingBagCollection`` (the optional
extra ``loka[torchrec]``).

:class:`TorchrecEmbeddingArch` holds every table of an :class:`EmbeddingArch` in one
``EmbeddingBagCollection`` (sum pooling, one feature per table, the same weights), and
pools a ``KeyedJaggedTensor``, or LoKA's ``{name: Jagged}`` converted to one. It is what a
torchrec user's model has: under ``DistributedModelParallel`` the collection is what gets
sharded (and on a GPU fused into FBGEMM's table-batched embedding kernels), while the
dense part, where LoKA acts, is unchanged. ``build(..., tables="torchrec")`` and
:func:`use_torchrec_tables` give a reference model these tables.

torchrec is imported inside the functions, so this module imports without it.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from loka.data.batch import Jagged
from loka.data.torchrec import from_kjt, to_kjt

from .arch import EmbeddingArch, jagged_to_padded


class TorchrecEmbeddingArch(nn.Module):
    """All tables of an :class:`EmbeddingArch` in a torchrec ``EmbeddingBagCollection``.

    Args:
        arch: the arch whose tables (names, rows, width, weights, sparse gradients) to take.

    Shapes:
        sparse: ``KeyedJaggedTensor`` or {name: Jagged} with B bags each -> (B, T, d).
    """

    def __init__(self, arch: EmbeddingArch) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.names: Tuple[str, ...] = tuple(arch.names)
        self.dim = arch.dim
        first = next(iter(arch.tables.values()), None)
        device = first.weight.device if first is not None else torch.device("cpu")
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=n, embedding_dim=arch.dim,
                               num_embeddings=arch.tables[n].num_embeddings, feature_names=[n],
                               pooling=PoolingType.SUM) for n in self.names], device=device)
        with torch.no_grad():
            for n in self.names:
                bag, old = self.ebc.embedding_bags[n], arch.tables[n]
                bag.weight.copy_(old.weight)
                bag.sparse = old.sparse  # sparse gradients for large tables, as before

    def _dict(self, sparse) -> Dict[str, Jagged]:
        return sparse if isinstance(sparse, dict) else from_kjt(sparse)

    def forward(self, sparse: Union[Dict[str, Jagged], "object"],
                names: Optional[Sequence[str]] = None) -> torch.Tensor:
        """Args: sparse, a KeyedJaggedTensor or {name: Jagged}; names: a subset of tables
        (default all). Returns: (B, T, d) pooled embeddings in the tables' dtype."""
        names = self.names if names is None else tuple(names)
        if isinstance(sparse, dict):
            missing = [n for n in self.names if n not in sparse]
            if missing:
                raise ValueError(f"batch lacks sparse features {missing}; it has {sorted(sparse)}")
            kjt = to_kjt(sparse, self.names)
        else:
            kjt = sparse
        pooled = self.ebc(kjt).to_dict()  # torchrec pools in float32
        dtype = next(self.ebc.parameters()).dtype
        return torch.stack([pooled[n] for n in names], dim=1).to(dtype)

    def sequence(self, name: str, sparse, max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The un-pooled bag of table ``name`` as (B, max_len, d) plus a (B, max_len) mask."""
        jagged = self._dict(sparse)[name]
        bag = self.ebc.embedding_bags[name]
        emb = F.embedding(jagged.values, bag.weight, sparse=bag.sparse)
        return jagged_to_padded(emb, jagged.offsets, max_len)

    def extra_repr(self) -> str:
        return f"tables={len(self.names)}, dim={self.dim}"


def use_torchrec_tables(model: nn.Module) -> int:
    """Replace every :class:`EmbeddingArch` in ``model`` by a :class:`TorchrecEmbeddingArch`
    holding the same weights (in place). Returns how many were replaced.

    The state_dict keys of the tables change (``<arch>.ebc.embedding_bags.<table>.weight``,
    torchrec's): replace before training, or after loading a checkpoint of the model
    without torchrec tables."""
    count = 0
    for fqn, mod in list(model.named_modules()):
        if isinstance(mod, EmbeddingArch) and mod.names:
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    TorchrecEmbeddingArch(mod))
            count += 1
    return count
