"""Where a site's quantized operands come from, read from the autograd graph while the
Probe trains, so that the Probe can price a quantization by what the compiled step will
pay for it.

Under ``torch.compile``, the amax, scale and cast of an operand that Inductor's own code
produces (an activation, a norm, arithmetic, the sum of two gradients) fuse into the kernel
that makes it; an operand that comes out of another GEMM, an embedding lookup, a gather or
the model's input needs a quantization pass of its own. Two operands matter per site:

* ``x``, the Linear's input (the forward's a operand, the weight gradient's b operand): its
  producer is the op that made it, the ``grad_fn`` of ``x`` seen through views;
* ``dy``, the gradient of the Linear's output (the input gradient's a operand, the weight
  gradient's a operand): the backward of whatever consumed the output ``y`` makes it. The
  consumers are found by walking the autograd graph back from the model's outputs once,
  at the end of the first statistics step's forward.

Kinds (:data:`KINDS`): ``pointwise`` (Inductor generates and can fuse into the producer),
``gemm`` (a matrix multiply, whose library kernel takes no fused epilogue), ``input`` (a
leaf or a tensor without gradient: a pass of its own), ``output`` (``y`` is a model output:
its gradient comes from the loss, outside the model), ``other`` (anything else: gathers,
concatenations, embedding bags, custom functions; priced as a pass of its own).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch
import torch.utils._pytree as pytree

__all__ = ["KINDS", "FUSIBLE", "producer_of", "op_name", "consumers_of_outputs",
           "consumer_kind", "merge_kinds"]

KINDS = ("pointwise", "gemm", "input", "output", "other")
FUSIBLE = ("pointwise",)
"""kinds whose quantization Inductor can fuse into the producing kernel"""

_VIEWS = frozenset({
    "View", "UnsafeView", "ReshapeAlias", "Alias", "T", "Transpose", "Permute",
    "Expand", "Squeeze", "Unsqueeze", "AsStrided",
    # wrappers' identity functions on module inputs (FSDP2's post-backward registration)
    "RegisterPostBackwardFunction"})
"""ops that only re-index a whole tensor or pass it on (Inductor folds them into the
kernel that reads it), seen through in both directions"""

_PIECES = frozenset({"Select", "Slice", "Unfold", "Split", "SplitWithSizes", "Unbind",
                     "Narrow", "Chunk"})
"""ops that take a part of a tensor: seen through to find what made x (a chunk of a
GEMM's output is a GEMM's), but the gradient of the whole is assembled from its parts'
gradients (a fused QKV projection's comes from attention and a concatenation), so as
consumers of y they make ``other``"""

_PASS_GRAD = frozenset({"Add", "Sub", "Clone"})
"""ops whose backward hands the incoming gradient on unchanged (to an operand of an add,
the first of a subtraction, a clone's input): the gradient's producer is then whatever
made the gradient of their output, so the walk for ``dy`` goes on through them"""

_REDUCTIONS = frozenset({"Sum", "Mean", "Var", "Std", "Amax", "Norm", "LinalgVectorNorm"})
"""reductions: as the producer of x (a pooled embedding) their loop runs over another
dimension than a row amax, so the quantization is not priced as fused; as the consumer of
y their backward is a broadcast, which Inductor generates"""

_POINTWISE = frozenset({
    "Relu", "Threshold", "Hardswish", "Hardsigmoid", "Hardtanh", "Gelu", "Silu", "Sigmoid",
    "Tanh", "Mish", "Elu", "Selu", "Celu", "LeakyRelu", "Softplus", "Prelu", "Glu",
    "Mul", "Div", "Add", "Sub", "Rsub", "Neg", "Exp", "Exp2", "Expm1", "Log", "Log1p",
    "Log2", "Pow", "Rsqrt", "Sqrt", "Reciprocal", "Clamp", "ClampMin", "ClampMax", "Where",
    "Abs", "Erf", "Sin", "Cos", "Maximum", "Minimum", "Lerp", "Addcmul", "Addcdiv",
    "MaskedFill", "NativeDropout", "FusedDropout", "ToCopy", "Clone", "Copy", "Softmax",
    "LogSoftmax", "NativeLayerNorm", "NativeBatchNorm", "NativeBatchNormLegit",
    "BatchNormWithUpdate", "NativeGroupNorm", "FusedRmsNorm", "CudnnBatchNorm"})
"""ops Inductor generates code for (elementwise, row-wise normalizations)"""

_GEMM = frozenset({"Mm", "Addmm", "Bmm", "Baddbmm", "Addbmm", "Mv", "Dot", "ScaledMm",
                   "LinearFunction"})
"""matrix multiplies (``F.linear`` and ``einsum`` reach autograd as these), LoKA's own FP8
Linear's autograd function among them"""

_SUFFIX = re.compile(r"Backwards?\d*$")


def op_name(node) -> str:
    """The forward op behind an autograd node: ``HardswishBackward0`` -> ``Hardswish``."""
    return _SUFFIX.sub("", type(node).__name__ if not hasattr(node, "name") else
                       node.name().rsplit("::", 1)[-1]).lstrip("_") or "?"


def _kind(name: str, consumer: bool = False) -> str:
    """The kind of the op ``name``: as a producer of x, or (``consumer``) as the op whose
    backward makes the gradient of its input."""
    if name in _GEMM:
        return "gemm"
    if name in _POINTWISE or (consumer and name in _REDUCTIONS):
        return "pointwise"
    return "other"


def _through_views(node):
    """The first node under ``node`` that is neither a view nor a part of a tensor (its
    first differentiable input)."""
    seen = 0
    while node is not None and op_name(node) in _VIEWS | _PIECES and seen < 64:
        nxt = [n for n, _ in node.next_functions if n is not None]
        node = nxt[0] if nxt else None
        seen += 1
    return node


def producer_of(t: torch.Tensor) -> str:
    """The kind of op that produced ``t`` (module docstring)."""
    node = _through_views(getattr(t, "grad_fn", None))
    if node is None or op_name(node) == "AccumulateGrad":
        return "input"
    return _kind(op_name(node))


def consumers_of_outputs(outputs) -> Dict[object, List[object]]:
    """node -> the nodes that take its result, over the autograd graph of every tensor in
    ``outputs`` (any nesting of tuples, lists and dicts)."""
    roots = [t.grad_fn for t in pytree.tree_leaves(outputs)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    consumers: Dict[object, List[object]] = {}
    seen = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(child, []).append(node)
            if child not in seen:
                stack.append(child)
    consumers["__outputs__"] = roots
    return consumers


def consumer_kind(node, consumers: Dict[object, List[object]]) -> Optional[str]:
    """The kind of op whose backward makes the gradient of the tensor ``node`` produced
    (the module docstring's ``dy``), or None when ``node`` is not in the walked graph."""
    outputs = set(consumers.get("__outputs__", ()))
    if node not in consumers and node not in outputs:
        return None
    kinds: List[str] = []
    seen = {node}
    stack = [node]
    # each node once (pass-through ops can reach a node along several paths, and a walk
    # along paths would grow with their number)
    while stack and len(seen) < 10_000:
        n = stack.pop()
        if n in outputs:
            kinds.append("output")
        for user in consumers.get(n, []):
            name = op_name(user)
            if name in _VIEWS or name in _PASS_GRAD:
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
            elif name in _PIECES:
                kinds.append("other")
            else:
                kinds.append(_kind(name, consumer=True))
    if not kinds:
        return None
    if len(kinds) > 1:
        # gradients of several users are summed: Inductor's add kernel, fusible
        return "pointwise"
    return kinds[0]


def merge_kinds(a: Optional[str], b: Optional[str]) -> Optional[str]:
    """One site seen twice (two calls in a step): the operand needs a pass if either
    call's does."""
    if a is None or a == b:
        return b if a is None else a
    return a if a not in FUSIBLE else b
