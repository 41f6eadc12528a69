"""Where a step's wall time is not GPU time (``loka.bench.profiling``'s idle attribution):
idle intervals of a step window, and the host events the idle time is given to, on
hand-made timelines whose answers are known exactly."""

import math

import pytest

from loka.bench import profiling
from loka.bench.profiling import STEP_MARK, attribute_idle, idle_intervals, idle_summary


def test_idle_intervals_merge_overlapping_kernels_and_clip_to_the_window():
    kernels = [(12.0, 20.0), (18.0, 25.0), (40.0, 50.0), (95.0, 130.0), (-5.0, 2.0)]
    assert idle_intervals((0.0, 100.0), kernels) == [(2.0, 12.0), (25.0, 40.0), (50.0, 95.0)]
    # no kernel at all: the whole window is idle; a window fully covered: nothing
    assert idle_intervals((0.0, 10.0), []) == [(0.0, 10.0)]
    assert idle_intervals((0.0, 10.0), [(-1.0, 11.0)]) == []


def test_idle_time_goes_to_the_innermost_host_event_and_the_outer_phase():
    host = [("## Call CompiledFxGraph bwd ##", 0.0, 60.0),
            ("aten::mm", 10.0, 30.0),
            ("cudaLaunchKernel", 25.0, 30.0),
            ("Optimizer.step#AdamW.step", 70.0, 90.0)]
    parts = attribute_idle([(5.0, 35.0), (60.0, 80.0)], host)
    # 5-10 and 30-35 under the graph call itself, 10-25 under mm, 25-30 in mm's launch;
    # 60-70 under nothing, 70-80 under the optimizer
    assert parts["inner"] == {"## Call CompiledFxGraph bwd ##": 10.0, "aten::mm": 15.0,
                              "aten::mm > cudaLaunchKernel": 5.0, "(no host event)": 10.0,
                              "Optimizer.step#AdamW.step": 10.0}
    assert parts["outer"] == {"## Call CompiledFxGraph bwd ##": 30.0, "(no host event)": 10.0,
                              "Optimizer.step#AdamW.step": 10.0}
    total = sum(parts["inner"].values())
    assert math.isclose(total, 30.0 + 20.0) and math.isclose(sum(parts["outer"].values()), total)


def test_summary_splits_each_step_into_busy_lead_idle_and_tail():
    # two steps of 100 us: step 1 waits 20 us for its first launch, runs 20-60 and 70-90,
    # then synchronizes for 10 us; step 2 the same shifted by 200 us
    windows = [(0.0, 100.0), (200.0, 300.0)]
    kernels = [(20.0, 60.0), (70.0, 90.0), (220.0, 260.0), (270.0, 290.0)]
    host = [(STEP_MARK, 0.0, 100.0), ("TorchDynamo Cache Lookup", 0.0, 20.0),
            ("## Call CompiledFxGraph fwd ##", 20.0, 88.0), ("cudaDeviceSynchronize", 88.0, 100.0),
            (STEP_MARK, 200.0, 300.0), ("TorchDynamo Cache Lookup", 200.0, 220.0),
            ("## Call CompiledFxGraph fwd ##", 220.0, 288.0),
            ("cudaDeviceSynchronize", 288.0, 300.0)]
    s = idle_summary(windows, kernels, host)
    assert s["steps"] == 2
    assert s["wall_us"] == pytest.approx(100.0) and s["busy_us"] == pytest.approx(60.0)
    assert s["idle_us"] == pytest.approx(40.0)
    assert s["lead_us"] == pytest.approx(20.0) and s["tail_us"] == pytest.approx(10.0)
    # the step marker is never the answer; per step: 20 guards, 10 graph call, 10 sync
    assert dict(s["idle_by_host_event_us"]) == {"TorchDynamo Cache Lookup": 20.0,
                                                "## Call CompiledFxGraph fwd ##": 10.0,
                                                "cudaDeviceSynchronize": 10.0}
    assert s["idle_by_host_event_us"][0][0] == "TorchDynamo Cache Lookup"
    assert sum(v for _, v in s["idle_by_phase_us"]) == pytest.approx(s["idle_us"])


