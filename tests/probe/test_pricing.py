"""The step-aware Probe: where each site's operands come from (read from the autograd graph
of a user's model), the price of a quantization by its producer, and the step predicted
from it, against scripted timings."""

import pytest
import torch
from torch import nn

import loka
from loka.config import BASELINE, ProbeConfig, Role
from loka.dispatch import Plan, RoleChoice, SitePlan, predict_step
from loka.jsonio import ReportError
from loka.kernels import get
from loka.probe import measure
from loka.probe.hooks import SiteCollector
from loka.probe.pricing import FUSED_SHARE, serve_time_us, split_quantization, step_time_us
from loka.probe.producers import consumer_kind, consumers_of_outputs, producer_of
from loka.probe.report import KernelResult, ProbeReport, RoleReport, SiteReport
from loka.timing import TimingResult
from tests.support import need_kernel

ROWWISE, TENSORWISE = "cublas-rowwise", "cublas-tensorwise"


class OwnNorm(nn.Module):
    """A user's RMS norm (not a class LoKA knows)."""

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class UserModel(nn.Module):
    """Embedding bag -> l0 -> Hard Swish -> l1 -> l2 (straight after l1, on a 3-D view)
    -> own norm + residual -> l3 -> out (the model's output)."""

    def __init__(self, d=32):
        super().__init__()
        self.emb = nn.EmbeddingBag(50, d, mode="sum")
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(d, d) for _ in range(4))
        self.norm = OwnNorm()

    def forward(self, ids):
        h = self.l1(nn.functional.hardswish(self.l0(self.emb(ids))))
        y = self.l2(h.view(-1, 2, h.shape[-1]))
        return self.l3(self.norm(y) + y).sum(-1)


def _kinds(producers):
    """The producer kinds of x and dy, without ``x_users``, ``x_layout`` and ``x_group``."""
    return {k: v for k, v in producers.items() if k not in ("x_users", "x_layout", "x_group")}


def _ids(n=16):
    return torch.randint(0, 50, (n, 3), generator=torch.Generator().manual_seed(0))


def test_producers_are_read_from_a_user_models_autograd_graph():
    model = UserModel()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(_ids()).pow(2).mean().backward()
    got = {name: site.producers for name, site in probe.sites.items()}
    one = {"x_users": "single", "x_layout": "rows"}  # read by its Linear alone, as rows
    assert got == {
        "l0": {"x": "other", "dy": "pointwise", **one},      # embedding bag; Hard Swish's backward
        "l1": {"x": "pointwise", "dy": "gemm", **one},       # l2's input gradient, through a view
        "l2": {"x": "gemm", "dy": "pointwise", **one},       # norm and residual: two users, summed
        "l3": {"x": "pointwise", "dy": "pointwise", **one},  # the sum over the last dim
    }
    # the kinds travel in the report and survive its JSON
    rep = probe.report()
    assert rep.sites["l1"].producers == {"x": "pointwise", "dy": "gemm", **one}
    again = ProbeReport.from_dict(rep.to_dict())
    assert {n: s.producers for n, s in again.sites.items()} == got


class SharedInputs(nn.Module):
    """h feeds two Linears (a and b); z, a norm's output, feeds c and the residual; d's
    input is read by d alone, through a view."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(d, d) for _ in range(4))
        self.norm = OwnNorm()
        self.gain = nn.Parameter(torch.full((d,), 2.0))

    def forward(self, x):
        h = torch.relu(x * self.gain)
        z = self.norm(self.a(h) + self.b(h))
        u = self.c(z) + z
        return self.d(torch.tanh(u).view(2, -1, u.shape[-1])).sum()


def test_whether_ops_besides_its_linear_read_x_is_read_from_the_graph():
    """A residual or a second Linear makes x 'shared' (its bf16 copy is written whatever
    the GEMM's quantization does); a serving price then keeps the training share."""
    model = SharedInputs()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(16, 32)).backward()
    got = {n: s.producers.get("x_users") for n, s in probe.sites.items()}
    assert got == {"a": "shared", "b": "shared", "c": "shared", "d": "single"}
    again = ProbeReport.from_dict(probe.report().to_dict())
    assert again.sites["c"].producers["x_users"] == "shared"
    d = again.sites["d"].to_dict()
    d["producers"]["x_users"] = "twice"
    with pytest.raises(ReportError, match="x_users"):
        SiteReport.from_dict(d)
    fused = {"x": "pointwise", "x_users": "single"}
    alone = serve_time_us(get(TENSORWISE), time_us_weight_q=13.0, time_us_gemm=10.0,
                          producers=fused, compiled=True)
    shared = serve_time_us(get(TENSORWISE), time_us_weight_q=13.0, time_us_gemm=10.0,
                           producers={**fused, "x_users": "shared"}, compiled=True)
    assert (alone, shared) == (pytest.approx(13 - 3 * (1 - 1 / 5)),
                               pytest.approx(13 - 3 * (1 - 3 / 5)))


