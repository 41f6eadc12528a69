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
again. Where the weight gradient's kernel takes ``q`` as is (tensorwise, the same format),
only ``q`` is saved for it, so the activation is kept in FP8; otherwise ``x`` is saved, as
without the producer (a rowwise ``q`` has its scales along the other axis of the weight
gradient's operand: dequantized and quantized again, it would be rounded twice), and the
gradients are those of ``linear(x)``.

Rowwise kernels with a two-layout quantizer (``Kernel.quantize_dual``: LoKA's Triton
rowwise kernels) make the two layouts each tensor needs in one call, with the same bits:
x (the forward's a, the weight gradient's xᵀ, kept in FP8 for the backward instead of x),
W (the forward's and the input gradient's b) and dy (both gradients' a; no transposed copy
of dy).

Graph-safety: the hot path has no host synchronization and no branch on tensor values
(branches are on shapes and on the config, fixed between calls), so ``torch.compile(...,
fullgraph=True)`` traces it and a training step can be captured in a CUDA graph.
Traceable kernels run inline (Inductor fuses their quantization into the producer);
opaque ones (see :mod:`loka.kernels.ops`) run as the custom op ``loka::gemm``.

Delayed scaling (:meth:`Linear.set_delayed_scaling`, training): x, W and dy, where every
FP8 role that reads the operand quantizes it tensorwise with PyTorch ops, are cast with a
scale estimated at earlier calls (:mod:`loka.numerics.delayed`), so no amax pass has to
finish before the cast: under ``torch.compile`` the cast fuses into the kernel that made
the tensor and the next estimate comes from the FP8 result in that same kernel. It acts
in training mode with gradients recorded; the first such call quantizes dynamically and
seeds the estimates (x and W from the tensors themselves, whatever the roles run; dy in
that call's backward). Each operand's state is a float32 buffer that ``state_dict`` does
not save.

Inference: :meth:`Linear.quantize_weight` stores Wᵀ in FP8 once; :meth:`drop_weight`
then frees the high-precision weight (the state_dict then holds ``weight_fp8`` and
``weight_scale`` in place of ``weight``); :meth:`set_input_amax` switches the forward's
activation quantization from dynamic to a static scale. A call with no gradient to record
on a Linear that serves from its FP8 weight with a static scale, on a kernel with a
:attr:`~loka.kernels.registry.Kernel.static_gemm`, takes that short path instead of the
autograd Function (the same bits): a compiled step guards a few of the module's
attributes per Linear, as it does for an ``nn.Linear``.

Length: the module, its autograd Function and the swaps in and out of ``nn.Linear``
(including under ``fully_shard``) share the module's internals; apart, each would reach
into the others'.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BASELINE, LinearConfig, Role, role_shape
from ..kernels import ops, registry
from ..kernels.registry import Kernel, Library, Scaling
from ..numerics import (AMAX_EPS, Granularity, QTensor, as_granularity, get_format, operand_block,
                        quantize, round_scale_to_power_of_two)
from ..numerics.scaling import is_qtensor
from ..numerics.delayed import (DEFAULT_DECAY, STREAK_GROWTH, check_decay, new_state,
                               next_state, quantize_delayed, seed_state)



STATIC_TABLE_MAX_SCALES = 1 << 22
"""the most float32 scales a static input-scale table keeps (16 MiB); a larger one keeps a
single row of blocks and expands it per call (:meth:`Linear.set_input_amax`)"""


def takes_static_input_scale(kernel: Kernel) -> bool:
    """Whether a forward ``kernel`` can quantize its activation with a static scale
    (:meth:`Linear.set_input_amax`): an FP8 kernel whose activation quantizer is PyTorch's,
    at a known granularity (Triton and FBGEMM kernels quantize inside)."""
    return bool(kernel.is_fp8 and kernel.quantize_a is not None
                and kernel.scaling in set(Granularity))


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-t.shape[0]) % multiple
    return F.pad(t, (0, 0, 0, extra)) if extra else t


def _pad_q_rows(q: QTensor, multiple: int) -> QTensor:
    """Zero rows appended to a tensorwise QTensor (its one scale is unchanged)."""
    extra = (-q.shape[0]) % multiple
    if not extra:
        return q
    zeros = torch.zeros(extra, q.shape[1], dtype=q.data.dtype, device=q.data.device)
    return QTensor(torch.cat([q.data, zeros]), q.scale, q.fmt,
                   (q.block[0] + extra, q.block[1]), q.granularity)


def _fits(kernel: Kernel, q: QTensor, operand: int) -> bool:
    return kernel.scaling == "tensorwise" and kernel.formats[operand] == q.fmt.name


def _shares(producer: Kernel, p_operand: int, consumer: Kernel, c_operand: int) -> bool:
    """Can the tensorwise FP8 operand ``p_operand`` (0 = a, 1 = b) quantized for
    ``producer`` feed ``consumer`` as its operand ``c_operand``, as is? Both tensorwise, of
    one library (so they agree on the layout of the FP8 data), with quantizers, and the
    same format. The three reuses: fwd x -> wgrad b, fwd Wᵀ -> dgrad b (transposed),
    dgrad dy -> wgrad a (transposed)."""
    # scalings compared by value: traced code then reads no member of ``Scaling``, which
    # compiled code would check per call is the kernels' own
    return (producer.scaling == consumer.scaling == "tensorwise"
            and producer.library == consumer.library
            and producer.quantize_a is not None and consumer.quantize_a is not None
            and producer.formats[p_operand] == consumer.formats[c_operand])


def _dual(first: Kernel, f_operand: int, second: Kernel, s_operand: int, rows: int):
    """The two-layout quantizer of ``first`` when one call of it can make operand ``f_operand``
    of ``first`` from a tensor t and operand ``s_operand`` of ``second`` from tᵀ (both
    rowwise, one library, one format; ``second`` needs no zero rows appended to t's
    ``rows``): the forward's x and the weight gradient's xᵀ, the input gradient's dy and
    the weight gradient's dyᵀ, the weight's forward and input-gradient layouts. None where
    the two need separate quantizations."""
    if (first.quantize_dual is None or second.quantize_dual is None
            or first.library != second.library or rows % second.align
            # the two-layout quantizer makes its kernel's a format
            or not first.formats[0] == first.formats[f_operand] == second.formats[s_operand]):
        return None
    return first.quantize_dual


DELAYABLE_LIBRARIES = (Library.CUBLAS, Library.TORCHAO, Library.EMULATED)
"""libraries whose tensorwise kernels quantize with PyTorch ops and take any tensorwise
QTensor of their format as is (LoKA's Triton and FBGEMM kernels quantize in their own
kernels)"""


def delayable(kernel: Kernel) -> bool:
    """A tensorwise FP8 kernel of :data:`DELAYABLE_LIBRARIES`."""
    return (kernel.scaling == "tensorwise" and kernel.quantize_a is not None
            and kernel.library in DELAYABLE_LIBRARIES)


def delayed_formats(kernels: Tuple[Kernel, Kernel, Kernel]) -> Tuple[Optional[str], ...]:
    """The FP8 format in which delayed scaling quantizes each of x, W and dy under
    ``kernels`` (fwd, dgrad, wgrad), or None where it does not: an operand is delayed when
    some FP8 role reads it and every FP8 role that reads it is :func:`delayable`, in one
    format (x: fwd a, wgrad b; W: fwd b, dgrad b; dy: dgrad a, wgrad a)."""
    kf, kd, kw = kernels

    def fmt(uses):
        fp8 = [(k, i) for k, i in uses if k.name != BASELINE]
        if not fp8 or not all(delayable(k) for k, _ in fp8):
            return None
        names = {k.formats[i] for k, i in fp8}
        return names.pop() if len(names) == 1 else None

    return fmt([(kf, 0), (kw, 1)]), fmt([(kf, 1), (kd, 1)]), fmt([(kd, 0), (kw, 0)])


def _delayed_cast(t: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor], fmt: str,
                  ready: bool, decay: float) -> QTensor:
    """Tensorwise FP8 ``t``, its operand's ``(est, streak)`` state updated in place: with
    the estimate's scale once seeded (``ready``), else dynamically, seeding it."""
    est, streak = state
    if ready:
        q = quantize_delayed(t, est, fmt)
        new_est, new_streak = next_state(est, streak, q, decay)
    else:
        q = quantize(t, fmt, Granularity.TENSORWISE, "a")
        new_est, new_streak = seed_state(est, streak, q)
    est.copy_(new_est)
    streak.copy_(new_streak)
    return q


