"""loka/kernels/reference.py: the float32 references leave the matmul flags as they were."""

import pytest
import torch

from loka.kernels import get
from loka.kernels.reference import matmul_state, restore_matmul_state

MATMUL = torch.backends.cuda.matmul


@pytest.mark.parametrize("precision", ["none", "ieee", "tf32"])
@pytest.mark.parametrize("kernel", ["fp32", "tf32"])
def test_the_float32_references_leave_the_matmul_precision_as_they_found_it(precision, kernel):
    """The legacy ``allow_tf32`` set back would leave ``fp32_precision`` at 'ieee' where it
    was 'none' (the same numerics under another name, which keys the compile caches)."""
    if not hasattr(MATMUL, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision")
    saved = matmul_state()
    try:
        MATMUL.fp32_precision = precision
        a, b = torch.randn(8, 16, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
        out = get(kernel).fn(a, b, torch.float64)
        assert MATMUL.fp32_precision == precision
        assert matmul_state() == ("fp32_precision", precision)
        # and the result is the float32 product (the CPU has no TF32)
        ref = a @ b
        assert float((out - ref).abs().max() / ref.abs().max()) < 1e-6
        assert float((out - ref).abs().max() / ref.abs().max()) > 0  # rounded to float32
    finally:
        restore_matmul_state(saved)
    assert matmul_state() == saved
