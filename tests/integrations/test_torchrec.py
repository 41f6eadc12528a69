"""LoKA on torchrec models and inputs, on the CPU: LoKA batches as KeyedJaggedTensors and
back, the synthetic stream and the Criteo reader yielding torchrec batches, a user's model
(an EmbeddingBagCollection fed KJTs plus a plain-PyTorch MLP) probed, planned, applied and
trained under the Guard, the reference models with torchrec tables, and the same site
names under DistributedModelParallel."""

import copy
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import loka
from loka.assembly import build_reference
from loka.data import CriteoReader, SyntheticCTR, sample_path
from loka.data.batch import Jagged
from loka.integrations import from_kjt, from_torchrec, to_kjt, to_torchrec, use_torchrec_tables
from loka.models.torchrec_embedding import TorchrecEmbeddingArch

torchrec = pytest.importorskip(
    "torchrec", reason="torchrec is not installed: pip install loka[torchrec] (on a CPU: "
                       "torchrec==1.8.0 with fbgemm-gpu-cpu==1.8.0, see the README)")
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.datasets.utils import Batch as TorchrecBatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spec():
    return loka.models.build("dlrm", "tiny").feature_spec


def test_batch_to_kjt_and_back_is_exact():
    batch = next(SyntheticCTR(_spec(), 16, seed=0))
    tb = to_torchrec(batch)
    assert isinstance(tb, TorchrecBatch) and isinstance(tb.sparse_features, KeyedJaggedTensor)
    kjt = tb.sparse_features
    assert kjt.keys() == list(batch.sparse)
    # torchrec's layout: key-major values, lengths (T * B,)
    assert torch.equal(kjt.values(), torch.cat([j.values for j in batch.sparse.values()]))
    assert torch.equal(kjt.lengths(), torch.cat([j.lengths for j in batch.sparse.values()]))
    back = from_torchrec(tb)
    assert torch.equal(back.dense, batch.dense) and torch.equal(back.labels, batch.labels)
    for name, jag in batch.sparse.items():
        assert torch.equal(back.sparse[name].values, jag.values)
        assert torch.equal(back.sparse[name].offsets, jag.offsets)
    # a chosen key order
    order = list(reversed(list(batch.sparse)))
    assert to_kjt(batch.sparse, order).keys() == order
    assert set(from_kjt(to_kjt(batch.sparse, order))) == set(batch.sparse)


def test_conversion_rejects_bad_input():
    jag = Jagged(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    other = Jagged(torch.tensor([1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="differ in batch size"):
        to_kjt({"a": jag, "b": other})
    with pytest.raises(ValueError, match=r"no sparse features \['c'\]"):
        to_kjt({"a": jag}, ["a", "c"])
    with pytest.raises(ValueError, match="at least one sparse feature"):
        to_kjt({})
    with pytest.raises(TypeError, match="expected a loka.data.Batch"):
        to_torchrec({"dense": 1})
    with pytest.raises(TypeError, match="expected a torchrec Batch"):
        from_torchrec(object())


def test_streams_yield_torchrec_batches_and_resume():
    stream = SyntheticCTR(_spec(), 8, seed=3)
    tr = stream.torchrec()
    first = [next(tr) for _ in range(3)]
    assert all(isinstance(b, TorchrecBatch) for b in first)
    state = tr.state_dict()
    fourth = next(tr)
    tr.load_state_dict(state)
    again = next(tr)
    assert torch.equal(again.dense_features, fourth.dense_features)
    assert torch.equal(again.sparse_features.values(), fourth.sparse_features.values())
    ref = SyntheticCTR(_spec(), 8, seed=3).batch(0)
    assert torch.equal(from_torchrec(first[0]).dense, ref.dense)
    reader = CriteoReader(sample_path(), 4, table_sizes=1000).torchrec()
    b = next(iter(reader))
    assert b.sparse_features.keys() == [f"C{i}" for i in range(1, 27)]
    assert b.dense_features.shape == (4, 13) and b.labels.shape == (4,)
    assert b.sparse_features.lengths().tolist() == [1] * (26 * 4)


class TorchrecCTR(nn.Module):
    """A torchrec user's model: an EmbeddingBagCollection fed a KJT, and its own MLP."""

    def __init__(self, spec, dim=16):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=t.name, embedding_dim=dim, num_embeddings=t.num_embeddings,
                               feature_names=[t.name]) for t in spec.tables],
            device=torch.device("cpu"))
        self.dense = nn.Linear(spec.num_dense, dim)
        width = dim * (len(spec.tables) + 1)
        self.over = nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                                  nn.Linear(32, 1))

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        dense = torch.relu(self.dense(batch.dense_features))
        return self.over(torch.cat([pooled, dense], dim=1)).squeeze(-1)


