"""loka/probe/precompile.py: the timing pass's compiled calls compiled ahead in children."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

import loka
from loka.config import ProbeConfig, Role
from loka.kernels.registry import get
from loka.probe import precompile
from loka.probe.measure import KernelTimer, _Measurement
from loka.probe.precompile import Entry, Precompile

KERNELS = ("bf16", "cublas-tensorwise", "cublas-rowwise")


def _model(linears=2):
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)]
    return nn.Sequential(*layers[:2 * linears - 1])


def _probe(workers, roles=("fwd",), kernels=KERNELS, linears=2, **kw):
    batches = [torch.randn(64, 32, generator=torch.Generator().manual_seed(i))
               for i in range(3)]
    cfg = ProbeConfig(timing_compile="on", precompile_workers=workers, kernels=kernels,
                      roles=roles, num_samples=2, bootstrap=0, timing_iters=2,
                      timing_warmup=1, timing_budget_ms=None, progress=False, **kw)
    return loka.probe(_model(linears), batches, lambda m, b: m(b).square().mean(), config=cfg)


def test_workers_default_to_none_on_the_cpu_and_are_capped():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert precompile.workers_for(ProbeConfig(), cpu, 10) == 0
    n = precompile.workers_for(ProbeConfig(), cuda, 100)
    assert 1 <= n <= precompile.MAX_WORKERS
    assert precompile.workers_for(ProbeConfig(), cuda, 1) == 1  # never more than entries
    assert precompile.workers_for(ProbeConfig(precompile_workers=3), cpu, 10) == 3
    assert precompile.workers_for(ProbeConfig(precompile_workers=3), cpu, 2) == 2
    assert precompile.workers_for(ProbeConfig(precompile_workers=0), cuda, 10) == 0
    with pytest.raises(ValueError, match="precompile_workers"):
        ProbeConfig(precompile_workers=-1)
    assert precompile.start([], cpu, ProbeConfig(precompile_workers=2)) is None


def test_the_compile_plan_is_what_the_timing_pass_compiles():
    """Each compiled kernel once per timed shape, forwards also with the weight quantized;
    no baseline, no kernel that times eagerly, no duplicate for repeated shapes."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 64))
    batches = [torch.randn(64, 32) for _ in range(2)]
    cfg = ProbeConfig(timing_compile="on", precompile_workers=0, kernels=KERNELS,
                      num_samples=2, bootstrap=0, progress=False)
    probe = loka.Probe(model, config=cfg)
    with probe:
        for b in batches:
            model(b).square().mean().backward()
    run = _Measurement(cfg)
    works = [run.plan_site(n, probe.sites[n], probe.modules[n], torch.device("cpu"))
             for n in probe.sites]
    entries = run.compile_plan(works)
    assert len(set(entries)) == len(entries)
    # the FP8 kernels of this CPU (torch 2.11's build has no rowwise _scaled_mm here)
    assert {e.kernel for e in entries} == {k for k in KERNELS[1:] if get(k).device_ok("cpu")}
    # two distinct (role, shape) per role of the 32->64 and 64->64 Linears: 2 x 3 = 6,
    # the 64->64 twice (one entry); forwards once more with the weight quantized
    shapes = {(e.role, e.shape) for e in entries}
    assert ("fwd", (64, 32, 64)) in shapes and ("wgrad", (64, 64, 64)) in shapes
    per_kernel = [e for e in entries if e.kernel == "cublas-tensorwise"]
    fwd = [e for e in per_kernel if e.role == "fwd"]
    assert sorted(e.weight_q for e in fwd) == [False, False, True, True]
    assert len(per_kernel) == len({(e.role, e.shape, e.weight_q) for e in per_kernel})
    assert all(e.dtype == "float32" for e in entries)
    off = _Measurement(ProbeConfig(timing_compile="off", kernels=KERNELS, progress=False))
    assert off.compile_plan([off.plan_site(n, probe.sites[n], probe.modules[n],
                                           torch.device("cpu")) for n in probe.sites]) == []


