"""torchao float8 as registry kernels, and the torchao model converter the benchmarks use.

Imported only when :func:`loka.kernels.capabilities.torchao_available` says so. The
kernels use torchao's own casts (``hp_tensor_to_float8_dynamic``: scale ``fmt.max / amax``
computed in float64, rounded down to a power of two in its rowwise recipe) and torchao's
GEMM entry (``addmm_float8_unwrapped``, which runs its rowwise recipe without fast
accumulation as a tensorwise cuBLAS GEMM followed by the scaling); operand layouts are
prepared as torchao's ``preprocess_addmm`` prepares them.

=======================  ==============================================================
torchao-tensorwise        tensorwise e4m3, no fast accumulation (torchao's dgrad/wgrad)
torchao-tensorwise-fastacc  tensorwise e4m3, fast accumulation (torchao's forward)
torchao-rowwise           rowwise e4m3, power-of-two scales (recipe 'rowwise')
torchao-rowwise-fastacc   the same on the CUTLASS rowwise kernel (fast accumulation)
=======================  ==============================================================

QTensors hold *dequantization* scales (``x ≈ q * s``); torchao's are their reciprocals.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

import torch
from torch import nn
from torchao.float8 import (Float8LinearConfig, Float8LinearRecipeName, ScalingGranularity,
                            convert_to_float8_training)
from torchao.float8.float8_ops import addmm_float8_unwrapped
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

from ...config import Role
from ...numerics import E4M3, Granularity, QTensor, in_memory_order, saturate_float64
from .. import capabilities as caps
from ..cublas import row_major
from ..recipes import check_gemm_operands
from ..registry import YES, Capability, Kernel, register

_AO_OUT = (torch.bfloat16, torch.float16, torch.float32)


def _cast(x: torch.Tensor, granularity: Granularity, operand: str, pow2: bool):
    """torchao's dynamic cast of one GEMM operand: (fp8 data, torchao scale)."""
    axiswise = granularity is Granularity.ROWWISE
    if x.numel() == 0:  # torchao's amax of an empty tensor raises: an empty operand, scale 1
        r, c = x.shape
        shape = ((r, 1) if operand == "a" else (1, c)) if axiswise else ()
        return (torch.empty(r, c, dtype=E4M3.dtype, device=x.device),
                torch.ones(shape, dtype=torch.float32, device=x.device))
    if not axiswise and in_memory_order(x) is not x:
        # a transposed view (Wᵀ, dyᵀ): cast its contiguous transpose, whose amax is read in
        # memory order (one scale either way), and hand back the transpose of the result
        data, scale = _cast(x.t(), granularity, "b" if operand == "a" else "a", pow2)
        return data.t(), scale
    # a float64 operand beyond float32's range saturates, as in LoKA's quantizers
    t = hp_tensor_to_float8_dynamic(
        saturate_float64(x), E4M3.dtype, LinearMMConfig(),
        gemm_input_role=GemmInputRole.INPUT if operand == "a" else GemmInputRole.WEIGHT,
        scaling_granularity=ScalingGranularity.AXISWISE if axiswise else ScalingGranularity.TENSORWISE,
        axiswise_dim=(-1 if operand == "a" else 0) if axiswise else None,
        round_scales_to_power_of_2=pow2)
    return t._data, t._scale


def _as_qtensor(data: torch.Tensor, ao_scale: torch.Tensor, granularity: Granularity,
                operand: str) -> QTensor:
    r, c = data.shape
    if granularity is Granularity.TENSORWISE:
        scale, block = ao_scale.reciprocal().float().reshape(1, 1), (max(r, 1), max(c, 1))
    elif operand == "a":
        scale, block = ao_scale.reciprocal().float().reshape(r, 1), (1, max(c, 1))
    else:
        scale, block = ao_scale.reciprocal().float().reshape(1, c), (max(r, 1), 1)
    return QTensor(data, scale, E4M3, block, granularity)


def _operand(x, granularity: Granularity, operand: str, pow2: bool):
    """(data, torchao scale) of an operand, quantizing a high-precision one."""
    if isinstance(x, QTensor):
        if x.fmt != E4M3 or x.granularity != granularity:
            raise ValueError(f"operand {operand} was quantized as {x.fmt}/{x.granularity}, "
                             f"but this kernel needs e4m3/{granularity}")
        scale = x.scale.reciprocal()
        return x.data, (scale.reshape(()) if granularity is Granularity.TENSORWISE else scale)
    return _cast(x, granularity, operand, pow2)


