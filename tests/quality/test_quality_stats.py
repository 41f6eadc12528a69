"""loka.quality.stats against float64 references written out here: the delta method's
interval of a ratio of paired means, the paired bootstrap, DeLong's paired AUC, the
Student-t quantiles."""

import math

import numpy as np
import pytest

from loka.data import auc, log_loss
from loka.quality import (bootstrap_ratio_interval, example_log_losses, paired_auc,
                          ratio_interval, t_interval, t_quantile, z_quantile)


def _pair(n=20000, seed=0, effect=1e-3):
    rng = np.random.default_rng(seed)
    labels = (rng.random(n) < 0.1).astype(np.float64)
    z_base = rng.normal(-2.2, 1.0, n) + 1.5 * labels
    z_plan = z_base + effect * rng.normal(size=n)
    return z_base, z_plan, labels


def test_example_log_losses_average_to_log_loss():
    z, _, y = _pair()
    assert math.fsum(example_log_losses(z, y)) / y.size == pytest.approx(
        log_loss(z, y, from_logits=True), rel=1e-13)


def test_ratio_interval_matches_the_delta_method_reference_and_is_zero_when_equal():
    z_base, z_plan, y = _pair()
    a, b = example_log_losses(z_base, y), example_log_losses(z_plan, y)
    change, low, high = ratio_interval(a, b)
    # reference: the delta method written out in float64
    r = b.mean() / a.mean()
    se = np.std(b - r * a, ddof=1) / (math.sqrt(a.size) * a.mean())
    assert change == pytest.approx(r - 1, abs=1e-15)
    assert (high - low) / 2 == pytest.approx(1.959963984540054 * se, rel=1e-9)
    assert ratio_interval(a, a.copy()) == (0.0, 0.0, 0.0)


def test_the_paired_bootstrap_agrees_with_the_delta_method():
    z_base, z_plan, y = _pair(effect=1e-2)
    a, b = example_log_losses(z_base, y), example_log_losses(z_plan, y)
    _, low, high = ratio_interval(a, b)
    b_low, b_high = bootstrap_ratio_interval(a, b, 400, seed=1)
    assert abs((b_high - b_low) - (high - low)) < 0.15 * (high - low)
    assert abs((b_high + b_low) - (high + low)) / 2 < 0.2 * (high - low)


def test_paired_auc_matches_a_brute_force_delong_reference():
    z_base, z_plan, y = _pair(n=600, effect=0.3)
    auc_base, auc_plan, change, low, high = paired_auc(z_base, z_plan, y)
    assert auc_base == pytest.approx(auc(z_base, y), abs=1e-13)
    assert auc_plan == pytest.approx(auc(z_plan, y), abs=1e-13)
    pos, neg = y == 1, y == 0

    def placements(s):  # O(m n) in float64: psi(x, y) = 1, 1/2, 0
        psi = (s[pos][:, None] > s[neg][None, :]) + 0.5 * (s[pos][:, None] == s[neg][None, :])
        return psi.mean(axis=1), psi.mean(axis=0)

    (b10, b01), (p10, p01) = placements(z_base), placements(z_plan)
    var = np.var(p10 - b10, ddof=1) / pos.sum() + np.var(p01 - b01, ddof=1) / neg.sum()
    assert change == pytest.approx(auc_plan - auc_base, abs=1e-15)
    assert (high - low) / 2 == pytest.approx(1.959963984540054 * math.sqrt(var), rel=1e-9)
    assert paired_auc(z_base, z_base.copy(), y)[2:] == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("df,expected", [(1, 12.7062047), (2, 4.3026527), (4, 2.7764451),
                                         (9, 2.2621572), (30, 2.0422725)])
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=1e-6)


def test_t_interval_and_z():
    assert z_quantile(0.95) == pytest.approx(1.959963984540054, abs=1e-12)
    mean, low, high = t_interval([1.0, 2.0, 4.0])
    sd = np.std([1.0, 2.0, 4.0], ddof=1)
    assert mean == pytest.approx(7 / 3, abs=1e-15)
    assert (high - low) / 2 == pytest.approx(4.3026527 * sd / math.sqrt(3), rel=1e-7)
    assert t_interval([1.0]) is None
