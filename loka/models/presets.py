"""The model registry: ``build(name, preset, mods, **overrides)``.

Presets: ``tiny`` (CPU tests: forward + backward well under a second), ``small`` (a CPU
demo: a few hundred steps in a minute or two on 2 cores), ``paper`` (GPU benchmarks;
Wukong's is the exact reference configuration of ANCHORS.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from loka.config import ModsConfig
from loka.data.batch import FeatureSpec, TableSpec

from .arch import RecModel
from .dcnv2 import DCNv2, DCNv2Config
from .dlrm import DLRM, DLRMConfig
from .interformer import InterFormer, InterFormerConfig
from .logreg import LogisticRegression, LogRegConfig
from .torchrec_embedding import use_torchrec_tables
from .wukong import Wukong, WukongConfig


def feature_spec(num_dense: int, num_tables: int, rows: int,
                 bag_lengths: Sequence[float] = (1.0,), extra: Sequence[TableSpec] = ()
                 ) -> FeatureSpec:
    """``num_tables`` tables ``t0..`` of ``rows`` rows, mean bag lengths cycling through
    ``bag_lengths``, then ``extra`` tables."""
    tables = tuple(TableSpec(f"t{i}", rows, float(bag_lengths[i % len(bag_lengths)]))
                   for i in range(num_tables))
    return FeatureSpec(num_dense, tables + tuple(extra))


_TINY = feature_spec(4, 4, 1_000, (1, 2, 3, 4))
_SMALL = feature_spec(8, 8, 10_000, (1, 2, 4, 8))
# Wukong paper: 8 dense tokens + 56 tables = n = 64 embeddings
_WUKONG_PAPER = feature_spec(8, 56, 100_000, (1, 2, 4, 8))
# DLRM / DCNv2 paper scale: the Criteo layout (13 dense, 26 tables)
_CRITEO_LIKE = feature_spec(13, 26, 100_000, (1, 1, 2, 4))


def _with_history(spec: FeatureSpec, rows: int, mean_len: float) -> FeatureSpec:
    return FeatureSpec(spec.num_dense, spec.tables + (TableSpec("history", rows, mean_len),))


_REGISTRY: Dict[str, Tuple[Callable[..., RecModel], Dict[str, Any]]] = {
    "wukong": (Wukong, {
        "tiny": WukongConfig(_TINY, embedding_dim=16, num_layers=2, num_fm=4, num_lcb=4,
                             fm_rank=4, fm_hidden=64, top_hidden=(64, 32), batch_size=256),
        "small": WukongConfig(_SMALL, embedding_dim=32, num_layers=3, num_fm=8, num_lcb=8,
                              fm_rank=8, fm_hidden=256, top_hidden=(256, 128), batch_size=512),
        "paper": WukongConfig(_WUKONG_PAPER, embedding_dim=256, num_layers=4, num_fm=32,
                              num_lcb=32, fm_rank=32, fm_hidden=2048, top_hidden=(2048, 1024),
                              batch_size=4096, sparse_embeddings=True),
    }),
    "dcnv2": (DCNv2, {
        "tiny": DCNv2Config(_TINY, embedding_dim=16, num_cross=2, deep_hidden=(64, 64),
                            structure="stacked", batch_size=256),
        "small": DCNv2Config(_SMALL, embedding_dim=32, num_cross=3, cross_rank=64,
                             deep_hidden=(256, 256), structure="parallel", top_hidden=(128,),
                             batch_size=512),
        "paper": DCNv2Config(_CRITEO_LIKE, embedding_dim=128, dense_hidden=(512, 256),
                             num_cross=3, cross_rank=512, deep_hidden=(1024, 1024, 512),
                             structure="parallel", top_hidden=(256,), batch_size=4096,
                             sparse_embeddings=True),
    }),
    "interformer": (InterFormer, {
        "tiny": InterFormerConfig(_with_history(_TINY, 1_000, 6.0), seq_len=8, embedding_dim=16,
                                  num_layers=2, num_heads=2, ffn_hidden=32, fm_rank=4,
                                  fm_hidden=64, top_hidden=(64, 32), batch_size=256),
        "small": InterFormerConfig(_with_history(_SMALL, 10_000, 16.0), seq_len=32,
                                   embedding_dim=32, num_layers=2, num_heads=4, ffn_hidden=64,
                                   fm_rank=8, fm_hidden=256, top_hidden=(256, 128),
                                   batch_size=512),
        "paper": InterFormerConfig(_with_history(feature_spec(8, 32, 100_000, (1, 2, 4, 8)),
                                                 100_000, 64.0),
                                   seq_len=128, embedding_dim=128, num_layers=3, num_heads=4,
                                   ffn_hidden=512, fm_rank=16, fm_hidden=1024,
                                   top_hidden=(1024, 512), batch_size=4096,
                                   sparse_embeddings=True),
    }),
    "dlrm": (DLRM, {
        "tiny": DLRMConfig(_TINY, embedding_dim=16, bottom_hidden=(32,), top_hidden=(64, 32),
                           batch_size=256),
        "small": DLRMConfig(_SMALL, embedding_dim=32, bottom_hidden=(128, 64),
                            top_hidden=(256, 128), batch_size=512),
        # the MLPerf DLRM shape: bottom 13-512-256-128, top 1024-1024-512-256-1
        "paper": DLRMConfig(_CRITEO_LIKE, embedding_dim=128, bottom_hidden=(512, 256),
                            top_hidden=(1024, 1024, 512, 256), batch_size=4096,
                            sparse_embeddings=True),
    }),
    "logreg": (LogisticRegression, {
        "tiny": LogRegConfig(_TINY, batch_size=256),
        "small": LogRegConfig(_SMALL, batch_size=512),
        "paper": LogRegConfig(_WUKONG_PAPER, batch_size=4096, sparse_embeddings=True),
    }),
}


def list_models() -> List[str]:
    """Names accepted by :func:`build`."""
    return sorted(_REGISTRY)


def _entry(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid models: {list_models()}")
    return _REGISTRY[name]


def presets(name: str) -> Dict[str, Any]:
    """Preset name -> config dataclass of model ``name`` (a copy of the registry's dict)."""
    return dict(_entry(name)[1])


TABLES = ("torch", "torchrec")
"""how :func:`build` holds a model's tables: ``torch`` (one ``nn.EmbeddingBag`` each) or
``torchrec`` (one torchrec ``EmbeddingBagCollection``; the optional ``loka[torchrec]``)"""


def build(name: str, preset: str = "tiny", mods: Optional[ModsConfig] = None,
          tables: str = "torch", **overrides: Any) -> RecModel:
    """Build a reference model.

    Args:
        name: one of :func:`list_models`.
        preset: one of ``presets(name)`` (``tiny``, ``small``, ``paper``).
        mods: Mods honoured at construction (None: none).
        tables: :data:`TABLES`; ``torchrec`` puts the tables in an ``EmbeddingBagCollection``
            (:func:`~loka.models.torchrec_embedding.use_torchrec_tables`).
        **overrides: config fields to replace, e.g. ``features=criteo_feature_spec()``,
            ``num_layers=3``.

    Returns:
        The model (on the current default device: construct under ``torch.device('meta')``
        to build paper scale without memory).
    """
    cls, table = _entry(name)
    if preset not in table:
        raise ValueError(f"unknown preset {preset!r} for {name!r}; valid presets: {list(table)}")
    config = table[preset]
    fields = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown {type(config).__name__} fields {unknown}; "
                         f"valid fields: {sorted(fields)}")
    if tables not in TABLES:
        raise ValueError(f"unknown tables {tables!r}; expected one of {list(TABLES)}")
    model = cls(dataclasses.replace(config, **overrides), mods)
    if tables == "torchrec":
        use_torchrec_tables(model)
    return model