def make_torchao_kernel(name: str, granularity: Granularity, *, fast_accum: bool,
                        pow2: bool, quantizes_as: Optional[str] = None) -> Kernel:
    def fn(a, b, out_dtype):
        check_gemm_operands(a, b, out_dtype)
        a_data, a_scale = _operand(a, granularity, "a", pow2)
        b_data, b_scale = _operand(b, granularity, "b", pow2)
        a_data = row_major(a_data)  # preprocess_addmm's layouts: a row-major, b column-major
        if b_data.stride(0) > b_data.stride(1) and b_data.stride(1) == 1:
            b_data = b_data.t().contiguous().t()
        lib_dtype = out_dtype if out_dtype in _AO_OUT else torch.float32
        out = addmm_float8_unwrapped(a_data, a_scale, b_data, b_scale, lib_dtype,
                                     use_fast_accum=fast_accum)
        return out if out.dtype == out_dtype else out.to(out_dtype)

    fn.__name__ = name.replace("-", "_")

    def quantize_a(a: torch.Tensor) -> QTensor:
        return _as_qtensor(*_cast(a, granularity, "a", pow2), granularity, "a")

    def quantize_b(b: torch.Tensor) -> QTensor:
        data, scale = _cast(b, granularity, "b", pow2)
        return _as_qtensor(data, scale, granularity, "b")

    # addmm_float8_unwrapped runs rowwise without fast accumulation on the tensorwise kernel
    needs = "rowwise" if granularity is Granularity.ROWWISE and fast_accum else "tensorwise"

    def requires(device: torch.device) -> Capability:
        if fast_accum and device.type != "cuda":
            return Capability(False, "fast accumulation exists on CUDA tensor cores only")
        if not caps.has_scaled_mm(device, needs, out_dtype=torch.bfloat16):
            return Capability(False, f"this torch build has no {needs} _scaled_mm on {device.type}")
        return YES

    return Kernel(
        name=name, fn=fn, library="torchao", formats=("e4m3", "e4m3"), scaling=str(granularity),
        roles=frozenset(Role), devices=("cpu", "cuda"), min_capability=(8, 9), vendor="nvidia",
        align=16, requires=requires, quantize_a=quantize_a, quantize_b=quantize_b,
        fast_accum=fast_accum, quantizes_as=quantizes_as,
        description=f"torchao float8 {granularity}" + (", power-of-two scales" if pow2 else "")
                    + (", fast accumulation" if fast_accum else ""))


TORCHAO_KERNELS = (
    make_torchao_kernel("torchao-tensorwise", Granularity.TENSORWISE, fast_accum=False, pow2=False),
    make_torchao_kernel("torchao-tensorwise-fastacc", Granularity.TENSORWISE, fast_accum=True,
                        pow2=False, quantizes_as="torchao-tensorwise"),
    make_torchao_kernel("torchao-rowwise", Granularity.ROWWISE, fast_accum=False, pow2=True),
    # (no twin: torchao's rowwise GEMM without fast accumulation scales its output in
    # ops of its own, which the compiled call fuses and a GEMM timed alone does not)
    make_torchao_kernel("torchao-rowwise-fastacc", Granularity.ROWWISE, fast_accum=True, pow2=True),
)
for _kernel in TORCHAO_KERNELS:
    register(_kernel)


# -- model conversion -------------------------------------------------------------------

RECIPES = tuple(r.value for r in Float8LinearRecipeName)
"""torchao's recipe names: 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"""


def _eligible(module: nn.Module, fqn: str, skip: Iterable[str]) -> bool:
    """Every nn.Linear whose dims are multiples of 16 (FP8 GEMMs need it), minus ``skip``."""
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0
            and module.out_features % 16 == 0 and not any(s in fqn for s in skip))


AUTO_FILTER_STAND_IN = {"rowwise_with_gw_hp": "rowwise"}
"""recipes torchao has no auto filter for -> the recipe whose filter stands in (it judges
the same forward GEMMs)"""


def convert_torchao(model: nn.Module, recipe: str = "tensorwise", auto_filter: bool = False,
                    device: "torch.device | str | None" = None,
                    skip_fqns: Iterable[str] = (), skip_last: bool = False) -> List[str]:
    """Swap a model's Linears for torchao's ``Float8Linear``, in place.

    Args:
        model: any module.
        recipe: a torchao recipe name (:data:`RECIPES`).
        auto_filter: use torchao's own filter (``_auto_filter_for_recipe``: skips Linears
            whose shapes its H100 benchmarks found slower in FP8); for a recipe it does not
            cover, the filter :data:`AUTO_FILTER_STAND_IN` names. Otherwise every Linear
            with dims divisible by 16.
        device: the device the model will run on; off CUDA torchao's emulation is used.
        skip_fqns: substrings of module names never converted.
        skip_last: the model's last ``nn.Linear`` (a recommendation model's logit) is
            never converted either (matched by its exact name; torchao's auto filter also
            gets it among its ``filter_fqns``).

    Returns:
        The fully qualified names of the converted Linears.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown torchao recipe {recipe!r}; expected one of {RECIPES}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if caps.device_type(device) != "cuda":
        config = dataclasses.replace(config, emulate=True)
    skip = list(skip_fqns)
    last = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1:] if skip_last else []
    if auto_filter:
        from torchao.float8 import _auto_filter_for_recipe

        torchao_filter = _auto_filter_for_recipe(AUTO_FILTER_STAND_IN.get(recipe, recipe),
                                                 skip + last)
        filter_fn = lambda m, fqn: (_eligible(m, fqn, skip) and fqn not in last  # noqa: E731
                                    and torchao_filter(m, fqn))
    else:
        filter_fn = lambda m, fqn: _eligible(m, fqn, skip) and fqn not in last  # noqa: E731
    converted = [fqn for fqn, m in model.named_modules() if filter_fn(m, fqn)]
    convert_to_float8_training(model, module_filter_fn=filter_fn, config=config)
    return converted
