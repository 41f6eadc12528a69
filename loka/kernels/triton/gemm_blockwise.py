"""Blockwise-scaled FP8 GEMM, the recipe of DeepSeek-V3 / DeepGEMM.

``a`` (M, K) FP8 with 1x128 scales ``scale_a`` (M, K/128); ``b`` (K, N) FP8 with 128x128
scales ``scale_b`` (K/128, N/128). The K loop runs in steps of 128: each step's partial
product (at most 128 products deep in the tensor cores' accumulator) is scaled by
``scale_a[:, k] * scale_b[k, n]`` and added to a float32 accumulator, which is both the
dequantization and DeepGEMM's promotion of the FP8 accumulator every 128 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...numerics import BLOCK
from .common import autotune, launch, check_gemm_operands, grouped_tile, next_pow2


def _cfg(bm, bn, stages, warps, group=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": group},
                         num_stages=stages, num_warps=warps)


BLOCKWISE_CONFIGS = [_cfg(128, 128, 3, 8), _cfg(64, 128, 4, 4), _cfg(128, 64, 4, 4),
                     _cfg(64, 64, 4, 4), _cfg(128, 32, 4, 4)]


def _prune(configs, named_args, **kwargs):
    m, n = named_args["M"], named_args["N"]
    return [c for c in configs if c.kwargs["BLOCK_N"] <= max(32, next_pow2(n))
            and c.kwargs["BLOCK_M"] <= max(64, next_pow2(m))]


@autotune(configs=BLOCKWISE_CONFIGS, key=["M", "N", "K"], prune=_prune)
@triton.jit
def blockwise_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_am, stride_ak,
                          stride_bk, stride_bn, stride_cm, stride_cn, stride_sam, stride_sak,
                          stride_sbk, stride_sbn, BLOCK_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile; BLOCK_K == 128 == the scale block, BLOCK_N divides 128."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows % M)[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + (cols % N)[None, :].to(tl.int64) * stride_bn
    sa_ptrs = sa_ptr + (rows % M) * stride_sam
    sb_ptr_n = sb_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + kk * stride_sak)
        sb = tl.load(sb_ptr_n + kk * stride_sbk)
        acc += tl.dot(a, b) * (sa[:, None] * sb)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


def gemm_blockwise(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b`` with 1x128 / 128x128 block scales.

    Args:
        a: (M, K) FP8, K contiguous preferred.
        b: (K, N) FP8, column-major (K contiguous) preferred.
        scale_a: (M, ceil(K/128)) float32.
        scale_b: (ceil(K/128), ceil(N/128)) float32.
        out_dtype: bf16, fp16 or fp32.

    Returns:
        (M, N) in ``out_dtype``.
    """
    m, k, n = check_gemm_operands(a, b)
    kb, nb = triton.cdiv(k, BLOCK), triton.cdiv(n, BLOCK)
    if tuple(scale_a.shape) != (m, kb) or tuple(scale_b.shape) != (kb, nb):
        raise ValueError(f"blockwise scales must be ({m}, {kb}) and ({kb}, {nb}), got "
                         f"{tuple(scale_a.shape)} and {tuple(scale_b.shape)}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise TypeError("blockwise scales must be float32")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if c.numel() == 0:
        return c
    grid = lambda meta_: (triton.cdiv(m, meta_["BLOCK_M"]) * triton.cdiv(n, meta_["BLOCK_N"]),)  # noqa: E731
    launch(blockwise_gemm_kernel)[grid](a, b, c, scale_a, scale_b, m, n, k, a.stride(0), a.stride(1),
                                        b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                                        scale_a.stride(0), scale_a.stride(1), scale_b.stride(0),
                                        scale_b.stride(1), BLOCK_K=BLOCK)
    return c


def reference(a, b, scale_a, scale_b, out_dtype=torch.bfloat16) -> torch.Tensor:
    """float32 reference: dequantize both operands blockwise, then multiply."""
    m, k = a.shape
    n = b.shape[1]
    sa = scale_a.repeat_interleave(BLOCK, dim=1)[:, :k]
    sb = scale_b.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:k, :n]
    return ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)
