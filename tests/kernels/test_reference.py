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


def test_a_state_set_through_the_legacy_flag_is_restored_too():
    """A process that turned TF32 on with the legacy ``allow_tf32`` finds it on after a
    float32 reference (which turns it off)."""
    saved = matmul_state()
    try:
        MATMUL.allow_tf32 = True
        before = matmul_state()
        get("fp32").fn(torch.randn(4, 8), torch.randn(8, 2), torch.float32)
        assert matmul_state() == before
        if before[0] == "fp32_precision":
            assert before[1] == "tf32"
        else:
            assert before[1] is True
    finally:
        restore_matmul_state(saved)
