"""Linears that read one tensor: the Probe groups them (``producers['x_group']``), a static
plan gives them one input scale (the largest amax any of them observed), they hold one
scale table, and compiled code casts the tensor to FP8 once for all of them
(``loka::scaled_mm``, whose lowering makes each operand once per graph)."""

import importlib.util

import pytest
import torch
from torch import nn

import loka
from loka.config import ROLES, ProbeConfig
from loka.dispatch import Linear, Plan, RoleChoice
from loka.dispatch.static import amax_from_report, group_amax
from loka.jsonio import ReportError
from loka.kernels import ops, registry
from loka.probe.report import ProbeReport, SiteReport


class TwoOverTokens(nn.Module):
    """Wukong's pattern in plain PyTorch: a norm makes h (B, n, d); two Linears read hᵀ
    (over the token axis), a third reads h as rows, a fourth reads another tensor."""

    def __init__(self, n=16, d=32, k=16):
        super().__init__()
        self.project = nn.Linear(n, k, bias=False)
        self.mix = nn.Linear(n, k, bias=False)
        self.rows = nn.Linear(d, d, bias=False)
        self.other = nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        a = self.project(h.transpose(1, 2))                  # (B, d, k)
        b = self.mix(h.transpose(1, 2))                      # the same tensor, viewed again
        return a.sum() + b.sum() + self.rows(h).sum() + self.other(torch.tanh(h)).sum()


def _probed(model, x):
    with loka.Probe(model, ProbeConfig(progress=False, timing=False, num_samples=4,
                                       kernels=("bf16", "emulated-tensorwise-e4m3"))) as probe:
        model(x).backward()
    return probe


def test_the_probe_groups_the_linears_that_read_one_tensor():
    torch.manual_seed(0)
    model, x = TwoOverTokens(), torch.randn(8, 16, 32)
    probe = _probed(model, x)
    groups = {n: s.producers.get("x_group") for n, s in probe.sites.items()}
    assert groups == {"project": "project", "mix": "project", "rows": None, "other": None}
    report = probe.report()
    again = ProbeReport.from_dict(report.to_dict())
    assert again.sites["mix"].producers["x_group"] == "project"
    for bad in ("", 3):
        d = again.sites["mix"].to_dict()
        d["producers"]["x_group"] = bad
        with pytest.raises(ReportError, match="x_group"):
            SiteReport.from_dict(d)


def _site(name, amax, group=None):
    producers = {"x_group": group} if group else {}
    stats = {"act": {"amax": amax}} if amax is not None else {}
    return SiteReport(name, 16, 16, 64, stats=stats, producers=producers)


def test_a_group_takes_the_largest_amax_any_member_observed():
    report = ProbeReport(sites={s.name: s for s in (
        _site("a", 3.0, "a"), _site("b", 5.0, "a"), _site("c", None, "a"),
        _site("d", 2.0), _site("e", 7.0, "e"))})
    assert group_amax(report) == {"a": 5.0, "b": 5.0, "c": None, "d": 2.0, "e": 7.0}
    assert amax_from_report(report, margin=2.0) == {"a": 10.0, "b": 10.0, "d": 4.0, "e": 14.0}


def test_linears_with_equal_static_scales_hold_one_table():
    torch.manual_seed(0)
    lins = [Linear(32, 16, bias=False) for _ in range(3)]
    for lin in lins:
        lin.set_config(loka.LinearConfig(fwd="cublas-tensorwise"))
    lins[0].set_input_amax(4.0, rows=64)
    lins[1].set_input_amax(4.0, rows=64)
    lins[2].set_input_amax(5.0, rows=64)
    assert lins[0]._xs_table is lins[1]._xs_table
    assert lins[0]._xs_table is not lins[2]._xs_table
    assert lins[0]._xs_table.item() == pytest.approx(4.0 / 448)
    x = torch.randn(64, 32)
    alone = Linear(32, 16, bias=False)
    alone.load_state_dict(lins[1].state_dict())
    alone.set_config(loka.LinearConfig(fwd="cublas-tensorwise"))
    alone.set_input_amax(torch.tensor(4.0), rows=64)
    with torch.no_grad():  # one table or its own: the same FP8 values, the same output
        assert torch.equal(lins[1](x), alone(x))
    for lin in lins:  # made again on a dtype change, still one table for equal scales
        lin.to(torch.float64)
    assert lins[0]._xs_table is lins[1]._xs_table
    assert lins[0]._xs_table is not lins[2]._xs_table


def _fp8(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn)


