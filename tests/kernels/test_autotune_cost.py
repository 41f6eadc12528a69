"""What LoKA's Triton autotuners spend (``loka.kernels.triton.common``): the benchmark is
skipped where one config is left, and every benchmark is counted with its wall time (the
Probe's report gives it as ``meta['spent']``). The GPU benchmark is replaced by a stub."""

import pytest

pytest.importorskip("triton")
from loka.kernels.triton import common  # noqa: E402


@pytest.fixture
def fake_gpu(monkeypatch):
    calls = []

    def do_bench(fn, warmup, rep, quantiles=None):
        calls.append((warmup, rep))
        return 0.5

    monkeypatch.setattr(common, "interpreted", lambda: False)
    monkeypatch.setattr(common.triton.testing, "do_bench", do_bench)
    return calls


def test_a_shape_with_several_configs_is_benchmarked_briefly_and_counted(fake_gpu, monkeypatch):
    configs, seconds = common.tuning_spent()
    monkeypatch.setattr(common._PRUNED, "kept", 3, raising=False)
    assert common._bench(lambda: None) == 0.5
    assert fake_gpu == [(1, 5)]
    after = common.tuning_spent()
    assert after[0] == configs + 1 and after[1] >= seconds


def test_a_shape_with_one_config_left_is_not_benchmarked(fake_gpu, monkeypatch):
    configs = common.tuning_spent()[0]
    monkeypatch.setattr(common._PRUNED, "kept", 1, raising=False)
    assert common._bench(lambda: None) == 0.0
    assert common._bench(lambda: None, quantiles=[0.5, 0.2, 0.8]) == [0.0, 0.0, 0.0]
    assert fake_gpu == [] and common.tuning_spent()[0] == configs


def test_the_pruning_records_how_many_configs_are_left(monkeypatch):
    """``early_config_prune`` of a LoKA autotuner under a limit of one config: one kept,
    and recorded for the benchmark."""
    from loka.kernels.roofline import autotune_limit
    from loka.kernels.triton import quantize as Q

    monkeypatch.setattr(common, "interpreted", lambda: False)
    monkeypatch.delenv("LOKA_TRITON_AUTOTUNE", raising=False)
    prune = Q.rowwise_quant_kernel.early_config_prune
    args = {"R": 4096, "C": 2048}
    monkeypatch.setattr(common._PRUNED, "kept", 0, raising=False)
    assert len(prune(Q.rowwise_quant_kernel.configs, args, BLOCK_C=2048)) > 1
    assert common._PRUNED.kept > 1
    with autotune_limit(1):
        assert len(prune(Q.rowwise_quant_kernel.configs, args, BLOCK_C=2048)) == 1
    assert common._PRUNED.kept == 1
