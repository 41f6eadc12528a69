"""``loka demo --quick`` end to end: every stage runs, every file is written, and the two arms
are compared fairly (same checkpoint, same steps, same held-out batches)."""

import json
import math
import re

import pytest
import torch

from loka import cli
from loka.demo import DemoConfig
from loka.dispatch import Plan
from loka.kernels import registry
from loka.probe.report import ProbeReport

FILES = ("report.json", "plan.json", "report.html", "summary.md", "curves.json")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["demo", "--quick", "--out", str(out), "--device", "cpu"])
    return code, out, buf.getvalue()


@pytest.mark.slow
def test_demo_writes_every_file(demo):
    code, out, _ = demo
    assert code == 0
    for name in FILES:
        assert (out / name).stat().st_size > 0, name


@pytest.mark.slow
def test_summary_has_ne_for_both_arms(demo):
    _, out, stdout = demo
    md = (out / "summary.md").read_text()
    row = next(l for l in md.splitlines() if l.startswith("| held-out NE"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    base, loka = float(cells[1]), float(cells[2])
    for ne in (base, loka):
        assert 0.5 < ne < 1.5 and math.isfinite(ne)
    assert cells[3].endswith("%")
    assert float(cells[3][:-1]) == pytest.approx((loka - base) / base * 100, abs=0.011)
    header = next(l for l in md.splitlines() if l.startswith("|  | "))
    assert "fp32" in header and "LoKA" in header
    # the printed table matches the file, and the CPU run says it planned on error only
    assert re.search(rf"held-out NE \(lower is better\)\s+{cells[1]}\s+{cells[2]}", stdout)
    assert "plan was made on error only" in stdout and "assume_fast=True" in stdout
    assert "samples/s" not in md  # no speed is compared on the CPU


@pytest.mark.slow
def test_arms_are_compared_fairly(demo):
    _, out, _ = demo
    cfg = DemoConfig.quick()
    curves = json.loads((out / "curves.json").read_text())
    assert curves["branch_step"] == cfg.probe_steps
    base, loka = curves["arms"]["baseline"], curves["arms"]["loka"]
    total = cfg.probe_steps + cfg.steps
    for arm in (base, loka):
        assert arm["train"]["step"] == list(range(1, total + 1))
        assert len(arm["train"]["loss"]) == total
        assert all(math.isfinite(x) for x in arm["train"]["loss"])
    # one shared history up to the branch, bit for bit; different kernels after it
    b = cfg.probe_steps
    assert base["train"]["loss"][:b] == loka["train"]["loss"][:b]
    assert base["train"]["loss"][b:] != loka["train"]["loss"][b:]
    # evaluated at the same steps (on the same held-out batches)
    assert base["eval"]["step"] == loka["eval"]["step"] and base["eval"]["step"][-1] == total


@pytest.mark.slow
def test_report_and_plan_agree(demo):
    _, out, _ = demo
    report = ProbeReport.load(out / "report.json")
    plan = Plan.load(out / "plan.json")
    assert report.meta["model"] == "wukong/tiny" and report.device == "cpu"
    assert set(plan.sites) == set(report.sites) and len(plan.sites) > 0
    chosen = {sp.kernel(r) for sp in plan.sites.values() for r in ("fwd", "dgrad", "wgrad")}
    assert any(registry.get(k).is_fp8 for k in chosen)
    assert plan.budget["assume_fast"] is True  # the CPU plans on error alone
    html = (out / "report.html").read_text()
    assert "fp32" in html and "LoKA" in html and "https://" not in html


def test_quick_config_is_small():
    q = DemoConfig.quick()
    assert q.preset == "tiny" and q.probe_steps + q.steps <= 100
    with pytest.raises(ValueError, match="probe_steps"):
        DemoConfig(probe_steps=0)
    with pytest.raises(ValueError, match="min_speedup"):
        DemoConfig(min_speedup=0)


def test_the_default_cpu_kernels_leave_out_a_slow_cpu_scaled_mm(monkeypatch):
    """Where the CPU build's ``_scaled_mm`` is far slower than a float32 matmul, the default
    CPU list drops the kernels that call it and says so; a list given is kept as it is."""
    from loka.demo import runner
    from loka.demo.config import CPU_KERNELS, QUICK_KERNELS, DemoConfig
    from loka.kernels import capabilities as caps

    cpu = torch.device("cpu")
    real = [k for k in CPU_KERNELS if k in {x.name for x in registry.available(cpu)}]
    cublas = [k for k in real if registry.get(k).library is registry.Library.CUBLAS]
    assert cublas  # the CPU build has torch._scaled_mm
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: 3.0)
    assert runner._kernels(DemoConfig(), cpu) == (tuple(real), "")
    monkeypatch.setattr(caps, "cpu_scaled_mm_slowdown", lambda: 1613.0)
    kernels, note = runner._kernels(DemoConfig(), cpu)
    assert kernels == tuple(k for k in real if k not in cublas)
    assert note.startswith("this CPU's torch._scaled_mm takes 1613x") and cublas[0] in note
    given = DemoConfig(kernels=("bf16", cublas[0]))
    assert runner._kernels(given, cpu) == (("bf16", cublas[0]), "")
    # the quick demo's list adapts as the default one does
    kernels, note = runner._kernels(DemoConfig.quick(), cpu)
    assert set(QUICK_KERNELS) & set(cublas) and not set(kernels) & set(cublas) and note


def test_cpu_scaled_mm_slowdown_is_a_ratio_of_two_timings(monkeypatch):
    """A stand-in ``_scaled_mm`` that sleeps 20 ms against a float32 matmul of 32 x 32 x 32
    (microseconds): far above the demo's threshold; the real one gives a positive ratio."""
    import time

    from loka.kernels import capabilities as caps

    measure = caps.cpu_scaled_mm_slowdown.__wrapped__  # (uncached)
    real = measure(n=32, calls=1)
    assert real is None or real > 0
    if real is None:
        return
    mm = torch._scaled_mm

    def slow(a, b, **kw):
        time.sleep(0.02)
        return mm(a, b, **kw)
    monkeypatch.setattr(torch, "_scaled_mm", slow)
    assert measure(n=32, calls=2) > 50
