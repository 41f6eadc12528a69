"""Timing of one GEMM call (quantization included), the way LoKA runs it.

On CUDA the call is captured ``calls_per_graph`` times into a CUDA graph and the graph is
replayed, each replay timed by CUDA events (``'cuda-graph'``): host launch overhead is
removed, as it is in a graph-captured training step, so small shapes are judged by their
GPU time. If capture fails (a host sync inside the call, an op that cannot be captured)
each call is timed by events instead (``'cuda-events'``, which includes launch gaps). On
the CPU it is the wall-clock median of single calls (``'cpu-wallclock'``): useful for
smoke tests, not for decisions about GPUs. Inputs stay in cache between calls (the same
buffers every call), for the kernel and for its baseline alike, unless ``flush_l2`` evicts
the L2 cache before each call.

Whole steps (a training step, an inference forward) are timed by :func:`time_steps`: the
median of per-step CUDA-event times after warm-up, or wall-clock medians on the CPU.
:class:`CapturedStep` captures a whole step in one CUDA graph, as a training loop or a server
that replays its step does.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

__all__ = ["TimingResult", "time_fn", "time_steps", "synchronize",
           "release_rng_after_failed_capture", "CapturedStep", "capture_into"]


@dataclass(frozen=True)
class TimingResult:
    median_us: float
    """median time of one call, microseconds"""
    method: str
    """'cuda-graph', 'cuda-events' or 'cpu-wallclock'"""
    iters: int = 0
    """timed repetitions the median is taken over"""
    note: str = ""
    """why a fallback was taken, if one was"""
    calls_per_graph: int = 0
    """calls captured in each timed graph ('cuda-graph'; 0 otherwise)"""


MIN_ITERS = 5
"""a time budget never cuts the repetitions below this"""
GRAPH_REPLAY_US = 200.0
"""with a budget, enough calls go into one graph for a replay to last about this long
(:func:`graph_calls`)"""


def time_fn(fn: Callable[[], object], device: "torch.device | str", *, warmup: int = 10,
            iters: int = 50, calls_per_graph: int = 10,
            budget_ms: Optional[float] = None, flush_l2: bool = False) -> TimingResult:
    """Median time of ``fn()``.

    Args:
        fn: a closure over its inputs; its outputs are discarded.
        device: where it runs ('cpu' or a CUDA device).
        warmup: untimed calls first (allocator, cuBLAS handles, autotuning).
        iters: timed repetitions (graph replays on CUDA), at most.
        calls_per_graph: calls captured in one graph, at most; the replay time is divided
            by the number captured.
        budget_ms: if given, a call is timed once after the warm-up (on CUDA in a graph
            of its own) and ``iters`` (and the calls per graph, :func:`graph_calls`) are
            reduced so the timed part takes about this long, but never below
            :data:`MIN_ITERS` repetitions: slow calls are not timed 500 times.
        flush_l2: on CUDA, evict the device's L2 cache before every call (a write of twice
            its size, timed on its own and subtracted): the call reads its inputs from
            memory, as a call inside a step often does, instead of from the cache the
            previous call left warm; the note says so. Ignored on the CPU.

    Returns:
        TimingResult with the median per call.
    """
    if warmup < 0 or iters < 1 or calls_per_graph < 1 or (budget_ms is not None and budget_ms <= 0):
        raise ValueError(f"time_fn needs warmup >= 0, iters >= 1, calls_per_graph >= 1, "
                         f"budget_ms > 0; got {warmup}, {iters}, {calls_per_graph}, {budget_ms}")
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            if flush_l2:
                return _time_cold(fn, warmup, iters, calls_per_graph, budget_ms)
            return _time_cuda(fn, warmup, iters, calls_per_graph, budget_ms)
    if device.type != "cpu":
        raise ValueError(f"time_fn supports cpu and cuda devices, not {device.type}")
    for _ in range(warmup):
        fn()
    if budget_ms is not None:
        t0 = time.perf_counter()
        fn()
        iters = _fit(iters, budget_ms * 1e3, (time.perf_counter() - t0) * 1e6)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return TimingResult(statistics.median(times), "cpu-wallclock", iters)


def _fit(iters: int, budget_us: float, call_us: float) -> int:
    return max(min(iters, int(budget_us / max(call_us, 1e-3))), min(MIN_ITERS, iters))


def _events_median(run: Callable[[], None], iters: int, per: int) -> float:
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(iters)]
    for start, end in pairs:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 / per for s, e in pairs)


_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
"""one side stream per device for every timing: cuBLAS keeps a workspace per stream it has
seen, so a fresh stream per timing would leave one workspace allocated per timed kernel"""


def _side_stream() -> "torch.cuda.Stream":
    dev = torch.cuda.current_device()
    if dev not in _SIDE_STREAMS:
        _SIDE_STREAMS[dev] = torch.cuda.Stream()
    return _SIDE_STREAMS[dev]


def graph_calls(call_us: float, at_most: int) -> int:
    """Calls to capture in one graph for a call of ``call_us`` (its time in a one-call
    graph): enough that a replay lasts about :data:`GRAPH_REPLAY_US`, so that the graph's
    own launch (several microseconds) is spread over many calls, at most ``at_most``."""
    return max(1, min(at_most, math.ceil(GRAPH_REPLAY_US / max(call_us, 1e-3))))


def capture_into(graph: "torch.cuda.CUDAGraph", fn: Callable[[], object], side,
                 mode: str, pool=None) -> object:
    """Capture ``fn()`` into ``graph`` on the stream ``side`` in capture mode ``mode`` (in
    the memory pool ``pool``, default the graph's own) and return what it returned.
    capture_begin/end in try/finally, not ``torch.cuda.graph()``, whose exit skips restoring
    the stream when capture_end raises (a failed capture leaves the caller on its own
    stream), and which would also run ``gc.collect()`` and empty the allocator's cache."""
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode=mode)
        try:
            return fn()
        finally:
            graph.capture_end()


