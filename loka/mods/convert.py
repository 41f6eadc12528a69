"""``loka.mods.convert``: apply any subset of the Mods to a built model, in place.

Converting a *trained* model is a model change, not a numerics-preserving rewrite:
BlockNorm, Hard Swish and No Bias compute a different function, so a converted model must
be trained (or at least fine-tuned) before its quality means anything. Only padding and
sibling merging preserve the function exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch.nn as nn

from loka.config import ModsConfig, config_to_dict

from ._swap import ModuleChange
from .blocknorm import swap_norms
from .hardswish import swap_activations
from .no_bias import remove_biases
from .shapes import merge_siblings, pad_linears


@dataclass(frozen=True)
class ModsReport:
    """What :func:`convert` changed: one :class:`ModuleChange` per swapped module, and the
    modules or options it could not apply, with the reason."""

    config: ModsConfig
    changes: Tuple[ModuleChange, ...] = ()
    skipped: Tuple[Tuple[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.changes)

    def __iter__(self) -> Iterator[ModuleChange]:
        return iter(self.changes)

    @property
    def fqns(self) -> List[str]:
        return [c.fqn for c in self.changes]

    def to_dict(self) -> dict:
        return {"config": config_to_dict(self.config),
                "changes": [c.to_dict() for c in self.changes],
                "skipped": [{"fqn": f, "reason": r} for f, r in self.skipped]}

    def summary(self) -> str:
        """A plain-text table: fqn | old | new."""
        rows = [("module", "old", "new")] + [(c.fqn, c.old, c.new) for c in self.changes]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
        lines += [f"skipped {f or '<model>'}: {r}" for f, r in self.skipped]
        return "\n".join(lines)


def convert(model: nn.Module, mods: ModsConfig) -> ModsReport:
    """Apply ``mods`` to ``model`` in place by module swaps; returns what changed.

    Order: merge siblings -> No Bias -> BlockNorm -> Hard Swish -> padding, so that a
    merged GEMM loses its bias and is padded as one.

    * ``merge_siblings``: every ``_loka_merge_siblings`` hook of the model (Wukong's FMB
      projection + LCB (+ residual projection); InterFormer's q/k/v) -> ``MergedLinear``.
    * ``no_bias``: every Linear except the final ones (``_loka_final = True``, else the last
      ``nn.Linear`` in registration order) loses its bias.
    * ``blocknorm``: ``nn.LayerNorm`` / ``nn.RMSNorm`` over one dim -> ``BlockNorm(B)``.
    * ``hardswish``: ``nn.SiLU`` -> ``nn.Hardswish``.
    * ``pad_to``: Linears with a dim not a multiple of it -> ``PaddedLinear``.
    * ``token_major``: every module with a ``token_major`` switch (Wukong's layers and FM
      blocks) computes its token-axis Linears as ``W @ X``; the same function, no swap.
    * ``fuse_norm_quant``: every module with a ``fuse_norm_quant`` switch (the reference
      models' MLPs, Wukong's top MLP input) runs a norm and an activation in front of a
      ``loka.Linear`` that takes an FP8 input, and the Linear's quantization, as one
      kernel (:func:`loka.mods.fused.norm_act_linear`); the same function, no swap. In
      another model, put ``loka.mods.fused.FusedNormActQuant`` in front of the Linear.

    Converting a trained model changes the function (except padding and merging): train
    or fine-tune afterwards. Idempotent: converting twice changes nothing the second time.

    Args:
        model: any ``nn.Module``; LoKA's reference models mark their logit layer.
        mods: which Mods to apply.

    Returns:
        ModsReport listing every changed module as (fqn, old, new).
    """
    if not isinstance(mods, ModsConfig):
        raise TypeError(f"mods must be a loka.ModsConfig, got {type(mods).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    changes: List[ModuleChange] = []
    skipped: List[Tuple[str, str]] = []
    if mods.merge_siblings:
        changes += merge_siblings(model)
    for enabled, step in ((mods.no_bias, remove_biases),
                          (mods.blocknorm is not None, lambda m: swap_norms(m, mods.blocknorm)),
                          (mods.hardswish, swap_activations)):
        if enabled:
            c, s = step(model)
            changes += c
            skipped += s
    if mods.pad_to is not None:
        changes += pad_linears(model, mods.pad_to)
    for enabled, switch, old, new, none in (
            (mods.token_major, "token_major", "n-axis Linears on Xᵀ", "n-axis Linears as W @ X",
             "no module of this model has token-axis Linears"),
            (mods.fuse_norm_quant, "fuse_norm_quant", "norm, activation, quantization",
             "norm -> activation -> quantization fused",
             "no module of this model has the switch: put loka.mods.fused.FusedNormActQuant "
             "in front of the loka.Linear")):
        if enabled:
            c, s = _flip(model, switch, old, new, none)
            changes += c
            skipped += s
    return ModsReport(config=mods, changes=tuple(changes), skipped=tuple(skipped))


def _flip(model: nn.Module, switch: str, old: str, new: str, none: str
          ) -> Tuple[List[ModuleChange], List[Tuple[str, str]]]:
    """Set the bool attribute ``switch`` of every module that has one; a change per module
    it was off in, or ``none`` as the reason it is skipped if no module has it."""
    switched = [(fqn, m) for fqn, m in model.named_modules()
                if isinstance(getattr(m, switch, None), bool)]
    changes = []
    for fqn, m in switched:
        if not getattr(m, switch):
            setattr(m, switch, True)
            changes.append(ModuleChange(fqn, f"{type(m).__name__}({old})",
                                        f"{type(m).__name__}({new})"))
    return changes, ([] if switched else [("", f"{switch}: {none}")])
