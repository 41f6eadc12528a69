"""Data for LoKA's reference models: the batch format, a learnable synthetic CTR stream,
a streaming Criteo TSV reader, and CTR metrics (NE, AUC, log loss)."""

from .batch import Batch, FeatureSpec, Jagged, TableSpec
from .criteo import CriteoFormatError, CriteoReader, criteo_feature_spec, sample_path
from .metrics import Metrics, auc, log_loss, normalized_entropy
from .synthetic import SyntheticConfig, SyntheticCTR, zipf_pmf

__all__ = [
    "Batch", "FeatureSpec", "Jagged", "TableSpec",
    "CriteoFormatError", "CriteoReader", "criteo_feature_spec", "sample_path",
    "Metrics", "auc", "log_loss", "normalized_entropy",
    "SyntheticConfig", "SyntheticCTR", "zipf_pmf",
]
