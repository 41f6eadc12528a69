"""torchao in both directions: plan a model torchao already converted, and hand a LoKA
plan to torchao's runtime.

**From torchao.** ``convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear``,
which subclasses ``nn.Linear`` but computes something else, so :func:`loka.apply` refuses
it (and says to call :func:`from_torchao`). :func:`from_torchao` puts a plain
``nn.Linear`` back at every such site, holding the *same* Parameter objects (an optimizer
built earlier keeps working) and the same hooks, and returns what torchao had configured
per site. The model is then what it was before torchao: the Probe learns it, ``loka.plan``
chooses per site and role, ``loka.apply`` applies. Sites keep their names, so a plan made
on the unconverted model fits, and :func:`to_torchao` can give the sites back to torchao.

**To torchao.** :func:`to_torchao` maps each site's three kernels to torchao's recipe
parts (``Float8LinearConfig``: one ``CastConfig`` per GEMM operand and one
``Float8GemmConfig`` per GEMM), for teams that keep torchao's runtime:

==========================  ==================================================
LoKA kernel of a role       torchao, for that GEMM's two operands
==========================  ==================================================
the baseline (bf16, ...)    ``ScalingType.DISABLED`` (the GEMM in high precision)
``*-tensorwise*``           ``ScalingGranularity.TENSORWISE``, dynamic
``*-rowwise*``              ``ScalingGranularity.AXISWISE``, dynamic
``*-fastacc``               ``Float8GemmConfig(use_fast_accum=True)``
operand format e4m3 / e5m2  ``CastConfig.target_dtype``
``torchao-rowwise*``        ``round_scales_to_power_of_2=True`` (torchao's recipe)
blockwise, MX               no torchao training recipe: high precision (noted)
==========================  ==================================================

cuBLAS, Triton and emulated kernels of one scaling map to the same torchao recipe: torchao
has one GEMM per recipe, LoKA's choice of implementation does not carry over. torchao casts
an operand once for both GEMMs it feeds, so where LoKA's choices give one operand two
formats (say dgrad in e5m2 and wgrad in e4m3 for the output gradient) the export keeps
the first GEMM's and notes it. For serving, ``inference_configs`` maps each site whose
forward is FP8 to ``Float8DynamicActivationFloat8WeightConfig`` (``PerRow`` for rowwise,
``PerTensor`` for tensorwise, 1x128 / 128x128 ``PerBlock`` for blockwise where torchao
has it) for ``torchao.quantization.quantize_``.

torchao is imported only inside the functions that need it: without it,
:func:`is_torchao_linear` and the error :func:`loka.apply` raises still work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..config import ROLES, Role
from ..dispatch import Plan
from ..dispatch.swap import root_module
from ..kernels import registry

_TORCHAO_FLOAT8 = ("Float8Linear",)
"""class names of torchao's float8 training Linears"""

_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_is_full_backward_hook",  # without it, full backward hooks never run
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")