def test_a_model_output_and_plain_tensors_are_their_own_kinds():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    assert producer_of(x) == "input"
    assert producer_of(torch.randn(4, 8, requires_grad=True)) == "input"  # a leaf
    y = lin(x)
    consumers = consumers_of_outputs({"out": [y]})
    assert consumer_kind(y.grad_fn, consumers) == "output"
    assert consumer_kind(lin(x).grad_fn, consumers) is None  # not in the walked graph
    # an applied FP8 Linear's output is a GEMM's
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    loka.apply(model, Plan.uniform(model, "emulated-rowwise-e4m3"))
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(16, 32)).sum().backward()
    assert _kinds(probe.sites["1"].producers) == {"x": "gemm", "dy": "output"}
    assert _kinds(probe.sites["0"].producers) == {"x": "input", "dy": "gemm"}


def test_gradients_handed_on_unchanged_are_traced_to_the_op_that_made_them():
    """``a(x) + pos -> b``: the add's backward hands b's input gradient (made by b's GEMM)
    to a unchanged, so a's dy is a GEMM's; an embedding pooled by a sum is not a producer
    a row quantization fuses into; a sum consuming y makes dy by a broadcast."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
            self.pos = nn.Parameter(torch.randn(32))

        def forward(self, ids):
            return self.b(self.a(self.emb(ids).sum(1)) + self.pos).sum(-1)

    model = Net()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(_ids()).pow(2).mean().backward()
    assert _kinds(probe.sites["a"].producers) == {"x": "other", "dy": "gemm"}
    assert _kinds(probe.sites["b"].producers) == {"x": "pointwise", "dy": "pointwise"}


class BlockRms(nn.Module):
    """A user's RMS norm over blocks of the row (as the paper's BlockNorm), in float32."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        b = x.float().unflatten(-1, (x.shape[-1] // self.block, self.block))
        return (b * (b.square().mean(-1, keepdim=True) + 1e-6).rsqrt()).flatten(-2).to(x.dtype)