# read by the hot path as names of this module, not as attributes of ``torch``: compiled
# code checks, per call, that each module's ``torch`` it read is the caller's
_is_autocast_enabled = torch.is_autocast_enabled
_get_autocast_dtype = torch.get_autocast_dtype
_is_grad_enabled = torch.is_grad_enabled
_f_linear = F.linear
_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)


def _autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast would compute a Linear of ``x`` in, or None where it leaves
    ``x`` as it is: autocast off (or unknown) on ``x``'s device, ``x`` already in it, or
    ``x`` float64 (which autocast does not cast)."""
    device_type = x.device.type
    if device_type == "meta" or not _is_autocast_enabled(device_type):
        return None  # (meta: autocast has no state for it, and asking raises)
    ad = _get_autocast_dtype(device_type)
    return ad if x.dtype in _AUTOCAST_FROM and x.dtype != ad else None


def _as_b(q_t: QTensor) -> QTensor:
    """The rowwise ``a`` operand of tᵀ (C, R) as the ``b`` operand t (R, C) a GEMM reads
    K-major: the same FP8 storage and scales, viewed as ``quantize_b(t)`` returns them."""
    c, r = q_t.shape
    return QTensor(q_t.data.t(), q_t.scale.reshape(1, -1), q_t.fmt, (max(r, 1), 1),
                   q_t.granularity)


class _LinearFunction(torch.autograd.Function):
    """One autograd node for the three role-specific GEMMs of a Linear."""

    @staticmethod
    def forward(ctx, x2d, x_q, weight, bias, kernels: Tuple[Kernel, Kernel, Kernel],
                weight_q: Optional[QTensor], grad_flags: Optional[torch.Tensor] = None,
                grad: bool = True, delayed: Optional[tuple] = None):
        kf, kd, kw = kernels
        out_dtype = x2d.dtype
        ctx.kernels = (kd, kw)
        ctx.has_bias = bias is not None
        ctx.out_dtype = out_dtype
        ctx.check_grads = grad_flags is not None
        ctx.x_q = ctx.w_q = ctx.w_b = None
        ctx.delayed = None
        xq_d = wq_d = None
        if delayed is not None and grad:  # (formats, estimates, ready, decay): training only
            (fx, fw, fg), (ex, ew, eg), ready, decay = delayed
            ctx.delayed = (fg, eg, ready, decay)
            x_used = fx is not None and x_q is None and (kf.name != BASELINE or (
                ctx.needs_input_grad[2] and not ctx.check_grads))
            w_used = fw is not None and weight_q is None and (kf.name != BASELINE
                                                              or ctx.needs_input_grad[0])
            if x_used:
                xq_d = _delayed_cast(x2d, ex, fx, ready, decay)
            elif fx is not None and not ready:  # seed it all the same (the next call casts)
                _delayed_cast(x2d.detach(), ex, fx, False, decay)
            if w_used:
                wq_d = _delayed_cast(weight, ew, fw, ready, decay)
            elif fw is not None and not ready:
                _delayed_cast(weight.detach(), ew, fw, False, decay)
            if xq_d is not None and kw.name != BASELINE and not ctx.check_grads:
                ctx.x_q = xq_d  # the wgrad kernel's b, as made in the forward
            if wq_d is not None and kd.name != BASELINE:
                ctx.w_q = wq_d.t()  # the dgrad kernel takes its transpose, W
        if kf.name == BASELINE:
            y = _f_linear(x2d, weight, bias)
        else:
            a = xq_d if xq_d is not None else x_q if x_q is not None else x2d
            b = (wq_d.t() if wq_d is not None else weight_q if weight_q is not None
                 else weight.t())
            share_w = wq_d is None and _shares(kf, 1, kd, 1)
            share_x = xq_d is None and _shares(kf, 0, kw, 1)
            # (``grad``: the caller's grad mode; a forward without it needs no gradient layout)
            dual_x = (_dual(kf, 0, kw, 1, x2d.shape[0])
                      if grad and ctx.needs_input_grad[2] and x_q is None and xq_d is None
                      and not ctx.check_grads and kw.name != BASELINE else None)
            dual_w = (_dual(kf, 1, kd, 1, 0)
                      if grad and ctx.needs_input_grad[0] and weight_q is None and wq_d is None
                      and weight.is_contiguous() and kd.name != BASELINE
                      and not ctx.check_grads else None)
            if dual_x is not None:
                # rowwise: x and xᵀ from one two-layout quantizer;
                # the backward keeps the FP8 xᵀ instead of x
                a, x_t = dual_x(x2d)
                ctx.x_q = _as_b(x_t)
            if dual_w is not None:
                # W (N, K) rowwise over K is the forward's b (Wᵀ, K-major); Wᵀ rowwise over
                # N is the input gradient's b (W, reduced over N)
                w_rows, w_cols = dual_w(weight)
                b, ctx.w_b = _as_b(w_rows), _as_b(w_cols)
            if share_w or share_x:  # tensorwise: never with the rowwise two-layout quantizer
                # tensorwise: one scale per tensor whatever the GEMM, so the FP8 copies of x
                # and W made here serve the gradient GEMMs too (no requantization)
                a = a if is_qtensor(a) else kf.quantize_a(a)
                b = b if is_qtensor(b) else kf.quantize_b(b)
                if share_w:
                    ctx.w_q = b
                if share_x and not ctx.check_grads:
                    ctx.x_q = a
            y = kf(a, b, out_dtype)
            if bias is not None:
                y = y + bias.to(y.dtype)
        if x_q is not None and ctx.x_q is None and _fits(kw, x_q, 1) and not ctx.check_grads:
            ctx.x_q = x_q  # the wgrad kernel's own operand: keep it, not a high-precision copy
        if ctx.x_q is not None:
            ctx.save_for_backward(weight)
        else:
            ctx.save_for_backward(x2d, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        kd, kw = ctx.kernels
        if ctx.x_q is not None:  # tensorwise, of the wgrad kernel's format (_fits)
            (weight,) = ctx.saved_tensors
            x_b, x2d = ctx.x_q, None
        else:
            x2d, weight = ctx.saved_tensors
            x_b = None
        if kd.name != BASELINE or kw.name != BASELINE:
            dy = dy.contiguous()  # FP8 quantizers read rows; the bf16 GEMMs take any strides
        dx = dw = db = None
        dy_q = dy_t = None
        dual_dy = (_dual(kd, 0, kw, 0, dy.shape[0])
                   if ctx.needs_input_grad[0] and ctx.needs_input_grad[2] else None)
        fg = ctx.delayed[0] if ctx.delayed is not None else None
        if fg is not None and ((kd.name != BASELINE and ctx.needs_input_grad[0])
                               or (kw.name != BASELINE and ctx.needs_input_grad[2])):
            _, eg, ready, decay = ctx.delayed
            dy_q = _delayed_cast(dy, eg, fg, ready, decay)  # one FP8 dy for both GEMMs
        elif dual_dy is not None:
            dy_q, dy_t = dual_dy(dy)  # dy for dgrad, dyᵀ for wgrad: no transposed copy
        elif _shares(kd, 0, kw, 0):
            dy_q = kd.quantize_a(dy)  # one FP8 copy of dy for both gradient GEMMs
        if ctx.needs_input_grad[0]:
            if kd.name == BASELINE:
                dx = dy.mm(weight.to(dy.dtype))
            else:
                w_b = (ctx.w_b if ctx.w_b is not None else
                       ctx.w_q.t() if ctx.w_q is not None else weight)
                dx = kd(dy_q if dy_q is not None else dy, w_b, dy.dtype)
        if ctx.needs_input_grad[2]:
            if kw.name == BASELINE:
                # addmm's backward for a column-major mat2 (Wᵀ): one GEMM whose result is
                # dW (N, K) row-major, the weight's own layout. (x2dᵀ·dy)ᵀ would give a
                # transposed view, which AccumulateGrad then copies element by element.
                dw = dy.t().mm(x2d)
            else:
                # zero rows add nothing to dyᵀ·x: pad M for kernels that need K-alignment;
                # dyᵀ row-major, as FP8 GEMMs (cuBLAS: TN layout) need for their a operand
                a = (dy_t if dy_t is not None else _pad_q_rows(dy_q, kw.align).t()
                     if dy_q is not None else _pad_rows(dy, kw.align).t().contiguous())
                b = _pad_q_rows(x_b, kw.align) if x_b is not None else _pad_rows(x2d, kw.align)
                dw = kw(a, b, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = dy.sum(0)
        d_flags = None
        if ctx.check_grads:  # the guard: did a gradient GEMM turn finite into non-finite?
            # (operands the baseline reads as well must be finite: a NaN weight is no
            # FP8 fault)
            dy_ok = torch.isfinite(dy).all()
            no = torch.zeros_like(dy_ok)
            dgrad_bad = (no if dx is None else
                         dy_ok & torch.isfinite(weight).all() & ~torch.isfinite(dx).all())
            wgrad_bad = (no if dw is None else
                         dy_ok & torch.isfinite(x2d).all() & ~torch.isfinite(dw).all())
            d_flags = torch.stack([dgrad_bad, wgrad_bad]).float()
        return dx, None, dw, db, None, None, d_flags, None, None


class SiteMonitor:
    """Health flags of one Linear, recorded only while ``armed`` (on the steps a
    :class:`~loka.dispatch.guard.Guard` checks). Everything stays on the device: reading
    the flags is the only synchronization, and the guard does it outside the hot path.

    ``fwd_bad``: a call turned a finite input (and finite weight and bias) into a
    non-finite output.
    ``saturation``: the largest fraction of input elements beyond a static input scale.
    ``grad_flags``: a (2,) leaf whose gradient counts calls whose dgrad / wgrad turned a
    finite gradient into a non-finite one (the backward writes it like any gradient, so
    this works under torch.compile and in CUDA graphs).
    """

    def __init__(self) -> None:
        self.armed = False
        self.clear()

    def clear(self) -> None:
        self.fwd_bad: Optional[torch.Tensor] = None
        self.saturation: Optional[torch.Tensor] = None
        self.grad_flags: Optional[torch.Tensor] = None

    def arm(self, device: torch.device) -> None:
        self.clear()
        self.grad_flags = torch.zeros(2, device=device, requires_grad=True)
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def record(self, x2d: torch.Tensor, y: torch.Tensor, input_amax: Optional[torch.Tensor],
               params: Tuple[Optional[torch.Tensor], ...] = ()) -> None:
        """Record one forward call; ``params`` (weight, bias) must be finite as well for
        the call to count as bad: a non-finite parameter fails the baseline just the same."""
        ok_in = torch.isfinite(x2d).all()
        for p in params:
            if p is not None:
                ok_in = ok_in & torch.isfinite(p.detach()).all()
        bad = ok_in & ~torch.isfinite(y).all()
        self.fwd_bad = bad if self.fwd_bad is None else self.fwd_bad | bad
        if input_amax is not None:
            sat = (x2d.detach().abs() > input_amax).float().mean()
            self.saturation = sat if self.saturation is None else torch.maximum(self.saturation, sat)


def _held(t: torch.Tensor) -> nn.Parameter:
    """``t`` (no copy) as a Parameter without gradient, for a loka.Linear's own tensors."""
    return t if type(t) is nn.Parameter and not t.requires_grad else \
        nn.Parameter(t.detach(), requires_grad=False)


