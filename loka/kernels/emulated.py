"""Emulated FP8 kernels: the numerical reference of every recipe, on any device.

Quantization is the recipe's own (shared with the real kernel); the scales are applied
the way the hardware applies them: after the K-reduction for tensorwise and rowwise (one
scale per output row/column; the FP8 values are reduced in float32, as tensor cores do),
per K-block for blockwise and MX (dequantize, then reduce).

The scaling itself runs in float64 and the result is rounded once to the output dtype.
In float32, ``acc * scale_a * scale_b`` overflows on the way where the result does not
(a = 3e38, b = 1e-10: scale_a alone is 6.7e35), and ``0 * inf`` is NaN; torch's CPU
``_scaled_mm`` and cuBLAS both keep such products in range. So a finite input never gives
NaN here: at worst ±inf, where the exact result exceeds the output dtype.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..config import GRAD_ROLES, Role
from ..numerics import Granularity
from .recipes import Recipe, check_gemm_operands
from .registry import Kernel, register



def emulated_gemm(recipe: Recipe, a, b, out_dtype: torch.dtype) -> torch.Tensor:
    check_gemm_operands(a, b, out_dtype)
    qa, qb = recipe.operands(a, b)
    if recipe.scaling in (Granularity.TENSORWISE, Granularity.ROWWISE):
        acc = torch.mm(qa.data.float(), qb.data.float())
        scales = qa.scale.double() * qb.scale.double()  # (M,1)|(1,1) times (1,N)|(1,1)
        out = acc.double() * scales
    else:
        out = torch.mm(qa.dequantize(torch.float64), qb.dequantize(torch.float64))
    return out.to(out_dtype)


def make_emulated(name: str, recipe: Recipe, *, emulates: Optional[str], align: int,
                  roles=None, min_capability: Optional[Tuple[int, int]] = None,
                  vendor: str = "any", description: str = "") -> Kernel:
    """An emulated kernel for ``recipe``; its alignment mirrors the real kernel's so that
    a plan made with it on the CPU is valid on the GPU."""

    def fn(a, b, out_dtype):
        return emulated_gemm(recipe, a, b, out_dtype)

    fn.__name__ = name.replace("-", "_")
    return Kernel(
        name=name, fn=fn, library="emulated", formats=recipe.formats,
        scaling=str(recipe.scaling), roles=frozenset(roles) if roles else frozenset(Role),
        devices=("cpu", "cuda"), align=align, quantize_a=recipe.quantize_a,
        quantize_b=recipe.quantize_b, emulates=emulates, vendor=vendor,
        min_capability=min_capability,
        description=description or f"emulated {recipe.scaling} {recipe.a_format}x{recipe.b_format}",
    )


TW = Granularity.TENSORWISE
RW = Granularity.ROWWISE
BW = Granularity.BLOCKWISE
MX = Granularity.MX

# name -> (recipe, real twin, alignment, roles, min compute capability, vendor)
EMULATED: Dict[str, tuple] = {
    "emulated-tensorwise-e4m3": (Recipe(TW), "cublas-tensorwise", 16, None, None, "any"),
    "emulated-rowwise-e4m3": (Recipe(RW), "cublas-rowwise", 16, None, None, "any"),
    "emulated-blockwise-e4m3": (Recipe(BW), "cublas-blockwise", 128, None, None, "any"),
    "emulated-tensorwise-e5m2": (Recipe(TW, "e5m2", "e4m3"), "cublas-tensorwise-e5m2", 16,
                                 GRAD_ROLES, None, "any"),
    "emulated-rowwise-e5m2": (Recipe(RW, "e5m2", "e4m3"), "cublas-rowwise-e5m2", 16,
                              GRAD_ROLES, None, "any"),
    # MXFP8: native on Blackwell-class GPUs (sm_100+); emulated here for the numerics.
    "emulated-mx-e4m3": (Recipe(MX, power_of_two=True), None, 32, None, (10, 0), "nvidia"),
    # AMD MI300 formats (finite, no negative zero); NVIDIA GPUs have no native kernel.
    "emulated-tensorwise-e4m3fnuz": (Recipe(TW, "e4m3fnuz", "e4m3fnuz"), None, 16, None,
                                     None, "amd"),
    "emulated-rowwise-e4m3fnuz": (Recipe(RW, "e4m3fnuz", "e4m3fnuz"), None, 16, None, None,
                                  "amd"),
}

for _name, (_recipe, _twin, _align, _roles, _cc, _vendor) in EMULATED.items():
    register(make_emulated(_name, _recipe, emulates=_twin, align=_align, roles=_roles,
                           min_capability=_cc, vendor=_vendor))