def _x_kind(make_x, d=32):
    """The producer kind of a Linear's input ``make_x(y)``, y out of a GEMM (a Probe over
    a two-Linear model)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            return self.b(make_x(self.a(x))).sum()

    model = Net()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(8, d)).backward()
    return probe.sites["b"].producers["x"]


def test_a_norm_over_blocks_of_the_row_is_not_a_producer_a_row_quantization_fuses_into():
    """The row's amax cannot share a kernel that reduces over parts of the row (Inductor
    splits it off into kernels that read x again); a norm over the whole row, batch
    statistics and pointwise ops after them keep the amax in the producing kernel."""
    hswish = nn.functional.hardswish
    assert _x_kind(BlockRms(8)) == "blocked"                          # 4 blocks of 8
    assert _x_kind(lambda y: hswish(BlockRms(8)(y)) * 2) == "blocked"  # pointwise after it
    assert _x_kind(BlockRms(32)) == "pointwise"                       # one block: the row
    assert _x_kind(lambda y: nn.functional.layer_norm(y, (32,))) == "pointwise"
    assert _x_kind(lambda y: nn.functional.rms_norm(y, (32,))) == "pointwise"
    assert _x_kind(lambda y: nn.functional.group_norm(y, 4)) == "blocked"
    assert _x_kind(lambda y: nn.functional.group_norm(y, 1)) == "pointwise"
    assert _x_kind(lambda y: nn.functional.batch_norm(y, None, None, training=True)) \
        == "pointwise"
    assert _x_kind(lambda y: y.softmax(-1)) == "pointwise"
    # a norm of the row's transpose reduces along the other axis: x = norm(y)ᵀ's rows
    # (length 8) were reduced over 32 at a time
    assert _x_kind(lambda y: nn.functional.layer_norm(y.view(8, 4, 8).transpose(1, 2), (4,))
                   .reshape(8, 32)) == "blocked"
    # a region that also reads another GEMM's output: Inductor realizes the block
    # statistics and fuses the amax into the kernel that reads both (DCNv2's cross layers)
    other = nn.Linear(32, 32)
    assert _x_kind(lambda y: BlockRms(8)(y) * other(y) + y) == "pointwise"
    assert _x_kind(lambda y: BlockRms(8)(y + other(y))) == "blocked"  # the norm of both
    # under activation checkpointing the walk reads sizes, never a saved tensor (whose
    # unpack hook would recompute the forward)
    from torch.utils.checkpoint import checkpoint
    assert _x_kind(lambda y: checkpoint(lambda t: BlockRms(8)(t).amax(-1, keepdim=True) * t,
                                        y, use_reentrant=False)) == "pointwise"
    assert _x_kind(lambda y: checkpoint(BlockRms(8), y, use_reentrant=False)) == "blocked"
    # a reduction further back runs in a kernel of its own: the walk stops at the first
    assert _x_kind(lambda y: torch.relu(y - y.mean(0)) * 3) == "pointwise"
    assert _x_kind(lambda y: y * BlockRms(8)(y).sum(-1, keepdim=True)) == "pointwise"


def test_block_norm_producers_are_priced_as_a_pass_of_their_own():
    """The evaluation set's own block norm (written outside loka) makes x 'blocked'; the
    step-aware price then keeps x's whole pass for rowwise and blockwise kernels, and fuses
    a tensorwise kernel's (its amax rides in the norm's kernel)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "evalset" / "common.py"
    spec = importlib.util.spec_from_file_location("evalset_common_for_pricing", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert _x_kind(common.RowBlockNorm(32, 8)) == "blocked"
    assert _x_kind(lambda y: common.HSwish()(common.RowBlockNorm(32, 8)(y))) == "blocked"
    blocked = {"x": "blocked", "dy": "pointwise"}
    assert _price(ROWWISE, Role.FWD, blocked) == pytest.approx(16.0)
    assert _price(ROWWISE, Role.DGRAD, blocked) < 16.0  # dy's pass still fuses
    assert _price("cublas-blockwise", Role.FWD, blocked) == pytest.approx(16.0)
    fused = _price(TENSORWISE, Role.FWD, {"x": "pointwise", "dy": "pointwise"})
    assert _price(TENSORWISE, Role.FWD, blocked) == pytest.approx(fused)
    assert fused == pytest.approx(16 - 3 * (1 - 3 / 5))
    assert _price(TENSORWISE, Role.FWD, blocked, compiled=False) == 16.0  # eager: no fusion
    # serving: x's pass of the weight-quantized forward (13 - 10 us)
    assert serve_time_us(get(TENSORWISE), time_us_weight_q=13.0, time_us_gemm=10.0,
                         producers=blocked, compiled=True) == pytest.approx(13 - 3 * (1 - 1 / 5))
    assert serve_time_us(get(ROWWISE), time_us_weight_q=13.0, time_us_gemm=10.0,
                         producers=blocked, compiled=True) is None  # pays its timed pass


def test_bad_producer_kinds_in_a_report_are_refused():
    d = SiteReport("s", 4, 4, 8, producers={"x": "pointwise"}).to_dict()
    d["producers"] = {"x": "fused-somehow"}
    with pytest.raises(ReportError, match="producers"):
        SiteReport.from_dict(d)
    d["producers"] = {"w": "gemm"}
    with pytest.raises(ReportError, match="producers"):
        SiteReport.from_dict(d)
    good = KernelResult(ROWWISE, time_us=80.0, time_us_gemm=50.0, step_us=70.0,
                        step_speedup=1.4).to_dict()
    assert KernelResult.from_dict(good).step_us == 70.0
    for key, value, why in (("step_us", "inf", "finite"), ("step_us", "nan", "finite"),
                            ("time_us_gemm", 0, "finite"), ("step_speedup", "inf", "finite"),
                            ("step_us", 500.0, "at most the timed call")):
        with pytest.raises(ReportError, match=why):
            KernelResult.from_dict({**good, key: value})
    with pytest.raises(ReportError, match="at most the timed call"):
        KernelResult.from_dict({**good, "time_us": None})
    served = {**good, "time_us_weight_q": 75.0, "speedup_weight_q": 1.2, "serve_us": 60.0,
              "serve_speedup": 1.5}
    assert KernelResult.from_dict(served).serve_us == 60.0
    for key, value, why in (("serve_us", 76.0, "at most the weight-quantized"),
                            ("time_us_weight_q", None, "at most the weight-quantized"),
                            ("serve_us", "nan", "finite"), ("serve_speedup", 0, "finite")):
        with pytest.raises(ReportError, match=why):
            KernelResult.from_dict({**served, key: value})


# -- pricing ---------------------------------------------------------------------------
def _price(kernel, role, producers, compiled=True, shape=(64, 32, 32)):
    # whole call 16 us, GEMM alone 10 us, forward with the weight quantized 13 us
    return step_time_us(get(kernel), role, shape, time_us=16.0, time_us_gemm=10.0,
                        time_us_weight_q=13.0, producers=producers, compiled=compiled)


def test_a_quantization_fused_into_its_producer_costs_the_share_it_keeps():
    fused = {"x": "pointwise", "dy": "pointwise"}
    # forward: a = x (3 us), b = the weight (3 us): only x's pass fuses
    assert _price(ROWWISE, Role.FWD, fused) == pytest.approx(16 - 3 * (1 - 1 / 3))
    assert _price(TENSORWISE, Role.FWD, fused) == pytest.approx(16 - 3 * (1 - 3 / 5))
    # the same operand out of a GEMM, of the model input, or timed eagerly: the pass stays
    for producers, compiled in (({"x": "gemm"}, True), ({"x": "input"}, True), (fused, False),
                                ({}, True)):
        assert _price(ROWWISE, Role.FWD, producers, compiled) == 16.0
    # input gradient: a = dy, split by size against the weight (64x32 vs 32x32)
    qa, qb = split_quantization(Role.DGRAD, (64, 32, 32), 16.0, 10.0)
    assert (qa, qb) == pytest.approx((4.0, 2.0))
    assert _price(ROWWISE, Role.DGRAD, fused) == pytest.approx(16 - 4 * (1 - 1 / 3))
    # weight gradient: rowwise scales of dyᵀ and x run along the tokens: no fusion;
    # tensorwise fuses both
    assert _price(ROWWISE, Role.WGRAD, fused) == 16.0
    assert _price(TENSORWISE, Role.WGRAD, fused) == pytest.approx(16 - 6 * (1 - 3 / 5))
    # missing timings, and a GEMM that timed slower than the whole call (noise): no credit
    assert step_time_us(get(ROWWISE), Role.FWD, (8, 8, 8), time_us=5.0, time_us_gemm=None,
                        producers=fused, compiled=True) is None
    assert step_time_us(get(ROWWISE), Role.FWD, (8, 8, 8), time_us=5.0, time_us_gemm=6.0,
                        producers=fused, compiled=True) == 5.0
    assert set(FUSED_SHARE.values()) == {1 / 3, 3 / 5}


def _scripted(monkeypatch, times):
    """KernelTimer.time answers from ``times`` (kernel, weight_q, gemm_only) -> us, as a
    CUDA-graph timing would: FP8 calls compiled, the baseline and the GEMM alone not."""
    def fake(self, kernel, role, shape, dev, dtype, weight_q=False, gemm_only=False):
        method = "cuda-graph" if kernel == BASELINE or gemm_only else "cuda-graph+compiled"
        return TimingResult(times[(kernel, weight_q, gemm_only)], method, 10)
    monkeypatch.setattr(measure.KernelTimer, "time", fake)


def test_serving_prices_xs_quantization_by_its_producer():
    """The weight is quantized once; x's pass (weight-quantized forward 13 us less the GEMM
    alone 10 us) is what fuses, at the share its scaling keeps: a fifth for tensorwise,
    whose cast kernel replaces the producer's own bf16 write in a serving forward."""
    def serve(kernel, producers, compiled=True, tq=13.0, tg=10.0):
        return serve_time_us(get(kernel), time_us_weight_q=tq, time_us_gemm=tg,
                             producers=producers, compiled=compiled)
    assert serve(ROWWISE, {"x": "pointwise"}) == pytest.approx(13 - 3 * (1 - 1 / 3))
    assert serve(TENSORWISE, {"x": "pointwise"}) == pytest.approx(13 - 3 * (1 - 1 / 5))
    assert serve(TENSORWISE, {"x": "blocked"}) == pytest.approx(13 - 3 * (1 - 1 / 5))
    for producers, compiled in (({"x": "blocked"}, True), ({"x": "gemm"}, True),
                                ({"x": "pointwise"}, False), ({}, True)):
        assert serve(ROWWISE, producers, compiled) is None
    assert serve(ROWWISE, {"x": "pointwise"}, tq=None) is None
    assert serve(ROWWISE, {"x": "pointwise"}, tg=None) is None
    # a GEMM alone timed slower than the call (noise): nothing to take off
    assert serve(ROWWISE, {"x": "pointwise"}, tg=14.0) == pytest.approx(13.0)


def test_the_step_aware_probe_flags_a_kernel_fast_where_its_quantization_fuses(monkeypatch):
    """The same FP8 kernel, slower than bf16 as an isolated call (105 vs 100 us), is fast
    behind an activation (its x pass fuses) and not behind another GEMM."""
    need_kernel(ROWWISE)
    _scripted(monkeypatch, {(BASELINE, False, False): 100.0,
                            (ROWWISE, False, False): 105.0, (ROWWISE, True, False): 85.0,
                            (ROWWISE, False, True): 60.0})

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Linear(32, 32) for _ in range(3))

        def forward(self, x):
            return self.c(self.b(torch.relu(self.a(x))))

    model = Tower()
    cfg = ProbeConfig(progress=False, roles=("fwd",), kernels=(BASELINE, ROWWISE),
                      num_samples=2, naive_samples=2, bootstrap=20, timing=True,
                      roofline_prune=False, time_unsafe=True, max_error=1.0)
    rep = loka.probe(model, [torch.randn(64, 32)], lambda m, x: m(x).square().mean(),
                     config=cfg)
    behind_relu = rep.sites["b"].roles[Role.FWD].kernels[ROWWISE]
    behind_gemm = rep.sites["c"].roles[Role.FWD].kernels[ROWWISE]
    for kr in (behind_relu, behind_gemm):
        assert kr.time_us == 105.0 and kr.speedup < 1
    assert behind_relu.time_us_gemm == 60.0
    # x's pass: 85 - 60 = 25 us, of which a fused rowwise cast keeps a third
    assert behind_relu.step_us == pytest.approx(105 - 25 * 2 / 3)
    assert behind_relu.step_speedup == pytest.approx(100 / behind_relu.step_us)
    assert behind_relu.fast and behind_relu.step_speedup > cfg.min_speedup
    # behind a GEMM nothing can fuse: the GEMM alone is not even timed
    assert behind_gemm.time_us_gemm is behind_gemm.step_us is None and not behind_gemm.fast
    # the report keeps the split (JSON round trip)
    back = ProbeReport.from_dict(rep.to_dict()).sites["b"].roles[Role.FWD].kernels[ROWWISE]
    assert (back.time_us_gemm, back.step_us) == (60.0, behind_relu.step_us)
    # serving: the forward with the weight quantized once (85 us), x's pass (85 - 60)
    # priced fused behind the activation, as timed behind the GEMM
    assert behind_relu.serve_us == pytest.approx(85 - 25 * 2 / 3)
    assert behind_relu.serve_speedup == pytest.approx(100 / behind_relu.serve_us)
    assert behind_gemm.serve_us is behind_gemm.serve_speedup is None
    assert back.serve_us == pytest.approx(behind_relu.serve_us)
    # the plan judges by the step-aware speedup (and its audit agrees); serving by the
    # serving price (100 / 68.3 behind the activation, 100 / 85 behind the GEMM)
    plan = loka.plan(rep)
    assert plan.sites["b"].roles[Role.FWD].kernel == ROWWISE
    assert plan.sites["b"].roles[Role.FWD].speedup == pytest.approx(behind_relu.step_speedup)
    assert plan.sites["c"].roles[Role.FWD].kernel == BASELINE
    assert loka.dispatch.audit(plan, rep)["ok"]
    serving = loka.plan(rep, inference=True)
    assert {s: serving.sites[s].roles[Role.FWD].kernel for s in "bc"} == {"b": ROWWISE,
                                                                          "c": ROWWISE}
    assert serving.sites["b"].roles[Role.FWD].speedup == pytest.approx(behind_relu.serve_speedup)
    assert serving.sites["c"].roles[Role.FWD].speedup == pytest.approx(100 / 85)
    assert loka.dispatch.audit(serving, rep)["ok"]


