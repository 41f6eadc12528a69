"""Reference recommendation models built from *Arch parts: Wukong, DCNv2, an
InterFormer-style model, DLRM (and a logistic-regression baseline).

    model = loka.models.build("wukong", preset="tiny", mods=loka.ModsConfig.paper())
    logits = model(batch)            # (B,)
"""

from .arch import (MLP, DenseArch, DenseTokenArch, EmbeddingArch, OverArch, RecModel,
                   jagged_to_padded, make_activation, make_linear, make_norm)
from .dcnv2 import DCNv2, DCNv2Config
from .dlrm import DLRM, DLRMConfig
from .interformer import InterFormer, InterFormerConfig
from .logreg import LogisticRegression, LogRegConfig
from .presets import build, feature_spec, list_models, presets
from .wukong import (FactorizationMachineBlock, LinearCompressionBlock, Wukong, WukongConfig,
                     WukongLayer)

__all__ = [
    "MLP", "DenseArch", "DenseTokenArch", "EmbeddingArch", "OverArch", "RecModel",
    "jagged_to_padded", "make_activation", "make_linear", "make_norm",
    "DCNv2", "DCNv2Config", "DLRM", "DLRMConfig", "InterFormer", "InterFormerConfig",
    "LogisticRegression", "LogRegConfig", "Wukong", "WukongConfig", "WukongLayer",
    "FactorizationMachineBlock", "LinearCompressionBlock",
    "build", "feature_spec", "list_models", "presets",
]
