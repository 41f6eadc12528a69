import contextlib

import pytest
import torch

from loka.timing import TimingResult, time_fn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("warmup,iters", [(0, 1), (3, 7)])
def test_cpu_wallclock_calls_and_labels(warmup, iters):
    calls = []
    a = torch.randn(32, 32)
    res = time_fn(lambda: calls.append(a @ a), "cpu", warmup=warmup, iters=iters)
    assert isinstance(res, TimingResult)
    assert res.method == "cpu-wallclock" and res.iters == iters
    assert len(calls) == warmup + iters
    assert res.median_us > 0


@pytest.mark.parametrize("kwargs", [dict(iters=0), dict(warmup=-1), dict(calls_per_graph=0)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="time_fn needs"):
        time_fn(lambda: None, "cpu", **kwargs)


def test_unsupported_device():
    with pytest.raises(ValueError, match="cpu and cuda"):
        time_fn(lambda: None, "meta")


@cuda
def test_cuda_graph_timing():
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    res = time_fn(lambda: a @ a, "cuda", warmup=3, iters=10)
    assert res.method == "cuda-graph" and res.median_us > 0 and not res.note
    assert res.calls_per_graph == 10


@cuda
def test_cuda_falls_back_to_events_when_capture_fails():
    a = torch.randn(256, 256, device="cuda")
    res = time_fn(lambda: (a @ a).sum().item(), "cuda", warmup=2, iters=5)  # a host sync
    assert res.method == "cuda-events" and "capture failed" in res.note and res.median_us > 0
    # the failed capture leaves the device's random numbers usable, on the same stream
    state = torch.cuda.get_rng_state()
    first = torch.randn(8, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(8, device="cuda"), first)
    # the device is usable afterwards
    assert float((a @ a).sum()) == pytest.approx(float((a.double() @ a.double()).sum()), rel=1e-3)


def test_budget_cuts_iterations_of_slow_calls_but_not_below_the_minimum():
    import time as _time

    calls = []

    def slow():
        calls.append(1)
        _time.sleep(0.004)

    res = time_fn(slow, "cpu", warmup=1, iters=50, budget_ms=20)
    assert res.iters == 5 and len(calls) == 1 + 1 + 5  # warm-up, estimate, minimum
    assert res.median_us >= 4000
    fast = time_fn(lambda: None, "cpu", warmup=0, iters=7, budget_ms=1000)
    assert fast.iters == 7  # never more than asked
    with pytest.raises(ValueError, match="budget_ms > 0"):
        time_fn(lambda: None, "cpu", budget_ms=0)


def test_graph_calls_spread_the_graph_launch_over_short_calls():
    """The calls per graph come from the call's time in a graph: a 5 us kernel gets the
    most allowed (its eager Python path, often 50-200 us for a Triton launch or a custom
    op, would have given it one or two, each charged the graph's whole launch), a 1 ms
    one a single call, never zero."""
    from loka.timing import GRAPH_REPLAY_US, graph_calls

    assert graph_calls(5.0, 10) == 10
    assert graph_calls(GRAPH_REPLAY_US / 4, 10) == 4
    assert graph_calls(1000.0, 10) == 1
    assert graph_calls(0.0, 3) == 3


@cuda
def test_cuda_budget_sizes_the_graph_by_its_graphed_time():
    """A short kernel behind a slow Python path gets the most calls per graph (sized by
    its graphed time, not its eager one)."""
    import time as _time

    a = torch.randn(256, 256, device="cuda")

    def slow_python_fast_kernel():
        _time.sleep(0.0005)  # 500 us of host time, invisible in a graph
        return a * 2

    res = time_fn(slow_python_fast_kernel, "cuda", warmup=2, iters=20, budget_ms=5)
    assert res.method == "cuda-graph" and res.calls_per_graph == 10


def test_flush_l2_is_ignored_on_the_cpu():
    calls = []
    res = time_fn(lambda: calls.append(1), "cpu", warmup=1, iters=3, flush_l2=True)
    assert res.method == "cpu-wallclock" and len(calls) == 4 and not res.note


def test_the_probe_times_with_a_cold_cache_when_asked(monkeypatch):
    """``ProbeConfig(cold_cache=True)`` reaches every timing, the baseline's too."""
    from loka.config import BASELINE, ProbeConfig, Role
    from loka.probe import measure

    seen = []

    def fake(fn, device, **kw):
        seen.append(kw["flush_l2"])
        fn()
        return TimingResult(1.0, "cpu-wallclock", 1)
    monkeypatch.setattr(measure, "time_fn", fake)
    for cold in (True, False):
        timer = measure.KernelTimer(ProbeConfig(cold_cache=cold, timing_compile="off"))
        for kernel in (BASELINE, "cublas-tensorwise"):  # (on every CPU build of torch)
            assert timer.time(kernel, Role.FWD, (16, 32, 16), torch.device("cpu"),
                              torch.float32).median_us == 1.0
    assert seen == [True, True, False, False]


@cuda
def test_a_cold_cache_makes_a_memory_bound_call_read_from_memory():
    """A copy of 8 MB fits the L2 of a large GPU: timed warm it reads the cache, timed cold
    it reads memory, so it is not faster cold; the flush's own time is subtracted."""
    a = torch.randn(2 << 20, device="cuda")
    out = torch.empty_like(a)
    warm = time_fn(lambda: out.copy_(a), "cuda", warmup=3, iters=20)
    cold = time_fn(lambda: out.copy_(a), "cuda", warmup=3, iters=20, flush_l2=True)
    assert cold.method == "cuda-graph" and "L2 flushed" in cold.note
    assert 0 < warm.median_us and cold.median_us >= 0.9 * warm.median_us


def test_after_a_failed_capture_the_devices_rng_gets_a_fresh_copy_of_its_state(monkeypatch):
    """(CPU, with stand-in generators; the GPU test above runs it for real.) The device's
    own generator, by index, by device or the current one, swaps its state for a clone."""
    from loka import timing

    class Gen:
        def __init__(self):
            self.state, self.set_to = object(), None

        def clone_state(self):
            return ("clone of", self.state)

        def graphsafe_set_state(self, s):
            self.set_to = s

    gens = [Gen(), Gen()]
    monkeypatch.setattr(torch.cuda, "default_generators", gens, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    timing.release_rng_after_failed_capture()
    assert gens[1].set_to == ("clone of", gens[1].state) and gens[0].set_to is None
    timing.release_rng_after_failed_capture(0)
    assert gens[0].set_to == ("clone of", gens[0].state)
    gens[0].set_to = None
    timing.release_rng_after_failed_capture(torch.device("cuda", 0))
    assert gens[0].set_to is not None


def test_time_steps_reports_the_hosts_time_per_step(monkeypatch):
    """A scripted clock, calls of 2, 4 and 3 ms after a warm-up: on the CPU the host's time
    to issue a step is the step's own, the median call."""
    import time as _time
    from loka import timing

    clock = [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: clock[0])

    costs = iter([0.001, 0.002, 0.004, 0.003])

    def step():
        clock[0] += next(costs)
    t = timing.time_steps(step, "cpu", steps=3, warmup=1, host=True)
    assert t["median_ms"] == pytest.approx(3.0) and t["host_ms"] == pytest.approx(3.0)
    assert t["synchronized_ms"] == pytest.approx(3.0)  # each CPU call runs as it is timed
    assert t["min_ms"] == pytest.approx(2.0) and t["max_ms"] == pytest.approx(4.0)
    # asked for only: timings that do not use it do not pay the extra calls on a GPU
    costs = iter([0.001, 0.002])
    assert "host_ms" not in timing.time_steps(step, "cpu", steps=1, warmup=1)
    assert t["timing"] == "cpu-wallclock"


@pytest.mark.parametrize("synchronized", [False, True])
def test_time_steps_on_cuda_waits_before_each_step_only_when_synchronized(monkeypatch,
                                                                          synchronized):
    """The CUDA path with its events and waits scripted: back to back, the steps are issued
    with no wait between them (one after the warm-up, one after the last step); synchronized,
    the device is idle before each step starts."""
    from loka import timing

    log = []

    class Event:
        count = 0

        def __init__(self, enable_timing=False):
            Event.count += 1
            self.n = Event.count

        def record(self):
            log.append(("record", self.n))

        def elapsed_time(self, end):
            return float(end.n - self.n)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append(("sync",)))
    t = timing.time_steps(lambda: log.append(("step",)), "cuda", steps=3, warmup=1,
                          synchronized=synchronized)
    assert t["synchronized"] is synchronized and t["timing"] == "cuda-events"
    assert t["median_ms"] == 1.0  # (each pair of scripted events is 1 apart)
    assert "synchronized_ms" not in t and "host_ms" not in t  # not asked
    timed = log[log.index(("sync",)):]  # from the warm-up's wait on
    steps = [i for i, e in enumerate(timed) if e == ("step",)]
    assert len(steps) == 3 and timed[-1] == ("sync",)
    waits_before = [timed[i - 2] == ("sync",) for i in steps]  # sync, record start, step
    # the first step starts after the warm-up's wait either way
    assert waits_before == [True] + [synchronized] * 2
    assert timed[1:].count(("sync",)) == (4 if synchronized else 1)


def test_time_steps_with_host_times_up_to_three_steps_from_an_idle_device(monkeypatch):
    """With ``host``, up to three more steps each start after a wait, between two events:
    their median is ``synchronized_ms``, beside the host's issue time."""
    from loka import timing

    log = []
    durations = iter([1.0] * 3 + [5.0, 7.0, 6.0])  # the 3 timed steps, then the 3 more

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("record")
            self.t = len(log)

        def elapsed_time(self, end):
            log.append("elapsed")
            return next(durations)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(timing, "synchronize", lambda device: log.append("sync"))
    t = timing.time_steps(lambda: log.append("step"), "cuda", steps=3, warmup=0, host=True)
    assert t["median_ms"] == 1.0 and t["synchronized_ms"] == 6.0 and t["host_ms"] >= 0
    # the three more: record, step, record, then the wait, and only then the reading
    tail = log[-15:]
    assert tail == ["record", "step", "record", "sync", "elapsed"] * 3


class _FakeCuda:
    """Stand-ins for the CUDA API :class:`loka.timing.CapturedStep` calls, on the CPU: a
    capture records what the step does instead of running it; a replay runs the record.
    ``stream`` is the current stream (a stream context sets it and sets it back), and each
    log entry of a step says which stream it ran on."""

    def __init__(self, monkeypatch, log, fail=None):
        from loka import timing

        fake = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name

            def wait_stream(self, other):
                log.append("wait")

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                assert fake.stream.name == "side"  # captured on the side stream
                fake.mode = capture_error_mode
                fake.capturing = True
                log.append("capture begins")

            def capture_end(self):
                fake.capturing = False
                log.append("capture ends")
                if fail is not None:
                    raise fail

            def replay(self):
                log.append("replay")

        @contextlib.contextmanager
        def stream(s):
            before, fake.stream = fake.stream, s
            try:
                yield
            finally:
                fake.stream = before

        self.capturing, self.mode = False, None
        self.default = self.stream = Stream("default")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: fake.stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(timing, "_SIDE_STREAMS", {})
        self.released = []
        monkeypatch.setattr(timing, "release_rng_after_failed_capture",
                            lambda device=None: self.released.append(device))


def test_a_captured_step_warms_up_captures_once_and_then_only_replays(monkeypatch):
    """The first call: ``warmup`` calls run, one is captured (not run) and the graph is
    replayed; every later call only replays, and returns the captured call's output."""
    from loka.timing import CapturedStep

    log = []
    fake = _FakeCuda(monkeypatch, log)
    out = torch.zeros(3)

    def step():
        log.append(("captured step" if fake.capturing else "step") + " on " + fake.stream.name)
        return out
    step.model = "the model"
    captured = CapturedStep(step, "cuda", warmup=2)
    assert captured.model == "the model"  # what it runs, for whoever times it
    assert captured() is out
    assert [e for e in log if "step" in e or e.startswith("capture") or e == "replay"] == [
        "step on side", "step on side", "capture begins", "captured step on side",
        "capture ends", "replay"]  # warm-up and capture off the caller's stream
    assert fake.mode == "global" and fake.stream is fake.default  # the caller's stream again
    log.clear()
    assert captured() is out and captured() is out
    assert log == ["replay", "replay"]  # no step runs on the host again


def test_a_step_that_cannot_be_captured_says_why_and_frees_the_random_state(monkeypatch):
    from loka.timing import CapturedStep

    log = []
    fake = _FakeCuda(monkeypatch, log,
                     fail=RuntimeError("operation not permitted when stream is capturing"))
    captured = CapturedStep(lambda: None, torch.device("cuda", 0), warmup=1)
    with pytest.raises(RuntimeError, match="could not be captured in a CUDA graph .*"
                       "operation not permitted.*capturable=True"):
        captured()
    assert fake.released == [torch.device("cuda", 0)] and captured.graph is None
    assert "replay" not in log
    assert fake.stream is fake.default  # the failed capture left the caller on its stream


@pytest.mark.parametrize("device, warmup, msg", [("cpu", 3, "the device is cpu, not cuda"),
                                                 ("cuda", 0, "needs warmup >= 1")])
def test_a_captured_step_refuses_bad_input(device, warmup, msg):
    from loka.timing import CapturedStep

    with pytest.raises(ValueError, match=msg):
        CapturedStep(lambda: None, device, warmup=warmup)


@cuda
def test_a_captured_training_step_replays_the_eager_steps():
    """A float32 MLP with capturable AdamW: five replays of the captured step (forward,
    loss, backward, optimizer) leave the weights of five eager steps (3 warm-up steps run
    first in both)."""
    from loka.timing import CapturedStep

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 1)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        x = torch.randn(128, 32, device="cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss
        return model, step
    eager, step = setup()
    for _ in range(3 + 1 + 5):  # warm-up, the captured call's replay, five more
        step()
    graphed, gstep = setup()
    captured = CapturedStep(gstep, "cuda", warmup=3)
    for _ in range(1 + 5):
        loss = captured()
    torch.cuda.synchronize()
    for a, b in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(loss)
