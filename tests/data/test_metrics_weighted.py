"""Weighted, multi-task, windowed and cross-rank NE and AUC against float64 references, and
against ``torchrec.metrics`` on the same inputs when torchrec is installed."""

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loka.data import Metrics, auc, log_loss, normalized_entropy


def ref_weighted_ne(p, y, w):
    """float64 by the textbook formula (natural log), independent of loka's arithmetic."""
    p, y, w = (np.asarray(a, np.float64) for a in (p, y, w))
    ce = -(w * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum()
    ctr = (w * y).sum() / w.sum()
    norm = -(w * (y * np.log(ctr) + (1 - y) * np.log(1 - ctr))).sum()
    return float(ce / norm)


def ref_weighted_auc(s, y, w):
    """O(n^2) weighted pair count in float64: ties count one half."""
    s, y, w = (np.asarray(a, np.float64) for a in (s, y, w))
    pos, neg = y == 1, y == 0
    sp, sn, wp, wn = s[pos], s[neg], w[pos], w[neg]
    pair = wp[:, None] * wn[None, :]
    wins = (pair * (sp[:, None] > sn[None, :])).sum() + 0.5 * (pair * (sp[:, None] == sn[None, :])).sum()
    return float(wins / (wp.sum() * wn.sum()))


def _inputs(n=600, tasks=None, seed=0, ties=False):
    rng = np.random.default_rng(seed)
    shape = (n,) if tasks is None else (n, tasks)
    y = (rng.random(shape) < 0.3).astype(np.float64)
    logits = rng.standard_normal(shape) + 1.5 * y - 1.0
    if ties:
        logits = np.round(logits, 1)
    p = 1 / (1 + np.exp(-logits))
    w = rng.uniform(0.1, 3.0, size=shape)
    return p, y, w


def test_weighted_ne_and_auc_against_float64_references():
    p, y, w = _inputs(ties=True)
    assert normalized_entropy(p, y, weights=w) == pytest.approx(ref_weighted_ne(p, y, w), rel=1e-12)
    assert auc(p, y, weights=w) == pytest.approx(ref_weighted_auc(p, y, w), abs=1e-13)
    ll = math.fsum(-(w * (y * np.log(p) + (1 - y) * np.log(1 - p)))) / math.fsum(w)
    assert log_loss(p, y, weights=w) == pytest.approx(ll, rel=1e-12)
    # the weighted AUC is not the unweighted one here: the weights are really used
    assert abs(auc(p, y, weights=w) - auc(p, y)) > 1e-4


def test_integer_weights_equal_repeated_examples():
    p, y, _ = _inputs(n=300, seed=3, ties=True)
    w = np.random.default_rng(4).integers(0, 4, size=300).astype(np.float64)
    rep_p, rep_y = np.repeat(p, w.astype(int)), np.repeat(y, w.astype(int))
    assert normalized_entropy(p, y, weights=w) == pytest.approx(normalized_entropy(rep_p, rep_y),
                                                                rel=1e-12)
    assert auc(p, y, weights=w) == pytest.approx(auc(rep_p, rep_y), abs=1e-13)
    ones = np.ones_like(p)
    assert normalized_entropy(p, y, weights=ones) == pytest.approx(normalized_entropy(p, y), rel=1e-14)
    assert auc(p, y, weights=ones) == pytest.approx(auc(p, y), abs=1e-14)
    m = Metrics(from_logits=False)
    m.update(p, y, weights=w)
    assert m.compute()["ctr"] == pytest.approx(rep_y.mean(), rel=1e-13)


def test_multi_task_is_each_column_alone():
    p, y, w = _inputs(n=400, tasks=3, seed=5)
    ne = normalized_entropy(p, y, weights=w)
    a = auc(p, y, weights=w)
    assert isinstance(ne, list) and len(ne) == 3
    for t in range(3):
        assert ne[t] == normalized_entropy(p[:, t], y[:, t], weights=w[:, t])
        assert a[t] == auc(p[:, t], y[:, t], weights=w[:, t])
        assert ne[t] == pytest.approx(ref_weighted_ne(p[:, t], y[:, t], w[:, t]), rel=1e-12)
    # one weight per example, shared by the tasks
    shared = normalized_entropy(p, y, weights=w[:, 0])
    assert shared[2] == normalized_entropy(p[:, 2], y[:, 2], weights=w[:, 0])
    m = Metrics(from_logits=False)
    for i in range(0, 400, 64):
        m.update(p[i:i + 64], y[i:i + 64], weights=w[i:i + 64])
    out = m.compute()
    assert out["count"] == 400 and len(out["ne"]) == 3
    for t in range(3):
        assert out["ne"][t] == pytest.approx(ne[t], rel=1e-14)
        assert out["auc"][t] == pytest.approx(a[t], abs=1e-14)


def test_window_keeps_the_latest_examples():
    p, y, w = _inputs(n=500, seed=6)
    m = Metrics(from_logits=False, window=130)
    for i in range(0, 500, 48):  # batches do not divide the window
        m.update(p[i:i + 48], y[i:i + 48], weights=w[i:i + 48])
        end = min(i + 48, 500)
        assert m.count == min(end, 130)
    out = m.compute()
    assert out["count"] == 130
    assert out["ne"] == pytest.approx(normalized_entropy(p[-130:], y[-130:], weights=w[-130:]),
                                      rel=1e-14)
    assert out["auc"] == pytest.approx(auc(p[-130:], y[-130:], weights=w[-130:]), abs=1e-14)
    big = Metrics(from_logits=False, window=5)
    big.update(p[:50], y[:50])  # one batch larger than the window
    assert big.count == 5 and big.compute()["auc"] == auc(p[45:50], y[45:50])


def test_single_class_auc_is_one_half_and_ne_raises():
    assert auc([0.9, 0.1, 0.4], [1, 1, 1]) == 0.5
    assert auc([0.9, 0.1, 0.4], [1, 0, 1], weights=[1, 0, 1]) == 0.5  # no negative weight
    assert auc([[0.2, 0.3], [0.4, 0.1]], [[0, 1], [0, 1]]) == [0.5, 0.5]  # task 1: all 1
    assert auc([[0.2, 0.3], [0.4, 0.1]], [[0, 1], [1, 0]]) == [1.0, 1.0]
    with pytest.raises(ValueError, match="every \\(weighted\\) label is 1"):
        normalized_entropy([0.9, 0.2], [1, 0], weights=[1.0, 0.0])


@pytest.mark.parametrize("weights,match", [
    ([1.0, -1.0, 1.0], ">= 0"), ([1.0, float("nan"), 1.0], "finite"),
    ([1.0, float("inf"), 1.0], "finite"), ([1.0, 1.0], "one per example"),
    ([0.0, 0.0, 0.0], "all weights are zero"),
])
def test_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        log_loss([0.2, 0.7, 0.5], [0, 1, 1], weights=weights)


def test_bad_metric_input():
    with pytest.raises(ValueError, match="differ in shape"):
        auc(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"\(N,\) or \(N, tasks\)"):
        auc(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="window"):
        Metrics(window=0)
    m = Metrics(from_logits=False)
    m.update([0.2, 0.6], [0, 1])
    with pytest.raises(ValueError, match="task columns"):
        m.update([[0.2, 0.6]], [[0, 1]])
    with pytest.raises(ValueError, match="weights with every update"):
        m.update([0.2, 0.6], [0, 1], weights=[1, 1])
    m.reset()
    m.update([[0.2, 0.6]], [[0, 1]])  # after a reset any layout goes


def test_reduce_without_a_process_group_is_the_local_result():
    p, y, w = _inputs(n=200, seed=7)
    m = Metrics(from_logits=False)
    m.update(p, y, weights=w)
    assert m.compute(reduce=True) == m.compute()


def _rank(rank, world, init, p, y, w, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        m = Metrics(from_logits=False, window=None)
        lo, hi = (0, 170) if rank == 0 else (170, 400)  # uneven shards
        for i in range(lo, hi, 50):
            j = min(i + 50, hi)
            m.update(p[i:j], y[i:j], weights=w[i:j])
        res = m.compute(reduce=True)
        np.save(os.path.join(out, f"r{rank}.npy"),
                np.array(res["ne"] + res["auc"] + res["logloss"] + res["ctr"] + [res["count"]]))
        # a rank without examples takes part with none
        lone = Metrics(from_logits=False)
        if rank == 0:
            lone.update(p, y, weights=w)
        res = lone.compute(reduce=True)
        np.save(os.path.join(out, f"lone{rank}.npy"), np.array(res["ne"] + res["auc"]))
        # different layouts: every rank raises the same error (none waits forever)
        odd = Metrics(from_logits=False)
        odd.update(p if rank == 0 else p[:, 0], y if rank == 0 else y[:, 0])
        try:
            odd.compute(reduce=True)
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        with open(os.path.join(out, f"odd{rank}.txt"), "w") as f:
            f.write(msg)
    finally:
        dist.destroy_process_group()


def test_reduction_across_two_ranks_equals_one_process(tmp_path):
    p, y, w = _inputs(n=400, tasks=2, seed=8)
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_rank, args=(2, init, p, y, w, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    one = Metrics(from_logits=False)
    one.update(p, y, weights=w)
    want = one.compute()
    for r in (0, 1):
        got = np.load(tmp_path / f"r{r}.npy")
        np.testing.assert_allclose(got[0:2], want["ne"], rtol=1e-13)
        np.testing.assert_allclose(got[2:4], want["auc"], rtol=0, atol=1e-14)
        np.testing.assert_allclose(got[4:6], want["logloss"], rtol=1e-13)
        np.testing.assert_allclose(got[6:8], want["ctr"], rtol=1e-13)
        assert got[8] == 400
        lone = np.load(tmp_path / f"lone{r}.npy")
        np.testing.assert_allclose(lone, want["ne"] + want["auc"], rtol=1e-13, atol=1e-14)
        assert (tmp_path / f"odd{r}.txt").read_text().startswith(
            "ranks updated with different layouts (tasks, weighted): [(0, 0), (2, 0)]")


# -- torchrec's metrics on the same inputs (when torchrec is installed) ------------------

def test_agrees_with_torchrec_metrics_on_weighted_multi_task_input():
    pytest.importorskip("torchrec", reason="torchrec is not installed (pip install loka[torchrec])")
    from torchrec.metrics.auc import compute_auc
    from torchrec.metrics.ne import compute_cross_entropy, compute_ne

    p, y, w = _inputs(n=700, tasks=3, seed=9)  # continuous scores: no ties
    pt, yt, wt = (torch.tensor(a.T.copy(), dtype=torch.float64) for a in (p, y, w))
    eta = 1e-12
    ce_sum = compute_cross_entropy(yt, pt, wt, eta).sum(-1)
    ne_torchrec = compute_ne(ce_sum, wt.sum(-1), (wt * yt).sum(-1), (wt * (1 - yt)).sum(-1),
                             eta).tolist()
    auc_torchrec = compute_auc(3, [pt], [yt], [wt]).tolist()
    ne_loka = normalized_entropy(p, y, weights=w)
    auc_loka = auc(p, y, weights=w)
    np.testing.assert_allclose(ne_loka, ne_torchrec, rtol=1e-10)
    np.testing.assert_allclose(auc_loka, auc_torchrec, rtol=0, atol=1e-10)
    # single-class tasks: both give 0.5
    y1 = np.ones_like(y)
    assert auc(p, y1, weights=w) == [0.5, 0.5, 0.5]
    assert compute_auc(3, [pt], [torch.ones_like(yt)], [wt]).tolist() == [0.5, 0.5, 0.5]


def test_streams_like_torchrec_rec_metrics_lifetime_and_window():
    """torchrec's NEMetric and AUCMetric (two tasks, weights, a window of two batches) fed
    the same batches as loka's Metrics: lifetime NE, window NE and window AUC agree."""
    pytest.importorskip("torchrec", reason="torchrec is not installed (pip install loka[torchrec])")
    from torchrec.metrics.auc import AUCMetric
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
    from torchrec.metrics.ne import NEMetric

    batch, window, tasks = 64, 128, 2
    infos = [RecTaskInfo(name=f"t{i}", label_name=f"l{i}", prediction_name=f"p{i}",
                         weight_name=f"w{i}") for i in range(tasks)]
    kw = dict(world_size=1, my_rank=0, batch_size=batch, tasks=infos, window_size=window,
              compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION)
    ne_tr, auc_tr = NEMetric(**kw), AUCMetric(**kw)
    life, win = Metrics(from_logits=False), Metrics(from_logits=False, window=window)
    for step in range(5):
        p, y, w = _inputs(n=batch, tasks=tasks, seed=100 + step)
        for m in (ne_tr, auc_tr):
            m.update(predictions={f"t{k}": torch.tensor(p[:, k]) for k in range(tasks)},
                     labels={f"t{k}": torch.tensor(y[:, k]) for k in range(tasks)},
                     weights={f"t{k}": torch.tensor(w[:, k]) for k in range(tasks)})
        life.update(p, y, weights=w)
        win.update(p, y, weights=w)
    got_ne, got_auc = ne_tr.compute(), auc_tr.compute()
    ours_life, ours_win = life.compute(), win.compute()
    for k in range(tasks):
        assert float(got_ne[f"ne-t{k}|lifetime_ne"]) == pytest.approx(ours_life["ne"][k], rel=1e-9)
        assert float(got_ne[f"ne-t{k}|window_ne"]) == pytest.approx(ours_win["ne"][k], rel=1e-9)
        # torchrec keeps AUC's state in float32
        assert float(got_auc[f"auc-t{k}|window_auc"]) == pytest.approx(ours_win["auc"][k], abs=1e-6)
