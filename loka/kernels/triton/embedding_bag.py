"""Pooled (sum) embedding lookup over jagged bags: ``out[b] = sum(weight[values[i]] for i in
offsets[b]:offsets[b+1])``, the forward of ``F.embedding_bag(mode="sum",
include_last_offset=True)`` in one pass.

One program per (bag, span of ``BLOCK_D`` features) walks its bag ``BLOCK_L`` ids at a time,
loads those rows' features as one (BLOCK_L, BLOCK_D) tile (each row's span is contiguous),
adds them in float32 and stores the sum once in the weight's dtype. The weight is read once
per id and the output is written once, so the kernel is bound by the bytes of the rows it
gathers. An empty bag sums to zero, as in torch.

The reference is :func:`reference_embedding_bag_sum` (float64 on request); the autograd of
the op that wraps this kernel (``loka.models.fused_embedding``) uses PyTorch's own
embedding-bag backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import autotune, launch, next_pow2

MAX_BLOCK_D = 256
"""widest feature span of one program (wider embeddings use several programs per bag)"""


def _prune(configs, named_args, **kwargs):
    # a bag of the Wukong/DLRM presets has 1-8 ids on average: BLOCK_L beyond 4x the mean
    # only loads masked lanes
    mean = named_args["NNZ"] / max(1, named_args["NUM_BAGS"])
    keep = [c for c in configs if c.kwargs["BLOCK_L"] <= max(4, 4 * next_pow2(int(mean) + 1))]
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_L"])]


@autotune(configs=[triton.Config({"BLOCK_L": L}, num_warps=w)
                   for L in (2, 4, 8, 16) for w in (1, 2, 4)],
          key=["D", "BLOCK_D", "MEAN_BUCKET"], prune=_prune)
@triton.jit
def bag_sum_kernel(values_ptr, offsets_ptr, weight_ptr, out_ptr, NUM_BAGS, NNZ, D,
                   stride_w, stride_o, MEAN_BUCKET, BLOCK_D: tl.constexpr,
                   BLOCK_L: tl.constexpr):
    """Bag ``program_id(0)``, features ``[program_id(1) * BLOCK_D, +BLOCK_D)``."""
    bag = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    start = tl.load(offsets_ptr + bag)
    end = tl.load(offsets_ptr + bag + 1)
    lanes = tl.arange(0, BLOCK_L)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(start, end, BLOCK_L):
        idx = i + lanes
        ok = idx < end
        ids = tl.load(values_ptr + idx, mask=ok, other=0).to(tl.int64)
        rows = tl.load(weight_ptr + ids[:, None] * stride_w + cols[None, :],
                       mask=ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(rows.to(tl.float32), axis=0)
    tl.store(out_ptr + bag.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty),
             mask=col_ok)


def check_bags(values: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> None:
    """The argument rules of :func:`embedding_bag_sum` (shapes, dtypes, devices)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be (rows, D), got shape {tuple(weight.shape)}")
    if values.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"values must be (nnz,) and offsets (bags + 1,), got "
                         f"{tuple(values.shape)} and {tuple(offsets.shape)}")
    if values.dtype not in (torch.int32, torch.int64) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"values and offsets must be integer ids, got {values.dtype}, "
                         f"{offsets.dtype}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    if len({values.device, offsets.device, weight.device}) != 1:
        raise ValueError(f"values, offsets and weight must share a device, got "
                         f"{values.device}, {offsets.device}, {weight.device}")


def embedding_bag_sum(values: torch.Tensor, offsets: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
    """(bags, D) sums of the rows of ``weight`` named by each bag of ``values``.

    Args:
        values: (nnz,) row ids, every one in ``[0, weight.shape[0])`` (not checked on the
            device: the caller's ids, as in ``F.embedding_bag``).
        offsets: (bags + 1,) non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == nnz``.
        weight: (rows, D), any float dtype; its rows need a unit feature stride.
    Returns:
        (bags, D) in ``weight.dtype``, summed in float32.
    """
    check_bags(values, offsets, weight)
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    bags, d = offsets.numel() - 1, weight.shape[1]
    out = torch.empty((bags, d), dtype=weight.dtype, device=weight.device)
    if bags == 0 or d == 0:
        return out
    block_d = min(MAX_BLOCK_D, max(16, next_pow2(d)))
    nnz = values.numel()
    grid = (bags, triton.cdiv(d, block_d))
    launch(bag_sum_kernel)[grid](values.contiguous(), offsets.contiguous(), weight, out, bags, nnz,
                                 d, weight.stride(0), out.stride(0),
                                 next_pow2(max(1, nnz // max(1, bags))), BLOCK_D=block_d)
    return out


def reference_embedding_bag_sum(values: torch.Tensor, offsets: torch.Tensor,
                                weight: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """The same sums by ``F.embedding_bag`` in ``dtype`` (float64: the test reference)."""
    return torch.nn.functional.embedding_bag(values.long(), weight.to(dtype), offsets.long(),
                                             mode="sum", include_last_offset=True)