def _capture(fn, calls: int, side) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of ``fn``, replayed once (the first replay uploads
    it); raises if ``fn`` cannot be captured. Thread-local capture, so that other threads'
    CUDA calls neither break the capture nor fail because of it."""
    graph = torch.cuda.CUDAGraph()

    def repeated() -> None:  # each output dropped before the next call: the pool reuses it
        for _ in range(calls):
            fn()
    capture_into(graph, repeated, side, "thread_local")
    graph.replay()
    torch.cuda.synchronize()
    return graph


def release_rng_after_failed_capture(device: "torch.device | int | None" = None) -> None:
    """After a CUDA graph capture that failed, give the device's default RNG a fresh copy
    of its state (the same seed and offset). The failed capture can leave the state marked
    as capturing (torch 2.11 on an H100: every later random op on the device raised
    "Offset increment outside graph capture encountered unexpectedly"), which would break
    the user's own training after a Probe or a timing. The copy continues the same random
    stream, so it changes nothing where the state was fine."""
    index = device if isinstance(device, int) or device is None else torch.device(device).index
    gen = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    if hasattr(gen, "graphsafe_set_state") and hasattr(gen, "clone_state"):
        gen.graphsafe_set_state(gen.clone_state())


class CapturedStep:
    """A whole step captured in one CUDA graph at its first call and replayed at every call
    after: the host issues it in one launch, whatever it holds (Dynamo's guards, the
    compiled code's launches, custom ops, an optimizer's step), as a training loop or a
    server that captures its whole step runs it. Inductor's own CUDA graphs
    (``mode="reduce-overhead"``) capture the compiled graphs only, and check their inputs
    on every call; here the host's time per step is the replay's, the same for every plan.

    The first call runs ``warmup`` calls of ``step`` on a side stream (compiles, autotuning,
    cuBLAS handles: capture needs them done), then captures one call and replays it. Every
    call returns what the captured call returned: the graph's outputs, overwritten by the
    next replay. The step's inputs are what it closes over, refilled in place between calls
    if they change. A training step's optimizer must be capturable (``capturable=True``);
    a step that waits for the host (``.item()``, a shape that depends on values) cannot be
    captured: the first call raises a RuntimeError that says so, and the device's random
    state is left usable (:func:`release_rng_after_failed_capture`). CUDA only: ``device``
    of another type is a ValueError.
    """

    def __init__(self, step: Callable[[], object], device: "torch.device | str" = "cuda",
                 warmup: int = 3):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a captured step runs in a CUDA graph: the device is "
                             f"{device.type}, not cuda")
        if warmup < 1:
            raise ValueError(f"a captured step needs warmup >= 1 (its compile and allocations "
                             f"must happen before capture), got {warmup}")
        self.step, self.device, self.warmup = step, device, int(warmup)
        self.graph: Optional["torch.cuda.CUDAGraph"] = None
        self.out: object = None
        self.model = getattr(step, "model", None)  # what it runs, for whoever times it

    def warm_up(self) -> None:
        """The ``warmup`` calls, on the side stream capture will use (the first call runs
        them before :meth:`record`)."""
        with torch.cuda.device(self.device):
            side = _side_stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.step()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()

    def record(self) -> None:
        """Capture one call (after :meth:`warm_up`), on the side stream. Global capture
        mode, PyTorch's for whole-network capture: the backward runs on autograd's own
        thread, whose unsafe calls must fail the capture too."""
        with torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            try:
                out = capture_into(graph, self.step, _side_stream(), "global")
            except Exception as exc:
                release_rng_after_failed_capture(self.device)
                raise RuntimeError(
                    f"the step could not be captured in a CUDA graph ({type(exc).__name__}: "
                    f"{(str(exc).splitlines() or [''])[0][:200]}): a step that waits for "
                    f"the host (.item(), a shape that depends on values) or an optimizer "
                    f"without capturable=True cannot") from exc
            self.graph, self.out = graph, out

    def capture(self) -> None:
        """Warm up and capture (done by the first call)."""
        self.warm_up()
        self.record()

    def __call__(self) -> object:
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.out


def _time_cuda(fn, warmup: int, iters: int, per_graph: int, budget_ms) -> TimingResult:
    side = _side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        if budget_ms is not None:
            # The call's time in a one-call graph sizes the real one. (Not its eager time:
            # a call with a long Python path, a Triton launch, a custom op, would get one
            # call per graph and be charged the graph's whole launch.)
            one = _capture(fn, 1, side)
            call_us = _events_median(one.replay, 3, 1)
            del one
            per_graph = graph_calls(call_us, per_graph)
            iters = _fit(iters, budget_ms * 1e3, call_us * per_graph)
        graph = _capture(fn, per_graph, side)
    except Exception as exc:  # noqa: BLE001 - any capture failure means: time eagerly
        failure = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        release_rng_after_failed_capture()
    else:
        return TimingResult(_events_median(graph.replay, iters, per_graph), "cuda-graph", iters,
                            calls_per_graph=per_graph)
    torch.cuda.synchronize()
    if budget_ms is not None:
        iters = _fit(iters, budget_ms * 1e3, _events_median(fn, 2, 1))
    return TimingResult(_events_median(fn, iters, 1), "cuda-events", iters,
                        f"graph capture failed: {failure}")


_FLUSH: Dict[int, torch.Tensor] = {}
"""one eviction buffer per device (twice its L2 cache) for ``flush_l2`` timings"""


def _flush_buffer() -> torch.Tensor:
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 << 20
        _FLUSH[dev] = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    return _FLUSH[dev]


def _time_cold(fn, warmup: int, iters: int, per_graph: int, budget_ms) -> TimingResult:
    """:func:`_time_cuda` of ``flush; fn`` less that of ``flush`` alone, per call."""
    buf = _flush_buffer()

    def flush():
        buf.zero_()

    def flushed():
        flush()
        fn()
    both = _time_cuda(flushed, warmup, iters, per_graph, budget_ms)
    alone = _time_cuda(flush, warmup, both.iters, both.calls_per_graph or 1, None)
    us = max(both.median_us - alone.median_us, 0.0)
    note = (f"L2 flushed before each call ({alone.median_us:.1f} us per flush, subtracted)"
            + (f"; {both.note}" if both.note else ""))
    return TimingResult(us, both.method, both.iters, note, both.calls_per_graph)


def synchronize(device: "torch.device | str") -> None:
    """Wait for ``device``'s queued work (a no-op off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], object], device: "torch.device | str", steps: int,
               warmup: int, host: bool = False, synchronized: bool = False
               ) -> Dict[str, object]:
    """Times of ``steps`` calls of a whole step, after ``warmup`` untimed ones (compilation
    and CUDA-graph capture happen there), each call timed on its own.

    Args:
        step: one training step or forward; its outputs are discarded.
        device: where it runs; on CUDA each call is timed by CUDA events (launch gaps
            included, as a step pays them), elsewhere by the wall clock.
        steps: timed calls (at least one).
        warmup: untimed calls first.
        host: also measure ``host_ms`` (on CUDA, up to three more calls).
        synchronized: on CUDA, start each call on an idle device (wait for the one before),
            as a caller that waits for each step's result does (a serving request); its time
            is then the longer of the host's issue and the device's work. Default: calls
            issued back to back, as a loop that does not wait issues them, where a host
            faster than the device hides its cost. (Elsewhere each call runs as it is
            timed either way.)

    Returns:
        ``median_ms``, ``min_ms``, ``max_ms`` over the timed calls, ``warmup_s`` (the
        warm-up's wall-clock seconds), ``timing`` ('cuda-events' or 'cpu-wallclock'),
        ``synchronized`` (as asked) and, with ``host``, ``host_ms`` (on CUDA the host's
        time to issue one call from an idle device, median of up to three more calls;
        elsewhere the median call, whose work runs in it) and ``synchronized_ms`` (on CUDA
        those up to three calls' time from an idle device to their end: the step as a
        caller that waits for each result sees it, whichever way the timed calls were
        issued; elsewhere ``median_ms``).
    """
    device = torch.device(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize(device)
    warm_s = time.perf_counter() - t0
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(steps)]
        for start, end in events:
            if synchronized:
                synchronize(device)
            start.record()
            step()
            end.record()
        synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
        # the host's time to issue one step from an idle device (calls back to back could
        # fill the launch queue and wait for the device): near the step's own time, the
        # host sets the pace
        issue, awaited = [], []
        for _ in range(min(steps, 3) if host else 0):
            begin, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            begin.record()
            t = time.perf_counter()
            step()
            issue.append((time.perf_counter() - t) * 1e3)
            end.record()
            synchronize(device)
            awaited.append(begin.elapsed_time(end))  # the step from an idle device
    else:
        for _ in range(steps):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        issue = awaited = times  # the work runs in the call
    out = {"median_ms": statistics.median(times), "min_ms": min(times),
           "max_ms": max(times), "warmup_s": warm_s,
           "timing": "cuda-events" if device.type == "cuda" else "cpu-wallclock",
           "synchronized": bool(synchronized)}
    if host:
        out["host_ms"] = statistics.median(issue)
        out["synchronized_ms"] = statistics.median(awaited)
    return out
