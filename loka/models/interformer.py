"""An InterFormer-style model (after Zeng et al., 2024, "InterFormer: Towards Effective
Heterogeneous Interaction Learning for Click-Through Rate Prediction"), reduced to its
structure: a sequence arch over a behaviour sequence and a non-sequence interaction arch,
interleaved, each layer exchanging summaries in both directions, then a top MLP.

Per layer l:
  * non-sequence -> sequence: a context token ``ctx = Linear(mean_n X)`` is prepended to the
    sequence, which goes through a pre-norm self-attention + MLP block;
  * sequence -> non-sequence: the summaries ``S = [ctx_out, masked mean of the sequence]``
    (B, 2, d) join X, and a Wukong layer maps the n + 2 embeddings back to n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from loka.config import ModsConfig
from loka.data.batch import Batch
from loka.mods import MergedLinear, ModuleChange, describe

from .arch import (DenseTokenArch, EmbeddingArch, FMConfig, OverArch, RecModel, make_activation,
                   make_linear, make_norm)
from .wukong import WukongLayer


@dataclass(frozen=True)
class InterFormerConfig(FMConfig):
    """An InterFormer-style model; ``seq_table``'s bag is the behaviour sequence
    (``num_layers``: interleaved (sequence, interaction) layers)."""

    seq_table: str = "history"
    """the table whose (un-pooled) bag is the behaviour sequence"""
    seq_len: int = 8
    """T: the first T ids of the bag are used; shorter bags are padded and masked"""
    num_heads: int = 2
    """attention heads of the sequence arch (must divide d)"""
    ffn_hidden: int = 32
    """hidden width of the sequence arch's MLP"""

    def __post_init__(self) -> None:
        object.__setattr__(self, "top_hidden", tuple(self.top_hidden))
        self.features.table(self.seq_table)  # raises a ValueError naming the tables
        if min(self.seq_len, self.embedding_dim, self.num_layers, self.num_heads,
               self.ffn_hidden, self.fm_rank, self.fm_hidden, self.batch_size) < 1:
            raise ValueError(f"InterFormerConfig needs positive sizes, got {self}")
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide embedding_dim="
                             f"{self.embedding_dim}")
        if self.num_tokens < 2:
            raise ValueError("InterFormer needs >= 2 non-sequence embeddings "
                             "(dense features + tables other than seq_table)")

    @property
    def num_tokens(self) -> int:
        """n, non-sequence embeddings: dense features + tables other than ``seq_table``."""
        return self.features.num_dense + len(self.features.tables) - 1


class SequenceBlock(nn.Module):
    """Pre-norm multi-head self-attention and MLP, with a key padding mask.

    q, k and v read the same normalized input: ``_loka_merge_siblings`` merges them.

    Shapes:
        x: (B, L, d), mask: (B, L) bool (True = a real item) -> (B, L, d)
    """

    def __init__(self, d: int, num_heads: int, ffn_hidden: int,
                 mods: Optional[ModsConfig] = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = make_norm(d, mods), make_norm(d, mods)
        self.q, self.k, self.v = (make_linear(d, d, mods) for _ in range(3))
        self.out = make_linear(d, d, mods)
        self.ffn = nn.Sequential(make_linear(d, ffn_hidden, mods), make_activation(mods),
                                 make_linear(ffn_hidden, d, mods))
        self.qkv: Optional[MergedLinear] = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Args: x (B, L, d), mask (B, L) bool. Returns: (B, L, d)."""
        b, length, d = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h) if self.qkv is not None else (self.q(h), self.k(h), self.v(h))
        heads = lambda t: t.reshape(b, length, self.num_heads, -1).transpose(1, 2)  # noqa: E731
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v),
                                             attn_mask=mask[:, None, None, :])
        x = x + self.out(att.transpose(1, 2).reshape(b, length, d))
        return x + self.ffn(self.norm2(x))

    def _loka_merge_siblings(self, when=None) -> List[ModuleChange]:
        if self.qkv is not None:
            return []
        siblings = [self.q, self.k, self.v]
        if when is not None and not when(siblings):
            return []
        self.qkv = MergedLinear(siblings)
        self.q = self.k = self.v = None
        new = describe(self.qkv)
        return [ModuleChange(n, describe(m), f"merged: {new}")
                for n, m in zip("qkv", siblings)]


class InterFormer(RecModel):
    """Interleaved sequence and interaction arches, then a top MLP over
    ``[flatten X (n d), flatten S (2 d)]``.

    Args:
        config: the architecture.
        mods: Mods honoured at construction.
    """

    def __init__(self, config: InterFormerConfig, mods: Optional[ModsConfig] = None) -> None:
        super().__init__(config, mods)
        c, mods = config, self.mods
        d, n = c.embedding_dim, c.num_tokens
        self.dense_arch = DenseTokenArch(c.features.num_dense, d) if c.features.num_dense else None
        self.embedding_arch = EmbeddingArch(c.features.tables, d, sparse=c.sparse_embeddings)
        self.token_tables = tuple(t for t in self.embedding_arch.names if t != c.seq_table)
        self.positions = nn.Parameter(torch.randn(c.seq_len, d) * d ** -0.5)
        self.context = nn.ModuleList(make_linear(d, d, mods) for _ in range(c.num_layers))
        self.sequence = nn.ModuleList(SequenceBlock(d, c.num_heads, c.ffn_hidden, mods)
                                      for _ in range(c.num_layers))
        self.interaction = nn.ModuleList(
            WukongLayer(n + 2, d, n // 2, n - n // 2, c.fm_rank, c.fm_hidden, mods)
            for _ in range(c.num_layers))
        self.over_arch = OverArch((n + 2) * d, c.top_hidden, mods)
        self._finish()

    def forward(self, batch: Batch) -> torch.Tensor:
        """Args: batch with dense (B, n_dense) and the tables of ``feature_spec``
        (``seq_table`` as the sequence). Returns: logits (B,)."""
        c = self.config
        tokens = [self.dense_arch(batch.dense)] if self.dense_arch is not None else []
        if self.token_tables:
            tokens.append(self.embedding_arch(batch.sparse, self.token_tables))
        x = torch.cat(tokens, dim=1) if len(tokens) > 1 else tokens[0]          # (B, n, d)
        seq, mask = self.embedding_arch.sequence(c.seq_table, batch.sparse, c.seq_len)
        seq = seq + self.positions                                               # (B, T, d)
        mask = F.pad(mask, (1, 0), value=True)  # the context token is always attended
        keep = mask[:, 1:].unsqueeze(-1).to(seq.dtype)
        for context, seq_block, interaction in zip(self.context, self.sequence, self.interaction):
            ctx = context(x.mean(1)).unsqueeze(1)                                 # (B, 1, d)
            h = seq_block(torch.cat([ctx, seq], dim=1), mask)       # (B, 1 + T, d)
            seq = h[:, 1:]
            seq_mean = (seq * keep).sum(1) / keep.sum(1).clamp_min(1.0)
            summary = torch.stack([h[:, 0], seq_mean], dim=1)     # (B, 2, d)
            x = interaction(torch.cat([x, summary], dim=1))  # (B, n, d)
        return self.over_arch(torch.cat([x.flatten(1), summary.flatten(1)], dim=1))
