"""The kernel registry: every GEMM kernel LoKA can run, FP8 or not.

>>> import loka
>>> [k.name for k in loka.kernels.available("cpu")][:3]
['bf16', 'fp32', 'emulated-tensorwise-e4m3']
"""

from . import capabilities
from .recipes import Recipe
from .registry import (Capability, Kernel, Library, Scaling, all_kernels, available, get,
                       register, unavailable, unregister)

# each kernel module registers its kernels when imported; adapters register what loads
from . import adapters, cublas, emulated, reference  # noqa: F401

__all__ = ["Kernel", "Capability", "Library", "Scaling", "Recipe", "register", "unregister", "get", "available",
           "unavailable", "all_kernels", "capabilities", "gemm"]


def gemm(name: str, a, b, out_dtype=None):
    """Run the kernel ``name`` on ``a (M, K) @ b (K, N)``."""
    kern = get(name)
    if out_dtype is None:
        out_dtype = a.dtype if hasattr(a, "dtype") and a.dtype.is_floating_point else None
    return kern(a, b, out_dtype)
