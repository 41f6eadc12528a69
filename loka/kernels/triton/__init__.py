"""LoKA's own Triton kernels, one file per kernel (Triton-tutorial shape: an autotuned
``@triton.jit`` kernel, a Python wrapper that checks, allocates and launches, and a torch
reference):

* :mod:`.quantize`       one-pass rowwise / two-stage colwise and tensorwise / blockwise FP8
                         quantization, bit-exact with :func:`loka.numerics.quantize`;
* :mod:`.gemm_rowwise`   FP8 GEMM with rowwise or tensorwise scales in the epilogue, optional
                         bias, Hard Swish, bf16 or FP8 (rowwise-scaled) output, and the
                         statistics of a following BlockNorm;
* :mod:`.gemm_blockwise` 1x128 / 128x128 blockwise-scaled FP8 GEMM (DeepGEMM's recipe);
* :mod:`.norm_act_quant` fused BlockNorm/LayerNorm -> Hard Swish -> FP8 quantization.

Importing this package needs ``triton`` but no GPU; the registry entries that run these
kernels are in :mod:`loka.kernels.adapters.triton_kernels`. Without a GPU the kernels run
on CPU tensors under Triton's interpreter: set ``TRITON_INTERPRET=1`` before ``triton`` is
first imported (Triton reads it then, for its own library functions too).
"""


from ..ops import register_triton_ops
from .common import interpreted

__all__ = ["interpreted"]

register_triton_ops()  # the ops whose bodies launch these kernels (loka.kernels.ops)
