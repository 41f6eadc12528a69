"""The model and batch of a benchmark row: the reference model as the benchmark builds it
(:func:`loka.assembly.build_reference`), its synthetic batch, and the row's changes to
the model that are not FP8 (Triton pooling, merging siblings where it pays)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
from torch import nn

from ..assembly import build_reference
from ..config import ModsConfig
from ..data.batch import Batch
from ..data.synthetic import SyntheticCTR
from ..dispatch import Linear
from ..mods import merge_pays, merge_siblings, observed_rows
from ..models.fused_embedding import FusedEmbeddingArch
from .config import BenchConfig
from .variants import Variant

__all__ = ["build_model", "make_batch", "cast_batch", "set_pooling", "automerge", "count_fp8"]


def build_model(cfg: BenchConfig, mods: Optional[ModsConfig], device: torch.device) -> nn.Module:
    """``cfg``'s reference model with ``mods`` (:func:`loka.assembly.build_reference`: dense
    embedding gradients, tables capped at ``cfg.table_rows``, fused tables if
    ``cfg.fused_embeddings``, bf16 on CUDA and float32 elsewhere)."""
    return build_reference(cfg.model, cfg.preset, mods, device, seed=cfg.seed,
                           table_rows=cfg.table_rows, fused_embeddings=cfg.fused_embeddings)


def make_batch(model: nn.Module, cfg: BenchConfig, device: torch.device) -> Batch:
    """The one synthetic batch every step of a row runs (``cfg.batch_size``, else the
    model's default)."""
    bs = cfg.batch_size or getattr(model, "default_batch_size", 4096)
    batch = SyntheticCTR(model.feature_spec, bs, seed=cfg.seed, device=device).batch(0)
    if device.type == "cuda":
        batch = batch.to(device)
    return batch


def cast_batch(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch`` with its dense features and labels in ``dtype`` (the model's)."""
    return dataclasses.replace(batch, dense=batch.dense.to(dtype), labels=batch.labels.to(dtype))


def set_pooling(model: nn.Module, variant: Variant) -> int:
    """``+triton-emb``: the fused embedding tables pool their bags with LoKA's Triton kernel
    (``loka.kernels.triton.embedding_bag``) instead of ``F.embedding_bag``; returns how many
    embedding archs were switched."""
    if not variant.triton_emb:
        return 0
    archs = [m for m in model.modules() if isinstance(m, FusedEmbeddingArch)]
    if not archs:
        raise ValueError(f"{variant.name}: +triton-emb needs fused embedding tables "
                         "(fused_embeddings)")
    for m in archs:
        m.pooling = "triton"
    return len(archs)


def automerge(model: nn.Module, batch: Batch, device: torch.device,
              roles=("fwd", "dgrad", "wgrad")) -> dict:
    """``+automerge``: merge each group of sibling Linears only where timing their GEMMs
    apart and merged at the rows they see on ``batch`` says it pays
    (:func:`loka.mods.merge_pays`); returns what was merged and every decision."""
    rows = observed_rows(model, lambda: model(batch))
    record: List[dict] = []
    when = merge_pays(lambda sib: rows[sib[0]], device=device,
                      dtype=next(model.parameters()).dtype, roles=roles, record=record)
    changes = merge_siblings(model, when=when)
    return {"merged": [c.fqn for c in changes], "decisions": record}


def count_fp8(model: nn.Module) -> int:
    """Linears that run an FP8 GEMM: loka.Linear with an FP8 kernel, torchao's Float8Linear,
    or an nn.Linear whose weight torchao's inference quantization replaced."""
    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and any(k.is_fp8 for k in m.kernels):
            n += 1
        elif type(m).__name__ == "Float8Linear":
            n += 1
        elif isinstance(m, nn.Linear) and any(
                hasattr(m.weight, a) for a in ("tensor_impl", "qdata")):
            n += 1  # torchao inference-quantized weight (AQT: tensor_impl; Float8Tensor: qdata)
    return n