_TABLES: "weakref.WeakValueDictionary[tuple, nn.Parameter]" = weakref.WeakValueDictionary()
"""static scale tables by (device, dtype, shape, value), for :func:`_shared_table`"""


def _shared_table(table: torch.Tensor) -> nn.Parameter:
    """``table`` held (:func:`_held`), or, where every scale in it is one value, the table
    another Linear already holds for that value, shape and device: Linears that read one
    tensor and hold equal static scales (:func:`loka.dispatch.static.group_amax`) then
    pass one tensor to a compiled step, so their casts of that input are one expression,
    which the lowering of ``loka::scaled_mm`` makes once (:mod:`loka.kernels.ops`).
    Tables are never written in place (a new amax makes a new one)."""
    held = _held(table)
    if held.device.type == "meta" or held.numel() == 0:
        return held
    first = held.reshape(-1)[0]
    if not bool((held == first).all()):
        return held
    key = (str(held.device), held.dtype, tuple(held.shape), float(first))
    shared = _TABLES.get(key)
    if shared is None:
        _TABLES[key] = shared = held
    return shared


_INTERNED: Dict[str, Kernel] = {}
"""kernels by the key a loka.Linear keeps (:func:`_intern`). Its forward reaches its Kernel
objects through this one global: Dynamo then guards each kernel once, where objects
reached from several sites' own attributes each get an identity guard per pair of sites
(three per FP8 site), run in Python on every call of the compiled step."""


