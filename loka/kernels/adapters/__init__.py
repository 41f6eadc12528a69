"""Optional kernel libraries. Each adapter module registers its kernels only when
``loka.kernels.capabilities`` says its library is importable. A library that imports but
whose adapter then fails (a version mismatch, say) registers nothing; the reason is kept
in :data:`FAILED` and shown by ``loka kernels``, and the core registry keeps working."""

import importlib
from typing import Dict

from .. import capabilities as _caps

FAILED: Dict[str, str] = {}
"""adapter module -> why it did not load"""

_ADAPTERS = (
    ("triton_kernels", lambda: True),  # imports without triton: its kernels say what they need
    ("torchao", _caps.torchao_available),
    ("fbgemm", _caps.fbgemm_genai_available),
)

for _name, _wanted in _ADAPTERS:
    if _wanted():
        try:
            importlib.import_module(f"{__name__}.{_name}")
        except Exception as _e:  # noqa: BLE001 - an optional library must not break the core
            FAILED[_name] = f"{type(_e).__name__}: {_e}"
