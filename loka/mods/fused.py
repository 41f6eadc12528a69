"""Fused norm -> activation -> FP8 quantization in front of a ``loka.Linear``.

The unfused composition reads and writes the activation three times (norm, activation,
the Linear's own quantization pass) and launches three kernels; at LRM shapes those
passes, not the GEMM, decide whether FP8 pays. :func:`fused_norm_act_quant` does it in one
kernel on the GPU (:mod:`loka.kernels.triton.norm_act_quant`) and hands the Linear both
tensors, ``linear(y, x_q=q)``: the FP8 one for the forward GEMM (no second quantization)
and the high-precision one as the autograd edge.

Numerics: the plain PyTorch composition (BlockNorm / LayerNorm, Hard Swish, then
:func:`loka.numerics.quantize`) is the CPU path and the reference; the kernel rounds where
it rounds, and its FP8 output equals ``quantize`` of its own high-precision output bit for
bit. Backward: a PyTorch formula (recomputes the norm from the saved input in float32; under
``torch.compile`` Inductor fuses it into one or two kernels), not a Triton kernel: the
backward of a row-local norm is memory-bound elementwise work that Inductor already
generates well, whereas the forward gains from the fused quantization.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import capabilities as caps
from ..kernels.ops import triton_kernel_op
from ..kernels.registry import Library
from ..numerics import QTensor, as_granularity, get_format, quantize
from .blocknorm import DEFAULT_EPS, BlockNorm

NORMS = ("blocknorm", "layernorm", "none")
ACTIVATIONS = ("hardswish", "identity")
GRANULARITIES = ("rowwise", "tensorwise")
BACKENDS = ("auto", "triton", "torch")


def reference_norm_act(x: torch.Tensor, norm: str = "blocknorm", block: int = 256,
                       act: str = "hardswish", eps: float = DEFAULT_EPS,
                       weight: Optional[torch.Tensor] = None,
                       bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unfused composition, differentiable: ``act(norm(x))`` in x's dtype.

    Args:
        x: (..., D) float.
    Returns:
        (..., D), dtype of x.
    """
    if norm == "blocknorm":
        y = BlockNorm(block, eps)(x)
    elif norm == "layernorm":
        y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    else:
        y = x
    return F.hardswish(y) if act == "hardswish" else y