def _intern(kernel: Kernel) -> str:
    """The key of ``kernel`` in :data:`_INTERNED` (its name, or the name and a count where
    another object holds that name: a kernel registered again with ``override=True``)."""
    key, n = kernel.name, 0
    while _INTERNED.get(key, kernel) is not kernel:
        n += 1
        key = f"{kernel.name}#{n}"
    _INTERNED[key] = kernel
    return key


# attributes loka.Linear adds to an nn.Linear (dropped again by to_linear)
_OWN_ATTRS = ("config", "_kernels", "_kernel_keys", "_all_baseline", "_wq", "input_amax",
              "_xs_table", "_static_key", "_serve_key",
              "monitor", "delayed_decay", "_delayed_formats", "_delayed_ready")
_DELAYED_OPERANDS = ("x", "w", "dy")
_DELAYED_BUFFERS = tuple(f"delayed_{kind}_{op}" for op in _DELAYED_OPERANDS
                         for kind in ("amax", "streak"))
"""per operand: its amax estimate and the growth of its next saturated call"""


def _sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are DTensors (``fully_shard`` manages them)."""
    return any(type(p).__name__ == "DTensor" or hasattr(p, "device_mesh")
               for p in module.__dict__["_parameters"].values() if p is not None)


def _fsdp_class(module: nn.Module, base: type) -> Optional[type]:
    """The class ``fully_shard`` gives modules of class ``base``, when ``module`` was
    ``fully_shard``-ed itself (its FSDP state and hooks are keyed by the object: such a
    module changes class in place instead of being replaced); else None."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls
    except ImportError:  # a build without torch.distributed
        return None
    if not isinstance(module, FSDPModule):
        return None
    classes = get_cls_to_fsdp_cls()
    cls = classes.get(base)
    if cls is None:
        deepcopy = type(module).__dict__.get("__deepcopy__")
        cls = classes[base] = type(f"FSDP{base.__name__}", (FSDPModule, base),
                                   {} if deepcopy is None else {"__deepcopy__": deepcopy})
    return cls


