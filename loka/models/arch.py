"""Reusable parts of the reference models (torchrec's *Arch split) and the layer factory
through which every model honours a :class:`~loka.config.ModsConfig` at construction.

Building with ``mods`` and converting afterwards with ``loka.mods.convert(model, mods)``
give the same module structure; the factory just skips the swap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from loka.config import ModsConfig
from loka.data.batch import FeatureSpec, Jagged, TableSpec
from loka.mods import BlockNorm
from loka.mods import merge_siblings as _merge_siblings
from loka.mods import pad_linears
from loka.mods.fused import norm_act, norm_act_linear, norm_act_spec
from loka.mods.no_bias import FINAL_ATTR

_NO_MODS = ModsConfig()

PRIOR_CTR = 0.03
"""The logit layer's bias starts at log(p / (1 - p)) of this CTR (the "prior" init of
Lin et al., 2017): a fresh model then predicts a typical CTR instead of 0.5, so the first
few hundred steps are not spent moving one bias. ``RecModel.init_logit_bias`` resets it."""


# -- layer factory ---------------------------------------------------------------------
@dataclass(frozen=True)
class FMConfig:
    """The fields of models built from Wukong layers (Wukong, InterFormer): n embeddings of
    width d through factorization-machine blocks, then a top MLP."""

    features: FeatureSpec
    """data the model reads: each dense feature and each table becomes one embedding"""
    embedding_dim: int = 16
    """d, the width of every embedding"""
    num_layers: int = 2
    """stacked layers"""
    fm_rank: int = 4
    """k, rank of the FMB's projection over the n axis"""
    fm_hidden: int = 64
    """hidden width of the FMB's MLP"""
    top_hidden: Tuple[int, ...] = (64, 32)
    """hidden widths of the top MLP (then one logit)"""
    batch_size: int = 256
    """default batch size B"""
    sparse_embeddings: bool = False
    """sparse embedding gradients (large tables)"""


def make_linear(in_features: int, out_features: int, mods: Optional[ModsConfig] = None,
                last: bool = False) -> nn.Linear:
    """An ``nn.Linear``; without bias under ``mods.no_bias`` unless ``last`` (the logit
    layer, which is also marked ``_loka_final = True``)."""
    mods = mods or _NO_MODS
    lin = nn.Linear(in_features, out_features, bias=last or not mods.no_bias)
    if last:
        setattr(lin, FINAL_ATTR, True)
    return lin


def make_norm(dim: int, mods: Optional[ModsConfig] = None) -> nn.Module:
    """``BlockNorm(mods.blocknorm)`` when set, else ``nn.LayerNorm(dim)``; over the last dim."""
    mods = mods or _NO_MODS
    return BlockNorm(mods.blocknorm) if mods.blocknorm is not None else nn.LayerNorm(dim)


def make_activation(mods: Optional[ModsConfig] = None) -> nn.Module:
    """``nn.Hardswish`` under ``mods.hardswish``, else ``nn.SiLU`` (Swish)."""
    mods = mods or _NO_MODS
    return nn.Hardswish() if mods.hardswish else nn.SiLU()


def check_mods(mods) -> ModsConfig:
    if mods is None:
        return _NO_MODS
    if not isinstance(mods, ModsConfig):
        raise TypeError(f"mods must be a loka.ModsConfig or None, got {type(mods).__name__}")
    return mods


def param_dtype(module: nn.Module) -> torch.dtype:
    """dtype of a module's first parameter: what a bf16 model's inputs are cast to."""
    return next(module.parameters()).dtype


