"""Mods: model changes that make an LRM FP8-friendly and cheaper (No Bias, BlockNorm,
Hard Swish, shape padding, sibling merging), applied by :func:`convert`.

The fused norm -> quantize GPU kernel lives in ``loka.mods.fused`` and is imported on its own.
"""

from ._swap import ModuleChange, describe
from .blocknorm import BlockNorm, swap_norms
from .convert import ModsReport, convert
from .hardswish import HardSwish, swap_activations
from .no_bias import final_linears, remove_biases
from .shapes import (MergedLinear, PaddedLinear, merge_pays, merge_siblings, observed_rows,
                     pad_linears)

__all__ = [
    "BlockNorm", "HardSwish", "MergedLinear", "ModsReport", "ModuleChange", "PaddedLinear",
    "convert", "describe", "final_linears", "merge_pays", "merge_siblings", "observed_rows", "pad_linears", "remove_biases",
    "swap_activations", "swap_norms",
]
