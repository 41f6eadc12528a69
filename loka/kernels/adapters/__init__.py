"""Optional kernel libraries. Each adapter module registers its kernels only when
``loka.kernels.capabilities`` says its library is importable."""

from .. import capabilities as _caps

if _caps.module_available("triton"):
    from . import triton_kernels  # noqa: F401
if _caps.torchao_available():
    from . import torchao  # noqa: F401
if _caps.fbgemm_genai_available():
    from . import fbgemm  # noqa: F401