# -- parts -----------------------------------------------------------------------------
class MLP(nn.Sequential):
    """``[Linear -> (norm) -> activation] * len(hidden)``, then an optional output Linear.

    Under ``mods.fuse_norm_quant`` (the switch ``fuse_norm_quant``, which
    ``loka.mods.convert`` also sets) each norm and activation in front of a Linear that
    takes an FP8 input runs with the Linear's quantization in one pass
    (:func:`loka.mods.fused.norm_act_linear`); the same function, fewer passes over the
    activation. ``forward(x, prologue)`` applies ``prologue`` (a norm owned by the caller)
    to x first, fused in the same way into the first Linear.

    Args:
        in_features: input width.
        hidden: widths of the hidden layers.
        mods: Mods honoured by the factory.
        out_features: width of a final Linear without activation; None: no such layer.
        norm: put a norm (LayerNorm or BlockNorm) after each hidden Linear.
        last: the output Linear is the model's logit layer.

    Shapes:
        x: (..., in_features) -> (..., out_features or hidden[-1])
    """

    def __init__(self, in_features: int, hidden: Sequence[int], mods: Optional[ModsConfig] = None,
                 out_features: Optional[int] = None, norm: bool = False, last: bool = False):
        layers: List[nn.Module] = []
        width = in_features
        for h in hidden:
            layers.append(make_linear(width, h, mods))
            if norm:
                layers.append(make_norm(h, mods))
            layers.append(make_activation(mods))
            width = h
        if out_features is not None:
            layers.append(make_linear(width, out_features, mods, last=last))
            width = out_features
        super().__init__(*layers)
        self.in_features, self.out_features = in_features, width
        self.fuse_norm_quant = bool(mods is not None and mods.fuse_norm_quant)

    def forward(self, x: torch.Tensor, prologue: Optional[nn.Module] = None) -> torch.Tensor:
        if not self.fuse_norm_quant:
            return super().forward(prologue(x) if prologue is not None else x)
        # a norm, then an activation, held back until the Linear they feed
        norm, act = prologue, None
        for m in self:
            if isinstance(m, nn.Linear):
                x, norm, act = norm_act_linear(x, norm, act, m), None, None
            elif act is None and isinstance(m, nn.Hardswish):
                act = m
            elif norm is None and act is None and norm_act_spec(m, None) is not None:
                norm = m  # a norm the fused kernel computes
            else:  # anything else: what is held back runs first, then the module
                x = norm_act(x, norm, act)
                x, norm, act = m(x), None, None
        return norm_act(x, norm, act)


