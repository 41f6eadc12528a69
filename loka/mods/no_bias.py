"""No Bias: drop the bias of every Linear except the final (logit) one.

The normalization after nearly every Linear of an LRM absorbs a bias anyway, while a bias
costs an epilogue read and blocks some fused FP8 GEMM paths. The logit layer keeps its
bias: it carries the base CTR.
"""

from __future__ import annotations

from typing import List, Tuple

import torch.nn as nn

from ._swap import ModuleChange, describe, iter_modules

FINAL_ATTR = "_loka_final"
"""Set ``module._loka_final = True`` on a Linear to mark it as a final (logit) layer."""


def final_linears(model: nn.Module) -> List[str]:
    """FQNs of the final Linears: those marked ``_loka_final = True``, else the last
    ``nn.Linear`` in module registration order (none if the model has no Linear)."""
    linears = [(fqn, m) for fqn, m in iter_modules(model) if isinstance(m, nn.Linear)]
    marked = [fqn for fqn, m in linears if getattr(m, FINAL_ATTR, False)]
    return marked or [fqn for fqn, _ in linears[-1:]]


def remove_biases(model: nn.Module) -> Tuple[List[ModuleChange], List[Tuple[str, str]]]:
    """Drop the bias of every Linear but the final ones, in place.

    An exact ``nn.Linear`` is swapped for a bias-free one sharing its weight Parameter; a
    Linear subclass keeps its identity and has its bias unregistered (``bias = None``).
    """
    keep = set(final_linears(model))
    changes, skipped = [], []
    for fqn, m in iter_modules(model):
        if not isinstance(m, nn.Linear) or m.bias is None or fqn in keep:
            continue
        old = describe(m)
        if type(m) is nn.Linear and fqn:
            new = nn.Linear(m.in_features, m.out_features, bias=False, device="meta")
            new.weight = m.weight
            model.set_submodule(fqn, new)
        else:
            m.register_parameter("bias", None)
            new = m
        changes.append(ModuleChange(fqn, old, describe(new)))
    return changes, skipped
