"""The pieces of loka.distributed that need no second process: statistics merges against
float64, wrapper-independent site names, the FP8 all-gather's halves, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import loka
import loka.distributed as ld
from loka.data import SyntheticCTR
from loka.dispatch import Plan, PlanMismatchError
from loka.kernels import get
from loka.probe import SiteStats, TensorStats
from loka.probe.hooks import canonical_name

FP8 = "emulated-rowwise-e4m3"


def _rows(n, d, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale + shift


def test_merged_tensor_stats_equal_float64_statistics_of_all_rows():
    parts = [_rows(40, 12, 0, 2.0, 5.0), _rows(25, 12, 1, 0.5, -3.0), _rows(1, 12, 2)]
    parts[1][3, 4] = float("nan")  # a bad row: counted, left out
    merged = None
    for p in parts:
        ts = TensorStats(12)
        ts.update(p)
        merged = ts if merged is None else merged.merge(ts)
    rows = torch.cat(parts).double()
    rows = rows[torch.isfinite(rows).all(1)]
    assert merged.moments.count == rows.shape[0] == 65
    assert float(merged.moments.nonfinite_rows) == 1
    torch.testing.assert_close(merged.moments.mean.double(), rows.mean(0), rtol=0, atol=1e-5)
    torch.testing.assert_close(merged.moments.covariance().double(), torch.cov(rows.t()),
                               rtol=1e-4, atol=1e-4)
    c = rows - rows.mean(0)
    kurt = (c ** 4).mean(0) / (c ** 2).mean(0) ** 2 - 3
    torch.testing.assert_close(merged.channels.excess_kurtosis().double(), kurt, rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(merged.range.channel_amax.double(), rows.abs().amax(0))
    assert merged.updates == 3


def test_merge_refuses_other_layouts_and_keeps_an_empty_side():
    a, b = TensorStats(4), TensorStats(5)
    with pytest.raises(ValueError, match="4 and 5"):
        b.merge(a)
    a.update(_rows(8, 4, 0))
    before = a.moments.mean.clone()
    a.merge(TensorStats(4))  # nothing learned: nothing changes
    assert torch.equal(a.moments.mean, before) and a.moments.count == 8
    empty = TensorStats(4).merge(a)
    assert torch.equal(empty.moments.mean, before)
    with pytest.raises(ValueError, match="cannot merge site"):
        SiteStats("x", 4, 8).merge(SiteStats("y", 8, 4))


def test_site_stats_copy_to_another_device_keeps_the_numbers():
    site = SiteStats("s", 6, 3)
    site.act.update(_rows(10, 6, 3))
    site.grad.update(_rows(10, 3, 4))
    site.weight.observe(_rows(3, 6, 5))
    copy = site.to("cpu")
    assert copy is not site and copy.act is not site.act
    assert copy.summary() == site.summary()
    copy.act.update(_rows(4, 6, 6))  # the copy is independent
    assert site.act.moments.count == 10 and copy.act.moments.count == 14


@pytest.mark.parametrize("name, want", [
    ("module.over.0", "over.0"), ("_orig_mod.module.over.0", "over.0"),
    ("layers._fsdp_wrapped_module.0._checkpoint_wrapped_module.proj", "layers.0.proj"),
    ("encoder.module.proj", "encoder.module.proj"),  # only a leading 'module' is DDP's
    ("", "")])
def test_canonical_names_strip_what_wrappers_add(name, want):
    assert canonical_name(name) == want


class _Wrapper(nn.Module):
    """Adds a leading 'module.' to every name, as DistributedDataParallel does."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def test_a_plan_applies_across_wrapper_prefixes_both_ways():
    bare, wrapped = _mlp(), _Wrapper(_mlp())
    plan_bare, plan_wrapped = Plan.uniform(bare, FP8), Plan.uniform(wrapped, FP8)
    assert set(plan_wrapped.sites) == {"module.0", "module.2"}
    x = torch.randn(8, 32)
    want = bare(x)
    loka.apply(bare, plan_wrapped)
    loka.apply(wrapped, plan_bare)
    assert isinstance(bare[0], loka.Linear) and isinstance(wrapped.module[2], loka.Linear)
    torch.testing.assert_close(bare(x), wrapped(x), rtol=0, atol=0)
    assert (bare(x) - want).abs().max() > 0  # FP8 now
    guard = loka.dispatch.Guard(bare, plan_wrapped)
    assert set(guard.sites) == {"module.0", "module.2"}
    assert loka.unapply(wrapped) and type(wrapped.module[0]) is nn.Linear
    with pytest.raises(PlanMismatchError, match="not in the model"):
        loka.apply(bare, Plan.uniform(_Wrapper(nn.Sequential(*[nn.Identity()] * 3,
                                                             nn.Linear(32, 32))), FP8))