def test_the_scaled_mm_op_is_torch_scaled_mm():
    a, w = _fp8((32, 64), 0), _fp8((48, 64), 1)
    tw = (torch.tensor(0.5), torch.tensor(0.25))
    rw = (torch.rand(32, 1) + 0.5, torch.rand(1, 48) + 0.5)
    rowwise_here = bool(registry.get("cublas-rowwise").device_ok("cpu"))
    for sa, sb in (tw, rw) if rowwise_here else (tw,):
        want = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        got = torch.ops.loka.scaled_mm(a, w.t(), sa, sb, torch.bfloat16, False)
        assert torch.equal(got, want)
    sa, sb = (rw if rowwise_here else tw)
    ref = (a.double() * sa.double()) @ (w.double().t() * sb.double())
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-2  # bf16 output rounding of an exact FP8 product
    meta = [t.to("meta") for t in (a, w.t(), *tw)]
    out = torch.ops.loka.scaled_mm(*meta, torch.bfloat16, False)  # the fake: shape, dtype
    assert out.shape == (32, 48) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="shapes do not match"):
        torch.ops.loka.scaled_mm(meta[0], meta[0], *meta[2:], torch.bfloat16, False)


def _served(model, x, amax):
    probe = _probed(model, x)
    plan = Plan.uniform(model, "cublas-tensorwise")
    for sp in plan.sites.values():  # serving: FP8 forwards, weights quantized once
        for role in ROLES[1:]:
            sp.roles[role] = RoleChoice(plan.baseline)
    shared = group_amax(probe.report())
    scales = {n: amax for n in ("project", "mix")} if amax else {
        n: v for n, v in shared.items() if n in ("project", "mix")}
    loka.apply(model, plan, inference=True, static_scales=scales)
    return model.eval()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Inductor's CUDA code generation needs triton")
def test_on_a_simulated_gpu_one_tensor_read_by_two_linears_is_cast_once(monkeypatch):
    """With one static scale, the two Linears over hᵀ read one FP8 copy of it: the step
    writes one byte per element of h less than with a copy per Linear (what
    ``torch._scaled_mm``'s exact-stride rule makes, ``loka::scaled_mm`` off)."""
    from loka.bench.stepcode import cuda_step_code, inventory

    def written(model, x):
        torch._dynamo.reset()
        codes = cuda_step_code(model, (x,), train=False)
        found = inventory(codes[0])
        assert len([l for l in found if l.kind == "gemm_fp8"]) == 4
        return sum(l.bytes_written for l in found if l.kind != "gemm_fp8")

    torch.manual_seed(0)
    x = torch.randn(64, 16, 256)
    model = _served(TwoOverTokens(16, 256, 32), x, amax=None)
    assert model.project._xs_table is model.mix._xs_table  # the group's one scale
    xb = x.to(torch.bfloat16)
    model = model.to(torch.bfloat16)
    once = written(model, xb)
    monkeypatch.setattr(ops, "_SCALED_MM_LOWERED", False)
    twice = written(model, xb)
    assert twice - once == pytest.approx(x.numel(), rel=0.01), (once, twice)


