"""Optional kernel libraries. Each adapter module registers its kernels only when
``loka.kernels.capabilities`` says its library is importable. A library that imports but
whose adapter then fails (a version mismatch, say) registers nothing; the reason is kept
in :data:`FAILED` and shown by ``loka kernels``, and the core registry keeps working.

LoKA's Triton kernels register at import. torchao and FBGEMM register when the registry is
first read (:func:`load`): importing them loads torch.compile's machinery and takes
seconds, which ``import loka`` and ``loka --help`` should not pay."""

import importlib
from typing import Dict

from .. import capabilities as _caps
from .. import registry as _registry

FAILED: Dict[str, str] = {}
"""adapter module -> why it did not load"""

_ADAPTERS = (
    ("triton_kernels", lambda: True),  # imports without triton: its kernels say what they need
    ("torchao", _caps.torchao_available),
    ("fbgemm", _caps.fbgemm_genai_available),
)
_DEFERRED = ("torchao", "fbgemm")


def _import(name: str) -> None:
    try:
        importlib.import_module(f"{__name__}.{name}")
    except Exception as e:  # noqa: BLE001 - an optional library must not break the core
        FAILED[name] = f"{type(e).__name__}: {e}"


_tried: set = set()


def load() -> None:
    """Register the deferred adapters whose library is importable (each tried once; what
    failed is in :data:`FAILED`). The registry calls it before it is first read."""
    for name, wanted in _ADAPTERS:
        if name in _DEFERRED and name not in _tried:
            _tried.add(name)
            if wanted():
                _import(name)


for _name, _wanted in _ADAPTERS:
    if _name not in _DEFERRED and _wanted():
        _import(_name)
_registry.add_loader(load)
