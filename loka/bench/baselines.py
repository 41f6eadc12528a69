"""torchao's float8 recipes as benchmark rows: training converts the Linears to torchao's
``Float8Linear`` (through LoKA's torchao adapter, :func:`loka.kernels.adapters.torchao.
convert_torchao`), inference quantizes them with torchao's ``quantize_``.

torchao is optional: its adapter is loaded by :mod:`loka.kernels.adapters` where torchao
imports, and ``quantize_`` is imported when a serving row is built (a run skips torchao's
rows, with a note, where it is not installed)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels import adapters
from .variants import TORCHAO_SERVING_RECIPES

__all__ = ["torchao_training", "torchao_inference", "contiguous_input"]


def torchao_training(model: nn.Module, recipe: str, auto: bool,
                     device: torch.device) -> Optional[str]:
    """Convert ``model`` to torchao's float8 training ``recipe``: every Linear torchao can
    take (dims divisible by 16) except the logit, or (``auto``) those torchao's own filter
    picks. Returns a note for the row when the conversion needed a stand-in: an auto filter
    of another recipe, or inputs made contiguous."""
    adapters.load()
    adapter = getattr(adapters, "torchao", None)
    if adapter is None:
        raise RuntimeError("torchao's adapter is not loaded: "
                           + adapters.FAILED.get("torchao", "torchao is not installed"))
    adapter.convert_torchao(model, recipe, auto_filter=auto, device=device, skip_last=True)
    note = None
    stand_in = adapter.AUTO_FILTER_STAND_IN.get(recipe) if auto else None
    if stand_in:
        note = f"torchao has no auto filter for {recipe}: its {stand_in} filter chose the Linears"
    if recipe.startswith("rowwise"):
        # torchao's rowwise casts cannot clone a strided input ("aten.clone.default with
        # axiswise scaling is not supported yet"), which Wukong's FM projection of the
        # transposed embeddings is: its Linears get their input made contiguous, a copy
        # charged to these rows
        n = 0
        for mod in model.modules():
            if type(mod).__name__ == "Float8Linear":
                mod.register_forward_pre_hook(contiguous_input)
                n += 1
        if n:
            note = "; ".join(filter(None, [note, f"inputs made contiguous at {n} Linear(s) "
                                                  "(torchao's rowwise casts need it)"]))
    return note


def contiguous_input(module, args):
    """A forward pre-hook: the module's first input made contiguous (no copy if it is)."""
    return (args[0].contiguous(),) + tuple(args[1:])


def torchao_inference(model: nn.Module, recipe: str, set_inductor_config: bool = True) -> nn.Module:
    """torchao's float8 inference quantization (dynamic activations, weights once) of every
    Linear with both dimensions divisible by 16 except the logit; ``recipe``: 'rowwise'
    (``PerRow``) or 'tensorwise' (``PerTensor``); ``set_inductor_config`` is torchao's own
    switch (its default, True, turns on coordinate-descent tuning)."""
    # torchao is optional: imported for its rows only (the library, not a LoKA module)
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, PerRow,
                                      PerTensor, quantize_)

    if recipe not in TORCHAO_SERVING_RECIPES:
        raise ValueError(f"torchao serves {' and '.join(TORCHAO_SERVING_RECIPES)} float8, "
                         f"not {recipe!r}")
    gran = PerRow() if recipe == "rowwise" else PerTensor()
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1:]

    def filt(mod, fqn):
        return (isinstance(mod, nn.Linear) and mod not in last
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(
        granularity=gran, set_inductor_config=set_inductor_config), filter_fn=filt)
    return model