def test_fp8_all_gather_halves_give_the_kernel_quantization_of_the_whole_weight():
    """The halves FSDP calls, run by hand on two 'ranks' of one weight (no collective)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    weight = model[0].weight.detach().clone()
    loka.apply(model, Plan.uniform(model, FP8))
    full = model[0]
    gathered_rows, gathered_scales = [], []
    for rank in range(2):
        shard = ld.FP8GatherWeight(weight[rank * 16:(rank + 1) * 16].clone(), "rowwise")
        (data, scale), meta = shard.fsdp_pre_all_gather(None, weight.shape, (64, 1), full, None)
        assert data.dtype == torch.uint8 and scale.shape == (16, 1)
        gathered_rows.append(data)
        gathered_scales.append(scale)
        again = shard.fsdp_pre_all_gather(None, weight.shape, (64, 1), full, None)
        assert again[0][0] is data  # quantized once until the weights change
        torch.optim.SGD([nn.Parameter(torch.zeros(1))]).step()  # any optimizer step
        assert shard.fsdp_pre_all_gather(None, weight.shape, (64, 1), full, None)[0][0] is not data
    deq, inner = shard.fsdp_post_all_gather((torch.cat(gathered_rows), torch.cat(gathered_scales)),
                                            meta, torch.float32)
    want = get(FP8).quantize_b(weight.t())
    assert torch.equal(full.weight_q.data.float(), want.data.float())
    assert torch.equal(full.weight_q.scale, want.scale)
    torch.testing.assert_close(deq.double(), want.dequantize(torch.float64).t(), rtol=0,
                               atol=1e-7)
    # tensorwise: one scale from the largest |w| of the shard (no mesh: this process's)
    tw = ld.FP8GatherWeight(weight.clone(), "tensorwise")
    (data,), (_, _, _, scale, _) = tw.fsdp_pre_all_gather(None, weight.shape, (64, 1), full, None)
    assert scale.numel() == 1
    assert float(scale) == pytest.approx(float(weight.abs().max()) / 448.0, rel=1e-6)
    # the wrapped weight behaves as the plain weight everywhere else
    x = torch.randn(3, 64)
    torch.testing.assert_close(x @ tw.t(), x @ weight.t())


class _Mesh:
    """What FSDP's shard mesh offers the all-gather extension: its size and group."""

    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

    def get_group(self):
        return None