def test_idle_under_the_profilers_own_events_is_set_apart():
    host = [("Activity Buffer Request", 0.0, 30.0), ("TorchDynamo Cache Lookup", 30.0, 40.0)]
    s = idle_summary([(0.0, 100.0)], [(40.0, 100.0)], host)
    assert s["idle_us"] == pytest.approx(40.0) and s["profiler_us"] == pytest.approx(30.0)
    assert dict(s["idle_by_host_event_us"]) == {"TorchDynamo Cache Lookup": 10.0}


def test_the_profilers_own_work_is_its_own_phase_whatever_it_interrupted():
    host = [("Torch-Compiled Region: 0/0", 0.0, 100.0), ("Activity Buffer Request", 10.0, 40.0)]
    s = idle_summary([(0.0, 100.0)], [(60.0, 100.0)], host)
    assert s["profiler_us"] == pytest.approx(30.0)
    assert dict(s["idle_by_host_event_us"]) == {"Torch-Compiled Region: 0/0": 30.0}
    assert dict(s["idle_by_phase_us"]) == {"Torch-Compiled Region: 0/0": 30.0}


def test_the_timeline_keeps_device_work_and_leaves_out_gpu_side_annotations():
    """A record_function range also has a GPU-side span (a CUDA event flagged as a user
    annotation) from its first kernel to its last: counted as work it would hide the
    gaps between them."""
    from types import SimpleNamespace as E
    from torch.autograd import DeviceType

    def ev(name, t0, t1, dev, ann=False):
        return E(name=name, time_range=E(start=t0, end=t1), device_type=dev,
                 is_user_annotation=ann)
    events = [ev(STEP_MARK, 0.0, 100.0, DeviceType.CPU),
              ev("Torch-Compiled Region: 0/0", 5.0, 80.0, DeviceType.CPU),
              ev("Torch-Compiled Region: 0/0", 10.0, 95.0, DeviceType.CUDA, ann=True),
              ev("triton_poi_fused_0", 10.0, 20.0, DeviceType.CUDA),
              ev("Memcpy DtoD", 50.0, 60.0, DeviceType.CUDA),
              ev("nvjet_gemm", 90.0, 95.0, DeviceType.CUDA)]
    kernels, host, windows = profiling.timeline(events)
    assert kernels == [(10.0, 20.0), (50.0, 60.0), (90.0, 95.0)]
    assert windows == [(0.0, 100.0)] and len(host) == 2
    s = idle_summary(windows, kernels, host)
    assert s["idle_us"] == pytest.approx(75.0) and s["busy_us"] == pytest.approx(25.0)
    assert s["lead_us"] == pytest.approx(10.0) and s["tail_us"] == pytest.approx(5.0)


def test_a_step_whose_gpu_never_waits_has_no_idle_time():
    s = idle_summary([(0.0, 50.0)], [(0.0, 30.0), (29.0, 50.0)], [("x", 0.0, 50.0)])
    assert s["idle_us"] == 0.0 and s["lead_us"] == 0.0 and s["tail_us"] == 0.0
    assert s["idle_by_host_event_us"] == [] and s["busy_us"] == pytest.approx(50.0)


def test_no_steps_and_a_step_without_kernels():
    empty = idle_summary([], [], [])
    assert empty["steps"] == 0 and empty["wall_us"] == 0.0 and empty["idle_us"] == 0.0
    s = idle_summary([(0.0, 10.0)], [], [("aten::add", 2.0, 4.0)])
    # all idle; counted as lead time (before any kernel), not also as tail time
    assert s["idle_us"] == pytest.approx(10.0) and s["lead_us"] == pytest.approx(10.0)
    assert s["tail_us"] == 0.0
    assert dict(s["idle_by_host_event_us"]) == {"(no host event)": 8.0, "aten::add": 2.0}


def test_gpu_idle_reads_the_profilers_steps(monkeypatch):
    """The real profiler on the CPU (no kernels: every step all idle), its synchronizations
    made no-ops: one window per step, from the step marker, and the step's own operators
    among the host events the idle time went to."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    a = torch.randn(64, 64)

    def step():
        return (a @ a).relu().sum()

    s = profiling.gpu_idle(step, steps=3)
    assert s["steps"] == 3 and s["busy_us"] == 0.0
    assert s["idle_us"] == pytest.approx(s["wall_us"]) and s["wall_us"] > 0
    names = [n for n, _ in s["idle_by_host_event_us"]]
    assert any(n.startswith("aten::") for n in names)
    assert STEP_MARK not in names
