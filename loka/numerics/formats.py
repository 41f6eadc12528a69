"""FP8 number formats and their limits.

``e4m3fn`` and ``e5m2`` are the OCP formats of NVIDIA Hopper/Blackwell; the ``fnuz``
variants (finite, no negative zero, exponent bias one larger) are those of AMD MI300.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

# read by traced code as names of this module, not as attributes of ``torch`` (compiled code
# would check per call that this module's ``torch`` is the caller's)
_finfo = torch.finfo
_DTYPE = torch.dtype


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit floating-point format."""

    name: str
    """short name used in kernel names and JSON: 'e4m3', 'e5m2', 'e4m3fnuz', 'e5m2fnuz'"""
    dtype: torch.dtype
    """the torch storage dtype"""
    exponent_bits: int
    mantissa_bits: int

    @property
    def max(self) -> float:
        """largest finite magnitude (448 for e4m3fn, 57344 for e5m2)"""
        return float(_finfo(self.dtype).max)

    @property
    def min_normal(self) -> float:
        """smallest positive normal number; values below it lose mantissa bits"""
        return float(_finfo(self.dtype).smallest_normal)

    @property
    def eps(self) -> float:
        """relative spacing at 1.0: half of it is the worst-case rounding error"""
        return float(_finfo(self.dtype).eps)

    @property
    def vendor(self) -> str:
        return "amd" if self.name.endswith("fnuz") else "ocp"

    def __str__(self) -> str:
        return self.name


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 4, 3)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 5, 2)
E4M3FNUZ = FP8Format("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3)
E5M2FNUZ = FP8Format("e5m2fnuz", torch.float8_e5m2fnuz, 5, 2)

FORMATS: Dict[str, FP8Format] = {f.name: f for f in (E4M3, E5M2, E4M3FNUZ, E5M2FNUZ)}
_ALIASES = {"e4m3fn": "e4m3", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2",
            "float8_e4m3fnuz": "e4m3fnuz", "float8_e5m2fnuz": "e5m2fnuz"}


def get_format(fmt: "FP8Format | str | torch.dtype") -> FP8Format:
    """Look up a format by name, alias or torch dtype."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, _DTYPE):
        for f in FORMATS.values():
            if f.dtype == fmt:
                return f
        raise ValueError(f"{fmt} is not an FP8 dtype")
    key = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if key not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[key]