def _rehome(dst: nn.Module, src: nn.Module) -> None:
    """Make ``dst`` the same module as ``src`` under another class: same Parameters, same
    hook dicts (so hooks and their handles keep working), same flags and attributes; its
    own parameter/buffer/child containers. Parameters that ``fully_shard`` manages keep
    one container: FSDP swaps sharded and unsharded parameters into the module it
    recorded (``src``), so ``dst`` must see those swaps."""
    dst.__dict__.update(src.__dict__)
    shared = ("_parameters",) if _sharded(src) else ()
    for key in ("_parameters", "_buffers", "_modules"):
        if key in shared:
            continue
        dst.__dict__[key] = type(src.__dict__[key])(src.__dict__[key])
    dst._non_persistent_buffers_set = set(src._non_persistent_buffers_set)
    dst.__dict__.pop("_compiled_call_impl", None)  # a compiled forward of the old class


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
        self.input_amax: Optional[torch.Tensor] = None
        self._input_scales: Optional[torch.Tensor] = None
        self.monitor: Optional[SiteMonitor] = None
        self.delayed_decay: Optional[float] = None
        self.set_config(config)

    # -- configuration -------------------------------------------------------------
    def set_config(self, config: LinearConfig) -> None:
        """Resolve and check the kernels once; raises for unknown kernels, roles they do
        not serve, or feature dims they cannot align. Clears a quantized weight and a
        static input scale (they belong to the previous forward kernel) and restarts
        delayed scaling's estimates (its decay stays)."""
        if not isinstance(config, LinearConfig):
            raise TypeError(f"config must be a LinearConfig, got {type(config).__name__}")
        if self.weight is None:
            raise ValueError("this Linear's high-precision weight was dropped (inference); "
                             "its kernels cannot change")
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
            kernels.append(ops.runnable(kern))
        self.config = config
        self._kernels = tuple(kernels)
        self._kernel_keys = tuple(_intern(k) for k in kernels)
        self._all_baseline = all(k.name == BASELINE for k in kernels)
        self.weight_q = None
        self.input_amax = self._input_scales = None
        # new kernels: which operands are delayed follows them, and the estimates start over
        self.set_delayed_scaling(self.__dict__.get("delayed_decay"))

    def set_delayed_scaling(self, decay: Optional[float] = DEFAULT_DECAY) -> Tuple[str, ...]:
        """Quantize x, W and dy with delayed tensorwise scales in training (module
        docstring); ``decay`` in (0, 1] is how fast an estimate above what is seen shrinks
        per training call. None: dynamic scaling again. The estimates start over (the next
        training call seeds them). Returns the operands scaled this way: those every FP8
        role of which quantizes tensorwise with PyTorch ops (:func:`delayed_formats`)."""
        if decay is not None:
            decay = check_decay(decay, "set_delayed_scaling(decay)")
        for name in _DELAYED_BUFFERS:
            self._buffers.pop(name, None)
        self._delayed_formats = (None, None, None)
        self._delayed_ready = False
        if decay is None:
            self.delayed_decay = None
            return ()
        self.delayed_decay = decay
        self._delayed_formats = delayed_formats(self._kernels)
        device = self.weight.device if self.weight is not None else None
        for op in _DELAYED_OPERANDS:
            est, streak = new_state(device)
            self.register_buffer(f"delayed_amax_{op}", est, persistent=False)
            self.register_buffer(f"delayed_streak_{op}", streak, persistent=False)
        return self.delayed_operands

    @property
    def delayed_operands(self) -> Tuple[str, ...]:
        """The operands (of "x", "w", "dy") delayed scaling casts under the current kernels;
        empty with it off."""
        return tuple(op for op, f in zip(_DELAYED_OPERANDS, self._delayed_formats) if f)

    def seed_delayed(self, x: float, w: float, dy: float) -> None:
        """Set the delayed scaling estimates (the amax of x, W and dy) so that the next
        training call uses them instead of seeding them dynamically (e.g. when resuming:
        the estimates are not in the ``state_dict``; ``delayed_state()`` reads them)."""
        if self.delayed_decay is None:
            raise ValueError("delayed scaling is off: set_delayed_scaling() first")
        values = dict(zip(_DELAYED_OPERANDS, (x, w, dy)))
        for op, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value < float("inf"):
                raise ValueError(f"{op} amax must be finite and positive, got {value!r}")
        for op, value in values.items():
            self._buffers[f"delayed_amax_{op}"].fill_(float(value))
            self._buffers[f"delayed_streak_{op}"].fill_(STREAK_GROWTH)
        self._delayed_ready = True

    def delayed_state(self) -> Optional[dict]:
        """``{"x", "w", "dy"}`` -> amax estimate (floats, a host synchronization), or None
        with delayed scaling off; ``seed_delayed(**state)`` sets them back."""
        if self.delayed_decay is None:
            return None
        return {op: float(self._buffers[f"delayed_amax_{op}"]) for op in _DELAYED_OPERANDS}

    @property
    def kernels(self) -> Tuple[Kernel, Kernel, Kernel]:
        return self._kernels

    # The FP8 weight, its scale and the static scale table are held in the module's
    # __dict__ as Parameters that no optimizer, state_dict or dtype cast sees (not in
    # _parameters): a compiled step then puts no aliasing guard on them (Dynamo skips it
    # for Parameters), which a plain tensor attribute takes on every call
    # (bench/results/2026-12-06-h100-assembled/NOTE.md measures the guards).
    @property
    def weight_q(self) -> Optional[QTensor]:
        """The FP8 weight the forward reads (serving, or gathered by FSDP2), or None."""
        return self._wq

    @weight_q.setter
    def weight_q(self, q: Optional[QTensor]) -> None:
        self.__dict__["_wq"] = None if q is None else QTensor(
            _held(q.data), _held(q.scale), q.fmt, q.block, q.granularity)
        self._refresh_static_key()

    @property
    def _input_scales(self) -> Optional[torch.Tensor]:
        return self._xs_table

    @_input_scales.setter
    def _input_scales(self, table: Optional[torch.Tensor]) -> None:
        self.__dict__["_xs_table"] = None if table is None else _shared_table(table)
        self._refresh_static_key()

    def _refresh_static_key(self) -> None:
        """Set ``_static_key``: the forward kernel's key in :data:`_INTERNED` where a call
        without gradients can take the short static path (an FP8 weight, a static input
        scale, and a forward kernel with a ``static_gemm``), else None; and ``_serve_key``:
        the same key where such a call can take the short dynamic path (an FP8 weight, an
        FP8 forward kernel, no static scale: the kernel quantizes x and checks the weight
        itself, as it does inside the autograd Function)."""
        d = self.__dict__
        kernels, keys, wq = d.get("_kernels"), d.get("_kernel_keys"), d.get("_wq")
        held = kernels is not None and keys is not None and wq is not None
        ok = (held and d.get("_xs_table") is not None and kernels[0].static_gemm is not None
              # a weight quantized as the kernel does (else the general path says why not)
              and wq.fmt.name == kernels[0].formats[1] and wq.granularity == kernels[0].scaling)
        d["_static_key"] = keys[0] if ok else None
        dynamic = held and d.get("_xs_table") is None and kernels[0].name != BASELINE
        d["_serve_key"] = keys[0] if dynamic else None

    def _live_kernels(self) -> Tuple[Kernel, Kernel, Kernel]:
        """The kernels as the hot path reads them: through the module's global table
        (:data:`_INTERNED`) by this Linear's keys, so that compiled code guards each kernel
        once for every site (a copy restored in a new process interns them again)."""
        kernels = tuple(_INTERNED.get(key) for key in self._kernel_keys)
        if any(k is None for k in kernels):
            self._kernel_keys = tuple(_intern(k) for k in self._kernels)
            return self._kernels
        return kernels

    def reads_only_x_q(self) -> bool:
        """Whether a call ``linear(x, x_q=q)`` reads nothing of ``x`` now but its shape and
        dtype: an FP8 forward kernel (it takes ``q``), no autograd graph recorded (nothing
        saved for the gradients) and the guard not armed (it records ``x``'s statistics).
        A producer may then skip writing the high-precision ``x`` and pass a placeholder
        of its shape and dtype (serving: the fused norm writes the FP8 tensor alone)."""
        mon = self.monitor
        return (self._live_kernels()[0].is_fp8 and not _is_grad_enabled()
                and not (mon is not None and mon.armed))

    @classmethod
    def validate(cls, linear: nn.Linear, config: LinearConfig = LinearConfig()) -> None:
        """Raise what :meth:`from_linear` would raise for ``linear`` and ``config``,
        leaving ``linear`` as it is."""
        new = cls.__new__(cls)
        _rehome(new, linear)
        new.weight_q = new.input_amax = new._input_scales = new.monitor = None
        new.delayed_decay = None
        new.set_config(config)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LinearConfig = LinearConfig()) -> "Linear":
        """Wrap an existing ``nn.Linear``, sharing its Parameter objects (optimizers that
        hold them keep working) and its hooks. A Linear that ``fully_shard`` manages
        itself becomes a ``loka.Linear`` in place (FSDP keys its state by the object)."""
        fsdp_cls = _fsdp_class(linear, cls)
        if fsdp_cls is not None:
            cls.validate(linear, config)  # raise before changing anything
            linear.__class__ = fsdp_cls
            new = linear
        else:
            new = cls.__new__(cls)
            _rehome(new, linear)
        new.weight_q = None
        new.input_amax = new._input_scales = None
        new.monitor = None
        new.delayed_decay = None  # a loka.Linear wrapped again starts with it off
        new.set_config(config)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this module's parameters and hooks."""
        if self.weight is None:
            raise ValueError("this Linear's high-precision weight was dropped (inference); "
                             "reload the original state_dict to get an nn.Linear back")
        fsdp_cls = _fsdp_class(self, nn.Linear)
        if fsdp_cls is not None:  # fully_shard-ed itself: back to nn.Linear in place
            lin = self
            lin.__class__ = fsdp_cls
        else:
            lin = nn.Linear.__new__(nn.Linear)
            _rehome(lin, self)
        for key in _OWN_ATTRS:
            lin.__dict__.pop(key, None)
        for name in _DELAYED_BUFFERS:
            lin._buffers.pop(name, None)
        return lin

    # -- inference -----------------------------------------------------------------
    def quantize_weight(self) -> None:
        """Quantize Wᵀ once for the forward kernel (inference: reused by every call)."""
        kf = self._kernels[0]
        if kf.quantize_b is None:
            raise ValueError(f"forward kernel {kf.name!r} has no weight quantizer")
        if self.weight is None:
            raise ValueError("the high-precision weight was dropped; it cannot be requantized")
        with torch.no_grad():
            self.weight_q = kf.quantize_b(self.weight.detach().t())

    def drop_weight(self) -> None:
        """Free the high-precision weight, keeping only its FP8 copy (forward only from
        then on). The state_dict then has ``weight_fp8`` and ``weight_scale`` instead of
        ``weight``; :meth:`to_linear` and :meth:`set_config` refuse."""
        if self.weight_q is None:
            raise ValueError("quantize_weight() first: there is no FP8 weight to keep")
        self.weight = None

    def set_input_amax(self, amax: "float | torch.Tensor | None", rows: int = 0) -> None:
        """Quantize the forward's activation with the static scale ``amax / fmt.max``
        (values beyond ``amax`` saturate) instead of a dynamic one; None: dynamic.

        The scale is computed here, once, and kept as the table of per-block scales of an
        input of up to ``rows`` rows (one row of blocks when ``rows`` is 0 or the
        granularity is tensorwise; one row of blocks too where the table would hold more
        than :data:`STATIC_TABLE_MAX_SCALES`): a call with no more rows than that passes a
        slice of the table to the GEMM, so compiled code launches no kernel to make or
        expand the scale. A larger input expands the table's first row (a small kernel
        per call)."""
        if amax is None:
            self.input_amax = self._input_scales = None
            return
        kf = self._kernels[0]
        if not takes_static_input_scale(kf):
            raise ValueError(f"forward kernel {kf.name!r} does not take a static input scale")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"rows must be a non-negative int, got {rows!r}")
        amax = torch.as_tensor(amax, dtype=torch.float32).detach()
        if amax.numel() != 1 or not bool(torch.isfinite(amax)) or float(amax) <= 0:
            raise ValueError(f"input amax must be one finite positive number, got {amax.tolist()}")
        device = self.weight.device if self.weight is not None else self.weight_q.device
        self.input_amax = amax.reshape(()).to(device)
        self._input_scales = self._scale_table(rows)

    def _scale_table(self, rows: int) -> torch.Tensor:
        """The static scales of an input of up to ``rows`` rows, made from
        :attr:`input_amax` on its device (as the per-call division did: a GPU divides by a
        host scalar as a multiplication by its reciprocal), outside inference mode (a
        table made under it could not be saved for a backward later)."""
        kf = self._kernels[0]
        fmt, gran = get_format(kf.formats[0]), as_granularity(kf.scaling)
        br, bc = operand_block(gran, "a")
        grid_rows = 1 if br == -1 else max(1, -(-rows // br))
        grid_cols = 1 if bc == -1 else -(-self.in_features // bc)
        if grid_rows * grid_cols > STATIC_TABLE_MAX_SCALES:  # memory: one row of blocks
            grid_rows = 1
        with torch.inference_mode(False):
            scale = self.input_amax.clamp(min=AMAX_EPS) / fmt.max
            if gran is Granularity.MX:
                scale = round_scale_to_power_of_two(scale)
            return scale.reshape(1, 1).expand(grid_rows, grid_cols).clone()

    def _quantize_input(self, x2d: torch.Tensor) -> QTensor:
        """Static quantization of ``x2d`` (M, K) for the forward kernel."""
        kf = self._live_kernels()[0]
        fmt, gran = get_format(kf.formats[0]), as_granularity(kf.scaling)
        br, bc = operand_block(gran, "a")
        m, k = x2d.shape
        grid = (1 if br == -1 else -(-m // br), 1 if bc == -1 else -(-k // bc))
        table = self._xs_table
        # a slice of the table is a view; shapes are fixed per compiled graph. A row count
        # traced as a symbol (an export with a dynamic batch) takes the first row broadcast:
        # the same values (the table holds one scale), and no guard on the count
        scale = (table[:grid[0]] if not isinstance(m, torch.SymInt) and grid[0] <= table.shape[0]
                 else table[:1].expand(grid))
        # checked once, in set_input_amax: no host synchronization per call
        return quantize(x2d, fmt, gran, "a", scale=scale, check_scale=False)

    def _apply(self, fn, recurse=True):
        # the FP8 weight and the static scales are held outside _parameters and _buffers
        # (a dtype cast must not touch them): follow the parameters' device only; the delayed
        # scaling estimates stay float32 whatever dtype the module is cast to
        states = {n: self._buffers[n] for n in _DELAYED_BUFFERS if n in self._buffers}
        super()._apply(fn, recurse)
        for name, before in states.items():
            after = self._buffers[name]
            if before.is_meta and not after.is_meta:  # to_empty: no values to keep
                fresh = dict(zip(("amax", "streak"), new_state(after.device)))
                self._buffers[name] = fresh[name.split("_")[1]]
                self._delayed_ready = False
            elif after.dtype != torch.float32:  # the values as they were, on the new device
                self._buffers[name] = before.to(after.device)
        held = [t for t in (self.weight_q, self.input_amax) if t is not None]
        if held:
            device = fn(torch.empty(0, device=held[0].device)).device
            if self.weight_q is not None:
                q = self.weight_q
                self.weight_q = QTensor(q.data.to(device), q.scale.to(device), q.fmt, q.block,
                                        q.granularity)
            if self.input_amax is not None:
                self.input_amax = self.input_amax.to(device)
                # made again there, from the amax, as the device would have made it
                br = operand_block(as_granularity(self._kernels[0].scaling), "a")[0]
                self._input_scales = self._scale_table(self._input_scales.shape[0] * max(br, 1))
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None and self.weight_q is not None:
            destination[prefix + "weight_fp8"] = self.weight_q.data.detach()
            destination[prefix + "weight_scale"] = self.weight_q.scale.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.weight is None and self.weight_q is not None:
            state_dict = dict(state_dict)
            for key, dst in (("weight_fp8", self.weight_q.data), ("weight_scale", self.weight_q.scale)):
                src = state_dict.pop(prefix + key, None)
                if src is None:
                    missing_keys.append(prefix + key)
                elif src.shape != dst.shape or src.dtype != dst.dtype:
                    error_msgs.append(f"{prefix + key}: expected {dst.dtype} {tuple(dst.shape)}, "
                                      f"got {src.dtype} {tuple(src.shape)}")
                else:
                    with torch.no_grad():
                        dst.copy_(src)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    # -- hot path ------------------------------------------------------------------
    def forward(self, x: torch.Tensor, x_q: Optional[QTensor] = None) -> torch.Tensor:
        static_key = self._static_key  # (the two keys are never both set)
        key = static_key if static_key is not None else self._serve_key
        if (key is not None and x_q is None and not _is_grad_enabled()
                and self.monitor is None and x.dtype in _AUTOCAST_FROM
                and _autocast_dtype(x) is None):
            # serving from the FP8 weight: with a static scale the cast and the GEMM, with
            # dynamic scales the kernel's own quantization of x and its GEMM, as the
            # autograd Function's forward does without gradients, without tracing it
            kern = _INTERNED.get(key)
            if (kern is not None and x.shape[-1] == self.in_features and x.numel() > 0
                    and (static_key is None or kern.static_gemm is not None)):
                x2d, wq = x.reshape(-1, self.in_features), self._wq
                y = (kern(x2d, wq, x.dtype) if static_key is None else
                     kern.static_gemm(x2d, wq.data, self._xs_table, wq.scale, x.dtype))
                bias = self.bias
                if bias is not None:
                    y = y + bias.to(y.dtype)
                return y.reshape(*x.shape[:-1], self.out_features)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (*, {self.in_features}), got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"loka.Linear expects a floating-point input, got {x.dtype}")
        if self._all_baseline or x.numel() == 0:
            if self.weight is None:  # weight dropped (inference): empty in, empty out
                return x.new_zeros(*x.shape[:-1], self.out_features,
                                   dtype=_autocast_dtype(x) or x.dtype)
            return _f_linear(x, self.weight, self.bias)
        lead = x.shape[:-1]
        ad = _autocast_dtype(x)
        if ad is not None:
            # as nn.Linear under autocast: compute in, and return, the autocast dtype (else
            # a float32 input meets a bf16 gradient in a baseline gradient GEMM)
            x = x.to(ad)
        x2d = x.reshape(-1, self.in_features)
        if x_q is not None and tuple(x_q.shape) != tuple(x2d.shape):
            raise ValueError(f"x_q has shape {tuple(x_q.shape)}, expected {tuple(x2d.shape)}")
        # the held state read from the instance's __dict__, not through its properties
        # (whose code a compiled step would guard at every site)
        if x_q is None and self._xs_table is not None:
            x_q = self._quantize_input(x2d)
        mon = self.monitor
        armed = mon is not None and mon.armed  # a Python flag: compiled graphs guard on it
        grad = _is_grad_enabled()
        delayed = None
        if (self.delayed_decay is not None and grad and self.training
                and any(self._delayed_formats)):
            ready = self._delayed_ready  # a Python flag: compiled code recompiles once on it
            states = tuple((self._buffers[f"delayed_amax_{op}"],
                            self._buffers[f"delayed_streak_{op}"]) for op in _DELAYED_OPERANDS)
            delayed = (self._delayed_formats, states, ready, self.delayed_decay)
            if not ready:
                self._delayed_ready = True
        weight_q = self._wq
        # serving from the FP8 weight reads nothing of the high-precision one: not passed,
        # so a compiled step has no guard on it
        weight = None if weight_q is not None and not grad else self.weight
        y = _LinearFunction.apply(x2d, x_q, weight, self.bias, self._live_kernels(),
                                  weight_q, mon.grad_flags if armed else None, grad,
                                  delayed)
        if armed:
            mon.record(x2d, y, self.input_amax, (self.weight, self.bias))
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        c = self.config
        extra = f", delayed_scaling={self.delayed_decay}" if self.delayed_decay is not None else ""
        return (super().extra_repr() + f", fwd={c.fwd}, dgrad={c.dgrad}, wgrad={c.wgrad}"
                + extra)