def test_compiled_on_the_cpu_the_op_serves_as_eager_does():
    """The lowering on Inductor's CPU back end: a compiled static step is bit-identical to
    the eager one (both call the same ``_scaled_mm`` on the same FP8 values)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32)
    model = _served(TwoOverTokens(), x, amax=6.0)

    def both(h):  # the two FP8 GEMMs over hᵀ
        return model.project(h.transpose(1, 2)), model.mix(h.transpose(1, 2))

    torch._dynamo.reset()
    with torch.no_grad():
        want = both(x)
        got = torch.compile(both)(x)
    assert ops.scaled_mm_lowered()
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def _timed_site(name, layout, group=None):
    """A forward of 1M rows timed on a GPU for ``cublas-tensorwise``: bf16 100 us, the call
    90 us, the weight-quantized forward 80 us, the GEMM alone 70 us; x laid out as
    ``layout``, its amax observed."""
    from loka.config import Role
    from loka.probe.report import KernelResult, RoleReport

    producers = {"x": "pointwise", "x_layout": layout}
    if group:
        producers["x_group"] = group
    kr = KernelResult("cublas-tensorwise", time_us=90.0, speedup=100 / 90,
                      timing="cuda-graph+compiled", time_us_weight_q=80.0, time_us_gemm=70.0)
    return SiteReport(name, 64, 32, ROWS, stats={"act": {"amax": 4.0}}, producers=producers,
                      roles={Role.FWD: RoleReport(Role.FWD, (ROWS, 64, 32), 100.0,
                                                  {"cublas-tensorwise": kr})})


ROWS = 1_000_000


def _copies_report():
    sites = [_timed_site("a", "copied", "a"), _timed_site("b", "copied", "a"),
             _timed_site("c", "copied"), _timed_site("d", "rows"), _timed_site("e", "copied")]
    return ProbeReport(sites={s.name: s for s in sites}, device="cuda",
                       device_name="NVIDIA H100 80GB HBM3")


def test_a_static_plan_is_credited_the_bytes_its_copies_of_strided_inputs_save():
    """``copy_savings_us``: each Linear over a strided x copies it in bf16 (2 bytes per
    element); a static FP8 plan writes one FP8 copy per group of Linears reading one tensor.
    Rows-laid inputs, dynamic or bf16 forwards and unknown devices save nothing here."""
    from loka.config import BASELINE, Role
    from loka.dispatch import SitePlan, copy_savings_us, predict_step

    report = _copies_report()
    sites = list(report.sites.values())
    plan = Plan(sites={s.name: SitePlan(s.name, 64, 32, ROWS, {
        Role.FWD: RoleChoice("cublas-tensorwise"), Role.DGRAD: RoleChoice(BASELINE),
        Role.WGRAD: RoleChoice(BASELINE)}) for s in sites}, device="cuda")
    plan.static_scales = {n: 4.0 for n in "abcd"}  # e keeps a dynamic scale
    n = ROWS * 64
    want = ((2 * n * 2 - n) + (n * 2 - n)) / 3.35e6  # group a+b, then c alone
    assert copy_savings_us(plan, report) == pytest.approx(want)
    serve = predict_step(plan, report, 1.0, inference=True)
    assert serve.copies_us == pytest.approx(want)
    # four static forwards at the GEMM alone (70 us), e at its weight-quantized call (80 us)
    assert serve.saved_ms == pytest.approx((4 * (100 - 70) + (100 - 80) + want) / 1e3)
    assert predict_step(plan, report, 1.0).copies_us == 0.0  # training: no such copies priced
    report.device_name = "cpu"
    assert copy_savings_us(plan, report) == 0.0


def test_repredict_recomputes_a_recorded_run_with_todays_prediction():
    """bench/repredict.py on the committed 16384 run: the recorded errors as the rows hold
    them, the copies priced, both steps predicted within 2% of what was measured."""
    import json
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "bench"))
    import repredict

    run = root / "bench/results/2026-12-06-h100-shared-copy/call5-public-path"
    report = ProbeReport.load(run / "w16384.wukong.b16384.report.json")
    plan = Plan.load(run / "w16384.wukong.b16384.plan.static.json")
    rows = json.loads((run / "w16384.json").read_text())["rows"]
    entries = repredict.repredict(report, plan, rows, "loka-optimize-static")
    assert [e["graphs"] for e in entries] == [False, True]
    lk = [r for r in rows if r["variant"] == "loka-optimize-static"]
    assert [e["recorded_error"] for e in entries] == [
        r["prediction"]["prediction_error"] for r in sorted(lk, key=lambda r: r["graphs"])]
    for e in entries:
        assert e["copies_us"] == pytest.approx(4 * 16384 * 256 * 64 * 3 / 3.35e6, rel=1e-3)
        assert abs(e["error"]) < 0.02 and abs(e["gpu_error"]) < 0.02
        assert e["recorded_gpu_error"] < -0.08  # before: the copies not priced


def test_the_static_serving_ceiling_counts_the_copies_too():
    """``fp8_ceiling(..., inference=True, static_scales=True)`` adds what the timed
    forwards' copies of strided inputs save to both ceilings; dynamic scales do not."""
    from loka.dispatch import fp8_ceiling

    report = _copies_report()
    n = ROWS * 64
    copies = ((2 * n * 2 - n) + 2 * (n * 2 - n)) / 3.35e6  # group a+b, c and e alone
    static = fp8_ceiling(report, 1.0, inference=True, static_scales=True)
    dynamic = fp8_ceiling(report, 1.0, inference=True)
    assert static.measured_speedup == pytest.approx(1 / (1 - (5 * 30 + copies) / 1e3))
    assert dynamic.measured_speedup == pytest.approx(1 / (1 - 5 * 10 / 1e3))  # the 90 us call
    saved = lambda c: (1 - 1 / c) * 1.0  # noqa: E731 - ms saved by a ceiling of a 1 ms step
    assert saved(static.roofline_speedup) - saved(dynamic.roofline_speedup) == \
        pytest.approx(copies / 1e3)