def _loss(model, batch):
    return nn.functional.binary_cross_entropy_with_logits(model(batch), batch.labels)


def test_a_torchrec_model_is_probed_planned_applied_and_trained_with_the_guard():
    torch.manual_seed(0)
    spec = _spec()
    model = TorchrecCTR(spec)
    tables = dict(model.ebc.named_parameters())
    loka.mods.convert(model, loka.ModsConfig.paper())  # the Mods change the dense part only
    assert model.over[0].bias is None and model.over[4].bias is not None  # the logit keeps it
    assert dict(model.ebc.named_parameters()) == tables
    data = SyntheticCTR(spec, 64, seed=1).torchrec()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = loka.ProbeConfig(every_n_steps=2, num_samples=4,
                              kernels=("bf16", "emulated-rowwise-e4m3"))
    with loka.Probe(model, config) as probe:
        for _, batch in zip(range(6), data):
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
    report = probe.report()
    assert sorted(report.sites) == ["dense", "over.0", "over.2", "over.4"]  # not the EBC
    plan = loka.plan(report, max_error=0.5, assume_fast=True)
    assert "over.0" in plan.fp8_sites()
    baseline = copy.deepcopy(model)  # the same weights, trained without FP8
    loka.apply(model, plan)
    assert isinstance(model.over[0], loka.Linear) and isinstance(model.ebc, EmbeddingBagCollection)
    guard = loka.dispatch.Guard(model, plan, check_every=2)
    eval_batch = next(SyntheticCTR(spec, 1024, seed=99).torchrec())

    def ne(m):
        with torch.no_grad():
            return loka.data.normalized_entropy(m(eval_batch), eval_batch.labels, from_logits=True)

    start = ne(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, baseline)]
    for _, batch in zip(range(24), data):
        for m, o in zip((model, baseline), opts):
            loss = _loss(m, batch)
            loss.backward()
            if m is baseline or guard.step(loss):
                o.step()
            o.zero_grad()
    assert guard.events == []
    ne_fp8, ne_f32 = ne(model), ne(baseline)
    assert ne_fp8 < 0.9 * start  # it learned
    assert abs(ne_fp8 / ne_f32 - 1) < 0.02  # and FP8 trained it as float32 did