def test_the_gemm_alone_is_timed_without_a_compile_of_its_own():
    """The call is compiled (its quantization is what Inductor fuses); the GEMM on operands
    quantized beforehand is one library call, timed as it is: no graph is compiled for it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    timer = measure.KernelTimer(ProbeConfig(timing_compile="on", timing_warmup=1,
                                            timing_iters=3))
    dev, shape = torch.device("cpu"), (64, 32, 48)
    before = counters["stats"]["unique_graphs"]
    call = timer.time(ROWWISE, Role.FWD, shape, dev, torch.bfloat16)
    compiled = counters["stats"]["unique_graphs"] - before
    gemm = timer.time(ROWWISE, Role.FWD, shape, dev, torch.bfloat16, gemm_only=True)
    assert isinstance(call, TimingResult) and call.method.endswith("+compiled")
    assert compiled >= 1
    assert isinstance(gemm, TimingResult) and not gemm.method.endswith("+compiled")
    assert counters["stats"]["unique_graphs"] - before == compiled
    assert gemm.median_us > 0
    # the cached answer: timed once per (kernel, role, shape, variant)
    assert timer.time(ROWWISE, Role.FWD, shape, dev, torch.bfloat16, gemm_only=True) is gemm


@pytest.mark.parametrize("kernel", [ROWWISE, TENSORWISE])
def test_the_gemm_alone_gets_its_operands_in_the_gemms_layouts(kernel):
    """Operands quantized beforehand are laid out as the library GEMM reads them (a
    row-major, b column-major), so that the GEMM timed alone pays no FP8 transpose that the
    compiled call fuses into its cast; the values and the GEMM's result are unchanged."""
    kern = get(kernel)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(48, 64, generator=gen).t()        # (64, 48), column-major
    b = torch.randn(32, 48, generator=gen)            # (32, 48) row-major: b (48, 32) below
    qa, qb = kern.quantize_a(a), kern.quantize_b(b.t().contiguous())
    assert not qa.data.is_contiguous() or qb.data.stride(0) != 1
    la, lb = measure.gemm_layouts(qa, qb)
    assert la.data.is_contiguous() and lb.data.stride(0) == 1
    for before, after in ((qa, la), (qb, lb)):
        assert torch.equal(before.data.float(), after.data.float())
        assert torch.equal(before.scale, after.scale)
    ref = a.double() @ b.t().double()
    out, out_laid = kern(qa, qb, torch.float32), kern(la, lb, torch.float32)
    assert torch.equal(out, out_laid)
    assert float((out.double() - ref).norm() / ref.norm()) < 0.08


