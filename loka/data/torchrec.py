"""LoKA batches as torchrec batches and back (the optional extra ``loka[torchrec]``).

torchrec's sparse input is a ``KeyedJaggedTensor``: for keys ``k0..kT-1`` one flat
``values`` tensor (key-major: all ids of ``k0``, then of ``k1``, ...) and ``lengths``
(T * B,), bag ``b`` of key ``t`` at ``lengths[t * B + b]``. A LoKA :class:`Jagged` per
feature holds the same ids with CSR offsets, so the conversion concatenates (or splits) and
never copies an id twice. A torchrec batch is ``torchrec.datasets.utils.Batch``
(``dense_features``, ``sparse_features``, ``labels``), what torchrec's own Criteo pipeline
and DLRM example feed their models.

:class:`TorchrecBatches` wraps any LoKA stream (``SyntheticCTR``, ``CriteoReader``) so that
it yields torchrec batches, keeping the stream's ``state_dict`` for resuming.

torchrec is imported inside the functions, so this module imports without it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Sequence

import torch

from .batch import Batch, Jagged


def torchrec_available() -> bool:
    """Whether torchrec (and the FBGEMM operators it loads) imports here."""
    try:
        _torchrec()
    except ImportError:
        return False
    return True


def _torchrec():
    try:
        import torchrec
        from torchrec.datasets.utils import Batch as TorchrecBatch
    except Exception as e:  # noqa: BLE001
        raise ImportError(f"torchrec is not usable here ({type(e).__name__}: {e}); install "
                          "it as the README's 'Optional dependencies' says") from None
    return torchrec, TorchrecBatch


def to_kjt(sparse: Dict[str, Jagged], keys: Optional[Sequence[str]] = None):
    """A ``KeyedJaggedTensor`` of ``sparse`` ({name: Jagged}), keys in ``keys`` order
    (default: the dict's)."""
    torchrec, _ = _torchrec()
    keys = list(sparse) if keys is None else list(keys)
    missing = [k for k in keys if k not in sparse]
    if missing:
        raise ValueError(f"no sparse features {missing}; the batch has {sorted(sparse)}")
    if not keys:
        raise ValueError("a KeyedJaggedTensor needs at least one sparse feature")
    sizes = {tuple(sparse[k].offsets.shape) for k in keys}
    if len(sizes) != 1:
        raise ValueError(f"features differ in batch size: offsets shapes {sorted(sizes)}")
    values = torch.cat([sparse[k].values for k in keys])
    lengths = torch.cat([sparse[k].lengths for k in keys])
    return torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def from_kjt(kjt) -> Dict[str, Jagged]:
    """{name: Jagged} of a ``KeyedJaggedTensor``."""
    return {k: Jagged(jt.values(), jt.offsets()) for k, jt in kjt.to_dict().items()}


def to_torchrec(batch: Batch, keys: Optional[Sequence[str]] = None):
    """``torchrec.datasets.utils.Batch`` of a LoKA :class:`Batch`: the same dense features,
    labels and ids (sparse features as one ``KeyedJaggedTensor``)."""
    _, TorchrecBatch = _torchrec()
    if not isinstance(batch, Batch):
        raise TypeError(f"expected a loka.data.Batch, got {type(batch).__name__}")
    return TorchrecBatch(dense_features=batch.dense,
                         sparse_features=to_kjt(batch.sparse, keys), labels=batch.labels)


def from_torchrec(batch) -> Batch:
    """A LoKA :class:`Batch` of a torchrec ``Batch`` (``dense_features``,
    ``sparse_features``, ``labels``)."""
    for attr in ("dense_features", "sparse_features", "labels"):
        if not hasattr(batch, attr):
            raise TypeError(f"expected a torchrec Batch (dense_features, sparse_features, "
                            f"labels), got {type(batch).__name__}")
    return Batch(dense=batch.dense_features, sparse=from_kjt(batch.sparse_features),
                 labels=batch.labels)


class TorchrecBatches:
    """A LoKA batch stream that yields torchrec batches.

    Args:
        stream: any iterable of :class:`Batch` (``SyntheticCTR``, ``CriteoReader``).
        keys: the order of the sparse features in each ``KeyedJaggedTensor`` (default: the
            batch's).
    """

    def __init__(self, stream: Iterable[Batch], keys: Optional[Sequence[str]] = None) -> None:
        _torchrec()  # fail here, not at the first batch, without torchrec
        self.stream, self.keys = stream, None if keys is None else list(keys)
        self._it: Optional[Iterator[Batch]] = None

    def __iter__(self) -> "TorchrecBatches":
        self._it = iter(self.stream)
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self.stream)
        return to_torchrec(next(self._it), self.keys)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped stream's state (for resuming), where it has one."""
        if not hasattr(self.stream, "state_dict"):
            raise TypeError(f"{type(self.stream).__name__} has no state_dict")
        return self.stream.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self._it = None