_RUN = """
import json, sys
from torch._dynamo.utils import counters
from loka.config import Role
from tests.probe.test_precompile import _probe
report = _probe(int(sys.argv[1]), kernels=("bf16", "cublas-tensorwise"), linears=1)
kinds = sorted({kr.timing for s in report.sites.values()
                for name, kr in s.roles[Role.FWD].kernels.items() if name != "bf16"})
print(json.dumps({"pre": report.meta.get("precompile"), "inductor": dict(counters["inductor"]),
                  "spent": report.meta["spent"],
                  "timings": kinds, "sites": sorted(report.sites)}))
"""


def _run_probe(workers: int, cache) -> dict:
    """A Probe in a process of its own (as a user runs it) on a fresh compile cache."""
    import os

    from tests.conftest import ROOT

    out = subprocess.run([sys.executable, "-c", _RUN, str(workers)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_children_compile_what_the_parent_then_loads(tmp_path):
    """A fresh cache: with one child, every graph the timing pass compiles is an FX graph
    cache hit in the parent; without, the parent compiles (misses) the same graphs."""
    got = _run_probe(1, tmp_path / "cache")
    pre = got["pre"]
    assert pre["workers"] == 1 and pre["failed"] == 0 and pre["timed_out"] == 0
    # one Linear (32->64) x (fwd, fwd with the weight quantized)
    assert pre["compiled"] == pre["entries"] == 2
    assert got["inductor"].get("fxgraph_cache_hit") == 2
    assert got["inductor"].get("fxgraph_cache_miss", 0) == 0
    # the report says so: every graph of the timing pass loaded from the children's cache
    assert (got["spent"]["fxgraph_hits"], got["spent"]["fxgraph_misses"]) == (2, 0)
    assert got["timings"] == ["cpu-wallclock+compiled"]  # every FP8 kernel timed compiled
    alone = _run_probe(0, tmp_path / "cache2")
    assert alone["pre"] is None
    assert alone["inductor"].get("fxgraph_cache_miss") == 2
    assert alone["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert (alone["spent"]["fxgraph_hits"], alone["spent"]["fxgraph_misses"]) == (0, 2)
    assert alone["spent"]["fxgraph_bypasses"] == 0
    assert alone["sites"] == got["sites"] == ["0"]


def test_warm_reports_what_failed_and_goes_on():
    done, failed = precompile.warm(
        [Entry("no-such-kernel", "fwd", (16, 16, 16), "float32", False),
         Entry("bf16", "fwd", (16, 32, 16), "float32", False)], torch.device("cpu"))
    assert done == 1 and len(failed) == 1 and "no-such-kernel" in failed[0]


def test_wait_reports_a_crashed_child_and_stops_a_slow_one(tmp_path):
    bad = subprocess.Popen([sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                           stdout=open(tmp_path / "out0.log", "w"), stderr=subprocess.STDOUT)
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ok = tmp_path / "out2.json"
    ok.write_text(json.dumps({"compiled": 2, "failed": ["x fwd: E"], "seconds": 1.0}))
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    pre = Precompile([Entry("k", "fwd", (1, 1, 1), "float32", False)] * 4,
                     [(bad, tmp_path / "out0.json"), (slow, tmp_path / "out1.json"),
                      (done, ok)], str(tmp_path / "work"))
    out = pre.wait(timeout=3.0)
    assert out["workers"] == 3 and out["timed_out"] == 1
    assert out["compiled"] == 2 and out["failed"] == 1
    assert any(e.startswith("child exited 3: boom") for e in out["errors"])
    assert slow.poll() is not None  # stopped
    pre.stop()
    pre.stop()  # idempotent


def test_cache_off_skips_the_children():
    from torch._inductor import config as inductor_config

    # (patch, not monkeypatch: setting the option back by hand would force the cache on)
    with inductor_config.patch(fx_graph_cache=False):
        pre = precompile.start([Entry("cublas-tensorwise", "fwd", (16, 16, 16), "float32",
                                      False)], torch.device("cpu"),
                               ProbeConfig(precompile_workers=2))
    out = pre.wait()
    assert out["workers"] == 0 and "FX graph cache is off" in out["skipped"]
    pre.stop()


def test_process_state_carries_changed_options_to_a_child():
    from torch._inductor import config as inductor_config

    with inductor_config.patch(realize_reads_threshold=3):
        state = precompile.process_state()
    assert state["inductor"]["realize_reads_threshold"] == 3
    json.dumps(state)  # what the spec file carries
    child = ("import json, sys; from loka.probe import precompile as p; "
             "from torch._inductor import config as c; "
             "p._apply_state(json.loads(sys.argv[1])); print(c.realize_reads_threshold)")
    out = subprocess.run([sys.executable, "-c", child, json.dumps(state)], check=True,
                         capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "3"


def test_the_timer_estimate_is_not_kept():
    timer = KernelTimer(ProbeConfig(progress=False))
    us = timer.estimate("bf16", Role.FWD, (16, 32, 16), torch.device("cpu"), torch.float32)
    assert us is not None and us > 0
    assert timer._results == {}
    assert timer.estimate("no-such-kernel", Role.FWD, (16, 32, 16), torch.device("cpu"),
                          torch.float32) is None


@pytest.fixture
def fake_triton():
    """Kernels registered as LoKA Triton kernels on the CPU (the emulated rowwise kernel's
    numerics; one of them returns zeros, far over any error budget), their calls' operand
    shapes recorded."""
    from loka.kernels import Kernel, register, unregister
    real = get("emulated-rowwise-e4m3")
    calls = {"test-triton-ok": [], "test-triton-bad": []}

    def make(name, zero):
        def fn(a, b, out):
            calls[name].append((tuple(a.shape), tuple(b.shape), type(b).__name__))
            y = real.fn(a, b, out)
            return torch.zeros_like(y) if zero else y
        register(Kernel(name, fn, library="triton", formats=real.formats,
                        scaling=real.scaling, quantize_a=real.quantize_a,
                        quantize_b=real.quantize_b))
    make("test-triton-ok", False)
    make("test-triton-bad", True)
    yield calls
    for name in calls:
        unregister(name)


def test_tune_ahead_calls_each_timed_triton_kernel_once_at_its_timed_shape(fake_triton):
    """After the errors, each Triton kernel the timing pass will time is called once per
    timed variant (the forward also with its weight quantized) on the timer's own operands;
    a kernel over the error budget and every compiled or non-Triton kernel are not."""
    calls = fake_triton
    model = _model()
    cfg = ProbeConfig(timing_compile="on", precompile_workers=0, num_samples=2, bootstrap=0,
                      progress=False, kernels=("bf16", "cublas-tensorwise", "test-triton-ok",
                                               "test-triton-bad"))
    probe = loka.Probe(model, config=cfg)
    with probe:
        model(torch.randn(64, 32)).square().mean().backward()
    run = _Measurement(cfg)
    works = [run.plan_site(n, probe.sites[n], probe.modules[n], torch.device("cpu"))
             for n in probe.sites]
    for w in works:
        run.errors(w)
    calls["test-triton-ok"].clear()
    calls["test-triton-bad"].clear()
    assert run.tune_ahead(works) == 2 * 4  # 2 Linears x (fwd, fwd weight-q, dgrad, wgrad)
    assert calls["test-triton-bad"] == []
    got = calls["test-triton-ok"]
    # fwd (64, 32) x (32, 64) of the first Linear; its weight quantized once (a QTensor)
    assert ((64, 32), (32, 64), "Tensor") in got and ((64, 32), (32, 64), "QTensor") in got
    assert ((64, 64), (64, 32), "Tensor") in got  # the first Linear's dgrad
    assert "tune_ahead" in run.phases
    # the timing pass then runs on the same operand pairs
    assert len(run.timer._operands) == len({(rw.role, rw.shape) for w in works
                                            for rw in w.roles})
    off = _Measurement(ProbeConfig(timing=False, kernels=cfg.kernels, progress=False))
    assert off.tune_ahead(works) == 0


def test_the_probe_tunes_ahead_only_while_children_compile(fake_triton, monkeypatch):
    """Tuned ahead where a child is still compiling once the errors are done, not where
    none is (no children, or all done), nor with ``tune_ahead=False``. The children are
    stood in for (what a real one compiles is tested above; whether it is still running
    after the errors depends on the machine's speed)."""
    kernels = ("bf16", "cublas-tensorwise", "test-triton-ok")
    state = {"running": True, "started": []}

    class Children:
        def __init__(self, entries):
            self.entries = list(entries)

        def running(self):
            return state["running"]

        def wait(self, status=None):
            return {"entries": len(self.entries), "workers": 1, "compiled": 0}

        def stop(self):
            pass

    def start(entries, device, config):
        state["started"].append(len(entries))
        return Children(entries) if config.precompile_workers else None
    monkeypatch.setattr(precompile, "start", start)
    with_children = _probe(1, kernels=kernels)
    assert with_children.meta["precompile"]["entries"] == 4  # 2 Linears x 2 variants
    assert with_children.meta["tuned_ahead"] == 2 * 2  # 2 Linears' forwards, 2 variants
    assert "tune_ahead" in with_children.meta["phases_s"]
    alone = _probe(0, kernels=kernels)
    assert alone.meta["tuned_ahead"] == 0 and "tune_ahead" not in alone.meta["phases_s"]
    off = _probe(1, kernels=kernels, tune_ahead=False)
    assert off.meta["tuned_ahead"] == 0 and off.meta["precompile"]["entries"] == 4
    state["running"] = False
    done = _probe(1, kernels=kernels)
    assert done.meta["tuned_ahead"] == 0 and done.meta["precompile"]["entries"] == 4
    assert state["started"] == [4] * 4
    for rep in (with_children, alone, off, done):  # the kernel is timed either way
        kr = rep.sites["0"].roles[Role.FWD].kernels["test-triton-ok"]
        assert kr.time_us > 0 and kr.time_us_weight_q > 0


def test_state_changes_names_each_setting_that_moved():
    before = {"inductor": {"a": 1}, "functorch": {}, "matmul": {"fp32_precision": "none",
                                                              "allow_tf32": False},
              "deterministic": False}
    after = {"inductor": {"a": 1, "b": 2}, "functorch": {},
             "matmul": {"fp32_precision": "ieee", "allow_tf32": False}, "deterministic": True}
    assert precompile.state_changes(before, after) == [
        "deterministic", "inductor.b", "matmul.fp32_precision"]
    assert precompile.state_changes(before, before) == []


@pytest.fixture
def matmul():
    """``torch.backends.cuda.matmul`` with ``fp32_precision`` at 'none', set back after."""
    flags = torch.backends.cuda.matmul
    if not hasattr(flags, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision")
    prev = flags.fp32_precision
    flags.fp32_precision = "none"
    try:
        yield flags
    finally:
        flags.fp32_precision = prev


def test_wait_says_when_the_parents_cache_keys_moved_after_the_children_started(matmul):
    """The float32 matmul precision is part of the compile caches' keys: a parent that
    moves it after starting its children loads nothing they compiled."""
    pre = Precompile([], [], None, state=precompile.process_state())
    assert pre.wait()["state_changed"] == []
    matmul.fp32_precision = "ieee"  # TF32 off as well, under another name
    assert pre.wait()["state_changed"] == ["matmul.fp32_precision"]


def test_the_state_names_only_the_matmul_flag_that_moved_and_a_child_takes_it(matmul):
    """Where this torch has ``fp32_precision``, the state carries it and not the legacy
    ``allow_tf32`` (which torch refuses to read once the two were set apart), so moving it
    names one flag; a child applies it."""
    before = precompile.process_state()
    assert "allow_tf32" not in before["matmul"]
    matmul.fp32_precision = "tf32"
    after = precompile.process_state()
    assert precompile.state_changes(before, after) == ["matmul.fp32_precision"]
    matmul.fp32_precision = "none"
    precompile._apply_state(after)  # as a child does
    assert matmul.fp32_precision == "tf32"


def test_the_probe_warns_when_its_children_compiled_under_other_keys(monkeypatch):
    class Moved:
        def running(self):
            return False

        def wait(self, status=None):
            return {"entries": 1, "workers": 1, "compiled": 1, "failed": 0, "timed_out": 0,
                    "errors": [], "wall_s": 0.0, "waited_s": 0.0,
                    "state_changed": ["matmul.fp32_precision"]}

        def stop(self):
            pass

    monkeypatch.setattr(precompile, "start", lambda *a, **k: Moved())
    with pytest.warns(UserWarning, match=r"compile caches changed .*matmul\.fp32_precision"):
        report = _probe(1, kernels=("bf16", "cublas-tensorwise"))
    assert report.meta["precompile"]["state_changed"] == ["matmul.fp32_precision"]