def test_a_kernel_that_quantizes_as_another_is_derived_without_a_compile():
    """A kernel whose quantization is another's (``Kernel.quantizes_as``; the fast-
    accumulation twins) gets that kernel's compiled call less its GEMM plus its own GEMM,
    with no graph compiled for it; timed first, it is measured as any kernel is."""
    import dataclasses

    from torch._dynamo.utils import counters

    from loka.kernels import registry

    twin = dataclasses.replace(get(ROWWISE), name="test-rowwise-twin", quantizes_as=ROWWISE)
    registry.register(twin)
    try:
        torch._dynamo.reset()
        dev, shape, dt = torch.device("cpu"), (64, 32, 48), torch.bfloat16
        timer = measure.KernelTimer(ProbeConfig(timing_compile="on", timing_warmup=1,
                                                timing_iters=3))
        call = timer.time(ROWWISE, Role.FWD, shape, dev, dt)
        before = counters["stats"]["unique_graphs"]
        derived = timer.time(twin.name, Role.FWD, shape, dev, dt)
        assert counters["stats"]["unique_graphs"] == before     # nothing compiled for it
        gemm = timer.time(ROWWISE, Role.FWD, shape, dev, dt, gemm_only=True)
        own = timer.time(twin.name, Role.FWD, shape, dev, dt, gemm_only=True)
        assert derived.median_us == pytest.approx(call.median_us - gemm.median_us
                                                  + own.median_us)
        assert derived.method == "cpu-wallclock+derived+compiled"
        assert "derived" in derived.note
        # the twin timed first: measured (compiled) as it is
        fresh = measure.KernelTimer(ProbeConfig(timing_compile="on", timing_warmup=1,
                                                timing_iters=3))
        first = fresh.time(twin.name, Role.FWD, shape, dev, dt)
        assert first.method == call.method == "cpu-wallclock+compiled"
    finally:
        registry.unregister(twin.name)