def test_uneven_shards_send_padded_rows_and_gather_their_row_scales_once(monkeypatch):
    """32 rows over 3 'ranks' (11/11/10) by hand: each rank's input is FSDP's padded shard,
    the row scales come from one all-gather per generation (faked: every rank's padded
    scales), and the gathered weight is the kernel's quantization of the whole weight."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    weight = model[0].weight.detach().clone()
    loka.apply(model, Plan.uniform(model, FP8))
    full = model[0]
    want = get(FP8).quantize_b(weight.t())
    bounds = [(0, 11), (11, 22), (22, 32)]
    every = torch.ones(3, 11)
    for r, (a, b) in enumerate(bounds):
        every[r, :b - a] = want.scale.reshape(-1)[a:b]
    sent = []

    def fake_gather(out, inp, group=None):
        sent.append(inp.clone())
        out.copy_(every.reshape(-1))
    monkeypatch.setattr(ld.fp8_gather.dist, "all_gather_into_tensor", fake_gather)
    rows = []
    for r, (a, b) in enumerate(bounds):
        if r:  # each simulated rank owns the module here: the gathered scales are per step
            ld.weights_changed()
        shard = ld.FP8GatherWeight(weight[a:b].clone(), "rowwise")
        (data,), meta = shard.fsdp_pre_all_gather(_Mesh(3), weight.shape, (64, 1), full, None)
        assert data.shape == (11, 64) and data.dtype == torch.uint8
        assert torch.equal(sent[-1], every[r])  # this rank's scales, padded with ones
        assert shard.fsdp_pre_all_gather(_Mesh(3), weight.shape, (64, 1), full, None)[0][0] \
            is data and len(sent) == r + 1  # once per generation
        # a new shard object for the same module (FSDP re-pads a smaller shard on its
        # rank only) finds the gathered scales on the module: no collective of its own
        again = ld.FP8GatherWeight(weight[a:b].clone(), "rowwise")
        (same,), _ = again.fsdp_pre_all_gather(_Mesh(3), weight.shape, (64, 1), full, None)
        assert torch.equal(same, data) and len(sent) == r + 1
        rows.append(data)
    assert not rows[2][10:].any()  # the padding row is zeros
    deq, _ = shard.fsdp_post_all_gather((torch.cat(rows),), meta, torch.float32)
    assert deq.shape == (32, 64)
    assert torch.equal(full.weight_q.data.float(), want.data.float())
    assert torch.equal(full.weight_q.scale, want.scale)
    torch.testing.assert_close(deq.double(), want.dequantize(torch.float64).t(), rtol=0,
                               atol=1e-7)
    # a rank whose shard is empty (2 rows over 3 ranks: 1/1/0) sends one zero row
    monkeypatch.setattr(ld.fp8_gather.dist, "all_gather_into_tensor",
                        lambda out, inp, group=None: out.copy_(inp.repeat(3)))
    monkeypatch.setattr(ld.fp8_gather.dist, "all_reduce", lambda t, **kw: None)
    for scaling in ("rowwise", "tensorwise"):
        empty = ld.FP8GatherWeight(weight[:0].clone(), scaling)
        (data,), meta = empty.fsdp_pre_all_gather(_Mesh(3), (2, 64), (64, 1), full, None)
        assert data.shape == (1, 64) and not data.any() and meta[-1] == 2


def test_fp8_all_gather_refuses_bad_input_and_says_what_it_skips():
    model = _mlp()
    loka.apply(model, Plan.uniform(model, FP8))
    with pytest.raises(ValueError, match="scaling must be one of"):
        ld.fp8_all_gather(model, "blockwise")
    with pytest.raises(ValueError, match="world_size"):
        ld.fp8_all_gather(model, world_size=0)
    done = ld.fp8_all_gather(model, "tensorwise")
    assert all("is not tensorwise FP8" in why for why in done.values())
    done = ld.fp8_all_gather(model, "rowwise", world_size=3)  # 64 and 32 rows over 3: padded
    assert done == {"0": "fp8", "2": "fp8"}
    assert isinstance(model[0].weight.data, ld.FP8GatherWeight)
    assert ld.fp8_all_gather(model, "rowwise", world_size=4) == done  # idempotent
    x = torch.randn(5, 32)
    assert torch.isfinite(model(x)).all()


def test_collectives_act_on_one_process_without_a_process_group():
    model = _mlp()
    plan = ld.plan_once(lambda: Plan.uniform(model, FP8))
    assert ld.broadcast_plan(plan) is plan
    ld.check_same_plan(plan)
    assert ld.plan_fingerprint(plan) == ld.plan_fingerprint(Plan.from_dict(plan.to_dict()))
    changed = plan.copy()
    changed.sites["0"].roles[loka.Role.FWD].kernel = "bf16"
    assert ld.plan_fingerprint(changed) != ld.plan_fingerprint(plan)
    with pytest.raises(TypeError, match="not a loka.Plan"):
        ld.plan_once(lambda: {"sites": {}})
    with pytest.raises(TypeError, match="must pass a loka.Plan"):
        ld.broadcast_plan(None)
    with pytest.raises(TypeError):
        ld.check_same_plan("plan.json")
    agree = ld.RankAgreement()
    assert agree.any(True) and not agree.any(False)
    assert agree.union({"a": "why"}) == {"a": "why"}
    assert ld.world() == (0, 1)


def test_shard_batch_splits_a_global_batch_exactly():
    spec = loka.models.presets("wukong")["tiny"].features
    batch = next(iter(SyntheticCTR(spec, 12, seed=0)))
    parts = [ld.shard_batch(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p.dense for p in parts]), batch.dense)
    assert torch.equal(torch.cat([p.labels for p in parts]), batch.labels)
    for name, jag in batch.sparse.items():
        assert torch.equal(torch.cat([p.sparse[name].values for p in parts]), jag.values)
        assert all(int(p.sparse[name].offsets[0]) == 0 for p in parts)
        assert torch.equal(torch.cat([p.sparse[name].lengths for p in parts]), jag.lengths)
    with pytest.raises(ValueError, match="does not split evenly"):
        ld.shard_batch(batch, 0, 5)
    with pytest.raises(ValueError, match="not in a world"):
        ld.shard_batch(batch, 3, 3)


def test_load_refuses_a_missing_or_corrupt_checkpoint(tmp_path):
    model = _mlp()
    with pytest.raises(FileNotFoundError, match="no distributed checkpoint"):
        ld.load(tmp_path / "nothing", model)
    ld.save(tmp_path / "ok", model, plan=Plan.uniform(model, FP8))
    other = nn.Sequential(nn.Linear(32, 16))
    with pytest.raises(ValueError, match="cannot load the checkpoint"):
        ld.load(tmp_path / "ok", other)
    (tmp_path / "ok" / ".metadata").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="cannot load the checkpoint"):
        ld.load(tmp_path / "ok", model)
    with pytest.raises(TypeError, match="loka.Plan"):
        ld.save(tmp_path / "bad", model, plan={"sites": {}})


def test_save_and_load_in_one_process_round_trip_weights_optimizer_and_plan(tmp_path):
    model = _mlp()
    plan = Plan.uniform(model, FP8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    ld.save(tmp_path / "c", model, opt, plan=plan)
    other = _mlp()
    for p in other.parameters():
        nn.init.zeros_(p)
    opt2 = torch.optim.Adam(other.parameters(), lr=1e-2)
    loaded = ld.load(tmp_path / "c", other, opt2)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0
    assert ld.plan_fingerprint(loaded.plan) == ld.plan_fingerprint(plan)
    assert loaded.report is None


def test_load_renews_the_fp8_shards_quantized_before_it(tmp_path):
    """Shards quantized before ``load`` (no optimizer step between) are stale after it: the
    next all-gather quantizes the loaded weights."""
    def gathered(model):
        w = model[0].weight
        (data,), meta = w.fsdp_pre_all_gather(None, w.shape, w.stride(), model[0], None)
        return data.clone(), meta[3].clone()

    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 32, bias=False))
        loka.apply(model, Plan.uniform(model, "emulated-tensorwise-e4m3"))
        assert ld.fp8_all_gather(model, "tensorwise", world_size=1) == {"0": "fp8"}
        models.append(model)
    saved, other = models
    want = gathered(saved)
    ld.save(tmp_path / "c", saved)
    before = gathered(other)
    assert not torch.equal(before[1], want[1])
    ld.load(tmp_path / "c", other)
    assert torch.equal(other[0].weight, saved[0].weight)
    got = gathered(other)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
