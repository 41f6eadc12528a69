import math

import pytest
import torch

from loka.numerics import MERE_FLOOR, mere, relative_frobenius, rowwise_relative_error, sqnr


def test_metrics_on_known_values():
    ref = torch.tensor([[1.0, -2.0], [4.0, 0.5]], dtype=torch.float64)
    approx = ref * 1.1
    rms = math.sqrt((1 + 4 + 16 + 0.25) / 4)  # axes this short: one global floor
    expected = sum(0.1 * abs(v) / (abs(v) + MERE_FLOOR * rms) for v in (1, -2, 4, 0.5)) / 4
    assert mere(approx, ref) == pytest.approx(expected, rel=1e-12)
    assert relative_frobenius(approx, ref) == pytest.approx(0.1, rel=1e-12)
    assert sqnr(approx, ref) == pytest.approx(20.0, rel=1e-12)  # 10*log10(1/0.01)
    torch.testing.assert_close(rowwise_relative_error(approx, ref),
                               torch.full((2,), 0.1, dtype=torch.float64))


def test_exact_and_degenerate_cases():
    r = torch.randn(8, 8)
    assert mere(r, r) == 0.0 and relative_frobenius(r, r) == 0.0 and sqnr(r, r) == math.inf
    z = torch.zeros(4, 4)
    assert mere(z, z) == 0.0 and relative_frobenius(z, z) == 0.0
    assert relative_frobenius(torch.ones(4, 4), z) == math.inf
    bad = r.clone()
    bad[0, 0] = math.nan
    assert math.isnan(sqnr(bad, r)) and math.isnan(mere(bad, r))


def test_metrics_reject_bad_shapes():
    with pytest.raises(ValueError, match="shape mismatch"):
        mere(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="empty"):
        sqnr(torch.zeros(0, 3), torch.zeros(0, 3))


def test_mere_floor_keeps_near_zero_outputs_from_dominating():
    ref = torch.randn(256, 256, dtype=torch.float64)
    ref[0, :8] = 1e-9  # a few outputs that happen to cancel to (almost) zero
    approx = ref + 1e-3 * torch.randn_like(ref)
    # pure relative error explodes on entries near zero; MERE with its floor stays small
    pure = ((approx - ref).abs() / ref.abs()).mean().item()
    assert mere(approx, ref) < 0.01 < pure


def test_mere_floor_follows_column_scales():
    # a weight gradient whose columns differ in scale by 1e5: doubling the small columns
    # must be visible, although they are invisible next to a global floor
    ref = torch.randn(64, 64, dtype=torch.float64)
    ref[:, :8] *= 1e5
    bad = ref.clone()
    bad[:, 8:] *= 2.0
    assert mere(bad, ref) > 0.5
    assert mere(bad.flatten(), ref.flatten()) < 0.2  # what the global floor would say


def test_mere_floor_per_row_and_column_on_float64_reference():
    ref = torch.randn(32, 24, dtype=torch.float64) * torch.logspace(-2, 2, 24, dtype=torch.float64)
    approx = ref * (1 + 0.01 * torch.randn_like(ref))
    want = 0.0
    for i in range(32):
        for j in range(24):
            row = ref[i].square().mean().sqrt().item()
            col = ref[:, j].square().mean().sqrt().item()
            want += abs(approx[i, j] - ref[i, j]).item() / (abs(ref[i, j].item()) + MERE_FLOOR * min(row, col))
    assert mere(approx, ref) == pytest.approx(want / (32 * 24), rel=1e-10)