def _check_args(x, norm, block, act, fmt, granularity, backend, weight, bias):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError("x must be a floating-point tensor of shape (..., D)")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if norm == "blocknorm" and (not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive int, got {block!r}")
    if (weight is not None or bias is not None) and norm != "layernorm":
        raise ValueError("weight and bias are LayerNorm's affine parameters")
    if x.shape[-1] == 0:
        raise ValueError("cannot normalize rows of zero features")
    get_format(fmt)


def triton_path_available(x: torch.Tensor, fmt="e4m3") -> bool:
    """Whether the fused Triton kernel runs for ``x``: a CUDA tensor on an FP8 GPU
    (compute capability >= 8.9) with Triton, in an OCP format.

    Under ``torch.compile`` the answer is a constant of the traced graph: the capability
    queries behind it (an import of triton, the device's properties) are not traceable,
    and tracing them broke a fused model's graph around every producer on the GPU."""
    return _triton_path(x.device, x.dtype, get_format(fmt).name)


@torch.compiler.assume_constant_result
def _triton_path(device: torch.device, dtype: torch.dtype, fmt_name: str) -> bool:
    cc = caps.cuda_capability(device)
    return (caps.triton_available(device) and cc is not None and cc >= (8, 9)
            and fmt_name in ("e4m3", "e5m2") and dtype != torch.float64)


# -- the GPU path: one Triton op with a PyTorch backward ------------------------------------

def _norm_act_quant_fake(x, weight, bias, norm, block, act, fmt, granularity, eps, return_hp):
    m, d = x.shape
    y = torch.empty_like(x) if return_hp else x.new_empty((0,))
    q = x.new_empty((m, d), dtype=get_format(fmt).dtype)
    s = x.new_empty((m, 1) if granularity == "rowwise" else (1, 1), dtype=torch.float32)
    return y, q, s


@triton_kernel_op("loka::norm_act_quant", _norm_act_quant_fake)
def _norm_act_quant_op(x: torch.Tensor, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], norm: str, block: int, act: str,
                       fmt: str, granularity: str, eps: float, return_hp: bool
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, D) -> (y (M, D) or (0,) when not ``return_hp``, q (M, D), scale).

    See :func:`loka.kernels.ops.triton_kernel_op`: under ``torch.compile`` on a GPU,
    Inductor sees the Triton kernels and launches them from its own code."""
    from ..kernels.triton import common

    with common.op_body():
        return _launch(x, weight, bias, norm, block, act, fmt, granularity, eps, return_hp)


def _launch(x, weight, bias, norm, block, act, fmt, granularity, eps, return_hp):
    """The op's body: the Triton kernel, called directly where no autograd or tracing
    needs the op (:func:`fused_norm_act_quant`)."""
    from ..kernels.triton import norm_act_quant as kernel

    y, q, s = kernel.norm_act_quant(x, norm=norm, block=block, act=act, fmt=fmt,
                                    granularity=granularity, return_hp=return_hp, eps=eps,
                                    weight=weight, bias=bias)
    return (y if y is not None else x.new_empty((0,))), q, s


def _setup_context(ctx, inputs, output):
    x, weight, bias, norm, block, act, _fmt, _gran, eps, _hp = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.params = (norm, block, act, eps)


def _backward(ctx, dy, _dq, _dscale):
    x, weight, bias = ctx.saved_tensors
    norm, block, act, eps = ctx.params
    dx, dw, db = norm_act_backward(x, dy, norm, block, act, eps, weight, bias)
    return dx, dw, db, None, None, None, None, None, None, None


_norm_act_quant_op.register_autograd(_backward, setup_context=_setup_context)


def _blocks(t: torch.Tensor, block: int):
    """(M, D) float32 -> list of (M, nblocks, B) views covering the full blocks and the tail."""
    d = t.shape[-1]
    full = d - d % block
    parts = []
    if full:
        parts.append(t[:, :full].reshape(t.shape[0], full // block, block))
    if full < d:
        parts.append(t[:, full:].reshape(t.shape[0], 1, d - full))
    return parts


def norm_act_backward(x: torch.Tensor, dy: torch.Tensor, norm: str, block: int, act: str,
                      eps: float, weight: Optional[torch.Tensor] = None,
                      bias: Optional[torch.Tensor] = None):
    """Gradients of ``act(norm(x))`` in float32, from the saved input.

    Args:
        x, dy: (M, D).
    Returns:
        dx (M, D) in x's dtype, dweight and dbias (D,) or None.
    """
    x32, g = x.float(), dy.float()
    dw = db = None
    if norm == "blocknorm":
        xs, gs = _blocks(x32, block), None
        rs = [torch.rsqrt(p.square().mean(-1, keepdim=True) + eps) for p in xs]
        n = torch.cat([(p * r).reshape(x.shape[0], -1) for p, r in zip(xs, rs)], -1)
    elif norm == "layernorm":
        mean = x32.mean(-1, keepdim=True)
        rstd = torch.rsqrt((x32 - mean).square().mean(-1, keepdim=True) + eps)
        xhat = (x32 - mean) * rstd
        n = xhat * weight.float() if weight is not None else xhat
        n = n + bias.float() if bias is not None else n
    else:
        n = x32
    if act == "hardswish":
        n = n.to(x.dtype).float()  # the activation saw the norm's rounded output
        g = g * torch.where(n < -3, 0.0, torch.where(n <= 3, n / 3 + 0.5, 1.0))
    if norm == "blocknorm":
        gs = _blocks(g, block)
        dxs = [r * gb - p * r.pow(3) * (gb * p).mean(-1, keepdim=True)
               for p, r, gb in zip(xs, rs, gs)]
        dx = torch.cat([t.reshape(x.shape[0], -1) for t in dxs], -1)
    elif norm == "layernorm":
        if weight is not None:
            dw = (g * xhat).sum(0).to(weight.dtype)
        if bias is not None:
            db = g.sum(0).to(bias.dtype)
        gh = g * weight.float() if weight is not None else g
        dx = rstd * (gh - gh.mean(-1, keepdim=True) - xhat * (gh * xhat).mean(-1, keepdim=True))
    else:
        dx = g
    return dx.to(x.dtype), dw, db


# -- the entry point ------------------------------------------------------------------------

def fused_norm_act_quant(x: torch.Tensor, norm: str = "blocknorm", block: int = 256,
                         act: str = "hardswish", fmt="e4m3", granularity: str = "rowwise",
                         return_hp: bool = True, *, eps: float = DEFAULT_EPS,
                         weight: Optional[torch.Tensor] = None,
                         bias: Optional[torch.Tensor] = None, backend: str = "auto"
                         ) -> Tuple[Optional[torch.Tensor], QTensor]:
    """``act(norm(x))`` and its FP8 quantization, in one kernel where the GPU allows.

    Args:
        x: (..., D) float32/bf16/fp16 pre-activation.
        norm: 'blocknorm' (parameter-free RMS norm over blocks of ``block`` features),
            'layernorm' (affine if ``weight``/``bias`` are given) or 'none'.
        block: BlockNorm's block size.
        act: 'hardswish' or 'identity'.
        fmt: FP8 format of the output ('e4m3', 'e5m2').
        granularity: 'rowwise' (one scale per row of the (M, D) view) or 'tensorwise'.
        return_hp: also return the high-precision activation (the autograd edge).
        eps: the norm's epsilon.
        weight, bias: LayerNorm's affine parameters (D,).
        backend: 'auto' (Triton on an FP8 GPU, else PyTorch), 'triton' (also on CPU
            tensors under Triton's interpreter) or 'torch' (the reference composition).

    Returns:
        y (..., D) in x's dtype (None if not ``return_hp``), and a QTensor (M, D) with
        M = x.numel() // D, as ``loka.numerics.quantize(y.reshape(M, D), fmt,
        granularity, 'a')`` gives it.
    """
    _check_args(x, norm, block, act, fmt, granularity, backend, weight, bias)
    fmt = get_format(fmt)
    lead, d = x.shape[:-1], x.shape[-1]
    x2d = x.reshape(-1, d)
    use_triton = backend == "triton" or (backend == "auto" and triton_path_available(x, fmt))
    if not use_triton:
        y = reference_norm_act(x2d, norm, block, act, eps, weight, bias)
        q = quantize(y.detach(), fmt, granularity, "a")
        return (y.reshape(*lead, d) if return_hp else None), q
    args = (x2d if x2d.stride(-1) == 1 else x2d.contiguous(), weight, bias, norm, block, act,
            fmt.name, granularity, float(eps), return_hp)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias))):
        y, data, scale = _norm_act_quant_op(*args)
    else:  # eager, nothing to differentiate (serving): the kernel without the op's dispatch,
        y, data, scale = _launch(*args)  # which costs host time at every call
    m = x2d.shape[0]
    blk = (1, d) if granularity == "rowwise" else (max(m, 1), d)
    q = QTensor(data, scale, fmt, blk, as_granularity(granularity))
    return (y.reshape(*lead, d) if return_hp else None), q


HANDOFF_LIBRARIES = (Library.EMULATED, Library.CUBLAS, Library.TRITON)
"""kernel libraries whose a-operand quantization is :func:`loka.numerics.quantize`'s (the
cuBLAS and Triton kernels use LoKA's own quantizers), so that a producer's FP8 tensor is
exactly what the Linear would have made. torchao and FBGEMM quantize by their own rules
(power-of-two scales, their own amax floor): their Linears quantize for themselves."""


def handoff(linear: nn.Module) -> Optional[Tuple[str, str]]:
    """``(fmt, granularity)`` in which ``linear`` (a ``loka.Linear``) takes its input from
    an FP8 producer, ``linear(y, x_q=q)``; None where it takes none: not a ``loka.Linear``,
    a high-precision or blockwise forward kernel, a kernel of another library (see
    :data:`HANDOFF_LIBRARIES`), or a static input scale (``set_input_amax``: the Linear
    quantizes with its calibrated scale)."""
    kernels = getattr(linear, "kernels", None)
    if not kernels or getattr(linear, "input_amax", None) is not None:
        return None
    kern = kernels[0]
    if not kern.is_fp8 or kern.scaling not in GRANULARITIES or kern.library not in HANDOFF_LIBRARIES:
        return None
    return kern.formats[0], kern.scaling


def norm_act_spec(norm: Optional[nn.Module], act: Optional[nn.Module]) -> Optional[dict]:
    """The arguments of :func:`fused_norm_act_quant` that compute ``act(norm(x))`` for
    these modules (None: no norm, no activation), or None where the fused kernel has no
    equivalent (another norm or activation)."""
    if norm is None:
        spec = {"norm": "none"}
    elif isinstance(norm, BlockNorm):
        spec = {"norm": "blocknorm", "block": norm.block_size, "eps": norm.eps}
    elif isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1:
        spec = {"norm": "layernorm", "eps": norm.eps, "weight": norm.weight, "bias": norm.bias}
    else:
        return None
    if act is None or isinstance(act, nn.Identity):
        spec["act"] = "identity"
    elif isinstance(act, nn.Hardswish):
        spec["act"] = "hardswish"
    else:
        return None
    return spec


def norm_act(x: torch.Tensor, norm: Optional[nn.Module], act: Optional[nn.Module]
             ) -> torch.Tensor:
    """``act(norm(x))`` by the modules, either of them None for none."""
    x = norm(x) if norm is not None else x
    return act(x) if act is not None else x


def norm_act_linear(x: torch.Tensor, norm: Optional[nn.Module], act: Optional[nn.Module],
                    linear: nn.Module) -> torch.Tensor:
    """``linear(act(norm(x)))``, the norm, the activation and the Linear's quantization of
    its input in one pass where the Linear takes an FP8 input (:func:`handoff`) and the
    fused kernel computes ``act(norm(.))`` (:func:`norm_act_spec`); else the modules one
    after the other. The same function either way: the Linear gets the FP8 tensor it would
    have made itself (on a GPU the fused norm may differ from the module's by an ulp: its
    reductions run in another order). Where the Linear reads nothing but that FP8 tensor
    (``reads_only_x_q``: serving), the high-precision activation is not written at all."""
    fq = handoff(linear) if norm is not None or act is not None else None
    spec = norm_act_spec(norm, act) if fq is not None else None
    if spec is None:
        return linear(norm_act(x, norm, act))
    y, q = fused_norm_act_quant(x, fmt=fq[0], granularity=fq[1],
                                return_hp=not linear.reads_only_x_q(), **spec)
    if y is None:  # a placeholder: the Linear takes its shape and dtype only
        y = x.new_empty(()).expand(x.shape)
    return linear(y, x_q=q)


class FusedNormActQuant(nn.Module):
    """Norm -> activation -> FP8 quantization as one module, for the input of a Linear.

    ``y, q = fused(x); out = linear(y, x_q=q)``: the Linear's forward kernel consumes ``q``
    (it must quantize its ``a`` operand with the same format and granularity; see
    :meth:`for_linear`), autograd flows through ``y``.

    Args:
        norm, block, act, fmt, granularity, eps: as :func:`fused_norm_act_quant`;
            ``granularity=None`` skips quantization (``q`` is None).
        normalized_dim: D, for a LayerNorm with affine parameters.
        elementwise_affine: give the LayerNorm a weight and a bias (ones and zeros).

    Shapes:
        x (..., D) -> y (..., D), q a QTensor (M, D) or None.
    """

    def __init__(self, norm: str = "blocknorm", block: int = 256, act: str = "hardswish",
                 fmt="e4m3", granularity: Optional[str] = "rowwise", eps: float = DEFAULT_EPS,
                 normalized_dim: Optional[int] = None, elementwise_affine: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if norm not in NORMS or act not in ACTIVATIONS:
            raise ValueError(f"norm must be one of {NORMS} and act one of {ACTIVATIONS}")
        if granularity is not None and granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES} or None")
        if elementwise_affine and (norm != "layernorm" or not normalized_dim):
            raise ValueError("elementwise_affine needs norm='layernorm' and normalized_dim")
        self.norm, self.block, self.act, self.eps = norm, block, act, eps
        self.fmt, self.granularity = get_format(fmt).name, granularity
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_dim, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(normalized_dim, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    @classmethod
    def for_linear(cls, linear: nn.Module, **kwargs) -> "FusedNormActQuant":
        """A module whose quantization matches ``linear``'s forward kernel (a
        ``loka.Linear``): its a-operand format and granularity (:func:`handoff`), or none
        where the Linear takes no FP8 activation from a producer."""
        fq = handoff(linear)
        if fq is None:
            kwargs["granularity"] = None
        else:
            kwargs.setdefault("fmt", fq[0])
            kwargs.setdefault("granularity", fq[1])
        return cls(**kwargs)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[QTensor]]:
        if self.granularity is None:
            return reference_norm_act(x, self.norm, self.block, self.act, self.eps,
                                      self.weight, self.bias), None
        y, q = fused_norm_act_quant(x, self.norm, self.block, self.act, self.fmt,
                                    self.granularity, True, eps=self.eps, weight=self.weight,
                                    bias=self.bias)
        return y, q

    def extra_repr(self) -> str:
        return (f"norm={self.norm}, block={self.block}, act={self.act}, fmt={self.fmt}, "
                f"granularity={self.granularity}")
