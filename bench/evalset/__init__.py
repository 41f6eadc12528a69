"""The evaluation set: recommendation models LoKA has never seen.

Three LRMs written in plain PyTorch from their papers, outside ``loka/`` and without
importing it, each with the LoKA paper's Mods built in as a user would write them (no bias
on hidden Linears, block RMS norms, hard swish: their own classes) and fed dense tensors
(already-pooled embeddings, as a torchrec EmbeddingBagCollection returns them):

    model = EVAL_MODELS["wukong"]("paper")        # or "tiny" for CPU tests
    inputs, labels = model.make_batch(4096, device="cuda", dtype=torch.bfloat16, seed=0)
    loss = loss_fn(model, (inputs, labels))       # BCE with logits, float32

``bench/eval_set.py`` measures them in bf16, with torchao's float8 recipes and through
LoKA's public path, side by side. No code under ``loka/`` may recognise them.
"""

from typing import Dict, Type

import torch.nn as nn

from .common import EvalBatch, HSwish, RowBlockNorm, DenseFeatureNorm, loss_fn
from .dcnv2 import DCNv2Rec
from .dlrm import DLRMRec
from .wukong import WukongRec

__all__ = ["EVAL_MODELS", "SCALES", "WukongRec", "DCNv2Rec", "DLRMRec", "RowBlockNorm",
           "HSwish", "DenseFeatureNorm", "EvalBatch", "loss_fn"]

EVAL_MODELS: Dict[str, Type[nn.Module]] = {"wukong": WukongRec, "dcnv2": DCNv2Rec,
                                           "dlrm": DLRMRec}
"""name -> model class; ``cls(scale)`` builds it, ``model.make_batch(...)`` feeds it"""

SCALES = ("paper", "tiny")
"""'paper': full size, for GPU benchmarks; 'tiny': small dims, for CPU tests"""
