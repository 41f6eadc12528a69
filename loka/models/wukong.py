"""Wukong (Zhang et al., 2024, "Wukong: Towards a Scaling Law for Large-Scale
Recommendation"): stacked layers of a Factorization Machine Block and a Linear
Compression Block over n embeddings of width d, then a top MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn

from loka.config import ModsConfig
from loka.data.batch import Batch
from loka.mods import BlockNorm, MergedLinear, ModuleChange, describe

from .arch import (MLP, DenseTokenArch, EmbeddingArch, FMConfig, OverArch, RecModel,
                   make_linear, make_norm)


@dataclass(frozen=True)
class WukongConfig(FMConfig):
    """A Wukong model. n = num_dense + len(tables) embeddings enter the first layer."""

    num_fm: int = 4
    """nF, embeddings produced by each FMB"""
    num_lcb: int = 4
    """nL, embeddings produced by each LCB"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_hidden", tuple(self.top_hidden))
        dims = (self.embedding_dim, self.num_layers, self.fm_rank, self.fm_hidden, self.batch_size)
        if min(dims) < 1 or self.num_fm < 0 or self.num_lcb < 0 or self.num_fm + self.num_lcb < 1:
            raise ValueError(f"WukongConfig needs positive dims and nF + nL >= 1, got {self}")
        if self.num_embeddings < 1:
            raise ValueError("WukongConfig.features must have dense features or tables")

    @property
    def num_embeddings(self) -> int:
        """n, embeddings entering the first layer."""
        return self.features.num_dense + len(self.features.tables)


def token_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Linear over the token axis of ``x`` (B, n, d), token-major: (B, out, d).

    A plain ``nn.Linear`` runs as ``W @ x_b`` for every sample b: one batched GEMM with the
    weight broadcast (a stride-0 batch), reading x as it lies and writing the output in the
    layout the layer's norm reads. (``torch.matmul(W, x)`` would not do: it folds the batch
    into the rows of ``xᵀ``, which copies x transposed and returns a transposed view.) Any
    other Linear (``loka.Linear`` of a plan, a padded Linear) runs as itself on ``xᵀ``, and
    its output is transposed back."""
    if type(linear) is nn.Linear:
        y = torch.bmm(linear.weight.expand(x.shape[0], -1, -1), x)
        return y if linear.bias is None else y + linear.bias[:, None]
    return linear(x.transpose(1, 2)).transpose(1, 2)


class FactorizationMachineBlock(nn.Module):
    """FMB: ``MLP(norm(flatten(X · proj(Xᵀ))))`` reshaped to nF embeddings.

    ``proj`` is a Linear over the n axis to rank k, so ``X · proj(Xᵀ) = X Xᵀ P`` is the
    factorization machine's all-pairs interaction ``X Xᵀ`` compressed by P (n, k), computed
    right to left so that the (n, n) matrix is never formed.

    Shapes:
        x: (B, n, d) -> (B, nF, d)
    """

    def __init__(self, n: int, d: int, num_out: int, rank: int, hidden: int,
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.num_out, self.d = num_out, d
        self.proj = make_linear(n, rank, mods)
        self.norm = make_norm(n * rank, mods)
        self.mlp = MLP(n * rank, [hidden], mods, out_features=num_out * d)
        self.token_major = bool(mods is not None and mods.token_major)

    def interact(self, x: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        """Args: x (B, n, d), projected = proj(xᵀ) (B, d, k). Returns: (B, nF, d)."""
        inter = torch.bmm(x, projected)  # (B, n, k)
        return self.mlp(inter.flatten(1), self.norm).view(x.shape[0], self.num_out, self.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (B, n, d). Returns: (B, nF, d)."""
        if self.token_major:
            return self.interact(x, token_linear(self.proj, x).transpose(1, 2))
        return self.interact(x, self.proj(x.transpose(1, 2)))