def test_fast_accumulation_twins_name_kernels_that_quantize_the_same():
    """Every ``quantizes_as`` names a registered kernel of the same library, formats and
    scaling, differing in fast accumulation (what the derivation assumes)."""
    from loka.kernels import registry

    twins = [k for k in registry.all_kernels() if k.quantizes_as]
    assert {k.name for k in twins} >= {"cublas-rowwise-fastacc", "cublas-tensorwise-fastacc",
                                       "torchao-tensorwise-fastacc"}
    for k in twins:
        t = get(k.quantizes_as)
        assert (t.library, t.formats, t.scaling) == (k.library, k.formats, k.scaling)
        assert t.fast_accum != k.fast_accum and t.quantizes_as is None


def _report(step_us, serve_us=None):
    kr = KernelResult(ROWWISE, time_us=80.0, speedup=1.25, timing="cuda-graph+compiled",
                      time_us_weight_q=70.0, time_us_gemm=50.0, step_us=step_us,
                      serve_us=serve_us)
    sr = SiteReport("s", 32, 32, 64, producers={"x": "pointwise", "dy": "gemm"},
                    roles={Role.FWD: RoleReport(Role.FWD, (64, 32, 32), 100.0, {ROWWISE: kr})})
    return ProbeReport(sites={"s": sr})


def test_the_predicted_step_uses_step_aware_times_and_keeps_the_isolated_one():
    plan = Plan(sites={"s": SitePlan("s", 32, 32, 64, {
        Role.FWD: RoleChoice(ROWWISE), Role.DGRAD: RoleChoice(BASELINE),
        Role.WGRAD: RoleChoice(BASELINE)})}, device="cuda")
    pred = predict_step(plan, _report(step_us=70.0), baseline_step_ms=1.0)
    assert pred.step_aware == ["s:fwd"]
    assert pred.predicted_step_ms == pytest.approx(1.0 - (100 - 70) / 1e3)
    assert pred.isolated_step_ms == pytest.approx(1.0 - (100 - 80) / 1e3)
    d = pred.to_dict()
    assert d["isolated_speedup"] == pytest.approx(1 / pred.isolated_step_ms)
    # no step-aware time: the isolated one
    pred = predict_step(plan, _report(step_us=None), baseline_step_ms=1.0)
    assert pred.step_aware == [] and pred.predicted_step_ms == pred.isolated_step_ms
    # serving: the forward timed with the weight quantized once, as the serving plan judges
    pred = predict_step(plan, _report(step_us=70.0), baseline_step_ms=1.0, inference=True)
    assert pred.step_aware == []
    assert pred.predicted_step_ms == pred.isolated_step_ms == pytest.approx(1 - 30 / 1e3)
    # ... step-aware where the report prices x's quantization fused into its producer
    pred = predict_step(plan, _report(step_us=70.0, serve_us=56.0), baseline_step_ms=1.0,
                        inference=True)
    assert pred.step_aware == ["s:fwd"]
    assert pred.predicted_step_ms == pytest.approx(1 - 44 / 1e3)
    assert pred.isolated_step_ms == pytest.approx(1 - 30 / 1e3)


