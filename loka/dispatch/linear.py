"""``loka.Linear``: an ``nn.Linear`` whose three GEMMs each run on a chosen kernel.

Same parameters, same ``state_dict`` keys, same module type hierarchy (it subclasses
``nn.Linear``), so it drops in anywhere. The kernels are resolved once, when the config is
set; the hot path is one ``torch.autograd.Function``:

    fwd    y  = x  @ Wᵀ    kernel ``config.fwd``,   a = x  (M, K), b = Wᵀ (K, N)
    dgrad  dx = dy @ W     kernel ``config.dgrad``, a = dy (M, N), b = W  (N, K)
    wgrad  dW = dyᵀ @ x    kernel ``config.wgrad``, a = dyᵀ (N, M), b = x (M, K)

With all three roles on the baseline the module is exactly ``F.linear`` (bit-identical
outputs and gradients). A role on the baseline inside a mixed config uses the very
formulas of ``nn.Linear``'s autograd, so it is bit-identical role by role too.

An FP8 producer (a fused norm→quantize kernel) may pass its output twice:
``linear(x, x_q=q)`` with ``x`` the high-precision tensor (the autograd edge) and ``q``
its :class:`~loka.numerics.QTensor`. The forward kernel consumes ``q`` without quantizing
again and only ``q`` is saved for the weight gradient, so the activation is kept in FP8.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LinearConfig, Role, role_shape
from ..kernels import registry
from ..kernels.registry import Kernel
from ..numerics import QTensor

BASELINE = "bf16"


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


class _LinearFunction(torch.autograd.Function):
    """One autograd node for the three role-specific GEMMs of a Linear."""

    @staticmethod
    def forward(ctx, x2d, x_q, weight, bias, kernels: Tuple[Kernel, Kernel, Kernel],
                weight_q: Optional[QTensor]):
        kf, kd, kw = kernels
        out_dtype = x2d.dtype
        a = x_q if x_q is not None else x2d
        if kf.name == BASELINE:
            y = F.linear(x2d, weight, bias)
        else:
            b = weight_q if weight_q is not None else weight.t()
            y = kf(a, b, out_dtype)
            if bias is not None:
                y = y + bias
        ctx.kernels = (kd, kw)
        ctx.has_bias = bias is not None
        ctx.out_dtype = out_dtype
        ctx.x_is_q = x_q is not None
        if ctx.x_is_q:  # keep the FP8 activation, not a high-precision copy
            ctx.x_q = x_q
            ctx.save_for_backward(weight)
        else:
            ctx.save_for_backward(x2d, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        kd, kw = ctx.kernels
        if ctx.x_is_q:
            (weight,) = ctx.saved_tensors
            x2d = ctx.x_q.dequantize(ctx.out_dtype)
        else:
            x2d, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if kd.name == BASELINE:
                dx = dy.mm(weight.to(dy.dtype))
            else:
                dx = kd(dy, weight, dy.dtype)
        if ctx.needs_input_grad[2]:
            if kw.name == BASELINE:
                dw = x2d.t().mm(dy).t()  # the formula of addmm's backward, for bit-equality
            else:
                # zero rows add nothing to dyᵀ·x: pad M for kernels that need K-alignment
                dw = kw(_pad_rows(dy, kw.align).t(), _pad_rows(x2d, kw.align), weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.sum(0)
        return dx, None, dw, db, None, None


class Linear(nn.Linear):
    """A drop-in ``nn.Linear`` with a kernel per GEMM role.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        config: a :class:`~loka.config.LinearConfig` naming a registered kernel per role.

    Shapes:
        input ``(*, in_features)``, optional ``x_q`` a QTensor ``(M, in_features)`` of the
        same values with M the product of the leading dims; output ``(*, out_features)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None, config: LinearConfig = LinearConfig()):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight_q: Optional[QTensor] = None
        self.set_config(config)

    # -- configuration -------------------------------------------------------------
    def set_config(self, config: LinearConfig) -> None:
        """Resolve and check the kernels once; raises for unknown kernels, roles they do
        not serve, or feature dims they cannot align."""
        if not isinstance(config, LinearConfig):
            raise TypeError(f"config must be a LinearConfig, got {type(config).__name__}")
        kernels = []
        for role in (Role.FWD, Role.DGRAD, Role.WGRAD):
            kern = registry.get(config.kernel(role))
            if role not in kern.roles:
                raise ValueError(f"kernel {kern.name!r} does not serve role {role}")
            # M is unknown here (wgrad pads M itself to the kernel's alignment)
            _, k, n = role_shape(role, kern.align, self.in_features, self.out_features)
            if kern.is_fp8 and not kern.pads and (k % kern.align or n % kern.align):
                raise ValueError(
                    f"kernel {kern.name!r} needs K and N multiples of {kern.align} for role "
                    f"{role}, but this Linear is {self.in_features}->{self.out_features}; "
                    "pad the features (loka.mods, ModsConfig(pad_to=16)) or keep this "
                    "role on the baseline")
            kernels.append(kern)
        self.config = config
        self._kernels = tuple(kernels)
        self._all_baseline = all(k.name == BASELINE for k in kernels)
        self.weight_q = None

    @property
    def kernels(self) -> Tuple[Kernel, Kernel, Kernel]:
        return self._kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LinearConfig = LinearConfig()) -> "Linear":
        """Wrap an existing ``nn.Linear``, sharing its Parameter objects (optimizers that
        hold them keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.weight_q = None
        new.training = linear.training
        for name, hook_dict in (("_forward_hooks", linear._forward_hooks),
                                ("_forward_pre_hooks", linear._forward_pre_hooks)):
            getattr(new, name).update(hook_dict)
        new.set_config(config)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this module's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        lin.training = self.training
        return lin

    def quantize_weight(self) -> None:
        """Quantize Wᵀ once for the forward kernel (inference: reused by every call)."""
        kf = self._kernels[0]
        if kf.quantize_b is None:
            raise ValueError(f"forward kernel {kf.name!r} has no weight quantizer")
        with torch.no_grad():
            self.weight_q = kf.quantize_b(self.weight.detach().t())

    # -- hot path ------------------------------------------------------------------
    def forward(self, x: torch.Tensor, x_q: Optional[QTensor] = None) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (*, {self.in_features}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"loka.Linear expects a floating-point input, got {x.dtype}")
        if self._all_baseline or x.numel() == 0:
            return F.linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if x_q is not None and tuple(x_q.shape) != tuple(x2d.shape):
            raise ValueError(f"x_q has shape {tuple(x_q.shape)}, expected {tuple(x2d.shape)}")
        y = _LinearFunction.apply(x2d, x_q, self.weight, self.bias, self._kernels,
                                  self.weight_q)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        return (super().extra_repr() + f", fwd={c.fwd}, dgrad={c.dgrad}, wgrad={c.wgrad}")