_FORMAT_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def is_torchao_linear(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's float8 Linears (``Float8Linear``), judged by
    its class without importing torchao."""
    cls = type(module)
    return cls.__name__ in _TORCHAO_FLOAT8 and cls.__module__.startswith("torchao.")


def torchao_sites(model: nn.Module) -> List[str]:
    """The fully qualified names of ``model``'s torchao float8 Linears."""
    root, _ = root_module(model)
    return [name for name, mod in root.named_modules() if is_torchao_linear(mod)]


def _plain_weight(weight: nn.Parameter) -> nn.Parameter:
    """The Parameter itself; a float8 all-gather wrapper (FSDP2) is unwrapped to a new
    Parameter around its high-precision tensor (identity cannot be kept there)."""
    inner = getattr(weight, "_tensor", None)
    if type(weight) is nn.Parameter or not isinstance(inner, torch.Tensor):
        return weight
    return nn.Parameter(inner, requires_grad=weight.requires_grad)


def from_torchao(model: nn.Module) -> Dict[str, Any]:
    """Turn every torchao ``Float8Linear`` of ``model`` back into an ``nn.Linear``, in place.

    The new Linear holds the same ``weight`` and ``bias`` Parameter objects and the same
    hooks and instance attributes, so optimizers, ``state_dict`` keys and site names are
    unchanged. (A weight torchao wrapped for its FP8 all-gather, ``enable_fsdp_float8_all_gather``,
    becomes a new Parameter around its high-precision tensor: build the optimizer after.)
    A module shared under several names is replaced once, under all of them.

    Args:
        model: a model (or its ``torch.compile`` wrapper) converted by torchao.

    Returns:
        site -> the torchao ``Float8LinearConfig`` it had (for the record, or to give back
        with ``convert_to_float8_training``); empty when nothing was converted.
    """
    root, _ = root_module(model)
    names: Dict[int, List[str]] = {}
    for name, mod in root.named_modules(remove_duplicate=False):
        if is_torchao_linear(mod):
            names.setdefault(id(mod), []).append(name)
    if "" in {n for ns in names.values() for n in ns}:
        raise ValueError("the model itself is a Float8Linear: wrap it in a module first")
    configs: Dict[str, Any] = {}
    for aliases in names.values():
        old = root.get_submodule(aliases[0])
        new = _linear_like(old)
        for name in aliases:
            root.set_submodule(name, new)
        configs[aliases[0]] = getattr(old, "config", None)
    return configs


def _linear_like(old: nn.Module) -> nn.Linear:
    with torch.device("meta"):
        new = nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    new.weight = _plain_weight(old.weight)
    new.bias = old.bias
    new.train(old.training)
    skip = {"config", "linear_mm_config", "scaling_type_input", "scaling_type_weight",
            "scaling_type_grad_output"}
    for key, value in old.__dict__.items():
        if key in _HOOK_DICTS:
            setattr(new, key, value)
        elif not key.startswith("_") and key not in skip and key not in new.__dict__:
            new.__dict__[key] = value  # plain attributes such as a model's own flags
    return new


# -- LoKA plan -> torchao ---------------------------------------------------------------

@dataclass
class TorchaoExport:
    """A LoKA plan in torchao's terms.

    Attributes:
        configs: site -> ``Float8LinearConfig`` for ``convert_to_float8_training``; only
            sites with at least one FP8 role.
        inference_configs: site -> ``Float8DynamicActivationFloat8WeightConfig`` for
            ``torchao.quantization.quantize_``; only sites whose forward is FP8.
        notes: where the export differs from the plan (one line each).
    """

    configs: Dict[str, Any] = field(default_factory=dict)
    inference_configs: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def module_filter_fn(self, inference: bool = False) -> Callable[[nn.Module, str], bool]:
        """torchao's ``module_filter_fn(module, fqn)``: True at the exported sites."""
        sites = set(self.inference_configs if inference else self.configs)
        return lambda module, fqn: fqn in sites and isinstance(module, nn.Linear)

    def convert(self, model: nn.Module) -> List[str]:
        """Convert ``model`` for training with torchao, in place: one
        ``convert_to_float8_training`` call per distinct config. Returns the sites."""
        from torchao.float8 import convert_to_float8_training

        root, _ = root_module(model)
        for config, sites in _grouped(self.configs):
            convert_to_float8_training(root, config=config,
                                       module_filter_fn=lambda m, fqn, s=sites: fqn in s)
        return torchao_sites(root)

    def quantize(self, model: nn.Module) -> List[str]:
        """Quantize ``model`` for serving with torchao, in place (``quantize_`` per
        distinct config). Returns the sites quantized."""
        from torchao.quantization import quantize_

        root, _ = root_module(model)
        for config, sites in _grouped(self.inference_configs):
            quantize_(root, config, filter_fn=lambda m, fqn, s=sites: fqn in s)
        return sorted(self.inference_configs)


def _grouped(configs: Dict[str, Any]) -> List[Tuple[Any, set]]:
    groups: List[Tuple[Any, set]] = []
    for site, config in configs.items():
        for cfg, sites in groups:
            if cfg == config:
                sites.add(site)
                break
        else:
            groups.append((config, {site}))
    return groups


def _role_kernel(plan: Plan, site: str, role: Role):
    name = plan.sites[site].kernel(role, plan.baseline)
    try:
        return registry.get(name)
    except KeyError:
        raise ValueError(f"site {site!r} {role}: kernel {name!r} is not registered here") from None


def to_torchao(plan: Plan, emulate: bool = False) -> TorchaoExport:
    """Map a LoKA plan to torchao configurations (see the module docstring for the table).

    Args:
        plan: a :class:`loka.Plan`.
        emulate: set torchao's ``emulate`` (FP8 GEMMs emulated in high precision), for a
            machine without FP8 tensor cores; the casts are torchao's real ones.

    Returns:
        A :class:`TorchaoExport`.
    """
    from torchao.float8 import (CastConfig, Float8GemmConfig, Float8LinearConfig,
                                ScalingGranularity, ScalingType)

    if not isinstance(plan, Plan):
        raise TypeError(f"expected a loka.Plan, got {type(plan).__name__}")
    out = TorchaoExport()
    for site in plan.sites:
        kernels = {role: _role_kernel(plan, site, role) for role in ROLES}
        if not any(k.is_fp8 for k in kernels.values()):
            continue
        fp8: Dict[Role, Any] = {}
        for role, kern in kernels.items():
            if not kern.is_fp8:
                continue
            if str(kern.scaling) not in ("tensorwise", "rowwise"):
                out.notes.append(f"{site} {role}: {kern.name} ({kern.scaling}) has no torchao "
                                 "training recipe; exported in high precision")
                continue
            if any(f not in _FORMAT_DTYPES for f in kern.formats):
                out.notes.append(f"{site} {role}: {kern.name} formats {kern.formats} are not "
                                 "torchao's; exported in high precision")
                continue
            fp8[role] = kern
        if not fp8:
            continue

        def cast(role: Role, operand: int):
            kern = fp8.get(role)
            if kern is None:
                return CastConfig(scaling_type=ScalingType.DISABLED)
            gran = (ScalingGranularity.AXISWISE if str(kern.scaling) == "rowwise"
                    else ScalingGranularity.TENSORWISE)
            return CastConfig(scaling_type=ScalingType.DYNAMIC, scaling_granularity=gran,
                              target_dtype=_FORMAT_DTYPES[kern.formats[operand]])

        # operands: fwd (x, W), dgrad (dy, W), wgrad (dy, x), as loka.Linear orders them
        c = {"input": cast(Role.FWD, 0), "weight": cast(Role.FWD, 1),
             "grad_output": cast(Role.DGRAD, 0), "weight_for_grad_input": cast(Role.DGRAD, 1),
             "grad_output_for_grad_weight": cast(Role.WGRAD, 0),
             "input_for_grad_weight": cast(Role.WGRAD, 1)}
        c = _one_dtype_per_operand(site, c, out.notes)
        pow2 = any(k.library == "torchao" and str(k.scaling) == "rowwise" for k in fp8.values())
        gemm = {role: Float8GemmConfig(use_fast_accum=bool(fp8[role].fast_accum)
                                       if role in fp8 else False) for role in ROLES}
        out.configs[site] = Float8LinearConfig(
            cast_config_input=c["input"], cast_config_weight=c["weight"],
            cast_config_grad_output=c["grad_output"],
            cast_config_input_for_grad_weight=c["input_for_grad_weight"],
            cast_config_weight_for_grad_input=c["weight_for_grad_input"],
            cast_config_grad_output_for_grad_weight=c["grad_output_for_grad_weight"],
            gemm_config_output=gemm[Role.FWD], gemm_config_grad_input=gemm[Role.DGRAD],
            gemm_config_grad_weight=gemm[Role.WGRAD],
            round_scales_to_power_of_2=pow2, emulate=emulate)
        if Role.FWD in fp8:
            inf = _inference_config(fp8[Role.FWD])
            if inf is None:
                out.notes.append(f"{site}: no torchao serving granularity for "
                                 f"{fp8[Role.FWD].name}")
            else:
                out.inference_configs[site] = inf
    for site in plan.sites:  # blockwise forwards still serve where torchao has PerBlock
        if site in out.inference_configs:
            continue
        kern = _role_kernel(plan, site, Role.FWD)
        if kern.is_fp8 and str(kern.scaling) == "blockwise":
            inf = _inference_config(kern)
            if inf is not None:
                out.inference_configs[site] = inf
    return out


def _one_dtype_per_operand(site: str, c: Dict[str, Any], notes: List[str]) -> Dict[str, Any]:
    """torchao casts each operand to one dtype for both GEMMs it feeds: where LoKA's two
    kernels differ, the second GEMM takes the first one's dtype."""
    from torchao.float8 import ScalingType

    for first, second in (("input", "input_for_grad_weight"),
                          ("weight", "weight_for_grad_input"),
                          ("grad_output", "grad_output_for_grad_weight")):
        a, b = c[first], c[second]
        if a.target_dtype is None or b.target_dtype is None:
            # a disabled cast carries the other GEMM's dtype (torchao checks they agree)
            dtype = a.target_dtype or b.target_dtype
            if dtype is not None:
                c[first] = dataclasses.replace(a, target_dtype=dtype)
                c[second] = dataclasses.replace(b, target_dtype=dtype)
            continue
        if a.target_dtype != b.target_dtype and b.scaling_type is not ScalingType.DISABLED:
            notes.append(f"{site}: {first.split('_for_')[0]} is cast to "
                         f"{str(a.target_dtype).split('.')[-1]} for both GEMMs (LoKA chose "
                         f"{str(b.target_dtype).split('.')[-1]} for {second})")
            c[second] = dataclasses.replace(b, target_dtype=a.target_dtype)
    return c


def _inference_config(kern) -> Optional[Any]:
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    if any(f not in _FORMAT_DTYPES for f in kern.formats):
        return None  # not torchao's formats (say e4m3fnuz): not served as e4m3 either
    act, weight = (_FORMAT_DTYPES[f] for f in kern.formats)
    scaling = str(kern.scaling)
    if scaling == "rowwise":
        gran: Any = PerRow()
    elif scaling == "tensorwise":
        gran = PerTensor()
    elif scaling == "blockwise":
        try:
            from torchao.quantization.granularity import PerBlock
        except ImportError:
            return None
        gran = [PerBlock([1, 128]), PerBlock([128, 128])]  # the form torchao compares to
    else:
        return None
    try:
        return Float8DynamicActivationFloat8WeightConfig(
            activation_dtype=act, weight_dtype=weight, granularity=gran,
            mm_config=Float8MMConfig(use_fast_accum=bool(kern.fast_accum)))
    except ValueError:  # a torchao release without this granularity
        return None


def describe(config) -> Dict[str, str]:
    """A torchao ``Float8LinearConfig`` per GEMM in LoKA's words: role -> 'bf16' or
    '<granularity>-<format>[-fastacc]' (for tests, notes and docs)."""
    def one(a, b, gemm) -> str:
        if a.scaling_type.name == "DISABLED":
            return "bf16"
        gran = "rowwise" if a.scaling_granularity.name == "AXISWISE" else "tensorwise"
        fmt = str(a.target_dtype).split("_")[1][:4]
        return f"{gran}-{fmt}" + ("-fastacc" if gemm.use_fast_accum else "")

    return {"fwd": one(config.cast_config_input, config.cast_config_weight,
                       config.gemm_config_output),
            "dgrad": one(config.cast_config_grad_output, config.cast_config_weight_for_grad_input,
                         config.gemm_config_grad_input),
            "wgrad": one(config.cast_config_grad_output_for_grad_weight,
                         config.cast_config_input_for_grad_weight, config.gemm_config_grad_weight)}
