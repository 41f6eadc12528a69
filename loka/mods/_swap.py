"""Module-swap plumbing shared by the Mods: one record type and one replace helper."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, List, Tuple

import torch.nn as nn


@dataclass(frozen=True)
class ModuleChange:
    """One module a Mod changed: its fully qualified name and a one-line description of
    the module before and after."""

    fqn: str
    old: str
    new: str

    def to_dict(self) -> dict:
        return {"fqn": self.fqn, "old": self.old, "new": self.new}


def describe(module: nn.Module) -> str:
    """``Name(extra_repr)`` without children, e.g. ``Linear(in_features=8, ..., bias=True)``."""
    return f"{type(module).__name__}({module.extra_repr()})"


def iter_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """Every (fqn, module), a module shared at two places yielded at both, as a list
    snapshot so that callers may swap while iterating."""
    return iter(list(model.named_modules(remove_duplicate=False)))


def swap_modules(model: nn.Module, match: Callable[[nn.Module], bool],
                 make: Callable[[nn.Module], nn.Module]) -> Tuple[List[ModuleChange], List[Tuple[str, str]]]:
    """Replace every matching submodule by ``make(old)``; returns (changes, skipped)."""
    changes, skipped = [], []
    for fqn, module in iter_modules(model):
        if not match(module):
            continue
        if fqn == "":
            skipped.append(("", f"cannot replace the root {type(module).__name__} in place"))
            continue
        new = make(module)
        model.set_submodule(fqn, new)
        changes.append(ModuleChange(fqn, describe(module), describe(new)))
    return changes, skipped