def test_the_graph_is_walked_on_at_most_two_statistics_steps():
    """A site whose output never reaches the model's outputs (a side branch whose result
    is dropped) stays unknown instead of costing a walk on every statistics step."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.side = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            self.side(x)  # computed, never used
            return self.a(x).sum(-1)

    model = Net()
    with loka.Probe(model, ProbeConfig(progress=False, every_n_steps=1)) as probe:
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
    assert _kinds(probe.sites["a"].producers) == {"x": "input", "dy": "pointwise"}  # the sum's
    assert "dy" not in probe.sites["side"].producers
    walks = probe._hooks._walks  # noqa: SLF001
    assert walks == {"a": 1, "side": SiteCollector.MAX_WALKS} and SiteCollector.MAX_WALKS == 2


def test_no_autograd_node_is_kept_when_the_root_forward_never_runs():
    """Manual counting, the sites called through a submodule: nothing is recorded for the
    walk (the gradient producers stay unknown), so nothing accumulates over the steps."""
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    probe = loka.Probe(model, ProbeConfig(progress=False, every_n_steps=1))
    with probe:
        for _ in range(5):
            model[0](torch.randn(8, 16)).sum().backward()
            probe.step()
            assert probe._hooks._outputs == {}  # noqa: SLF001
    assert _kinds(probe.sites["0.0"].producers) == {"x": "input"}
    assert _kinds(probe.sites["0.2"].producers) == {"x": "pointwise"}


def test_the_gradient_walk_visits_each_node_once_and_parts_make_other():
    """Diamonds of pass-through ops (h = h + h.T, sixteen deep) are walked in linear time;
    a fused projection split into parts gets its gradient assembled from them (other)."""
    lin = nn.Linear(16, 16)
    y = lin(torch.randn(16, 16))
    h = y
    for _ in range(16):
        h = h + h.t()
    class Counted(dict):
        reads = 0

        def get(self, *args):
            Counted.reads += 1
            return super().get(*args)

    consumers = Counted(consumers_of_outputs(h))
    assert consumer_kind(y.grad_fn, consumers) == "output"
    assert Counted.reads < 4 * len(consumers)  # once per node: paths are 2**16
    qkv = nn.Linear(16, 48)
    q, k, v = qkv(torch.randn(4, 8, 16)).split(16, dim=-1)
    out = nn.functional.scaled_dot_product_attention(q, k, v)
    assert consumer_kind(qkv(torch.randn(4, 8, 16)).grad_fn, consumers_of_outputs(out)) is None
    node = q.grad_fn  # the split's node: y = qkv's output is its input
    y_node = [n for n, _ in node.next_functions if n is not None][0]
    assert consumer_kind(y_node, consumers_of_outputs(out)) == "other"
    assert producer_of(q) == "gemm"  # a part of a GEMM's output is a GEMM's


def test_a_linear_called_twice_needs_a_pass_if_either_call_does():
    """One Linear applied after an activation and after another GEMM in the same step:
    its x is priced as a pass; its output feeding a GEMM in one call makes dy a pass too."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.shared, self.post = (nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            first = self.shared(torch.relu(x))          # pointwise in, pointwise out
            second = self.shared(self.pre(x))           # a GEMM in, a GEMM out
            return torch.tanh(first).sum(-1) + self.post(second).sum(-1)

    model = Net()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(8, 16, requires_grad=True)).sum().backward()
    assert _kinds(probe.sites["shared"].producers) == {"x": "gemm", "dy": "gemm"}
    assert probe.sites["shared"].act.updates == 1  # statistics: still the first call only


class Assembled(nn.Module):
    """A DLRM-like top: dense features concatenated with pairwise dots picked by an index
    (``cat``, ``index``), zero-padded, then a Linear; a second Linear reads a stack of two views; a
    third an ``index_select`` of rows; a fourth the embedding bag's output (a library
    kernel: 'other')."""

    def __init__(self, d=16):
        super().__init__()
        self.emb = nn.EmbeddingBag(50, d, mode="sum")
        self.pre = nn.Linear(d, d)
        self.top = nn.Linear(d + 8, d)
        self.stk = nn.Linear(d, d)
        self.sel = nn.Linear(d, d)
        self.bag = nn.Linear(d, d)
        self.register_buffer("pairs", torch.tensor([1, 2, 3, 6, 7, 11]))
        self.register_buffer("rows", torch.arange(7, -1, -1))

    def forward(self, dense, ids):
        dense = self.pre(dense)
        t = torch.stack([dense, torch.tanh(dense), dense * 2, dense + 1], dim=1)   # (B, 4, d)
        dots = torch.bmm(t, t.transpose(1, 2)).flatten(1)[:, self.pairs]
        out = self.top(nn.functional.pad(torch.cat([dense, dots], dim=1), (0, 2)))
        s = self.stk(torch.stack([out, out * 3], dim=1)).sum(1)
        return (s + self.sel(torch.index_select(out, 0, self.rows)) + self.bag(self.emb(ids))).sum()


