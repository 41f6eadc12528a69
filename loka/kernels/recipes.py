"""FP8 recipes: how each operand of a GEMM is quantized.

A real kernel and its emulated twin share one :class:`Recipe`, so their quantization is
the same code and only the GEMM differs (a library call vs a float32 matmul).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..numerics import Granularity, QTensor, get_format, quantize
from ..numerics.scaling import is_qtensor

# read by traced code as a name of this module (not an attribute of ``torch``: compiled code
# would check per call that this module's ``torch`` is the caller's)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Recipe:
    scaling: Granularity
    a_format: str = "e4m3"
    b_format: str = "e4m3"
    power_of_two: bool = False
    """round scales up to powers of two (always for MX)"""

    @property
    def formats(self) -> Tuple[str, str]:
        return (self.a_format, self.b_format)

    def quantize_a(self, a: torch.Tensor) -> QTensor:
        return quantize(a, self.a_format, self.scaling, "a", power_of_two=self.power_of_two)

    def quantize_b(self, b: torch.Tensor) -> QTensor:
        return quantize(b, self.b_format, self.scaling, "b", power_of_two=self.power_of_two)

    def _check(self, q: QTensor, operand: str) -> QTensor:
        fmt = get_format(self.a_format if operand == "a" else self.b_format)
        # formats compared by name: the dataclass's own __eq__ reads the class through
        # another path than the instance, which compiled code would check per call
        if q.fmt.name != fmt.name or q.granularity != self.scaling:
            raise ValueError(
                f"operand {operand} was quantized as {q.fmt}/{q.granularity}, but this "
                f"recipe needs {fmt}/{self.scaling}")
        return q

    def operands(self, a, b) -> Tuple[QTensor, QTensor]:
        """Quantize the operands that are not quantized yet; check the ones that are."""
        qa = self._check(a, "a") if is_qtensor(a) else self.quantize_a(a)
        qb = self._check(b, "b") if is_qtensor(b) else self.quantize_b(b)
        if qa.shape[1] != qb.shape[0]:
            raise ValueError(f"GEMM shapes do not match: a {tuple(qa.shape)} @ b {tuple(qb.shape)}")
        return qa, qb

    def tag(self) -> str:
        """'e4m3', or 'e5m2' when the gradient operand (a) is e5m2."""
        if self.a_format == self.b_format:
            return self.a_format
        return f"{self.a_format}"


def check_gemm_operands(a, b, out_dtype: torch.dtype) -> None:
    """Shape and dtype checks shared by every kernel, with readable messages."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"GEMM operands must be 2-D, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"GEMM shapes do not match: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if not is_qtensor(t) and not t.is_floating_point():
            raise TypeError(f"GEMM operand {name} must be floating point, got {t.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"unsupported GEMM output dtype {out_dtype}")