def test_reference_models_build_with_torchrec_tables():
    for name in ("dlrm", "interformer"):
        torch.manual_seed(0)
        plain = loka.models.build(name, "tiny")
        torch.manual_seed(0)
        tr = loka.models.build(name, "tiny", tables="torchrec")
        assert isinstance(tr.embedding_arch, TorchrecEmbeddingArch)
        assert isinstance(tr.embedding_arch.ebc, EmbeddingBagCollection)
        batch = next(SyntheticCTR(plain.feature_spec, 32, seed=2))
        # the same weights: the same logits (torchrec pools in float32, as nn.EmbeddingBag)
        torch.testing.assert_close(tr(batch), plain(batch), rtol=1e-6, atol=1e-6)
        # the same sites for LoKA
        assert ([n for n, m in tr.named_modules() if isinstance(m, nn.Linear)]
                == [n for n, m in plain.named_modules() if isinstance(m, nn.Linear)])
    arch = tr.embedding_arch
    kjt = to_kjt(batch.sparse, arch.names)
    torch.testing.assert_close(arch(kjt), arch(batch.sparse), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unknown tables 'fbgemm'"):
        loka.models.build("dlrm", "tiny", tables="fbgemm")
    bench = build_reference("wukong", "tiny", None, torch.device("cpu"), tables="torchrec")
    assert isinstance(bench.embedding_arch, TorchrecEmbeddingArch)
    assert not any(b.sparse for b in bench.embedding_arch.ebc.embedding_bags.values())
    big = loka.models.build("dlrm", "tiny", sparse_embeddings=True)
    assert use_torchrec_tables(big) == 1
    assert all(b.sparse for b in big.embedding_arch.ebc.embedding_bags.values())


DMP_SCRIPT = textwrap.dedent("""
    import json, math, os, sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1)
    import loka
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from loka.data import SyntheticCTR
    from loka.integrations import site_name, unwrap
    from test_torchrec import TorchrecCTR, _loss, _spec
    torch.manual_seed(0)
    spec = _spec()
    plain = TorchrecCTR(spec)
    plan = loka.dispatch.Plan.uniform(plain, "emulated-rowwise-e4m3", device="cpu")
    torch.manual_seed(0)
    dmp = DistributedModelParallel(TorchrecCTR(spec), device=torch.device("cpu"))
    wrapped = [n for n, m in dmp.named_modules() if isinstance(m, torch.nn.Linear)]
    inner = unwrap(dmp)
    probe_sites = sorted(loka.Probe(inner, loka.ProbeConfig(kernels=("bf16",)))._hooks.sites)
    # and on the wrapper itself: the same names, and the plan applies through it
    direct_sites = sorted(loka.Probe(dmp, loka.ProbeConfig(kernels=("bf16",)))._hooks.sites)
    report = loka.apply(dmp, plan)
    data = SyntheticCTR(spec, 32, seed=1).torchrec()
    losses = []
    opt = torch.optim.SGD(dmp.parameters(), lr=0.05)
    for _, batch in zip(range(3), data):
        loss = _loss(dmp, batch); loss.backward(); opt.step(); opt.zero_grad()
        losses.append(float(loss.detach()))
    print("RESULT " + json.dumps(dict(
        wrapped=wrapped, canon=[site_name(n) for n in wrapped], probe=probe_sites,
        direct=direct_sites,
        changed=sorted(report.changed),
        loka=sorted(n for n, m in dmp.named_modules() if isinstance(m, loka.Linear)),
        finite=all(math.isfinite(v) for v in losses))))
    dist.destroy_process_group()
""")


def test_distributed_model_parallel_keeps_site_names(tmp_path):
    """torchrec's DistributedModelParallel on the CPU (gloo, one rank, in a fresh process):
    LoKA sees the unwrapped model's site names, given ``unwrap(dmp)`` or the wrapper
    itself; a plan made on the plain model applies through the wrapper, and the wrapped
    model trains with loka.Linear inside."""
    script = tmp_path / "dmp.py"
    script.write_text(DMP_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as sock:  # a free port: other test runs may share the machine
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    proc = subprocess.run([sys.executable, str(script), port], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    sites = ["dense", "over.0", "over.2", "over.4"]
    assert out["wrapped"] == [f"_dmp_wrapped_module.module.{s}" for s in sites]
    assert out["canon"] == sites and sorted(out["probe"]) == sites == out["direct"]
    assert out["changed"] == ["over.0", "over.2", "over.4"]  # dense: K = 4 fits no FP8 kernel
    assert out["loka"] == [f"_dmp_wrapped_module.module.{s}" for s in sites[1:]]
    assert out["finite"] is True