class LinearCompressionBlock(nn.Module):
    """LCB: a Linear over the n axis, n -> nL embeddings.

    Shapes:
        x: (B, n, d) -> (B, nL, d)
    """

    def __init__(self, n: int, num_out: int, mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.proj = make_linear(n, num_out, mods)
        self.token_major = bool(mods is not None and mods.token_major)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (B, n, d). Returns: (B, nL, d)."""
        if self.token_major:
            return token_linear(self.proj, x)
        return self.proj(x.transpose(1, 2)).transpose(1, 2)


class WukongLayer(nn.Module):
    """``norm(concat(FMB(X), LCB(X)) + residual(X))``, the norm over d.

    The residual is X itself when nF + nL == n, else a Linear over the n axis. The FMB
    projection, the LCB and the residual projection all read ``Xᵀ``: ``_loka_merge_siblings``
    turns them into one ``MergedLinear`` (one GEMM of width k + nL (+ nF + nL)).

    Shapes:
        x: (B, n, d) -> (B, nF + nL, d)
    """

    def __init__(self, n: int, d: int, num_fm: int, num_lcb: int, rank: int, hidden: int,
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.n, self.n_out = n, num_fm + num_lcb
        self.fmb = FactorizationMachineBlock(n, d, num_fm, rank, hidden, mods)
        self.lcb = LinearCompressionBlock(n, num_lcb, mods)
        self.residual = make_linear(n, self.n_out, mods) if n != self.n_out else None
        self.norm = make_norm(d, mods)
        self.merged: Optional[MergedLinear] = None
        self.token_major = bool(mods is not None and mods.token_major)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (B, n, d). Returns: (B, nF + nL, d)."""
        return self.norm(self.pre_norm(x))

    def pre_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The layer without its norm: ``concat(FMB(X), LCB(X)) + residual(X)``."""
        if self.token_major:
            return self._pre_norm_token_major(x)
        xt = x.transpose(1, 2)  # (B, d, n): the Linears below act on the n axis
        if self.merged is not None:
            outs = self.merged(xt)
            fm_proj, lcb = outs[0], outs[1]
            res = outs[2].transpose(1, 2) if len(outs) == 3 else x
        else:
            fm_proj, lcb = self.fmb.proj(xt), self.lcb.proj(xt)
            res = self.residual(xt).transpose(1, 2) if self.residual is not None else x
        out = torch.cat([self.fmb.interact(x, fm_proj), lcb.transpose(1, 2)], dim=1)
        return out + res

    def _pre_norm_token_major(self, x: torch.Tensor) -> torch.Tensor:
        """The same function with the n-axis Linears as ``W @ x`` (:func:`token_linear`)."""
        if self.merged is not None:
            outs = token_linear(self.merged.linear, x).split(self.merged.split_sizes, dim=1)
            fm_proj, lcb = outs[0], outs[1]
            res = outs[2] if len(outs) == 3 else x
        else:
            fm_proj, lcb = token_linear(self.fmb.proj, x), token_linear(self.lcb.proj, x)
            res = token_linear(self.residual, x) if self.residual is not None else x
        out = torch.cat([self.fmb.interact(x, fm_proj.transpose(1, 2)), lcb], dim=1)
        return out + res

    def _loka_merge_siblings(self, when=None) -> List[ModuleChange]:
        if self.merged is not None:
            return []
        names = ["fmb.proj", "lcb.proj"] + (["residual"] if self.residual is not None else [])
        siblings = [self.get_submodule(n) for n in names]
        if when is not None and not when(siblings):
            return []
        self.merged = MergedLinear(siblings)
        self.fmb.proj = None
        self.lcb.proj = None
        if self.residual is not None:
            self.residual = None
        new = describe(self.merged)
        return [ModuleChange(n, describe(m), f"merged: {new}") for n, m in zip(names, siblings)]


class Wukong(RecModel):
    """Wukong: embeddings X (B, n, d) -> L Wukong layers -> top MLP over (B, n_L * d).

    Dense features become one embedding each (``DenseTokenArch``), tables one pooled
    embedding each, so n = num_dense + len(tables).

    Args:
        config: the architecture.
        mods: Mods honoured at construction (None: plain bf16 model).
    """

    def __init__(self, config: WukongConfig, mods: Optional[ModsConfig] = None) -> None:
        super().__init__(config, mods)
        c, mods = config, self.mods
        self.dense_arch = DenseTokenArch(c.features.num_dense, c.embedding_dim) \
            if c.features.num_dense else None
        self.embedding_arch = EmbeddingArch(c.features.tables, c.embedding_dim,
                                            sparse=c.sparse_embeddings)
        n_out = c.num_fm + c.num_lcb
        self.layers = nn.ModuleList(
            WukongLayer(c.num_embeddings if i == 0 else n_out, c.embedding_dim, c.num_fm,
                        c.num_lcb, c.fm_rank, c.fm_hidden, mods) for i in range(c.num_layers))
        self.over_arch = OverArch(n_out * c.embedding_dim, c.top_hidden, mods)
        self.fuse_norm_quant = bool(mods.fuse_norm_quant)
        self._finish()

    def _top_prologue(self) -> Optional[nn.Module]:
        """The last layer's norm, when the top MLP may apply it to the flattened
        (B, n * d) output (and fuse it with its first Linear's quantization): a BlockNorm
        whose blocks divide d never straddles two embeddings, so it is the same function
        on the flattened rows."""
        norm = self.layers[-1].norm
        if self.fuse_norm_quant and isinstance(norm, BlockNorm) \
                and self.config.embedding_dim % norm.block_size == 0:
            return norm
        return None

    def embed(self, batch: Batch) -> torch.Tensor:
        """Args: batch. Returns: X (B, n, d), the dense tokens first."""
        parts = [self.dense_arch(batch.dense)] if self.dense_arch is not None else []
        if self.embedding_arch.names:
            parts.append(self.embedding_arch(batch.sparse))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch with dense (B, n_dense) and the tables of ``feature_spec``.
        Returns: logits (B,)."""
        x = self.embed(batch)
        for layer in self.layers[:-1]:
            x = layer(x)
        top_norm = self._top_prologue()
        if top_norm is None:
            return self.over_arch(self.layers[-1](x).flatten(1))
        return self.over_arch(self.layers[-1].pre_norm(x).flatten(1), top_norm)