def test_concatenations_stacks_and_gathers_make_assembled_inputs():
    """x put together by Inductor's own indexing code is 'assembled': a static cast fuses
    into it and an amax is priced as a pass; a library kernel's output stays 'other'."""
    from loka.probe.pricing import serve_static_time_us, splits_gemm, static_cast_fuses
    from loka.probe.producers import merge_kinds

    model = Assembled()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(8, 16), _ids(8)).backward()
    got = {n: s.producers["x"] for n, s in probe.sites.items()}
    assert got == {"pre": "input", "top": "assembled", "stk": "assembled", "sel": "assembled",
                   "bag": "other"}
    again = ProbeReport.from_dict(probe.report().to_dict())  # a kind the report takes
    assert again.sites["top"].producers["x"] == "assembled"
    tw = get(TENSORWISE)
    single = {"x": "assembled", "x_users": "single"}
    # a static cast rides in the concatenation; a dynamic amax does not
    assert static_cast_fuses(single) and not static_cast_fuses({"x": "other"})
    assert serve_static_time_us(tw, time_us_weight_q=13.0, time_us_gemm=10.0,
                                producers=single, compiled=True) == pytest.approx(10.0)
    assert serve_static_time_us(tw, time_us_weight_q=13.0, time_us_gemm=10.0,
                                producers={"x": "other"}, compiled=True) == \
        pytest.approx(10.0 + 3.0 * 3 / 5)
    # dynamic serving: no step-aware price (the plan takes the timed call, 13 us)
    assert serve_time_us(tw, time_us_weight_q=13.0, time_us_gemm=10.0, producers=single,
                         compiled=True) is None
    # the GEMM alone is timed for the static price: forwards only, compiled FP8 quantizers
    assert splits_gemm(tw, Role.FWD, single, compiled=True)
    assert not splits_gemm(tw, Role.WGRAD, {**single, "dy": "other"}, compiled=True)
    assert not splits_gemm(tw, Role.FWD, single, compiled=False)
    assert not splits_gemm(get(BASELINE), Role.FWD, single, compiled=True)
    # two calls: whatever takes no static cast wins, then whatever takes no amax
    assert merge_kinds("assembled", "other") == "other"
    assert merge_kinds("other", "assembled") == "other"
    assert merge_kinds("pointwise", "assembled") == "assembled"
    assert merge_kinds("blocked", "pointwise") == "blocked"


class TransposedInput(nn.Module):
    """A Wukong-like layer: a Linear over the embedding axis reads the transposed
    embeddings (a strided view, copied to rows), which a residual also reads; another
    Linear reads rows of the same tensor."""

    def __init__(self, n=8, d=16):
        super().__init__()
        self.pre = nn.Linear(d, d)
        self.mix = nn.Linear(n, n)
        self.rows = nn.Linear(d, d)

    def forward(self, x):
        h = torch.tanh(self.pre(x))                               # (B, n, d)
        mixed = self.mix(h.transpose(1, 2)).transpose(1, 2)      # reads hᵀ: copied
        return (self.rows(h) + mixed + h).sum()


def test_a_strided_input_the_linear_copies_takes_its_static_cast_in_that_copy():
    """x read through a transposed view is copied to rows by the step in bf16 too
    ('copied'): a static cast is written in that copy, so nothing is left of its pass even
    though a residual reads x ('shared'); a Linear reading rows keeps the shared share."""
    from loka.probe.pricing import serve_static_time_us, static_cast_fuses
    from loka.probe.producers import x_layout

    model = TransposedInput()
    with loka.Probe(model, ProbeConfig(progress=False)) as probe:
        model(torch.randn(4, 8, 16)).backward()
    got = {n: (s.producers["x_layout"], s.producers.get("x_users")) for n, s in probe.sites.items()}
    assert got == {"pre": ("rows", None), "mix": ("copied", "shared"), "rows": ("rows", "shared")}
    again = ProbeReport.from_dict(probe.report().to_dict())
    assert again.sites["mix"].producers["x_layout"] == "copied"
    d = again.sites["mix"].to_dict()
    d["producers"]["x_layout"] = "columns"
    with pytest.raises(ReportError, match="x_layout"):
        SiteReport.from_dict(d)
    tw = get(TENSORWISE)
    mix, rows = probe.sites["mix"].producers, probe.sites["rows"].producers
    assert serve_static_time_us(tw, time_us_weight_q=13.0, time_us_gemm=10.0, producers=mix,
                                compiled=True) == pytest.approx(10.0)
    assert serve_static_time_us(tw, time_us_weight_q=13.0, time_us_gemm=10.0, producers=rows,
                                compiled=True) == pytest.approx(10.0 + 3.0 / 5)
    # the model's input, copied: the cast rides in the copy all the same
    assert static_cast_fuses({"x": "input", "x_layout": "copied"})
    assert not static_cast_fuses({"x": "input", "x_layout": "rows"})
    assert x_layout(torch.randn(4, 8, 16).transpose(1, 2), 8) == "copied"
    assert x_layout(torch.randn(4, 8, 16).view(32, 16), 16) == "rows"
    assert x_layout(torch.randn(16), 16) == "rows"
