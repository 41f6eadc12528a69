"""The Probe's hooks (loka/probe/hooks.py): steps, statistics steps, sites, subsampling."""

import pytest
import torch

import loka
from loka.config import LinearConfig, ProbeConfig
from loka.probe import Probe

TW = "emulated-tensorwise-e4m3"


def _train(model, steps, probe=None, manual=False, extra=None):
    for i in range(steps):
        model(torch.randn(32, 16)).sum().backward()
        if extra:
            extra(model)
        if manual:
            probe.step()


@pytest.mark.parametrize("every,steps", [(1, 4), (3, 10), (4, 4), (100, 7)])
@pytest.mark.parametrize("manual", [False, True])
def test_statistics_are_taken_only_on_stats_steps(every, steps, manual, counting):
    model = counting()
    cfg = ProbeConfig(every_n_steps=every, progress=False)
    with Probe(model, cfg) as p:
        seen_hooks = []

        def check(m):  # after each step's backward: site hooks only while a stats step runs
            seen_hooks.append(len(m.a._forward_hooks))
        _train(model, steps, p, manual, extra=check)
    expected = len(range(0, steps, every))
    for site in p.sites.values():
        assert site.act.updates == expected and site.grad.updates == expected
        assert site.weight.snapshots == expected
    assert p.steps == steps and p.stats_steps == list(range(0, steps, every))
    assert seen_hooks == [1 if i % every == 0 else 0 for i in range(steps)]
    assert not model.a._forward_hooks and not model._forward_pre_hooks  # all removed


def test_eval_no_grad_and_repeated_calls_are_not_counted(counting):
    model = counting()
    with Probe(model, ProbeConfig(every_n_steps=2, progress=False)) as p:
        model.eval()
        model(torch.randn(4, 16))
        model.train()
        with torch.no_grad():
            model(torch.randn(4, 16))
        assert p.steps == 0
        x = torch.randn(32, 16)
        model.a(x)  # a submodule called on its own during step 0: counted once with it
        model(x).sum().backward()
        model(x).sum().backward()  # step 1: off
    assert p.steps == 2
    assert p.sites["a"].act.updates == 1 and p.sites["b"].act.updates == 1
    assert p.sites["a"].tokens == 32


def test_sites_filter_and_loka_linear(counting):
    model = counting()
    assert set(Probe(model).sites) == {"a", "b"}          # loka.Linear is an nn.Linear
    assert set(Probe(model, ProbeConfig(module_filter="^b")).sites) == {"b"}
    with pytest.raises(ValueError, match="no nn.Linear matching"):
        Probe(model, ProbeConfig(module_filter="nothing"))
    with pytest.raises(ValueError, match="regular expression"):
        Probe(model, ProbeConfig(module_filter="(["))
    with pytest.raises(KeyError, match="no kernel named"):
        Probe(model, ProbeConfig(kernels=("no-such-kernel",)))
    with pytest.raises(TypeError, match="nn.Module"):
        Probe("model")
    p = Probe(model).attach()
    with pytest.raises(RuntimeError, match="already attached"):
        p.attach()
    p.detach()


def test_probe_does_not_change_training(counting):
    def run(with_probe):
        torch.manual_seed(0)
        model = counting()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        batches = [torch.randn(300, 16) for _ in range(3)]
        ctx = Probe(model, ProbeConfig(every_n_steps=1, max_rows_per_update=64))
        if with_probe:
            ctx.attach()
        for x in batches:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        ctx.detach()
        return [p.detach().clone() for p in model.parameters()], torch.randn(3)

    (w1, r1), (w2, r2) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(w1, w2))
    assert torch.equal(r1, r2)  # the global random stream is untouched too


def test_row_subsampling_and_token_count(counting):
    model = counting()
    with Probe(model, ProbeConfig(every_n_steps=1, max_rows_per_update=50)) as p:
        model(torch.randn(6, 40, 16)).sum().backward()  # 240 rows of 16 features
    assert p.sites["a"].tokens == 240
    assert p.sites["a"].act.moments.count == 50 and p.sites["b"].grad.moments.count == 50


def test_loka_linear_with_fp8_kernels_is_probed():
    lin = loka.Linear(32, 32, config=LinearConfig.uniform(TW))
    with Probe(lin, ProbeConfig(every_n_steps=1, progress=False)) as p:
        lin(torch.randn(16, 32)).sum().backward()
    assert set(p.sites) == {""} and p.sites[""].grad.updates == 1
