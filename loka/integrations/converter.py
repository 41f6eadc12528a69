"""A LoKA plan as a TorchTitan-style model converter.

Training frameworks in the TorchTitan mould swap modules through *converters*: an object
with ``convert(model)``, called once after the model is built (on the meta device, before
it is parallelized), and ``post_optimizer_hook(model)``, called after every optimizer step
(torchao's float8 converter uses it to precompute FSDP's FP8 weight scales). A
:class:`PlanConverter` is such a converter whose module swap is ``loka.apply(model,
plan)``: it slots in where a float8 converter would, and a framework that lists converters
by name can register it under one. Models torchao already converted are turned back first
(:func:`~loka.integrations.torchao.from_torchao`), so it may follow torchao's float8
converter with LoKA's plan deciding; it must not precede it (torchao's converter would turn
LoKA's Linears, which are ``nn.Linear`` too, into its own).
"""

from __future__ import annotations

from typing import List, Optional, Union

from torch import nn

from ..dispatch import ApplyReport, Plan, apply
from .torchao import from_torchao


class PlanConverter:
    """``convert(model)`` applies ``plan``; ``post_optimizer_hook`` has nothing to do
    (LoKA's scales are computed per call, or fixed at ``convert`` for inference).

    Args:
        plan: the plan to apply.
        inference: apply for serving (``loka.apply(..., inference=True)``).
        strict: as :func:`loka.apply`.
    """

    def __init__(self, plan: Plan, inference: bool = False, strict: bool = True) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"expected a loka.Plan, got {type(plan).__name__}")
        self.plan, self.inference, self.strict = plan, inference, strict
        self.reports: List[ApplyReport] = []

    def convert(self, model: nn.Module) -> ApplyReport:
        """Apply the plan to ``model`` in place (after undoing a torchao conversion)."""
        from_torchao(model)
        report = apply(model, self.plan, inference=self.inference, strict=self.strict)
        self.reports.append(report)
        return report

    def post_optimizer_hook(self, model: Union[nn.Module, List[nn.Module], None]) -> None:
        """Called after each optimizer step; LoKA needs nothing there."""
        return None

    @property
    def last_report(self) -> Optional[ApplyReport]:
        return self.reports[-1] if self.reports else None
