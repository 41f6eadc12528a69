"""Streaming reader of the Criteo click-log TSV format (Kaggle Display Advertising
Challenge and Criteo 1TB / Terabyte share it).

One example per line, tab separated: ``label``, 13 integer count features ``I1..I13``,
26 categorical features ``C1..C26`` as 8-digit hex hashes; any feature may be empty.
Files without the label column (the Kaggle test set) are read with ``has_label=False``.

Transforms (those of the DLRM reference pipeline):
  * counts: missing -> 0, negatives clamped to 0, then ``log(1 + x)``;
  * categoricals: ``int(hex, 16) % table_size``; missing -> id 0. Each is a one-id bag.

The file is read line by line (constant memory), and the reader's position is a byte
offset, so ``state_dict``/``load_state_dict`` resume exactly where a run stopped.
"""

from __future__ import annotations

import importlib.resources
import math
import os
from typing import Dict, Iterator, List, Sequence, Union

import torch

from .batch import Batch, FeatureSpec, Jagged, TableSpec
from .torchrec import TorchrecBatches

NUM_DENSE = 13
NUM_SPARSE = 26
SPARSE_NAMES = tuple(f"C{i}" for i in range(1, NUM_SPARSE + 1))


class CriteoFormatError(ValueError):
    """A malformed line; the message names the file and the 1-based line number."""


def sample_path() -> str:
    """Path of the ~200-line sample shipped with the package (synthetic, Criteo layout)."""
    return str(importlib.resources.files("loka.data") / "samples" / "criteo_sample.tsv")


def criteo_feature_spec(table_sizes: Union[int, Sequence[int]] = 100_000) -> FeatureSpec:
    """The FeatureSpec of Criteo data hashed into ``table_sizes`` rows (one or 26 sizes)."""
    sizes = _table_sizes(table_sizes)
    return FeatureSpec(NUM_DENSE, tuple(TableSpec(n, s, 1.0) for n, s in zip(SPARSE_NAMES, sizes)))


def _table_sizes(table_sizes) -> List[int]:
    sizes = [int(table_sizes)] * NUM_SPARSE if isinstance(table_sizes, int) else list(table_sizes)
    if len(sizes) != NUM_SPARSE or min(sizes) < 1:
        raise ValueError(f"table_sizes must be a positive int or {NUM_SPARSE} positive ints")
    return sizes


class CriteoReader:
    """Iterate a Criteo TSV file as :class:`Batch` es.

    Args:
        path: the TSV file.
        batch_size: examples per batch B; the last batch may be smaller (``drop_last=False``).
        table_sizes: rows of each of the 26 tables (hash modulus), one int or 26.
        has_label: whether lines start with the label column (40 fields, else 39).
        skip_malformed: count and skip malformed lines (``num_skipped``) instead of raising.
        drop_last: drop a final incomplete batch.
        loop: restart from the top at end of file (an infinite stream) instead of stopping.

    Yields:
        Batch: dense (B, 13) float32 ``log1p`` counts, sparse {C1..C26: Jagged of one id per
        bag}, labels (B,) float32 (zeros when ``has_label=False``).
    """

    def __init__(self, path: Union[str, os.PathLike], batch_size: int, *,
                 table_sizes: Union[int, Sequence[int]] = 100_000, has_label: bool = True,
                 skip_malformed: bool = False, drop_last: bool = False, loop: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no Criteo file at {self.path!r}")
        self.batch_size, self.has_label = batch_size, has_label
        self.table_sizes = _table_sizes(table_sizes)
        self.skip_malformed, self.drop_last, self.loop = skip_malformed, drop_last, loop
        self.feature_spec = criteo_feature_spec(self.table_sizes)
        self.num_skipped = 0
        self._offset, self._line_no = 0, 0  # byte offset and line number of the next line

    # -- parsing -----------------------------------------------------------------------
    def _parse(self, line: str, line_no: int):
        fields = line.rstrip("\r\n").split("\t")
        expected = NUM_DENSE + NUM_SPARSE + int(self.has_label)
        if len(fields) != expected:
            raise CriteoFormatError(f"{self.path}:{line_no}: expected {expected} tab-separated "
                                    f"fields, got {len(fields)}")
        try:
            if self.has_label:
                label = fields[0]
                if label not in ("0", "1"):
                    raise ValueError(f"label must be 0 or 1, got {label!r}")
                fields = fields[1:]
            dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[:NUM_DENSE]]
            cats = [int(x, 16) % n if x else 0
                    for x, n in zip(fields[NUM_DENSE:], self.table_sizes)]
        except ValueError as e:
            raise CriteoFormatError(f"{self.path}:{line_no}: {e}") from None
        return (float(label) if self.has_label else 0.0), dense, cats

    def _make_batch(self, labels, dense, cats) -> Batch:
        b = len(labels)
        cat_t = torch.tensor(cats, dtype=torch.int64).view(b, NUM_SPARSE)
        offsets = torch.arange(b + 1, dtype=torch.int64)
        sparse = {name: Jagged(cat_t[:, i].contiguous(), offsets)
                  for i, name in enumerate(SPARSE_NAMES)}
        return Batch(dense=torch.tensor(dense, dtype=torch.float32).view(b, NUM_DENSE),
                     sparse=sparse, labels=torch.tensor(labels, dtype=torch.float32))

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        while True:
            yielded = False
            for batch in self._read_from(self._offset):
                yielded = True
                yield batch
            if not (self.loop and yielded):
                return
            self._offset, self._line_no = 0, 0

    def _read_from(self, offset: int) -> Iterator[Batch]:
        labels, dense, cats = [], [], []
        with open(self.path, "rb") as f:
            f.seek(offset)
            line_no = self._line_no
            while True:
                raw = f.readline()
                if not raw:
                    break
                line_no += 1
                if not raw.strip():
                    continue
                try:
                    y, d, c = self._parse(raw.decode("utf-8", errors="replace"), line_no)
                except CriteoFormatError:
                    if not self.skip_malformed:
                        raise
                    self.num_skipped += 1
                    continue
                labels.append(y)
                dense.extend(d)
                cats.extend(c)
                if len(labels) == self.batch_size:
                    # position first, so that a checkpoint taken after this batch resumes
                    # with the next one
                    self._offset, self._line_no = f.tell(), line_no
                    yield self._make_batch(labels, dense, cats)
                    labels, dense, cats = [], [], []
            self._offset, self._line_no = f.tell(), line_no
        if labels and not self.drop_last:
            yield self._make_batch(labels, dense, cats)

    def is_empty(self) -> bool:
        """Whether the file holds no example at all (only blank lines, or, with
        ``skip_malformed``, only malformed ones); reads up to the first example."""
        with open(self.path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if not self.skip_malformed:
                    return False  # a malformed first line is reported when it is read
                try:
                    self._parse(raw.decode("utf-8", errors="replace"), line_no)
                except CriteoFormatError:
                    continue
                return False
        return True

    def at_end(self) -> bool:
        """Whether no example is left after the reader's position (the batches read so far
        covered the rest of the file)."""
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            return not any(raw.strip() for raw in f)

    def torchrec(self) -> "TorchrecBatches":
        """This stream yielding torchrec batches (``torchrec.datasets.utils.Batch``, sparse
        features as one ``KeyedJaggedTensor``; the optional ``loka[torchrec]``)."""
        return TorchrecBatches(self)

    def state_dict(self) -> Dict[str, int]:
        return {"offset": self._offset, "line_no": self._line_no, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self._offset, self._line_no = int(state["offset"]), int(state["line_no"])
        self.num_skipped = int(state.get("num_skipped", 0))