class DenseArch(nn.Module):
    """Bottom MLP over the dense features.

    Args:
        num_dense: n_dense input features.
        hidden: hidden widths; out_features: output width (no activation after it).

    Shapes:
        dense: (B, n_dense) -> (B, out_features)
    """

    def __init__(self, num_dense: int, hidden: Sequence[int], out_features: int,
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.mlp = MLP(num_dense, hidden, mods, out_features=out_features)
        self.num_dense, self.out_features = num_dense, out_features

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        """Args: dense (B, n_dense). Returns: (B, out_features)."""
        if dense.shape[-1] != self.num_dense:
            raise ValueError(f"expected {self.num_dense} dense features, got {dense.shape[-1]}")
        return self.mlp(dense.to(param_dtype(self.mlp)))  # a bf16 model gets bf16 input


class DenseTokenArch(nn.Module):
    """Each dense feature becomes its own embedding ``x_i * w_i + b_i`` (a feature
    tokenizer): dense features join the n embeddings of an interaction model without a
    GEMM, so the model's Linears are exactly its interaction and top layers.

    Shapes:
        dense: (B, n_dense) -> (B, n_dense, dim)
    """

    def __init__(self, num_dense: int, dim: int) -> None:
        super().__init__()
        self.num_dense, self.dim = num_dense, dim
        self.weight = nn.Parameter(torch.empty(num_dense, dim))
        self.bias = nn.Parameter(torch.empty(num_dense, dim))
        nn.init.normal_(self.weight, std=dim ** -0.5)
        nn.init.normal_(self.bias, std=dim ** -0.5)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        """Args: dense (B, n_dense). Returns: (B, n_dense, dim)."""
        if dense.shape[-1] != self.num_dense:
            raise ValueError(f"expected {self.num_dense} dense features, got {dense.shape[-1]}")
        return dense.unsqueeze(-1).to(self.weight.dtype) * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"num_dense={self.num_dense}, dim={self.dim}"


class EmbeddingArch(nn.Module):
    """One ``nn.EmbeddingBag`` (sum pooling) per table, all of width ``dim``.

    Args:
        tables: the tables (name, num_embeddings, mean_bag_length).
        dim: embedding width d.
        sparse: sparse gradients (for large tables: the optimizer then touches only the
            rows a batch used; see ``loka.train.make_optimizers``).

    Shapes:
        sparse: {name: Jagged(values (nnz,), offsets (B + 1,))} -> (B, T, d), tables in order.
    """

    def __init__(self, tables: Sequence[TableSpec], dim: int, sparse: bool = False) -> None:
        super().__init__()
        self.names: Tuple[str, ...] = tuple(t.name for t in tables)
        self.dim = dim
        self.tables = nn.ModuleDict({
            t.name: nn.EmbeddingBag(t.num_embeddings, dim, mode="sum", sparse=sparse,
                                    include_last_offset=True) for t in tables})
        for table in self.tables.values():
            nn.init.normal_(table.weight, std=dim ** -0.5)

    def _check(self, sparse: Dict[str, Jagged], names) -> None:
        missing = [n for n in names if n not in sparse]
        if missing:
            raise ValueError(f"batch lacks sparse features {missing}; it has {sorted(sparse)}")

    def forward(self, sparse: Dict[str, Jagged],
                names: Optional[Sequence[str]] = None) -> torch.Tensor:
        """Args: sparse {name: Jagged}; names: a subset of tables (default all).
        Returns: (B, T, d) pooled embeddings."""
        names = self.names if names is None else names
        self._check(sparse, names)
        return torch.stack([self.tables[n](sparse[n].values, sparse[n].offsets) for n in names],
                           dim=1)

    def sequence(self, name: str, sparse: Dict[str, Jagged], max_len: int
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The un-pooled bag of table ``name`` as a padded sequence (first ``max_len`` ids).

        Returns:
            (B, max_len, d) embeddings (zeros at padding) and a (B, max_len) bool mask.
        """
        self._check(sparse, [name])
        table, jagged = self.tables[name], sparse[name]
        emb = F.embedding(jagged.values, table.weight, sparse=table.sparse)
        return jagged_to_padded(emb, jagged.offsets, max_len)


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Jagged rows -> padded (B, max_len, ...) plus mask, with static-shape ops only
    (no host sync, ``torch.compile``-friendly); items past ``max_len`` are dropped.

    Args:
        values: (nnz, ...) per-item values; offsets: (B + 1,) CSR offsets.

    Returns:
        (B, max_len, ...) values (zeros at padding) and (B, max_len) bool mask.
    """
    batch = offsets.numel() - 1
    item = torch.arange(values.shape[0], device=values.device)
    row = torch.bucketize(item, offsets[1:], right=True)       # bag of each item
    pos = item - offsets[row]
    # items beyond max_len go to one spare slot that is cut off afterwards
    slot = torch.where(pos < max_len, row * max_len + pos, batch * max_len)
    out = values.new_zeros((batch * max_len + 1,) + values.shape[1:]).index_copy(0, slot, values)
    lengths = (offsets[1:] - offsets[:-1]).clamp(max=max_len)
    mask = torch.arange(max_len, device=values.device) < lengths.unsqueeze(1)
    return out[:-1].view((batch, max_len) + values.shape[1:]), mask


class OverArch(nn.Module):
    """Top MLP to one logit; its last Linear is the model's logit layer (keeps its bias).

    Shapes:
        x: (B, in_features) -> (B,)
    """

    def __init__(self, in_features: int, hidden: Sequence[int],
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.mlp = MLP(in_features, hidden, mods, out_features=1, last=True)

    def forward(self, x: torch.Tensor, prologue: Optional[nn.Module] = None) -> torch.Tensor:
        """Args: x (B, in_features); prologue: a norm to apply to x first (see
        :class:`MLP`). Returns: logits (B,)."""
        return self.mlp(x, prologue).squeeze(-1)


class RecModel(nn.Module):
    """Base of the reference models: a config, Mods, and what data the model needs.

    Subclasses build their layers through the factory and call ``_finish()`` last, which
    applies the shape Mods (sibling merging, padding) that are transforms, not choices.
    """

    def __init__(self, config, mods: Optional[ModsConfig]) -> None:
        super().__init__()
        self.config = config
        self.mods = check_mods(mods)

    @property
    def feature_spec(self) -> FeatureSpec:
        """Dense feature count and the (name, num_embeddings, mean_bag_length) tables."""
        return self.config.features

    @property
    def default_batch_size(self) -> int:
        return self.config.batch_size

    def merge_siblings(self):
        """Merge sibling Linears into single GEMMs in place; returns the ModuleChanges."""
        return _merge_siblings(self)

    @torch.no_grad()
    def init_logit_bias(self, ctr: float) -> None:
        """Set the bias of the final (logit) Linear(s) to ``log(ctr / (1 - ctr))``."""
        if not 0.0 < ctr < 1.0:
            raise ValueError(f"ctr must be in (0, 1), got {ctr}")
        for m in self.modules():
            if isinstance(m, nn.Linear) and getattr(m, FINAL_ATTR, False) and m.bias is not None:
                m.bias.fill_(math.log(ctr / (1.0 - ctr)))

    def _finish(self) -> None:
        self.init_logit_bias(PRIOR_CTR)
        if self.mods.merge_siblings:
            _merge_siblings(self)
        if self.mods.pad_to is not None:
            pad_linears(self, self.mods.pad_to)
